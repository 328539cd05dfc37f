"""The model registry: `config.json`'s `architectures[0]` -> its family's spec (config parser
and weight-name map), and `ModelConfig.arch` -> the module that runs it.

Every model class takes a `ModelConfig`, runs `forward(tokens, positions, meta, cache)` ->
hidden (T, d_model), and `compute_logits(hidden)` -> (N, vocab); the runner and the engine
see only that interface.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from model.config import ModelConfig
from model.models.gemma import GEMMA_FAMILY, GemmaForCausalLM
from model.models.gpt2 import GPT2
from model.models.gpt_oss import GPT_OSS, GptOssForCausalLM
from model.models.llama import LLAMA_FAMILY, LlamaForCausalLM
from model.models.llava import LLAVA, LlavaForConditionalGeneration
from model.models.mixtral import MIXTRAL, MoEForCausalLM
from model.models.phi3 import PHI3, Phi3ForCausalLM
from model.models.qwen2_vl import QWEN2_VL, Qwen2VLForConditionalGeneration
from model.models.qwen_moe import QWEN2_MOE, QWEN3_MOE
from model.models.transformer import QKV, QKV_ARCHITECTURE, Transformer
from model.models.weight_map import ArchitectureSpec, CheckpointError

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    QKV_ARCHITECTURE: QKV,
    "GPT2LMHeadModel": GPT2,
    "GPT2Model": GPT2,
    **LLAMA_FAMILY,
    "MixtralForCausalLM": MIXTRAL,
    "Qwen2MoeForCausalLM": QWEN2_MOE,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "GptOssForCausalLM": GPT_OSS,
    **GEMMA_FAMILY,
    "Phi3ForCausalLM": PHI3,
    "Qwen2VLForConditionalGeneration": QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": QWEN2_VL,
    "LlavaForConditionalGeneration": LLAVA,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

MODEL_CLASSES: dict[str, type[nn.Module]] = {"transformer": Transformer, "gpt2": Transformer,
                                             "llama": LlamaForCausalLM, "moe": MoEForCausalLM, "gpt_oss": GptOssForCausalLM,
                                             "gemma2": GemmaForCausalLM, "gemma3": GemmaForCausalLM,
                                             "phi3": Phi3ForCausalLM, "qwen2_vl": Qwen2VLForConditionalGeneration,
                                             "llava": LlavaForConditionalGeneration}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The module for `cfg.arch`, with freshly initialised (not loaded) parameters."""
    return MODEL_CLASSES[cfg.arch](cfg)


def architecture_of(raw: dict[str, Any], where: str) -> tuple[str, ArchitectureSpec]:
    """config.json's `architectures[0]` (or, for old GPT-2 configs, `model_type`) and its spec."""
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") == "gpt2":
        archs = ["GPT2LMHeadModel"]
    if not isinstance(archs, list) or not archs or archs[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {archs or None} in {where}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0], ARCHITECTURES[archs[0]]
