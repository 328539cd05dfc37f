"""Weight-only quantization: on the fly (int8 per output channel, int4 per group) and from GPTQ
and AWQ checkpoints that this file writes itself, packed as the formats document them.

Every check compares our quantized model with a float model whose linear weights are set to the
format's dequantized weights, computed here from the codes, zero points and scales this file
chose (never read back through the code under test): logits within 1e-3 relative, and the
engine's greedy output the same alone, in a batch of 16 and under preemption.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from model import LLM, SamplingParams
from model.config import EngineConfig, ModelConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.layers.linear.kernel import int8_path, quant_matmul_q8
from model.layers.linear.quantized import QuantizedLinear
from model.loading.checkpoint import CheckpointError, load_model, save_model
from model.loading.quant.quantize import on_the_fly_scheme
from model.models.registry import build_model
from tests.support.in_process import edge_app
from tests.support.tiny_models import full_logits, write_tiny_llama
from tests.support.requirements import required

RTOL = 1e-3  # relative (Frobenius) error of logits against the dequantized reference
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- checkpoints -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """Tiny Llama: hidden 64, MLP 96 (group 32 divides both), untied head, vocab 301."""
    return write_tiny_llama(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """Tiny Qwen2 (q/k/v biases, tied head)."""
    return write_tiny_llama(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=6, with_tokenizer=False,
                            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory) -> Path:
    """The paper's Transformer (preset architecture) in a tiny shape, saved as our checkpoint."""
    cfg = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=128)
    model = build_model(cfg)
    model.init_weights(3)
    directory = tmp_path_factory.mktemp("transformer")
    save_model(model, directory)
    return directory


def float_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def reference_model(directory: Path, weights: dict[str, torch.Tensor], prefix: str):
    """The float model of `directory` with the given dequantized weights (checkpoint name of the
    layer without `.weight` -> (N, K) float32) in place of its linear weights."""
    _, model = load_model(directory)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            modules[name.removeprefix(prefix)].weight.copy_(w)
    return model


def check_layers(model, refs: dict[str, torch.Tensor], prefix: str) -> None:
    """Each quantized layer against x W_ref^T for 1 row (decode: weights decoded in registers),
    5 rows (one decoded scratch row per weight row) and 40 rows (dequantized blocks)."""
    gen = torch.Generator().manual_seed(0)
    for name, layer in model.named_modules():
        if isinstance(layer, QuantizedLinear) and prefix + name in refs:
            for rows in (1, 5, 40):
                x = torch.randn(rows, layer.in_features, generator=gen)
                with torch.no_grad():
                    got = layer(x) - (layer.bias if layer.bias is not None else 0)
                assert rel_err(got, x @ refs[prefix + name].t()) < 1e-5, (name, rows)


# ---- on the fly: the formats' math written out here -----------------------------------------

def int8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: q = round(w / s), s = max|w_row| / 127 -> (codes, q * s)."""
    s = w.abs().amax(dim=1, keepdim=True) / 127
    q = torch.clamp(torch.round(w / s), -127, 127)
    return q, q * s


def int4_reference(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per group: [min(0, lo), max(0, hi)] onto 0..15 -> (codes, (q - z) * s)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(2, keepdim=True).clamp(max=0), g.amax(2, keepdim=True).clamp(min=0)
    s = (hi - lo) / 15
    z = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(g / s) + z, 0, 15)
    return q.reshape(n, k), ((q - z) * s).reshape(n, k)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizing_by_blocks_of_rows_equals_the_whole_matrix(bits, monkeypatch) -> None:
    import model.layers.linear.quantized as quantized

    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(9))
    monkeypatch.setattr(quantized, "_BLOCK_ELEMENTS", 64 * 7)  # blocks of 7 rows
    layer = QuantizedLinear(64, 300, bits, 64 if bits == 8 else 32, False, has_offsets=bits == 4)
    layer.quantize_from(w)
    codes, ref = int8_reference(w) if bits == 8 else int4_reference(w, 32)
    assert torch.equal(layer.codes().float(), codes)
    assert rel_err(layer.dequantized_weight(), ref) < 1e-6


# ---- int8 activations (quantization_activations=int8) ----------------------------------------

def round_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 rounding written out: each block of 32 values of a row -> codes
    round(x * 127 / max|x|) (half to even, in float32 as the kernel rounds), and d = max|x| / 127;
    the values the codes stand for."""
    m, k = x.shape
    b = x.float().reshape(m, k // 32, 32)
    amax = b.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    codes = torch.round(b * inv)
    return (codes.double() * (amax / 127).double()).reshape(m, k)


@pytest.mark.parametrize("bits,group,offsets", [(8, 128, False), (8, 64, True), (4, 32, True), (4, 64, True),
                                                (4, 128, False)])
def test_int8_activations_kernel_equals_its_math_on_every_path(bits, group, offsets) -> None:
    """Every vector path this CPU has (and the scalar loop) equals x rounded to int8 blocks times
    the dequantized weight, whatever the row count; each row of y depends on its own row only."""
    gen = torch.Generator().manual_seed(bits * 1000 + group)
    k, n = 256, 77
    layer = QuantizedLinear(k, n, bits, group, False, has_offsets=offsets)
    layer.quantize_from(torch.randn(n, k, generator=gen))
    if offsets and bits == 8:  # a checkpoint's asymmetric int8 (GPTQ, AWQ) carries offsets
        layer.offsets.copy_(torch.randn(layer.offsets.shape, generator=gen) * 0.01)
    w = layer.dequantized_weight().double()
    x = torch.randn(70, k, generator=gen) * torch.linspace(0.1, 10, k)  # blocks of very different sizes
    x[3, 32:64] = 0  # an all-zero block
    rounded = round_to_int8_blocks(x)
    ref = rounded @ w.t()
    exact = x.double() @ w.t()
    # what the rounding of x can move y by, at most: |x - x_rounded| . |w| (half a code per value)
    bound = (x.double() - rounded).abs() @ w.abs().t()
    assert ((x.double() - rounded).abs().reshape(70, -1, 32) <=
            x.double().abs().reshape(70, -1, 32).amax(2, keepdim=True) / 254 * (1 + 1e-5)).all()
    for path in range(int8_path() + 1):
        for rows in (1, 3, 4, 5, 70):
            got = quant_matmul_q8(x[:rows], layer.qweight, layer.scales, layer.offsets, bits, group, path=path)
            assert rel_err(got.double(), ref[:rows]) < 1e-6, (path, rows)
            assert ((got.double() - exact[:rows]).abs() <= bound[:rows] + 1e-4).all(), (path, rows)
        alone = torch.cat([quant_matmul_q8(x[i:i + 1], layer.qweight, layer.scales, layer.offsets, bits, group,
                                           path=path) for i in range(9)])
        assert torch.equal(alone, quant_matmul_q8(x[:9], layer.qweight, layer.scales, layer.offsets, bits, group,
                                                  path=path)), path


def test_int8_activations_layer_routing() -> None:
    """The layer takes the int8-activation product for every row count once switched on, and its
    float kernel (1e-5 of the format's math) when off."""
    required(int8_path() != 0, "the quantized-matmul kernel has no integer vector path on this CPU")
    gen = torch.Generator().manual_seed(2)
    layer = QuantizedLinear(128, 40, 4, 32, True, has_offsets=True)
    layer.quantize_from(torch.randn(40, 128, generator=gen))
    torch.nn.init.normal_(layer.bias, generator=gen)
    w = layer.dequantized_weight().double()
    for rows in (1, 40, 100):
        x = torch.randn(rows, 128, generator=gen)
        with torch.no_grad():
            layer.int8_activations = False
            assert rel_err((layer(x) - layer.bias).double(), x.double() @ w.t()) < 1e-5
            layer.int8_activations = True
            assert rel_err((layer(x) - layer.bias).double(), round_to_int8_blocks(x) @ w.t()) < 1e-6


def test_quantization_activations_is_checked() -> None:
    with pytest.raises(ValueError, match="quantization_activations must be one of auto, float32, int8"):
        EngineConfig(quantization_activations="int4")


ON_THE_FLY = {"llama-int8": ("llama", "int8", 128), "llama-int4-g32": ("llama", "int4", 32),
              "transformer-int8": ("transformer", "int8", 128), "transformer-int4-g64": ("transformer", "int4", 64)}


@pytest.mark.parametrize("case", list(ON_THE_FLY))
def test_on_the_fly_logits_match_the_dequantized_reference(case, llama_dir, transformer_dir) -> None:
    arch, method, group = ON_THE_FLY[case]
    directory, prefix = (llama_dir, "model.") if arch == "llama" else (transformer_dir, "")
    _, model = load_model(directory, quantize=on_the_fly_scheme(method, group))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    floats = float_weights(directory)
    refs = {}
    for name, layer in layers.items():
        codes, refs[prefix + name] = (int8_reference(floats[f"{prefix}{name}.weight"]) if method == "int8"
                                      else int4_reference(floats[f"{prefix}{name}.weight"], group))
        assert torch.equal(layer.codes().float(), codes), name  # the codes are the format's
    expected = ({f"layers.{i}.self_attn.{p}" for i in range(2) for p in LINEARS[:4]}
                | {f"layers.{i}.mlp.{p}" for i in range(2) for p in LINEARS[4:]}) if arch == "llama" else \
        {f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.out", "mlp.fc", "mlp.proj")}
    assert set(layers) == expected  # every linear layer but the LM head
    check_layers(model, refs, prefix)
    ref = reference_model(directory, refs, prefix)
    tokens = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(1))
    for t in (7, 50):  # decode-sized (the kernel) and prefill-sized (dequantized blocks)
        assert rel_err(full_logits(model, tokens[:t]), full_logits(ref, tokens[:t])) < RTOL


def test_a_quantized_head_keeps_gemma2s_final_logit_softcap(tmp_path) -> None:
    """The quantized head's product goes through the model's own finish (Gemma 2's soft-cap):
    replacing compute_logits once dropped it, and logits ran past the cap."""
    cap = 1.0
    write_tiny_llama(tmp_path, "gemma2", seed=3, with_tokenizer=False, head_dim=16, num_key_value_heads=2,
                     tie_word_embeddings=True, query_pre_attn_scalar=24, final_logit_softcapping=cap)
    _, plain = load_model(tmp_path)
    _, model = load_model(tmp_path, quantize=on_the_fly_scheme("int8", 64), quantize_lm_head=True)
    tokens = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    logits, ref = full_logits(model, tokens), full_logits(plain, tokens)
    assert logits.abs().max().item() <= cap
    assert rel_err(logits, ref) < 0.05  # int8 weights; 0.51 with the cap dropped


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_lm_head_is_quantized_when_asked(family, llama_dir, qwen2_dir) -> None:
    """Untied (Llama): the head alone. Tied (Qwen2): one quantized matrix is both the head and
    the embedding table."""
    directory = llama_dir if family == "llama" else qwen2_dir
    _, model = load_model(directory, quantize=on_the_fly_scheme("int8", 128), quantize_lm_head=True)
    assert model.lm_head is None
    floats = float_weights(directory)
    refs = {f"model.{n}": int8_reference(floats[f"model.{n}.weight"])[1]
            for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and n.startswith("layers.")}
    ref = reference_model(directory, refs, "model.")
    with torch.no_grad():
        if family == "llama":
            assert isinstance(model.quantized_head, QuantizedLinear)
            ref.lm_head.weight.copy_(int8_reference(floats["lm_head.weight"])[1])
        else:
            assert not any(isinstance(m, torch.nn.Embedding) for m in model.modules())
            ref.embed_tokens.weight.copy_(int8_reference(floats["model.embed_tokens.weight"])[1])
    tokens = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    assert rel_err(full_logits(model, tokens), full_logits(ref, tokens)) < RTOL
    _, plain = load_model(directory, quantize=on_the_fly_scheme("int8", 128))
    assert not any(isinstance(m, QuantizedLinear) and "." not in n for n, m in plain.named_modules())


def test_the_lm_head_scheme_follows_quantize_lm_head() -> None:
    """auto: int8 on the CPU whatever the layers hold, full precision elsewhere and for float
    models; True: as the layers; "int8" needs quantized layers (EngineConfig says so)."""
    from model.loading.quant.quantize import head_scheme

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    int4, int8 = on_the_fly_scheme("int4", 64), on_the_fly_scheme("int8", 128)
    assert head_scheme("auto", int4, cpu) == int8 and head_scheme("auto", int8, cpu) == int8
    assert head_scheme("auto", int4, cuda) is None and head_scheme("auto", None, cpu) is None
    assert head_scheme(True, int4, cuda) == int4 and head_scheme("int8", int4, cuda) == int8
    assert head_scheme(False, int4, cpu) is None
    assert EngineConfig().quantize_lm_head == "auto"
    for bad in (1, "int4", None):
        with pytest.raises(ValueError, match="quantize_lm_head must be true, false, auto or int8"):
            EngineConfig(quantization="int4", quantize_lm_head=bad)
    with pytest.raises(ValueError, match="quantize_lm_head=int8 applies with quantization int8 or int4"):
        EngineConfig(quantize_lm_head="int8")


@pytest.mark.parametrize("setting,bits", [("auto", 8), (True, 4), (False, None)])
def test_the_engine_quantizes_the_head_as_configured(setting, bits, llama_dir) -> None:
    """int4 layers on the CPU: the head in int8 by default (auto), in int4 with true, float with
    false; its logits stay within the int8 head's error of the float head's."""
    def engine(head: object) -> Engine:
        return build_engine(str(llama_dir), EngineConfig(quantization="int4", quantization_group_size=32, num_kv_blocks=16,
                                                   quantize_lm_head=head), device="cpu")

    net = engine(setting).runner.model
    head = getattr(net, "quantized_head", None)
    assert (head.bits if head is not None else None) == bits
    assert (net.lm_head is None) == (bits is not None)
    if setting == "auto":
        tokens = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4))
        float_head = engine(False).runner.model
        assert rel_err(full_logits(net, tokens), full_logits(float_head, tokens)) < 0.02


# ---- the engine: alone, in a batch of 16, under preemption ----------------------------------

def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _others(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 24))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99),
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("arch,method,acts", [("llama", "int4", "float32"), ("transformer", "int8", "float32"),
                                               ("llama", "int4", "int8"), ("transformer", "int8", "int8")])
def test_engine_greedy_alone_equals_batched_and_preempted(arch, method, acts, llama_dir, transformer_dir) -> None:
    if acts == "int8":
        required(int8_path() != 0, "the quantized-matmul kernel has no integer vector path on this CPU")
    directory = str(llama_dir if arch == "llama" else transformer_dir)
    prompt = list(range(3, 12))
    llm = LLM(directory, device="cpu", dtype="float32", quantization=method, quantization_group_size=32,
              engine_config=EngineConfig(block_size=8, quantization_activations=acts))
    assert llm.engine.runtime.quantization == method
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.int8_activations == (acts == "int8") for m in layers)
    alone = llm.generate([prompt], _greedy())[0].token_ids
    prompts, params = _others(15, seed=3)
    batch = llm.generate(prompts[:8] + [prompt] + prompts[8:], params[:8] + [_greedy()] + params[8:])
    assert batch[8].token_ids == alone
    tight = LLM(directory, device="cpu", dtype="float32", quantization=method, quantization_group_size=32,
                engine_config=EngineConfig(num_kv_blocks=10, block_size=8, quantization_activations=acts))
    prompts, params = _others(8, seed=4)
    outs = tight.generate(prompts[:4] + [prompt] + prompts[4:], params[:4] + [_greedy()] + params[4:])
    assert tight.engine.stats().num_preemptions_total > 0
    assert outs[4].token_ids == alone


# ---- GPTQ and AWQ checkpoints, packed here ---------------------------------------------------

def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_words(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """32 / bits codes per int32 along `dim`; slot i (bits [bits*i, bits*(i+1))) holds element
    order[i] of each run of 32 / bits (default element i)."""
    pack = 32 // bits
    c = codes.long() & ((1 << bits) - 1)
    c = c if dim == 1 else c.t()
    runs = c.reshape(c.shape[0], c.shape[1] // pack, pack)
    words = torch.zeros(runs.shape[:2], dtype=torch.long)
    for slot, element in enumerate(order or range(pack)):
        words |= runs[:, :, element] << (bits * slot)
    words = to_int32(words)
    return words if dim == 1 else words.t().contiguous()


def gptq_pack(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, fmt: str,
              gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Quantize w (N, K) as GPTQ does and pack it in AutoGPTQ's layout -> (tensors, dequantized
    reference (N, K) by the format's math: scales * (q - zero), zero read back as stored + 1 in
    the original `gptq` format)."""
    n, k = w.shape
    group = k if group == -1 else group
    maxq = (1 << bits) - 1
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // group  # groups follow the order columns were quantized in
    groups = k // group
    wt = w.t()  # (K, N)
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n)
    for g in range(groups):
        cols = wt[g_idx == g]
        lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
        if sym:
            hi = torch.maximum(hi.abs(), lo.abs())
            lo = -hi
        scales[g] = (hi - lo) / maxq
        zeros[g] = torch.full((n,), float((maxq + 1) // 2)) if sym else torch.round(-lo / scales[g])
    scales = scales.half()
    s = scales.float()[g_idx]  # (K, N)
    q = torch.clamp(torch.round(wt / s) + zeros[g_idx], 0, maxq)
    stored = zeros - 1 if fmt == "gptq" else zeros
    read_zero = (stored.long() & maxq) + (1 if fmt == "gptq" else 0)  # the format's zero point
    tensors = {"qweight": pack_words(q, bits, dim=0), "qzeros": pack_words(stored, bits, dim=1),
               "scales": scales, "g_idx": g_idx.to(torch.int32)}
    return tensors, (s * (q - read_zero.float()[g_idx])).t()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a word holds output column AWQ_ORDER[i]


def awq_pack(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ GEMM: 4-bit, zero points, qweight (K, N/8) and qzeros packed along the outputs in
    AWQ's interleaved order -> (tensors, scales * (q - zero))."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(2).clamp(max=0), g.amax(2).clamp(min=0)
    scales = ((hi - lo) / 15).half()  # (N, G)
    s = scales.float()
    z = torch.clamp(torch.round(-lo / s), 0, 15)
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)  # (N, G, group)
    ref = (s[..., None] * (q - z[..., None])).reshape(n, k)
    tensors = {"qweight": pack_words(q.reshape(n, k).t(), 4, dim=1, order=AWQ_ORDER),
               "qzeros": pack_words(z.t(), 4, dim=1, order=AWQ_ORDER), "scales": scales.t().contiguous()}
    return tensors, ref


def write_quantized(src: Path, dst: Path, qc: dict, pack) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with every decoder linear layer replaced by `pack(w)`'s
    tensors and `quantization_config` in config.json -> the dequantized reference weights."""
    shutil.copytree(src, dst)
    tensors, refs = {}, {}
    for name, t in float_weights(src).items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.rsplit(".", 1)[-1] in LINEARS:
            packed, refs[base] = pack(t.float())
            tensors.update({f"{base}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(raw))
    return refs


GPTQ_CASES = {  # id -> (family, bits, group_size, sym, desc_act, checkpoint_format)
    "llama-4bit-g32-sym": ("llama", 4, 32, True, False, "gptq"),
    "llama-4bit-g32-asym-desc_act": ("llama", 4, 32, False, True, "gptq"),
    "qwen2-4bit-g-1-asym-v2": ("qwen2", 4, -1, False, False, "gptq_v2"),
    "llama-8bit-g32-sym-desc_act": ("llama", 8, 32, True, True, "gptq"),
    "qwen2-8bit-g-1-asym": ("qwen2", 8, -1, False, False, "gptq"),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_checkpoint_matches_its_dequantized_reference(case, llama_dir, qwen2_dir, tmp_path) -> None:
    family, bits, group, sym, desc_act, fmt = GPTQ_CASES[case]
    src = llama_dir if family == "llama" else qwen2_dir
    gen = torch.Generator().manual_seed(7)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}
    refs = write_quantized(src, tmp_path / "gptq", qc, lambda w: gptq_pack(w, bits, group, sym, desc_act, fmt, gen))
    _, model = load_model(tmp_path / "gptq")
    assert model.quant_scheme.describe() == {"method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                             "desc_act": desc_act}
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == len(refs) == 14
    check_layers(model, refs, "model.")
    ref = reference_model(src, refs, "model.")
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))
    for t in (5, 40):
        assert rel_err(full_logits(model, tokens[:t]), full_logits(ref, tokens[:t])) < RTOL


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_awq_checkpoint_matches_its_dequantized_reference(family, llama_dir, qwen2_dir, tmp_path) -> None:
    src = llama_dir if family == "llama" else qwen2_dir
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    refs = write_quantized(src, tmp_path / "awq", qc, lambda w: awq_pack(w, 32))
    _, model = load_model(tmp_path / "awq")
    assert model.quant_scheme.method == "awq"
    check_layers(model, refs, "model.")
    ref = reference_model(src, refs, "model.")
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(4))
    for t in (6, 40):
        assert rel_err(full_logits(model, tokens[:t]), full_logits(ref, tokens[:t])) < RTOL


# ---- what is refused --------------------------------------------------------------------------

REFUSED = {  # quantization_config -> the field and value the error names
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"},
                 "quantization_config.version 'gemv'"),
    "awq-3bit": ({"quant_method": "awq", "bits": 3, "group_size": 32, "zero_point": True, "version": "gemm"},
                 "quantization_config.bits 3"),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "quantization_config.bits 3"),
    "gptq-marlin": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
                    "quantization_config.checkpoint_format 'marlin'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     "quantization_config.quant_method 'bitsandbytes'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_checkpoint_variants_are_refused_by_name(case, llama_dir, tmp_path) -> None:
    qc, message = REFUSED[case]
    shutil.copytree(llama_dir, tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "q")


def test_bad_arguments_are_refused(llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4; got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128; got 48"):
        EngineConfig(quantization_group_size=48)
    # The tiny Llama's MLP is 96 wide: groups of 64 do not divide down_proj's inputs.
    with pytest.raises(ValueError, match="group size 64 does not divide in_features 96 of layers.0.mlp.down_proj"):
        load_model(llama_dir, quantize=on_the_fly_scheme("int4", 64))
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    write_quantized(llama_dir, tmp_path / "awq", qc, lambda w: awq_pack(w, 32))
    with pytest.raises(ValueError, match=r"already quantized \(awq"):
        load_model(tmp_path / "awq", quantize=on_the_fly_scheme("int8", 128))


# ---- the service ------------------------------------------------------------------------------

def test_service_serves_int8_and_says_so(llama_dir) -> None:
    from service.app import AppArgs

    args = AppArgs(model=str(llama_dir), quantization="int4", quantization_group_size=64, quantize_lm_head=True)
    config = EngineConfig(**args.engine_config())  # the app's arguments reach the engine's config
    assert (config.quantization, config.quantization_group_size, config.quantize_lm_head) == ("int4", 64, True)
    engine = build_engine(str(llama_dir), EngineConfig(quantization="int8", num_kv_blocks=64), device="cpu")
    expected = LLM(str(llama_dir), device="cpu", quantization="int8").generate([[1, 2, 3]], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids

    async def run() -> tuple[dict, dict]:
        async with edge_app(engine, "tiny-int8") as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge") as client:
                models = (await client.get("/v1/models")).json()
                done = await client.post("/v1/completions", json={
                    "model": "tiny-int8", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True})
                assert done.status_code == 200, done.text
                return models, done.json()

    models, done = asyncio.run(run())
    card = models["data"][0]
    assert card["quantization"] == "int8"
    assert card["quantization_config"] == {"method": "int8", "bits": 8, "group_size": -1,
                                           "activations": "int8" if int8_path() > 0 else "float32",  # auto
                                           "lm_head": {"method": "int8", "bits": 8, "group_size": -1}}  # auto
    assert done["choices"][0]["text"] == engine.tokenizer.decode(expected)
