"""Offline API: `LLM(model).generate(prompts, params)` on the continuous-batching engine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.sequence import TokenLogprob
from model.inspect.attention_maps import AttentionMaps
from model.inspect.attention_spec import AttentionSpec
from model.multimodal.inputs import MultiModalInputs
from model.sampling.params import SamplingParams

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass
class CompletionOutput:
    """One prompt's generation."""

    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: entry i is prompt token i + 1's (vLLM's list less its leading None)
    prompt_logprobs: list[TokenLogprob] | None = None


class LLM:
    """A model and an engine, for batch generation in-process.

    `model` is a preset name (`transformer-base-trained`, the default and what `make serve`
    serves; `transformer-base`, its random-weight twin; ...), a checkpoint directory, or an HF hub id (`org/name` at `revision`, from the Hugging Face
    cache or downloaded into it; a local directory of the same name wins).
    """

    def __init__(self, model: str = "transformer-base-trained", device: str = "auto", dtype: str = "auto",
                 seed: int = 0, engine_config: EngineConfig | None = None, revision: str | None = None,
                 **engine_args: Any) -> None:
        """`engine_args`: any `EngineConfig` field by name (`max_model_len=4096`, `quantization="int8"`,
        `speculative_config={...}`, `tensor_parallel_size=2`, as vLLM's `LLM` takes them), replacing
        that field of `engine_config`. Tensor parallelism starts a local Ray when none runs."""
        unknown = sorted(set(engine_args) - ENGINE_FIELDS)
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; it takes model, device, dtype, seed, "
                            f"engine_config, revision and the EngineConfig fields: {', '.join(sorted(ENGINE_FIELDS))}")
        if engine_args:
            engine_config = (engine_config or EngineConfig()).replace(**engine_args)
        self.engine = build_engine(model, engine_config, device=device, dtype=dtype, seed=seed, revision=revision)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (idempotent)."""
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the checkpoint's `generation_config.json` defaults
        (temperature, top_p, top_k, repetition_penalty) applied: what `generate` uses when it
        is given no params. Explicit `SamplingParams` are used as they are, as in vLLM;
        to start from the defaults, change a copy of these."""
        return self.engine.generation_config.default_sampling_params()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora: str | Seq[str | None] | None = None,
                 priority: Seq[int] | None = None) -> list[CompletionOutput]:
        """Generate for every prompt (a string, a list of token ids, or vLLM's dict with images:
        `{"prompt": str | list[int], "multi_modal_data": {"image": PIL image or a list}}`, whose
        prompt holds the model's image token once per image); `params` is one
        `SamplingParams` for all prompts or one per prompt (None: `get_default_sampling_params()`).
        `lora`: a LoRA adapter's name (EngineConfig.lora_modules, or `base:adapter`) for all prompts
        or one per prompt (None: the base model). `priority`: one per prompt, as vLLM's (lower first;
        needs scheduling_policy="priority"; None: all 0). Outputs come in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        outs: dict[str, CompletionOutput] = {}
        order = []
        try:
            for prompt, p, adapter, prio in zip(prompts, params, loras, priorities, strict=True):
                ids, mm = self._prompt(prompt)
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, p, lora=adapter, priority=prio, mm=mm)
                outs[rid] = CompletionOutput(ids, logprobs=[] if p.logprobs is not None else None)
                order.append(rid)
        except Exception:
            # A bad prompt: drop the ones already queued, or the next call would meet them.
            for rid in order:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = outs[delta.request_id]
                out.text += delta.new_text
                out.token_ids.extend(delta.new_token_ids)
                if out.logprobs is not None and delta.new_logprobs:
                    out.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    out.finish_reason = delta.finish_reason
        return [outs[r] for r in order]

    def _prompt(self, prompt: str | list[int] | dict) -> tuple[list[int], MultiModalInputs | None]:
        """A prompt's token ids (images expanded) and its images."""
        if not isinstance(prompt, dict):
            return (self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)), None
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(f"a prompt dict takes prompt or prompt_token_ids, and multi_modal_data; got {sorted(unknown)}")
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        return self.engine.process_images(ids, images) if images else (ids, None)

    def attention(self, prompt: str | list[int] | dict, layers: Seq[int] | None = None, heads: Seq[int] | None = None,
                  rows: str | Seq[int] = "all", max_tokens: int = 0, scale: str = "sqrt_dk") -> torch.Tensor:
        """Attention weights (layers, heads, rows, keys) of `prompt` (and of `max_tokens` greedy
        tokens generated after it): row r holds softmax over keys 0..r, keys after it are 0.
        `layers`/`heads` default to all, `rows` is "all", "last" or query positions."""
        return self.attention_maps(prompt, layers, heads, rows, max_tokens, scale).weights

    def attention_maps(self, prompt: str | list[int] | dict, layers: Seq[int] | None = None,
                       heads: Seq[int] | None = None, rows: str | Seq[int] = "all", max_tokens: int = 0,
                       scale: str = "sqrt_dk") -> AttentionMaps:
        """`attention` with its bookkeeping: token ids, the layers/heads/rows returned, and per
        (layer, head) the pre-softmax score std and mean row entropy; for a prompt with images (the
        dict `generate` takes), where each image's patch grid sits among the keys (`images`)."""
        spec = AttentionSpec(None if layers is None else tuple(layers), None if heads is None else tuple(heads),
                             rows if isinstance(rows, str) else tuple(rows), max_tokens, scale)
        # At least one token is generated so the request is scheduled like any other; only
        # `max_tokens` of them join the captured sequence.
        params = SamplingParams(max_tokens=max(1, max_tokens), temperature=0.0, attention=spec)
        ids, mm = self._prompt(prompt)
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, ids, params, mm=mm)
        maps = None
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.request_id == rid and delta.finished:
                    maps = delta.attention
        assert maps is not None
        return maps
