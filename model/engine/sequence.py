"""A request's life in the engine, and what the engine hands back each step. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from model.sampling.logprobs import TokenLogprob
from model.sampling.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# The largest priority a request may ask for (the API bounds it): the Batch API's requests run at
# it, after every interactive one; metrics count the sequences at it apart (EngineStats).
LOWEST_PRIORITY = 1_000_000


@dataclass
class RequestTimes:
    """Engine timestamps (time.monotonic()) of one request; the service derives its metrics from these."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    """What one `Engine.step()` produced for one request: the delta since the previous step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    times: RequestTimes
    token_times: list[float] = field(default_factory=list)  # when each of new_token_ids was sampled
    new_logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs, on the request's first output: entry i is prompt token i + 1
    # given the tokens before it (the first prompt token has none).
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    attention: Any = None  # model.inspect.attention_maps.AttentionMaps of a finished attention request


@dataclass
class Sequence:
    """One request inside the scheduler: prompt, generated tokens, blocks, progress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Leading blocks given back because they fell out of every layer's sliding window; their
    # block_table entries hold the block manager's null block (BlockManager.release_out_of_window).
    num_released_blocks: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    # Prefix caching (block_manager.py): hashes of the full blocks of token_ids, how many of
    # block_table's leading blocks are committed to the cache, and the prompt tokens found
    # cached when the sequence was first admitted.
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding (model/engine/spec_decode/): tokens proposed after token_ids for the
    # scheduler to verify this step; never part of token_ids (nor of any block hash).
    spec_token_ids: list[int] = field(default_factory=list)
    # LoRA (model/loading/lora.py): the adapter's name (None: the base model), and its resident
    # slot in the wrapped layers once the engine has one for it (-1: none).
    lora: str | None = None
    lora_slot: int = -1
    # Dynamic NTK / LongRoPE: every position is rotated as in a sequence at least this long (it
    # was longer than the original context when it arrived, or grew past it and was recomputed);
    # 0: each position as in a sequence ending there.
    rope_len: int = 0
    # Scheduling (scheduler.py): lower priorities are admitted first and preempted last under the
    # priority policy (vLLM's meaning); the tenant's running sequences rank its waiting ones
    # behind a quieter tenant's (None: a tenant of its own). The arrival (time.monotonic()) is
    # kept through preemptions: aging and first-come-first-served count from it.
    priority: int = 0
    tenant: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Images (model.multimodal.inputs.MultiModalInputs): their pixels, where their placeholder
    # tokens sit in the prompt, their hashes and (Qwen2-VL) the M-RoPE positions; None: text only.
    mm: Any = None
    # (offset, length, key) of each image, for the block hashes (`hash_token_ids`).
    mm_hash_keys: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def hash_token_ids(self) -> list[int]:
        """`token_ids` as the prefix cache names them: an image's placeholder tokens replaced by its
        key (a hash of its pixels), so a block holding an image matches only the same image."""
        ids = self.token_ids
        if not self.mm_hash_keys:
            return ids
        ids = list(ids)
        for offset, length, key in self.mm_hash_keys:
            ids[offset:offset + length] = [key] * length
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
