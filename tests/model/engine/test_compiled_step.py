"""The compiled CPU decode step (model/engine/runner.py `DecodeGraphs`, `enforce_eager=False`):
the project's kernels are custom ops whose fake implementations agree with them, the compiled
step gives the eager step's tokens, compiles two graphs however many buckets run (batch 1, then
one with a dynamic batch dimension), and decodes eagerly, saying why, where it cannot compile."""

from __future__ import annotations

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.runner import DecodeGraphs
from model.layers import paged_attention
from model.layers.linear import dense, kernel
from tests.support.requirements import required
from tests.support.tiny_models import build_tiny_gpt2, build_tiny_llama, hf_greedy, save_tiny_gpt2, write_tiny_llama

BS = 4
NO_KERNEL = "the fused paged-attention kernel did not build here: nothing is compiled"
PROMPTS = [[5 + i] * (2 + 3 * i) for i in range(6)]
# Six sequences that finish one after another: decode batches of 6, 5, ... 1 (buckets 8, 8, 4, 4, 2, 1).
PARAMS = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))  # GQA: 4 query heads, 2 KV heads


def _generate(model: str, eager: bool, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, enforce_eager=eager, engine_config=EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=8,
                                                                     **engine_args))
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)], llm


def _checks() -> tuple[str, ...]:
    return ("test_schema", "test_faketensor")  # the ops are inference-only: no autograd checks


def test_the_kernels_fake_implementations_agree_with_them() -> None:
    """torch.library.opcheck runs each op on real and on fake tensors and compares what comes out
    (shapes, dtypes, strides) and checks the op against its schema."""
    required(dense.kernel_available() and kernel.kernel_available() and paged_attention.kernel_available(),
             "the C++ kernels did not build here")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g)
    torch.library.opcheck(torch.ops.qkv_dense.dense_matmul.default, (x, w, torch.randn(40, generator=g)),
                          test_utils=_checks())
    codes = torch.randint(-127, 128, (40, 64), dtype=torch.int8, generator=g)
    scales = torch.rand(40, 2, generator=g)
    torch.library.opcheck(torch.ops.qkv_quant.quant_matmul.default, (x, codes, scales, scales.new_empty(0), 8, 32),
                          test_utils=_checks())
    torch.library.opcheck(torch.ops.qkv_quant.quant_matmul_q8.default,
                          (x, codes, scales, scales.new_empty(0), 8, 32, -1), test_utils=_checks())
    k_cache, v_cache = torch.randn(6, BS, 2, 16, generator=g), torch.randn(6, BS, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    tables, seqs, keys = torch.tensor([[1, 4, 2], [5, 0, 3]]), torch.tensor([0, 1, 1]), torch.tensor([9, 3, 11])
    torch.library.opcheck(torch.ops.qkv_paged.paged_attention.default,
                          (q, k_cache, v_cache, tables, seqs, keys, 0.25, 0), test_utils=_checks())


@pytest.mark.parametrize("quant", [
    {},
    {"quantization": "int8", "quantization_activations": "float32"},
    {"quantization": "int4", "quantization_group_size": 32, "quantization_activations": "float32"},
])
def test_the_compiled_step_gives_the_eager_tokens_with_two_compiles(llama_dir, quant) -> None:
    required(paged_attention.kernel_available(), NO_KERNEL)
    eager, _ = _generate(llama_dir, True, **quant)
    compiled, llm = _generate(llama_dir, False, **quant)
    graphs = llm.engine.runner.graphs
    assert graphs.compiled is not None and graphs.eager_reason is None
    assert graphs.num_steps >= 10 and graphs.num_padding_rows > 0  # buckets 8, 4, 2 and 1 all ran
    assert graphs.num_compiles == 2  # batch 1, then one dynamic batch dimension for every other bucket
    assert "compile" in llm.engine.runtime.startup_seconds  # both compiled at start-up, before any request
    assert compiled == eager
    assert len({tuple(o) for o in eager}) == 6


GEMMA3 = dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=True, query_pre_attn_scalar=24,
              num_hidden_layers=6, sliding_window=8, rope_parameters={
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
PHI3 = dict(partial_rotary_factor=0.5, max_position_embeddings=128, original_max_position_embeddings=32,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                          "long_factor": [1.0, 2.5, 6.0, 11.0]})


@pytest.mark.parametrize("arch,overrides", [
    ("gpt2", {}),
    ("mistral", {"sliding_window": 8}),  # the window passed into the fused kernel, traced as a constant
    ("qwen3", {}),  # q/k norms
    ("gemma3", GEMMA3),  # 5:1 local/global layers with two rotary tables, (1 + w) norms
    ("phi3", PHI3),  # its checkpoint's fused projections, partial LongRoPE, decoding past the original length
], ids=["gpt2", "mistral-window", "qwen3", "gemma3", "phi3-longrope"])
def test_the_compiled_step_gives_hf_greedy_tokens(arch, overrides, tmp_path) -> None:
    """HF parity through the compiled step, on families whose decode differs in what surrounds the
    kernels: learned positions and LayerNorm, a sliding window (outrun by the generation), q/k norms,
    per-layer rotary tables, LongRoPE's switch of factors."""
    required(paged_attention.kernel_available(), NO_KERNEL)
    prompt = [5, 17, 42, 8, 99, 23, 61, 7, 3, 11, 250, 31, 77, 120, 64, 9, 200, 13, 44, 2, 180, 6, 95, 150]
    if arch == "gpt2":
        directory, hf = save_tiny_gpt2(tmp_path / arch), build_tiny_gpt2()
    elif arch in ("gemma3", "phi3"):
        import transformers

        directory = write_tiny_llama(tmp_path / arch, arch, seed=3, with_tokenizer=False, **overrides)
        hf_cls = {"gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}[arch]
        hf = getattr(transformers, hf_cls).from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    else:
        directory, hf = write_tiny_llama(tmp_path / arch, arch=arch, **overrides), build_tiny_llama(arch, **overrides)
    llm = LLM(str(directory), enforce_eager=False, dtype="float32",
              engine_config=EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=4))
    assert llm.engine.runner.graphs.compiled is not None
    got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, prompt, 16)
    assert llm.engine.runner.graphs.num_compiles == 2 and llm.engine.runner.graphs.compiled is not None


def test_the_compiled_step_with_int8_activations_stays_close_to_eager(llama_dir) -> None:
    """int8 activations round each block of 32 activations to codes: a last-bit difference in a
    norm that Inductor computes in another order can move one code, so the compiled step is held
    to the eager logits within that rounding, not to identical tokens."""
    required(paged_attention.kernel_available() and kernel.int8_path() > 0, "no int8-activation kernel path here")
    logits = {}
    for eager in (True, False):
        llm = LLM(llama_dir, enforce_eager=eager, quantization="int8", quantization_activations="int8",
                  engine_config=EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=8))
        out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5))
        logits[eager] = [dict(step.top) for step in out[0].logprobs]
        if not eager:
            assert llm.engine.runner.graphs.compiled is not None
    for want, got in zip(logits[True], logits[False]):
        shared = want.keys() & got.keys()
        assert len(shared) >= 4
        assert max(abs(want[t] - got[t]) for t in shared) < 0.05


@pytest.mark.parametrize("model,backend,reason", [
    ("transformer-base", "gather", "gathers the cache"),
    ("transformer-base-additive", "fused", "has no fused kernel"),
    ("mixtral", "fused", "mixture-of-experts"),
])
def test_a_step_that_cannot_compile_decodes_eagerly_and_says_why(model, backend, reason, tmp_path) -> None:
    if model == "mixtral":
        model = str(write_tiny_llama(tmp_path / "mixtral", arch="mixtral"))
    llm = LLM(model, enforce_eager=False, engine_config=EngineConfig(num_kv_blocks=32, block_size=BS, max_num_seqs=4,
                                                                     attention_backend=backend))
    graphs = llm.engine.runner.graphs
    assert graphs.compiled is None and reason in graphs.eager_reason and graphs.num_compiles == 0
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and graphs.num_steps >= 4


def test_a_failed_compile_falls_back_to_eager_with_the_reason(llama_dir, monkeypatch, caplog) -> None:
    """A backend that fails (here: Inductor raising) turns compilation off at start-up, logged and
    kept as `eager_reason`; the engine then decodes eagerly and gives the eager tokens."""
    required(paged_attention.kernel_available(), NO_KERNEL)

    def broken(self, gm, example_inputs):
        raise RuntimeError("C++ compile error: no such compiler")

    monkeypatch.setattr(DecodeGraphs, "_inductor", broken)
    eager, _ = _generate(llama_dir, True)
    with caplog.at_level("WARNING", logger="model.engine.runner"):
        fallback, llm = _generate(llama_dir, False)
    graphs = llm.engine.runner.graphs
    assert graphs.compiled is None and "no such compiler" in graphs.eager_reason
    assert "compiling the decode step failed" in caplog.text
    assert fallback == eager


def test_a_compiled_graph_that_fails_mid_serving_leaves_the_step_to_eager(llama_dir, caplog) -> None:
    """A compiled graph that raises while serving (here: replaced by one that does) is dropped: the
    same rows run eagerly in that step, and every later step decodes eagerly."""
    required(paged_attention.kernel_available(), NO_KERNEL)
    eager, _ = _generate(llama_dir, True)
    llm = LLM(llama_dir, enforce_eager=False, engine_config=EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=8))
    graphs = llm.engine.runner.graphs

    def failing(*inputs):
        raise RuntimeError("the compiled graph hit an unsupported op")

    graphs.compiled = failing
    with caplog.at_level("WARNING", logger="model.engine.runner"):
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == eager
    assert graphs.compiled is None and "unsupported op" in graphs.eager_reason
    assert caplog.text.count("compiling the decode step failed") == 1


def test_lora_rows_decode_eagerly_beside_compiled_base_rows(tmp_path) -> None:
    """An engine serving a LoRA adapter compiles the base model's decode step; steps with adapter
    rows run eagerly (their grouping by adapter changes from step to step). Base and adapter
    requests, alone and mixed, get the eager engine's tokens, and nothing recompiles."""
    required(paged_attention.kernel_available(), NO_KERNEL)
    from peft import LoraConfig, get_peft_model

    base = write_tiny_llama(tmp_path / "base")
    torch.manual_seed(3)
    peft = get_peft_model(build_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    requests = [(PROMPTS[2], "a"), (PROMPTS[4], None), (PROMPTS[2], None), (PROMPTS[5], "a")]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(base), enforce_eager=eager, engine_config=EngineConfig(
            num_kv_blocks=64, block_size=BS, max_num_seqs=8, lora_modules={"a": str(tmp_path / "adapter")}))
        engine = llm.engine
        runs = []
        for batch in ([requests[1]], [requests[0]], requests):  # base alone, adapter alone, mixed
            for i, (prompt, lora) in enumerate(batch):
                engine.add_request(f"{eager}-{len(runs)}-{i}", prompt, PARAMS[3], lora=lora)
            got: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
            runs.append([got[k] for k in sorted(got)])
        outs[eager] = runs
        if not eager:
            graphs = engine.runner.graphs
            assert graphs.compiled is not None and graphs.num_compiles == 2 and graphs.num_steps > 0
    assert outs[False] == outs[True]
    mixed = outs[True][2]
    assert mixed[0] != mixed[2]  # one prompt with and without the adapter: the adapter's rows mattered


def test_buckets_past_the_kernels_row_limit_get_a_third_graph_at_start_up(llama_dir) -> None:
    """Above 64 rows the dense and quantized products take another path, so a step of more rows
    needs its own graph: compiled at start-up with the other two (the largest bucket is warmed up),
    never while serving; the tokens stay the eager step's."""
    required(paged_attention.kernel_available(), NO_KERNEL)
    prompts = [[1 + i % 250, 7, 3 + i % 5] for i in range(70)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(llama_dir, enforce_eager=eager, engine_config=EngineConfig(num_kv_blocks=400, block_size=BS,
                                                                             max_num_seqs=72))
        if not eager:
            graphs = llm.engine.runner.graphs
            assert graphs.num_compiles == 3 and graphs.compiled is not None
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert graphs.num_compiles == 3 and graphs.compiled is not None and graphs.num_steps >= 2
    assert outs[False] == outs[True]
