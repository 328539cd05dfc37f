"""Qwen2-VL and Qwen2.5-VL against HF transformers on a tiny random checkpoint saved by transformers with its
image processor: logits, greedy tokens alone, in a mixed batch, chunked, preempted, and through
the prefix and encoder caches (images keyed by their pixels)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.inspect.attention_spec import AttentionSpec
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.llm import LLM
from model.loading.checkpoint import load_model
from model.multimodal.processor import ImageInputError
from model.sampling.params import SamplingParams
from tests.support.tiny_models import one_thread, save_tiny_gpt2  # noqa: F401 (one torch thread: exact comparisons)
from tests.support.vision_models import QWEN2_VL_IDS, hf_qwen2_vl_inputs, random_image, save_tiny_qwen2_vl

IMAGE = [QWEN2_VL_IDS["vision_start"], QWEN2_VL_IDS["image_pad"], QWEN2_VL_IDS["vision_end"]]
PROMPT_1 = [1, 40, 41, 42] + IMAGE + [50, 51, 52, 53, 54, 55]  # text, an image, text
PROMPT_2 = [1, 40] + IMAGE + [60, 61] + IMAGE + [70, 71, 72]  # two images
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"), version=request.param)


def hf_class(directory: Path):
    import transformers

    return getattr(transformers, json.loads((directory / "config.json").read_text())["architectures"][0])


@pytest.fixture(scope="module")
def hf_model(vl_dir: Path):
    return hf_class(vl_dir).from_pretrained(str(vl_dir)).eval()


@pytest.fixture(scope="module")
def llm(vl_dir: Path) -> LLM:
    return LLM(str(vl_dir), dtype="float32", max_num_seqs=16)


def hf_greedy(hf, directory: Path, ids: list[int], images: list, n: int = 32) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(**hf_qwen2_vl_inputs(directory, ids, images), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def our_logits(model, ids: list[int], mm) -> torch.Tensor:
    """Our model's logits (T, vocab) for one prompt prefilled in one pass, images in place."""
    t, cfg = len(ids), model.cfg
    blocks = math.ceil(t / 16)
    cache = KVCache(cfg.n_layers, blocks, 16, cfg.kv_heads, cfg.d_head, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slot_mapping=torch.arange(t), prefills=[PrefillChunk(0, t, t, torch.arange(blocks))])
    if mm is not None:
        rows = torch.cat([torch.arange(im.offset, im.end) for im in mm.images])
        meta.mm_embeds = rows, torch.cat([model.encode_image(im.data) for im in mm.images])
        meta.mrope_positions = mm.positions
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), meta, cache))


@pytest.mark.parametrize("prompt,images", [(PROMPT_1, [(120, 90)]), (PROMPT_2, [(56, 112), (150, 60)])],
                         ids=["one-image", "two-images"])
def test_logits_match_hf(vl_dir: Path, hf_model, llm: LLM, prompt, images) -> None:
    pics = [random_image(i, w, h) for i, (w, h) in enumerate(images)]
    ids, mm = llm.engine.process_images(prompt, pics)
    assert len(mm.images) == len(pics) and sum(t == QWEN2_VL_IDS["image_pad"] for t in ids) > len(pics)
    _, ours = load_model(vl_dir)
    with torch.no_grad():
        ref = hf_model(**hf_qwen2_vl_inputs(vl_dir, ids, pics)).logits[0]
    got = our_logits(ours, ids, mm)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # The image matters: the logits after it move with another picture.
    _, other = llm.engine.process_images(prompt, [random_image(9, w, h) for w, h in images])
    assert not torch.allclose(our_logits(ours, ids, other)[-1], got[-1], atol=1e-3)


def test_greedy_tokens_match_hf(vl_dir: Path, hf_model, llm: LLM) -> None:
    pics = [random_image(3, 56, 112), random_image(4, 150, 60)]
    ids, _ = llm.engine.process_images(PROMPT_2, pics)
    out = llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": pics}}, GREEDY)[0]
    assert out.token_ids == hf_greedy(hf_model, vl_dir, ids, pics)
    assert out.prompt_token_ids == ids


def test_batch_of_16_with_text_only_requests(vl_dir: Path, hf_model, llm: LLM) -> None:
    prompts = []
    for i in range(16):
        if i % 2:
            prompts.append([1, 40 + i, 41, 42, 43, 44, 45 + i])
        else:
            prompts.append({"prompt": PROMPT_1, "multi_modal_data": {"image": random_image(10 + i, 60 + 8 * i, 90)}})
    batch = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, batch):
        assert out.token_ids == llm.generate(prompt, GREEDY)[0].token_ids
    for prompt, out in list(zip(prompts, batch))[:4:2]:  # two image requests against HF too
        image = prompt["multi_modal_data"]["image"]
        assert out.token_ids == hf_greedy(hf_model, vl_dir, out.prompt_token_ids, [image])
    text = batch[1]
    assert text.token_ids == hf_greedy(hf_model, vl_dir, text.prompt_token_ids, [])


def _run(engine: Engine, requests: dict[str, tuple[list[int], object]], params: SamplingParams = GREEDY
         ) -> dict[str, tuple[list[int], int]]:
    """Each request's tokens and cached prompt tokens, run together on `engine`."""
    for rid, (ids, mm) in requests.items():
        engine.add_request(rid, ids, params, mm=mm)
    out = {rid: ([], 0) for rid in requests}
    while engine.has_unfinished():
        for d in engine.step():
            tokens, cached = out[d.request_id]
            out[d.request_id] = (tokens + d.new_token_ids, max(cached, d.num_cached_tokens))
    return out


def test_prefix_cache_keys_images_by_pixels(vl_dir: Path, hf_model) -> None:
    engine = build_engine(str(vl_dir), EngineConfig(enable_prefix_caching=True, block_size=4), dtype="float32")
    first, second = random_image(20, 112, 112), random_image(21, 112, 112)  # same size: the same token ids
    ids, mm = engine.process_images(PROMPT_1, [first])
    ids_b, mm_b = engine.process_images(PROMPT_1, [second])
    assert ids == ids_b and mm.images[0].hash != mm_b.images[0].hash
    a = _run(engine, {"a": (ids, mm)})["a"]
    again = _run(engine, {"again": (ids, engine.process_images(PROMPT_1, [first.copy()])[1])})["again"]
    other = _run(engine, {"other": (ids_b, mm_b)})["other"]
    assert again[0] == a[0] == hf_greedy(hf_model, vl_dir, ids, [first])
    assert again[1] >= len(ids) - 4  # the whole prompt but its last (partial) block came from the cache
    # A different picture shares only the blocks before its image starts, and gets its own answer.
    image_start = mm_b.images[0].offset
    assert other[1] == image_start // 4 * 4
    assert other[0] == hf_greedy(hf_model, vl_dir, ids_b, [second]) != a[0]
    cache = engine.runner.encoder_cache
    assert cache.misses == 2 and cache.hits == 0  # the repeat's image blocks were all cached


def test_chunked_and_preempted_match_alone(vl_dir: Path, llm: LLM) -> None:
    pics = [random_image(30 + i, 112, 56 + 28 * i) for i in range(4)]
    reqs = {f"r{i}": llm.engine.process_images(PROMPT_1, [p]) for i, p in enumerate(pics)}
    alone = {rid: llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": p}}, GREEDY)[0].token_ids
             for rid, p in zip(reqs, pics)}
    # Prefill chunks of 8 tokens cut through the images; 20 blocks of 4 tokens hold one or two of
    # the four requests, so the others wait or are preempted and recomputed.
    engine = build_engine(str(vl_dir), EngineConfig(max_num_batched_tokens=8, block_size=4, num_kv_blocks=20,
                                              enable_prefix_caching=False), dtype="float32")
    got = _run(engine, reqs)
    assert {rid: toks for rid, (toks, _) in got.items()} == alone
    assert engine.scheduler.num_preemptions > 0
    # Chunks cut through the images, yet each image was encoded once (no cache eviction here).
    assert engine.runner.encoder_cache.misses == 4


def test_encoder_runs_once_per_image(vl_dir: Path) -> None:
    engine = build_engine(str(vl_dir), EngineConfig(enable_prefix_caching=False), dtype="float32")
    pic = random_image(40)
    reqs = {f"r{i}": engine.process_images(PROMPT_1, [pic]) for i in range(3)}
    outs = _run(engine, reqs)
    assert len({tuple(t) for t, _ in outs.values()}) == 1
    cache = engine.runner.encoder_cache
    assert (cache.misses, cache.hits) == (1, 2)
    assert cache.encode_seconds > 0


def test_bad_image_inputs_are_clear_errors(vl_dir: Path, llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ImageInputError, match="1 image placeholder.*2 image"):
        llm.engine.process_images(PROMPT_1, [random_image(1), random_image(2)])
    with pytest.raises(ImageInputError, match="0 image placeholder"):
        llm.generate({"prompt": [1, 2, 3], "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    ids, mm = llm.engine.process_images(PROMPT_1, [random_image(1)])
    with pytest.raises(ImageInputError, match="token ranges"):
        llm.engine.add_request("bad", PROMPT_1, GREEDY, mm=mm)  # the unexpanded prompt
    text = LLM(str(save_tiny_gpt2(tmp_path / "gpt2")), dtype="float32")
    with pytest.raises(ImageInputError, match="does not take images"):
        text.generate({"prompt": [1, 2], "multi_modal_data": {"image": random_image(1)}}, GREEDY)


def test_attention_maps_locate_the_image_patches(vl_dir: Path, llm: LLM) -> None:
    """The attention explorer's data: maps over a prompt with an image equal a recompute by hand
    (HF's eager attention weights), and say where the image's patch grid sits among the keys."""
    pic = random_image(50, 112, 84)
    ids, mm = llm.engine.process_images(PROMPT_1, [pic])
    llm.engine.add_request("att", ids, SamplingParams(max_tokens=1, temperature=0.0, attention=AttentionSpec()), mm=mm)
    maps = None
    while llm.engine.has_unfinished():
        maps = next((d.attention for d in llm.engine.step() if d.finished), maps)
    (offset, length, rows, cols), = maps.images
    assert (offset, length) == (mm.images[0].offset, mm.images[0].length) and rows * cols == length == 12
    hf = hf_class(vl_dir).from_pretrained(str(vl_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(**hf_qwen2_vl_inputs(vl_dir, ids, [pic]), output_attentions=True).attentions
    torch.testing.assert_close(maps.weights, torch.stack([a[0] for a in ref]), atol=1e-5, rtol=0)


def test_int8_quantizes_the_decoder_not_the_vision_tower(vl_dir: Path, llm: LLM) -> None:
    from model.layers.linear.quantized import QuantizedLinear

    q = LLM(str(vl_dir), dtype="float32", quantization="int8", quantization_group_size=32)
    net = q.engine.runner.model
    assert isinstance(net.layers[0].self_attn.qkv_proj, QuantizedLinear)  # q, k and v fused at load
    assert not any(isinstance(m, QuantizedLinear) for m in net.visual.modules())
    prompt = {"prompt": PROMPT_1, "multi_modal_data": {"image": random_image(60)}}
    assert len(q.generate(prompt, GREEDY)[0].token_ids) == 32


def test_the_older_flat_layout_loads_the_same_model(vl_dir: Path, llm: LLM, tmp_path: Path) -> None:
    """Checkpoints saved before transformers 4.52 (most on the Hub): text fields at the top of
    config.json, `rope_scaling: {type: mrope}`, `in_chans`, and tensors named `model.*` / `visual.*`."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((vl_dir / "config.json").read_text())
    flat = {**raw.pop("text_config"), **raw}
    rope = flat.pop("rope_parameters")
    flat["rope_theta"] = rope.pop("rope_theta")
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["vision_config"]["in_chans"] = flat["vision_config"].pop("in_channels")
    old = tmp_path / "old"
    old.mkdir()
    for f in vl_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (old / f.name).write_bytes(f.read_bytes())
    (old / "config.json").write_text(json.dumps(flat))
    tensors = load_file(str(vl_dir / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}
    assert any(k.startswith("visual.") for k in renamed) and not any("language_model" in k for k in renamed)
    save_file(renamed, str(old / "model.safetensors"))
    prompt = {"prompt": PROMPT_1, "multi_modal_data": {"image": random_image(70)}}
    assert LLM(str(old), dtype="float32").generate(prompt, GREEDY)[0].token_ids == llm.generate(prompt, GREEDY)[0].token_ids


def test_the_encoders_totals_reach_the_services_counters(vl_dir: Path) -> None:
    """EngineStats carries the encoder cache's totals; service/engine/metrics.py adds what each
    refresh finds new to qkv_mm_* counters (Ray's metric objects, their inc recorded)."""
    from service.engine.metrics import EngineMetrics
    from tests.support.in_process import recorded_counters

    engine = build_engine(str(vl_dir), EngineConfig(enable_prefix_caching=False), dtype="float32")
    _run(engine, {f"r{i}": engine.process_images(PROMPT_1, [random_image(80 + i % 2)]) for i in range(3)})
    st = engine.stats()
    assert (st.mm_images_encoded, st.mm_encoder_cache_hits) == (2, 1) and st.mm_encoder_seconds > 0
    metrics = EngineMetrics("tiny-vl")
    calls = recorded_counters(metrics, {"mm_encoded": "qkv_mm_images_encoded_total",
                                        "mm_cache_hits": "qkv_mm_encoder_cache_hits_total",
                                        "mm_encoder_time": "qkv_mm_encoder_seconds_total"})
    metrics.refresh(st)
    metrics.refresh(st)  # nothing new: no increment
    assert calls == {"mm_encoded": [2], "mm_cache_hits": [1], "mm_encoder_time": [st.mm_encoder_seconds]}
