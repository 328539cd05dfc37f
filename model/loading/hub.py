"""HF hub ids (`org/name`) -> a checkpoint directory in the Hugging Face cache.

Through `huggingface_hub`, so its usual settings apply: the cache (`HF_HOME`, `HF_HUB_CACHE`),
offline mode (`HF_HUB_OFFLINE=1`: only what is cached), a token for gated or private models
(`HF_TOKEN`, or what `hf auth login` stored). Only the files a checkpoint needs are fetched:
the configs, the tokenizer files and the safetensors weights (the shards that the index lists,
never other weight formats). A local directory always wins over a hub id of the same name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# `org/name`: what the hub accepts as a model id (one slash, no leading dot or dash).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
SMALL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json",
               # vision models: the image processor's config, and the chat template processors save
               "preprocessor_config.json", "chat_template.json"]
SINGLE_WEIGHTS = "model.safetensors"


class HubModelNotFoundError(ValueError):
    """A hub id that cannot be resolved; the message says why and what to do."""


def is_hub_id(model: str) -> bool:
    """True for `org/name` (that is not a local path: no leading `/`, `.` or `~`)."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def resolve_model_dir(model: str, revision: str | None = None) -> str | None:
    """The checkpoint directory `model` names: itself when it is a local directory, else the
    cached (or, online, downloaded) snapshot of the hub id at `revision` (default: main).
    None when `model` is neither a directory nor shaped like a hub id.

    Raises `HubModelNotFoundError` when the id cannot be found (offline and not cached,
    unknown repository or revision, gated without a token).
    """
    if os.path.isdir(model):
        return model
    if not is_hub_id(model):
        return None
    snapshot = _download(model, revision, SMALL_FILES)
    index = Path(snapshot) / "model.safetensors.index.json"
    if index.is_file():  # only the shards the index lists: repos may also carry consolidated copies
        shards = sorted(set(json.loads(index.read_text("utf-8")).get("weight_map", {}).values()))
    else:
        shards = [SINGLE_WEIGHTS]
    snapshot = _download(model, revision, shards)
    logger.info("model %s (revision %s) resolved to %s", model, revision or "main", snapshot)
    return snapshot


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    """`snapshot_download` of the files matching `patterns`, its errors turned into ours."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"revision {revision!r} of " if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except GatedRepoError:
        raise HubModelNotFoundError(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its licence on the model page and set "
            "HF_TOKEN (or run `hf auth login`) to a token with access") from None
    except RepositoryNotFoundError:
        raise HubModelNotFoundError(
            f"model {repo_id!r} is neither a local directory nor a repository on the Hugging Face Hub (for a "
            "private repository set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubModelNotFoundError(f"{where}model {repo_id!r} does not exist on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        raise HubModelNotFoundError(
            f"{where}model {repo_id!r} is not a local directory and was not found in the local Hugging Face cache ({_cache_dir()}) and the "
            "Hub cannot be reached (offline, or HF_HUB_OFFLINE=1). Download it first on a machine with network "
            f"access: `hf download {repo_id}{' --revision ' + revision if revision else ''}` (or "
            f"`huggingface-cli download {repo_id}`) into the same cache (HF_HOME / HF_HUB_CACHE), or pass a "
            "checkpoint directory") from None
    except HFValidationError as e:
        raise HubModelNotFoundError(f"{repo_id!r} is not a valid Hugging Face Hub id: {e}") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
