"""What the HTTP edge and the prefix router need to know about the served model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.loading.generation_config import GenerationConfig


@dataclass
class ModelInfo:
    """What the HTTP edge needs to validate and tokenize without touching the engine."""

    served_model_name: str
    max_model_len: int
    vocab_size: int  # the embedding's size: valid token ids are below it
    num_kv_blocks: int
    block_size: int
    tokenizer: Any  # model.loading.tokenizer.Tokenizer (and the special tokens); picklable, so the router tokenizes too
    generation_config: GenerationConfig  # sampling defaults for fields a request does not set
    attention: Any = None  # model.inspect.attention_spec.AttentionShape: checks /v1/attention requests
    quantization: dict[str, Any] | None = None  # the weights' scheme (method, bits, group_size, ...); None: full precision
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters chosen by `model` (model/loading/lora.py)
    lora_dynamic: bool = False  # `<served name>:<adapter>` loads an adapter on first use
    takes_images: bool = False  # a vision model: chat requests may carry images (service/http/images.py)
