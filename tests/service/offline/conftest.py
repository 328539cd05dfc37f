"""What the offline tests share: a tiny chat model and a local Ray for the engine actors."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import ray

from tests.support.chat_tokenizers import write_tiny_qwen3_chat

MAX_MODEL_LEN = 1024  # the tiny Qwen3's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3 with a chat template of its own (tokenizer.json, tokenizer_config.json)."""
    return str(write_tiny_qwen3_chat(tmp_path_factory.mktemp("qwen3-chat")))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING)
    yield
    ray.shutdown()
