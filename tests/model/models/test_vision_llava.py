"""LLaVA checkpoints saved by HF transformers (a Llama decoder behind a CLIP or SigLIP tower) give
HF's logits over a whole prompt with one or two images and HF's greedy continuations through
`LLM.generate` with images: alone, in a chunked batch of 16 with text-only requests, from the
prefix cache (the same image hits, another image with the same ids does not), under preemption,
and with each distinct image encoded once.

Tiny random models (tests/support/vision_llava_models.py) cover CLIP's class token dropped ("default") or
kept ("full"), SigLIP's patches with and without their first, feature layers -2, -1 and 1, GQA and
multi-head attention, tied and untied heads.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import LLM, SamplingParams
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.loading.checkpoint import CheckpointError, load_model
from model.models.clip import used_layers
from model.multimodal.processor import ImageProcessor
from tests.support.tiny_models import one_thread  # noqa: F401  (autouse: this module runs on one torch thread)
from tests.support.vision_llava_models import (CASES, IMAGE_TOKEN_ID, TEXT_VOCAB, hf_generate, hf_inputs, image_tokens,
                                 random_image, save_tiny_llava)
from tests.support.requirements import need_module

transformers = need_module("transformers")

LOGITS_ATOL = 1e-4  # fp32; the observed difference is ~2e-6
GREEDY_TOKENS = 32
IMG = IMAGE_TOKEN_ID
PROMPTS = {1: [5, 6, 7, 8, 9, IMG, 10, 11, 12], 2: [5, 6, IMG, 7, 8, 9, IMG, 10]}  # by number of images
GREEDY = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
MAIN = "clip-layer-2-default"  # the case the engine tests run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, "transformers.PreTrainedModel"]]:
    """case -> (saved checkpoint, HF's model loaded back from it in fp32, eager attention)."""
    out = {}
    for i, case in enumerate(CASES):
        directory = save_tiny_llava(tmp_path_factory.mktemp(case), case, seed=i)
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager").eval()
        out[case] = directory, hf
    return out


def images_for(seeds: list[int]) -> list:
    return [random_image(s, 30 + 7 * s, 60 - 5 * s) for s in seeds]


def prompt_with(n_images: int, seed: int = 0) -> list[int]:
    """PROMPTS[n_images] with its text ids shifted by `seed`, so prompts differ but images sit alike."""
    return [t if t == IMG else (t + seed) % TEXT_VOCAB or 1 for t in PROMPTS[n_images]]


def our_logits(model, ids: list[int], embeds: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """Our logits (T, vocab) of the expanded prompt, prefilled in one pass with the image rows
    embedded from `embeds` (the prompt's image embeddings in order)."""
    cfg, t = model.cfg, len(ids)
    num_blocks = math.ceil(t / block_size)
    cache = KVCache(cfg.n_layers, num_blocks, block_size, cfg.kv_heads, cfg.d_head, torch.float32, "cpu")
    meta = AttnMetadata(slot_mapping=torch.arange(t), prefills=[
        PrefillChunk(start=0, length=t, context_len=t, block_table=torch.arange(num_blocks))])
    meta.mm_embeds = (torch.tensor([i for i, tok in enumerate(ids) if tok == IMG]), embeds)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), meta, cache))


@pytest.mark.parametrize("case", list(CASES))
def test_config_is_read_from_config_json(checkpoints, case) -> None:
    directory, hf = checkpoints[case]
    cfg, model = load_model(directory)
    c, v = hf.config, cfg.vision
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.kv_heads, cfg.vocab_size) == (
        "llava", c.text_config.num_hidden_layers, c.text_config.hidden_size, c.text_config.num_key_value_heads,
        c.text_config.vocab_size)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings == (model.lm_head is None)
    assert (v.kind, v.tower, v.image_token_id, v.feature_layer, v.feature_select) == (
        "llava", CASES[case][0], IMG, c.vision_feature_layer, c.vision_feature_select_strategy)
    assert (v.hidden_size, v.depth, v.image_size, v.patch_size, v.hidden_act) == (
        c.vision_config.hidden_size, c.vision_config.num_hidden_layers, c.vision_config.image_size,
        c.vision_config.patch_size, c.vision_config.hidden_act)
    # only the layers up to the feature layer are built (and loaded): HF's hidden_states index
    assert len(model.vision_tower.encoder.layers) == used_layers(v) == {-2: 2, -1: 3, 1: 1}[v.feature_layer]


@pytest.mark.parametrize("n_images", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(checkpoints, case, n_images) -> None:
    directory, hf = checkpoints[case]
    _, model = load_model(directory)
    images = images_for(list(range(1, n_images + 1)))
    ids, pixel_values = hf_inputs(directory, hf, PROMPTS[n_images], images)
    processor = ImageProcessor.from_directory(directory, model.cfg.vision)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0]  # (T, vocab)
        embeds = [model.encode_image(processor.preprocess(im)) for im in images]
    for e in embeds:  # the engine's placeholder expansion counts what the encoder gives
        assert e.shape == (image_tokens(hf), model.cfg.d_model)
    assert processor.num_tokens(processor.preprocess(images[0])) == image_tokens(hf)
    got = our_logits(model, ids, torch.cat(embeds))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    # the images matter: the same ids without them (placeholder embeddings) are far off
    assert (our_logits(model, ids, model.embed_tokens(torch.full((len(ids),), IMG))[:sum(t == IMG for t in ids)])
            - expected).abs().max() > 100 * LOGITS_ATOL


@pytest.mark.parametrize("n_images", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_generate(checkpoints, case, n_images) -> None:
    directory, hf = checkpoints[case]
    images = images_for(list(range(1, n_images + 1)))
    expected = hf_generate(hf, *hf_inputs(directory, hf, PROMPTS[n_images], images), GREEDY_TOKENS)
    llm = LLM(str(directory), dtype="float32")
    image = images[0] if n_images == 1 else images  # one PIL image or a list
    out = llm.generate({"prompt": PROMPTS[n_images], "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert out.token_ids == expected
    assert out.prompt_token_ids.count(IMG) == n_images * image_tokens(hf)  # expanded by the engine


def _requests(n: int) -> tuple[list, list[SamplingParams]]:
    """n prompts: every third has images (one or two, some sent by several), the rest text of 1 to 30
    tokens; the first six greedy, the others greedy or seeded sampling, 8 to 24 tokens."""
    rng = random.Random(7)
    prompts, params = [], []
    for i in range(n):
        if i % 3 == 0:
            k = 1 + (i // 3) % 2
            seeds = [1 + (i // 3) % 3 + j for j in range(k)]
            prompts.append({"prompt": prompt_with(k, i), "multi_modal_data": {"image": images_for(seeds)}})
        else:
            prompts.append([rng.randrange(1, TEXT_VOCAB) for _ in range(rng.randint(1, 30))])
        temperature = 0.0 if i < 6 else rng.choice([0.0, 0.8])
        params.append(SamplingParams(max_tokens=rng.randint(8, 24), temperature=temperature, seed=rng.randrange(99),
                                     ignore_eos=True))
    return prompts, params


def _distinct_images(prompts: list) -> int:
    from model.multimodal.inputs import image_hash

    return len({image_hash(im) for p in prompts if isinstance(p, dict) for im in p["multi_modal_data"]["image"]})


def test_batch_with_text_requests_equals_each_alone(checkpoints) -> None:
    """16 requests, 6 with images, prefilled in chunks of 24 tokens (so an image's 16 tokens are split
    over two steps), give what each gives alone; each distinct image is encoded once."""
    directory, hf = checkpoints[MAIN]
    prompts, params = _requests(16)
    llm = LLM(str(directory), dtype="float32", block_size=4, max_num_batched_tokens=24)
    batch = llm.generate(prompts, params)
    assert llm.engine.runner.encoder_cache.misses == _distinct_images(prompts) < sum(
        len(p["multi_modal_data"]["image"]) for p in prompts if isinstance(p, dict))
    alone = LLM(str(directory), dtype="float32", block_size=4, enable_prefix_caching=False)
    for prompt, p, out in zip(prompts, params, batch):
        assert out.token_ids == alone.generate(prompt, p)[0].token_ids
    for prompt, p, out in zip(prompts[:6:3], params[:6:3], batch[:6:3]):  # greedy image requests: HF's
        images = prompt["multi_modal_data"]["image"]
        assert out.token_ids == hf_generate(hf, *hf_inputs(directory, hf, prompt["prompt"], images), p.max_tokens)


def _run(llm: LLM, prompt: list[int], images: list) -> tuple[list[int], int]:
    """One request straight through the engine: its tokens and its prompt tokens from the prefix cache."""
    ids, mm = llm.engine.process_images(prompt, images)
    rid = f"r{random.random()}"
    llm.engine.add_request(rid, ids, GREEDY, mm=mm)
    tokens, cached = [], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            cached = out.num_cached_tokens if cached is None else cached
    return tokens, cached


def test_prefix_cache_hits_the_same_image_only(checkpoints) -> None:
    directory, hf = checkpoints[MAIN]
    block = 4
    llm = LLM(str(directory), dtype="float32", block_size=block)
    prompt = PROMPTS[1]
    first, second = images_for([1]), images_for([2])
    length = len(prompt) - 1 + image_tokens(hf)
    tokens, cached = _run(llm, prompt, first)
    assert cached == 0
    again, cached = _run(llm, prompt, first)
    assert again == tokens and cached == (length - 1) // block * block  # every full block, image included
    other, cached = _run(llm, prompt, second)
    offset = prompt.index(IMG)
    assert cached == offset // block * block  # the text before the image's first block, nothing after
    assert other == hf_generate(hf, *hf_inputs(directory, hf, prompt, second), GREEDY_TOKENS) != tokens
    assert llm.engine.runner.encoder_cache.misses == 2


def test_preemption_keeps_outputs(checkpoints) -> None:
    """Six image requests and two text ones in a pool of about three requests' blocks: some are
    preempted and recomputed (from the encoder cache), and every output is HF's."""
    directory, hf = checkpoints[MAIN]
    block = 4
    prompts = [{"prompt": prompt_with(1 + i % 2, i),
                "multi_modal_data": {"image": images_for([1 + i, 2 + i][:1 + i % 2])}} for i in range(6)]
    prompts += [[7, 8, 9] * 5, [11, 12] * 9]
    own = math.ceil((len(PROMPTS[2]) - 2 + 2 * image_tokens(hf) + GREEDY_TOKENS) / block)
    llm = LLM(str(directory), dtype="float32", block_size=block, num_kv_blocks=3 * own)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions_total > 0
    assert llm.engine.runner.encoder_cache.misses == _distinct_images(prompts)
    for prompt, out in zip(prompts[:6], outs):
        images = prompt["multi_modal_data"]["image"]
        assert out.token_ids == hf_generate(hf, *hf_inputs(directory, hf, prompt["prompt"], images), GREEDY_TOKENS)
    alone = LLM(str(directory), dtype="float32", block_size=block)
    assert [o.token_ids for o in outs[6:]] == [alone.generate(p, GREEDY)[0].token_ids for p in prompts[6:]]


def test_encoder_cache_encodes_each_distinct_image_once(checkpoints) -> None:
    """The same image in three requests and twice in one prompt, prefilled in chunks that split it:
    one encoding; with the cache sized below one image, every chunk that needs it encodes it again."""
    directory, _ = checkpoints[MAIN]
    image = images_for([3])[0]
    prompts = [{"prompt": PROMPTS[2], "multi_modal_data": {"image": [image, image]}}] + [
        {"prompt": prompt_with(1, s), "multi_modal_data": {"image": image}} for s in (1, 2, 3)]
    llm = LLM(str(directory), dtype="float32", block_size=4, max_num_batched_tokens=12)
    cached = llm.generate(prompts, GREEDY)
    assert llm.engine.runner.encoder_cache.misses == 1
    uncached = LLM(str(directory), dtype="float32", block_size=4, max_num_batched_tokens=12, encoder_cache_size=1)
    assert [o.token_ids for o in uncached.generate(prompts, GREEDY)] == [o.token_ids for o in cached]
    assert uncached.engine.runner.encoder_cache.misses > 4


# ---- checkpoint layouts ----------------------------------------------------------------

NEWER_LAYOUT = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower.vision_model."),
                ("multi_modal_projector.", "model.multi_modal_projector."))


def _rewrite(src: Path, dst: Path, rename, drop: str | None = None) -> Path:
    """A copy of checkpoint `src` with its tensors renamed by `rename` (and `drop` left out)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {rename(k): v for k, v in load_file(src / "model.safetensors").items() if k != drop}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _newer(name: str) -> str:
    for old, new in NEWER_LAYOUT:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def test_other_checkpoint_layout_and_missing_tensors(checkpoints, tmp_path) -> None:
    """The module tree's names (`model.language_model.*`, `lm_head.weight`, CLIP's `vision_model.`
    inside `model.vision_tower`) load to the same model; a missing tower tensor is named."""
    directory, _ = checkpoints[MAIN]
    _, model = load_model(directory)
    _, newer = load_model(_rewrite(directory, tmp_path / "newer", _newer))
    ours, theirs = model.state_dict(), newer.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    missing = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_model(_rewrite(directory, tmp_path / "missing", lambda n: n, drop=missing))


def test_a_processor_config_of_another_size_is_a_request_error(checkpoints, tmp_path) -> None:
    """A preprocessor_config.json that crops to another size than the tower's image_size fails the
    request that sends an image (ImageInputError, a 400 at the HTTP edge), not an engine step."""
    import json
    import shutil

    from model.multimodal.processor import ImageInputError

    directory = tmp_path / "mismatch"
    shutil.copytree(checkpoints[MAIN][0], directory)
    config = json.loads((directory / "preprocessor_config.json").read_text())
    config["crop_size"] = {"height": 56, "width": 56}
    config["size"] = {"shortest_edge": 56}
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    llm = LLM(str(directory), dtype="float32")
    with pytest.raises(ImageInputError, match="56x56 pixels but the vision tower takes 28x28"):
        llm.generate({"prompt": prompt_with(1), "multi_modal_data": {"image": random_image(1)}}, GREEDY)
    assert len(llm.generate([5, 6, 7], GREEDY)[0].token_ids) == GREEDY_TOKENS  # text is still served
