"""Tensor parallelism over Ray worker actors with gloo (model/engine/parallel/): LLM(model,
tensor_parallel_size=2) gives the greedy tokens of TP=1 and its logits within 1e-5 (fp32), alone, in
a batch of 16 and under preemption, for Llama with GQA (1 KV head for 2 ranks), Qwen3 (q/k norms)
and Qwen2 (q/k/v biases, tied head), both with 2 KV heads, Llama with dynamic NTK and with LongRoPE
(prompts past the original context), GPT-2 (fused c_attn, odd vocabulary) and the paper's
Transformer with dot and additive attention; a killed worker is a WorkerDiedError from
check_health and step.

One local Ray for the module (run under `flock /tmp/qkv-ray.lock`); the workers take half a CPU each.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from tests.support.requirements import need_module

ray = need_module("ray")

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.engine.parallel import WorkerDiedError  # noqa: E402
from tests.support.local_serve import write_tiny_checkpoint  # noqa: E402
from tests.support.tiny_models import save_tiny_gpt2, write_tiny_llama  # noqa: E402

BLOCK = 8
NUM_BLOCKS = 24  # the batch of 16 below needs about 40: it is preempted
VOCAB = 258  # the smallest vocabulary of the checkpoints below
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.5 + 0.7 * i for i in range(8)]}

MODELS = {
    "llama-gqa-kv1": lambda d: write_tiny_llama(d, "llama", num_key_value_heads=1, with_tokenizer=False),
    # Qwen3 and Qwen2 (Llama's code path with q/k norms, q/k/v biases) have 2 KV heads: one per rank.
    "qwen3": lambda d: write_tiny_llama(d, "qwen3", num_key_value_heads=2, head_dim=24, with_tokenizer=False),
    "qwen2": lambda d: write_tiny_llama(d, "qwen2", num_key_value_heads=2, tie_word_embeddings=True,
                                        with_tokenizer=False),
    "gpt2": lambda d: save_tiny_gpt2(d, n_head=2, vocab_size=301, with_tokenizer=False),
    "transformer-additive": lambda d: write_tiny_checkpoint(d, d_model=32, d_ff=64, max_position=128,
                                                            attention="additive"),
    # Rotation by sequence length: the batch's prompts longer than 16 tokens are rotated as HF's
    # prefill of them (AttnMetadata.rope_len, which the workers' step message carries).
    "llama-dynamic-ntk": lambda d: write_tiny_llama(d, "llama", num_key_value_heads=2, with_tokenizer=False,
                                                    rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                                    max_position_embeddings=16),
    "llama-longrope": lambda d: write_tiny_llama(d, "llama", num_key_value_heads=2, with_tokenizer=False,
                                                 rope_scaling=LONGROPE, max_position_embeddings=64),
    # A random preset: each rank draws the seeded tensors one at a time and keeps its slices.
    "transformer-dot-preset": lambda d: "transformer-draft-small",
}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def kept() -> dict[str, LLM]:
    """The latest TP=2 engine, left running for the failure test (a worker start costs seconds here)."""
    store: dict[str, LLM] = {}
    yield store
    for llm in store.values():
        llm.shutdown()


def _fresh_tp2(directory: str, kept: dict[str, LLM]) -> LLM:
    for llm in kept.values():  # the local Ray has CPUs for one TP=2 engine's workers at a time
        llm.shutdown()
    kept.clear()
    kept["last"] = _engine(directory, 2)
    return kept["last"]


class LogitsSpy:
    """Records the logits each step samples from (the driver's `sample`, in this process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import model.engine.parallel.driver as driver
        import model.engine.runner as runner

        self.steps: list[torch.Tensor] = []
        real = runner.sample

        def spy(logits, rows):
            self.steps.append(logits.detach().clone())
            return real(logits, rows)

        monkeypatch.setattr(runner, "sample", spy)
        monkeypatch.setattr(driver, "sample", spy)


def _engine(directory: str, tp: int) -> LLM:
    return LLM(directory, device="cpu", dtype="float32", tensor_parallel_size=tp,
               engine_config=EngineConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, tp_worker_num_cpus=0.5))


def _workload() -> tuple[list[int], list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(13)]
    batch = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(3, 8), temperature=0.0, ignore_eos=True) for _ in range(16)]
    params[5] = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3, logprobs=3)
    return prompt, batch, params


def _runs(llm: LLM, spy: LogitsSpy) -> dict:
    prompt, batch, params = _workload()
    spy.steps.clear()
    alone = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    alone_logits = torch.cat(spy.steps)  # (6, vocab): one row per step
    before = llm.engine.stats().num_preemptions_total
    outs = llm.generate(batch, params)
    preempted = llm.engine.stats().num_preemptions_total - before
    return {"alone": alone, "alone_logits": alone_logits, "batch": [o.token_ids for o in outs],
            "prompt_logprobs": [(lp.token_id, lp.logprob) for lp in outs[5].prompt_logprobs],
            "logprobs": [(lp.token_id, lp.logprob) for lp in outs[5].logprobs], "preempted": preempted}


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1(name: str, tmp_path, monkeypatch, kept) -> None:
    directory = str(MODELS[name](tmp_path / name))
    spy = LogitsSpy(monkeypatch)
    single = _runs(_engine(directory, 1), spy)
    llm = _fresh_tp2(directory, kept)
    assert len(llm.engine.runner.workers) == 2
    split = _runs(llm, spy)
    assert llm.engine.runner.stats.comm_seconds > 0  # the all-reduces ran in the workers
    assert split["alone"] == single["alone"]
    torch.testing.assert_close(split["alone_logits"], single["alone_logits"], rtol=0, atol=1e-5)
    assert split["batch"] == single["batch"]
    assert single["preempted"] > 0 and split["preempted"] > 0  # the batch of 16 outgrew the pool
    for key in ("prompt_logprobs", "logprobs"):
        assert [t for t, _ in split[key]] == [t for t, _ in single[key]]
        torch.testing.assert_close(torch.tensor([v for _, v in split[key]]),
                                   torch.tensor([v for _, v in single[key]]), rtol=0, atol=1e-5)


def test_killed_worker_is_worker_died_error(kept) -> None:
    """Killing one worker fails the health check and the next step by the worker's death, not by
    the collective's timeout (whose error says "did not finish ... within")."""
    from tests.support.polling import wait_until

    llm = kept.get("last") or _fresh_tp2("transformer-draft-small", kept)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def reports_the_death() -> bool:
        try:
            llm.engine.check_health()
        except WorkerDiedError:
            return True
        return False

    try:
        assert len(llm.generate([[1, 2, 3]], greedy)[0].token_ids) == 4
        llm.engine.check_health()
        ray.kill(llm.engine.runner.workers[1])
        # ray.kill is asynchronous: a ping sent just after it may still be answered, so the
        # health check is repeated until it reports the death (a hang bound, far above normal).
        wait_until(reports_the_death, 120, "the health check to report the killed worker", every_s=0.1)
        llm.engine.add_request("after-kill", [4, 5, 6], greedy)
        with pytest.raises(WorkerDiedError, match="a tensor-parallel worker failed while a step"):
            llm.engine.step()
    finally:
        llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(WorkerDiedError):
        llm.engine.check_health()


def test_hung_worker_times_out_as_worker_died_error(monkeypatch, kept) -> None:
    """A worker that stops answering (SIGSTOP) fails the step at the step deadline, not never: the
    error is the deadline's ("did not finish a step within 3 s") or rank 0's collective timing out."""
    monkeypatch.setenv("QKV_TP_TIMEOUT_S", "3")  # the driver's deadline and the collectives' timeout
    llm = _fresh_tp2("transformer-draft-small", kept)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        pid = ray.get(llm.engine.runner.workers[1].ping.remote())
        os.kill(pid, signal.SIGSTOP)
        llm.engine.add_request("hung", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(WorkerDiedError, match=r"did not finish a step within 3 s|failed while a step"):
            llm.engine.step()
        with pytest.raises(WorkerDiedError, match="health check"):
            llm.engine.check_health()
    finally:
        llm.shutdown()  # SIGKILL ends a stopped process too


@pytest.mark.parametrize("tp, field", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_bad_tensor_parallel_size_names_the_field(tp: int, field: str, tmp_path) -> None:
    directory = str(write_tiny_llama(tmp_path / "m", "llama", num_key_value_heads=2, with_tokenizer=False))
    with pytest.raises(ValueError, match=f"tensor_parallel_size \\({tp}\\).*{field}"):
        LLM(directory, device="cpu", dtype="float32", tensor_parallel_size=tp)


def test_bad_parallel_arguments() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 is not supported yet"):
        EngineConfig(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization is not supported with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, quantization="int8")
