"""The suite's checks on an accelerator: `pytest -m gpu` on a machine with CUDA (skipped without
one; `--accel-device cpu` runs the same tests on the CPU, which checks the tests themselves).

On the device, in float32: logits within 1e-4 of HF transformers and 24 greedy tokens identical
(alone, from the prefix cache, in a batch of 16, preempted) for Llama (GQA, RoPE), GPT-2, Gemma 2
(soft-caps, windows) and Qwen3 (q/k norms), through the gather and flex backends; sampling with temperature, top-k/p,
penalties, logit bias, logprobs and seeds (a seed's tokens the same alone and batched); decode on
CUDA graphs equal to eager decoding, captured (not fallen back), with no gather workspace under
flex; int8/int4 logits equal to the CPU's; a LoRA adapter equal to peft's merged model; ngram
speculation equal to plain greedy decoding; Qwen2-VL and Qwen2.5-VL image requests beside text ones
equal to HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.loading.checkpoint import load_model
from model.loading.quant.quantize import on_the_fly_scheme
from tests.support.tiny_models import build_tiny_llama, build_tokenizer, engine_greedy_runs, full_logits, hf_greedy, write_tiny_llama
from tests.support.requirements import need_module

pytestmark = pytest.mark.gpu
transformers = need_module("transformers")

LOGITS_ATOL = 1e-4
GREEDY = 24
BLOCK = 16  # flex on CUDA needs a multiple of 16
PROMPT = torch.randint(0, 301, (37,), generator=torch.Generator().manual_seed(5)).tolist()
GEMMA = dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=True, query_pre_attn_scalar=24,
             sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu")
    out = {"llama": str(write_tiny_llama(root / "llama")),
           "gemma2": str(write_tiny_llama(root / "gemma2", "gemma2", seed=2, **GEMMA)),
           "qwen3": str(write_tiny_llama(root / "qwen3", "qwen3", seed=3, head_dim=32))}  # q/k norms
    from tests.support.tiny_models import save_tiny_gpt2
    out["gpt2"] = str(save_tiny_gpt2(root / "gpt2"))
    return out


def _hf(directory: str):
    config = transformers.AutoConfig.from_pretrained(directory)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "qwen3"])
def test_parity_with_hf_alone_batched_cached_preempted(device, checkpoints, arch, backend) -> None:
    directory = checkpoints[arch]
    hf = _hf(directory)
    _, ours = load_model(directory, device=device)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    got = full_logits(ours, PROMPT, block_size=BLOCK).cpu()
    assert (got - want).abs().max().item() < LOGITS_ATOL
    ref = hf_greedy(hf, PROMPT, GREEDY)
    runs = engine_greedy_runs(directory, PROMPT, GREEDY, vocab=301, block_size=BLOCK, device=device,
                              attention_backend=backend)
    assert runs == {k: ref for k in runs}


def test_sampling_on_the_device(device, checkpoints) -> None:
    llm = LLM(checkpoints["llama"], device=device, dtype="float32", engine_config=EngineConfig(block_size=BLOCK))
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=8, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5,
                       repetition_penalty=1.3, logit_bias={7: -100.0}, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5, seed=11, ignore_eos=True, min_tokens=4),
    ]
    outs = llm.generate([PROMPT, PROMPT[:20], PROMPT[5:]], params)
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    assert 7 not in outs[1].token_ids
    assert all(lp is not None and lp.logprob <= 0.0 and len(lp.top) == 3 for lp in outs[0].logprobs)
    alone = llm.generate([PROMPT[5:]], params[2])[0].token_ids
    assert alone == outs[2].token_ids  # a seed's draw does not depend on the batch


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_decode_graphs_equal_eager_decoding(device, checkpoints, backend) -> None:
    prompts = [PROMPT[: 5 + 4 * i] for i in range(6)]
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    tokens = {}
    for eager in (True, False):
        llm = LLM(checkpoints["llama"], device=device, dtype="float32", enforce_eager=eager,
                  engine_config=EngineConfig(block_size=BLOCK, max_num_seqs=8, attention_backend=backend))
        tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        if not eager and device.startswith("cuda"):
            assert graphs.eager_reason is None and graphs.num_replays > 0  # captured, not fallen back
            # flex decode never gathers, so no workspace was reserved for the graphs
            assert (llm.engine.runner.cache.workspace_blocks == 0) == (backend == "flex")
    assert tokens[True] == tokens[False]


def test_cuda_default_captures(device, checkpoints) -> None:
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs are CUDA's")
    llm = LLM(checkpoints["llama"], device=device, engine_config=EngineConfig(block_size=BLOCK))
    assert llm.engine.runner.graphs is not None and llm.engine.runner.backend == "flex"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_logits_equal_the_cpus(device, checkpoints, method) -> None:
    scheme = on_the_fly_scheme(method, 32)
    _, on_device = load_model(checkpoints["llama"], device=device, quantize=scheme, quantize_lm_head=True)
    _, on_cpu = load_model(checkpoints["llama"], quantize=scheme, quantize_lm_head=True)
    got, want = full_logits(on_device, PROMPT, BLOCK).cpu(), full_logits(on_cpu, PROMPT, BLOCK)
    assert (got - want).abs().max().item() < LOGITS_ATOL


def test_lora_adapter_equals_peft_merged(device, tmp_path) -> None:
    peft = need_module("peft")
    base = tmp_path / "base"
    build_tiny_llama().save_pretrained(base)
    build_tokenizer(301).save(str(base / "tokenizer.json"))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(build_tiny_llama(), config)
    model.save_pretrained(tmp_path / "adapter")
    ref = hf_greedy(model.merge_and_unload().eval(), PROMPT, GREEDY)
    llm = LLM(str(base), device=device, dtype="float32",
              engine_config=EngineConfig(block_size=BLOCK, lora_modules={"a": str(tmp_path / "adapter")}))
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True), lora="a")
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got += out.new_token_ids
    assert got == ref


def test_ngram_speculation_equals_plain_greedy(device, checkpoints) -> None:
    prompt = PROMPT[:12] * 3  # repeats: the proposer finds matches
    greedy = SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plain = LLM(checkpoints["llama"], device=device, dtype="float32", engine_config=EngineConfig(block_size=BLOCK))
    fast = LLM(checkpoints["llama"], device=device, dtype="float32", speculative_config=spec,
               engine_config=EngineConfig(block_size=BLOCK))
    assert fast.generate([prompt], greedy)[0].token_ids == plain.generate([prompt], greedy)[0].token_ids
    assert fast.engine.stats().spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("where", ["host", "disk"])
def test_kv_offload_tier_gives_the_same_tokens(device, checkpoints, where, tmp_path) -> None:
    """The prefix cache's offload tier on the device (blocks copied out to the host and back,
    decode graphs on): a pool of 8 blocks holds one 80-token prompt, so the second ask of each of
    four finds its prefix in the tier; tokens equal those without prefix caching."""
    g = torch.Generator().manual_seed(9)
    systems = [torch.randint(1, 301, (80,), generator=g).tolist() for _ in range(4)]
    prompts = [s + torch.randint(1, 301, (5,), generator=g).tolist() for _ in range(2) for s in systems]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(**fields) -> tuple[list[list[int]], object]:
        llm = LLM(checkpoints["llama"], device=device, dtype="float32",
                  engine_config=EngineConfig(block_size=BLOCK, num_kv_blocks=8, **fields))
        return [llm.generate([p], greedy)[0].token_ids for p in prompts], llm.engine.stats()

    want, _ = run(enable_prefix_caching=False)
    got, stats = run(kv_offload_bytes=32 << 20, kv_offload_dir=str(tmp_path) if where == "disk" else None)
    assert got == want
    assert stats.kv_offload_loaded_blocks >= 4 * 5 - 5 and stats.kv_offload_errors == 0


def _two_asks() -> tuple[list[list[int]], SamplingParams]:
    g = torch.Generator().manual_seed(11)
    systems = [torch.randint(1, 301, (80,), generator=g).tolist() for _ in range(4)]
    return ([s + torch.randint(1, 301, (5,), generator=g).tolist() for _ in range(2) for s in systems],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def test_shared_tier_and_transferred_blocks_give_the_same_tokens(device, checkpoints, tmp_path) -> None:
    """The tier the replicas of a node share (kv_share_dir) and prefill/decode transfers, on the
    device, decode graphs on: a second engine loads the blocks the first wrote; a decode engine
    decodes from blocks another engine exported; tokens equal those without prefix caching."""
    prompts, greedy = _two_asks()

    def llm(**fields) -> LLM:
        return LLM(checkpoints["llama"], device=device, dtype="float32",
                   engine_config=EngineConfig(block_size=BLOCK, num_kv_blocks=8, **fields))

    plain = llm(enable_prefix_caching=False)
    want = [plain.generate([p], greedy)[0].token_ids for p in prompts]
    writer, reader = (llm(kv_share_dir=str(tmp_path), kv_share_bytes=32 << 20) for _ in range(2))
    for p in prompts[:4]:
        writer.generate([p], greedy)
    writer.engine.kv_share.flush()
    assert [reader.generate([p], greedy)[0].token_ids for p in prompts] == want
    assert reader.engine.stats().kv_share_loaded_blocks >= 4 * 5 and reader.engine.stats().kv_share_errors == 0
    prefill, decode = llm(), llm()
    got = []
    for p in prompts:
        prefill.generate([p], SamplingParams(max_tokens=1, temperature=0.0))
        assert decode.engine.receive_prefix(prefill.engine.export_prefix(p))
        got.append(decode.generate([p], greedy)[0].token_ids)
    assert got == want and decode.engine.incoming.loaded_blocks >= 4 * 5


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_vision_language_parity(device, tmp_path, version) -> None:
    """Qwen2-VL / Qwen2.5-VL on the device: 24 greedy tokens of image requests (one chunked through
    its image) beside text requests equal HF's on the CPU, and a repeat of an image from the prefix
    cache equals it too."""
    from tests.support.vision_models import QWEN2_VL_IDS, hf_qwen2_vl_inputs, random_image, save_tiny_qwen2_vl

    directory = save_tiny_qwen2_vl(tmp_path / "vl", version=version)
    hf = _hf(str(directory))
    hf.generation_config.eos_token_id = None
    image = [QWEN2_VL_IDS["vision_start"], QWEN2_VL_IDS["image_pad"], QWEN2_VL_IDS["vision_end"]]
    llm = LLM(str(directory), device=device, dtype="float32", block_size=BLOCK, max_num_batched_tokens=32)
    prompts = [{"prompt": [7, 8] + image + [9, 10], "multi_modal_data": {"image": random_image(i, 112, 84 + 28 * i)}}
               for i in range(3)] + [[7, 8, 9, 10, 11]]
    params = SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.generate(prompts[:1], params)[0].token_ids == outs[0].token_ids  # its image's blocks cached now
    for prompt, out in zip(prompts, outs):
        images = [prompt["multi_modal_data"]["image"]] if isinstance(prompt, dict) else []
        with torch.no_grad():
            ref = hf.generate(**hf_qwen2_vl_inputs(directory, out.prompt_token_ids, images), max_new_tokens=GREEDY,
                              do_sample=False)[0, len(out.prompt_token_ids):].tolist()
        assert out.token_ids == ref
