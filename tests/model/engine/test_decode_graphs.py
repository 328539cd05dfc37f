"""Decode on static buffers (model/engine/runner.py `DecodeGraphs`), the path CUDA graphs replay:
on the CPU the capture is skipped (the step is compiled instead, or eager where it cannot be), so
the padded static-buffer step itself is checked here against the eager step: the same hidden
states, the same K/V in every sequence's blocks (padding rows write only the scratch block), and
the same greedy tokens with enforce_eager on and off. tests/model/engine/test_compiled_step.py
checks what is particular to compilation."""

from __future__ import annotations

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.engine.runner import batch_buckets
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import Sequence
from tests.support.tiny_models import write_tiny_llama

BS = 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))  # GQA: 4 query heads, 2 KV heads


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]


def _prefilled(engine: Engine, tables: list[list[int]], lengths: list[int]) -> list[Sequence]:
    """Sequences whose prompts (all but the last token) are in the cache, in the given blocks."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i, (table, n) in enumerate(zip(tables, lengths)):
        seq = Sequence(f"s{i}", torch.randint(1, 300, (n,), generator=g).tolist(), SamplingParams(max_tokens=4))
        seq.block_table = list(table)
        seqs.append(seq)
    engine.runner.graphs, graphs = None, engine.runner.graphs  # the prefills run eagerly anyway
    engine.runner.run([ScheduledSeq(s, s.num_tokens - 1) for s in seqs], [])
    engine.runner.graphs = graphs
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    return seqs


@pytest.mark.parametrize("backend", ["gather", "fused", "flex"])
@torch.inference_mode()
def test_static_decode_step_equals_the_eager_step(llama_dir, backend) -> None:
    engine = build_engine(llama_dir, EngineConfig(num_kv_blocks=24, block_size=BS, max_num_seqs=8, attention_backend=backend,
                                            enforce_eager=False))
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None and graphs.scratch_block == 24 and runner.cache.num_blocks == 25
    # Three sequences (bucket 4: one padding row), block tables with holes and out of order.
    seqs = _prefilled(engine, [[7, 2, 19], [11], [3, 23, 0, 5]], [10, 3, 15])
    batch = [ScheduledSeq(s, 1) for s in seqs]
    for c in runner.cache.keys + runner.cache.values:
        c[24].zero_()  # the compiled step's start-up warm-up decoded padding rows there already
    before = [c.clone() for c in runner.cache.keys + runner.cache.values]
    tokens, positions, meta, _ = runner.prepare(batch)
    static = graphs.run(tokens, positions, meta).clone()
    after_static = [c.clone() for c in runner.cache.keys + runner.cache.values]
    assert graphs.num_steps == 1 and graphs.num_padding_rows == 1
    for c, saved in zip(runner.cache.keys + runner.cache.values, before):
        c.copy_(saved)
    tokens, positions, meta, _ = runner.prepare(batch)
    eager = runner.model(tokens, positions, meta, runner.cache)
    assert static.shape == eager.shape == (3, 64)
    assert (static - eager).abs().max().item() < 1e-5
    for got, want, old in zip(after_static, runner.cache.keys + runner.cache.values, before):
        assert (got[:24] - want[:24]).abs().max().item() < 1e-5  # every sequence's block alike
        assert torch.equal(want[24], old[24]) and not torch.equal(got[24], old[24])  # padding: scratch only


def test_greedy_tokens_equal_with_enforce_eager_on_and_off(llama_dir) -> None:
    prompts = [[5 + i] * (2 + 3 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    outs = {}
    for eager in (True, False):
        llm = LLM(llama_dir, enforce_eager=eager,
                  engine_config=EngineConfig(num_kv_blocks=64, block_size=BS, max_num_seqs=8))
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:  # batches of 6 .. 1 decoded on the buffers, 6, 5 and 3 of them padded
            assert graphs.num_steps >= 10 and graphs.num_padding_rows > 0
    assert outs[True] == outs[False]
    assert len({tuple(o) for o in outs[True]}) == 6


def test_cpu_default_is_eager() -> None:
    """enforce_eager=None: static buffers only where a graph is captured (they cost padding rows);
    the CUDA half is tests/gpu/test_gpu.py's (`pytest -m gpu`)."""
    assert EngineConfig().enforce_eager is None
    engine = build_engine("transformer-base", EngineConfig(num_kv_blocks=8), device="cpu")
    assert engine.runner.graphs is None


@pytest.mark.parametrize("model,backend,gathers", [
    ("transformer-base", "gather", True),
    ("transformer-base", "flex", False),
    ("transformer-base", "fused", False),
    ("transformer-base-additive", "flex", True),  # additive scores have no kernel: decode gathers
])
def test_the_workspace_is_reserved_only_where_decode_gathers(model, backend, gathers) -> None:
    engine = build_engine(model, EngineConfig(num_kv_blocks=32, block_size=BS, max_num_seqs=12, max_model_len=40,
                                        attention_backend=backend, enforce_eager=False), device="cpu")
    graphs = engine.runner.graphs
    graphs.reserve_workspace()
    assert engine.runner.cache.workspace_blocks == (12 * 10 if gathers else 0)  # 12 rows of 40 / BS blocks


@pytest.fixture
def capturing_engine(llama_dir):
    """An engine whose static decode path tries to capture (as on CUDA), with two sequences to decode."""
    engine = build_engine(llama_dir, EngineConfig(num_kv_blocks=24, block_size=BS, max_num_seqs=4, enforce_eager=False),
                    device="cpu")
    engine.runner.graphs.capture = True
    seqs = _prefilled(engine, [[1, 2], [3, 4, 5]], [6, 9])
    return engine, engine.runner.prepare([ScheduledSeq(s, 1) for s in seqs])[:3]


@torch.inference_mode()
def test_capture_falls_back_to_eager_only_when_an_op_cannot_be_captured(capturing_engine, monkeypatch, caplog):
    """CUDA cannot capture here, so its failure is raised where the capture would run: an error that
    says an op cannot be captured turns capture off (with the reason logged and kept); any other,
    out of memory included, reaches the caller instead of decoding eagerly for good."""
    engine, (tokens, positions, meta) = capturing_engine
    graphs = engine.runner.graphs

    def fail_with(exc: Exception):
        def capture(bucket: int) -> None:
            raise exc
        return capture

    for exc in (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("CUDA error: an illegal memory access was encountered"), IndexError("index 9 is out of bounds")):
        monkeypatch.setattr(graphs, "_capture_bucket", fail_with(exc))
        with pytest.raises(type(exc)):
            graphs.run(tokens, positions, meta)
        assert graphs.capture and graphs.eager_reason is None
    monkeypatch.setattr(graphs, "_capture_bucket",
                        fail_with(RuntimeError("CUDA error: operation not permitted when stream is capturing")))
    with caplog.at_level("WARNING", logger="model.engine.runner"):
        hidden = graphs.run(tokens, positions, meta)
    assert not graphs.capture and "operation not permitted when stream is capturing" in graphs.eager_reason
    assert "cannot be captured" in caplog.text and "stream is capturing" in caplog.text
    assert (hidden - engine.runner.model(tokens, positions, meta, engine.runner.cache)).abs().max().item() < 1e-5
