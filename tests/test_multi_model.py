"""Many adapters and many models behind one endpoint (issue 28), on one local Ray with two apps
deployed in turn:

- adapter-aware routing over two engine replicas behind real HAProxy and the prefix router:
  requests for one adapter (no shared prefix) all land on one replica, and a burst for a new
  dynamic adapter loads it on one replica only (told apart by the `replica` label of Ray's
  metrics, as tests/test_prefix_routing.py does);
- a two-model app (`models:`): both names answered with each model's own greedy output, an
  adapter of one of them by its name, `/v1/models` listing both and the adapter, an unknown
  model the edge's 404.

Before Ray: the `models` argument checks, and the ASGI forwarding the front uses (no Ray).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from local_serve import write_tiny_checkpoint
from service.replica.engine_deployment import GAUGE_REFRESH_S
from serve_fixtures import METRICS_INTERVAL_MS, scrape, wait_until
from tiny_models import build_tiny_llama, torch_threads, write_tiny_llama

HTTP_PORT, METRICS_PORT = 19110, 19111
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
SMALL = {"engine_num_cpus": 0.5, "router_num_cpus": 0.1, "torch_threads": 1, "max_num_seqs": 8,
         "num_kv_blocks": 128, "block_size": 8}
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _adapter(directory: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(build_tiny_llama(), config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (the adapters' base) with adapters a, c, d; a tiny Transformer of another shape."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("multi")
    with torch_threads(1):
        out = {"llama": write_tiny_llama(root / "llama"), "adapters": root / "adapters",
               "transformer": write_tiny_checkpoint(root / "transformer", d_model=32, n_heads=2, d_ff=64, init_seed=3)}
        for name, seed in (("a", 1), ("c", 3), ("d", 4)):
            _adapter(out["adapters"] / name, seed)
    return out


# ---- without Ray ------------------------------------------------------------------------------

def test_models_entries_take_defaults_and_refuse_app_level_fields() -> None:
    from service.app import AppArgs
    from service.multi_model import model_args

    def entries(args: dict[str, Any]) -> list[AppArgs]:
        return model_args(AppArgs.model_validate(args))

    got = entries({"models": [{"model": "/m/x"}, {"model": "/m/y", "num_replicas": 2, "engine_num_cpus": 2}],
                   "engine_num_cpus": 0.5, "api_key": "k", "max_body_bytes": 4096})
    assert [(a.resolved_name(), a.engine_num_cpus, a.num_replicas, a.api_key, a.max_body_bytes) for a in got] == \
        [("x", 0.5, 1, "k", 4096), ("y", 2, 2, "k", 4096)]
    with pytest.raises(ValueError, match=r"models\[0\]: api_key is app-level"):
        entries({"models": [{"model": "/m/x", "api_key": "k"}]})
    with pytest.raises(ValueError, match=r"models\[1\]: the name 'x' is already served by models\[0\]"):
        entries({"models": [{"model": "/m/x"}, {"model": "/other/x"}]})
    with pytest.raises(ValueError, match=r"the name 'x' is already served"):  # an adapter named like a model
        entries({"models": [{"model": "/m/x"}, {"model": "/m/y", "lora_modules": {"x": "/a"}}]})
    with pytest.raises(ValueError, match="model belong"):
        entries({"model": "/m/z", "models": [{"model": "/m/x"}]})
    with pytest.raises(ValueError, match="max_num_seqs"):  # each entry is validated as AppArgs
        entries({"models": [{"model": "/m/x", "max_num_seqs": 0}]})


def test_the_forwarded_request_gets_the_edge_answer_and_a_cancel_aborts(ckpts: dict[str, Path]) -> None:
    """`run_asgi` (what the front's handle call runs in a replica) over the real edge: the same
    answer as a direct call (JSON and SSE), and a stream closed early aborts the engine's request."""
    import httpx

    from in_process import edge_app
    from model.config import EngineConfig
    from model.engine.engine import Engine
    from service.http.asgi_forward import ForwardedRequest, ResponseStart, run_asgi

    def fwd(body: dict[str, Any], path: str = "/v1/completions") -> ForwardedRequest:
        raw = json.dumps(body).encode()
        return ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json")], raw)

    async def main() -> tuple[Any, ...]:
        engine = Engine(str(ckpts["transformer"]), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu")
        body = {"prompt": "hello", **GREEDY}
        async with edge_app(engine, "tiny") as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                direct = (await client.post("/v1/completions", json=body)).json()
            items = [item async for item in run_asgi(app, fwd(body))]
            streamed = [item async for item in run_asgi(app, fwd({**body, "stream": True}))]
            missing = [item async for item in run_asgi(app, fwd({**body, "model": "nope"}))]
            aborted: list[int] = []
            app.state.host.metrics.observe_abort = aborted.append  # called for each request cancel() aborts
            long = run_asgi(app, fwd({"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}))
            assert isinstance(await long.__anext__(), ResponseStart)
            await long.__anext__()  # the first chunk: the request runs
            await long.aclose()
            for _ in range(100):
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            return direct, items, streamed, missing, engine.has_unfinished(), aborted

    with torch_threads(1):
        direct, items, streamed, missing, unfinished, aborted = asyncio.run(main())
    assert isinstance(items[0], ResponseStart) and items[0].status == 200
    forwarded = json.loads(b"".join(items[1:]))
    assert forwarded["choices"][0]["text"] == direct["choices"][0]["text"]
    events = [line[6:] for line in b"".join(streamed[1:]).decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == direct["choices"][0]["text"]
    assert missing[0].status == 404 and json.loads(b"".join(missing[1:]))["error"]["code"] == "model_not_found"
    assert aborted == [1] and not unfinished  # the closed stream's request was aborted, and is gone


# ---- on Ray -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve_instance() -> Any:
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, _metrics_export_port=METRICS_PORT,
             _system_config={"metrics_report_interval_ms": METRICS_INTERVAL_MS})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
        yield serve
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _deploy(serve: Any, args: dict[str, Any]) -> str:
    from service.app import build_app

    serve.run(build_app(args), name="qkv", route_prefix="/")
    url = f"http://127.0.0.1:{HTTP_PORT}"
    wait_until(lambda: requests.get(f"{url}/health", timeout=5).ok, 60, "the app's /health")
    return url


def complete(url: str, model: str, prompt: str | list[int]) -> dict[str, Any]:
    r = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def per_replica(name: str, **labels: str) -> Counter[str]:
    totals: Counter[str] = Counter()
    for n, lab, value in scrape(METRICS_URL):
        if n == name and all(lab.get(k) == v for k, v in labels.items()):
            totals[lab["replica"]] += value
    return totals


class TestAdapterRouting:
    """One model, two replicas, HAProxy asking the prefix router, which routes by adapter."""

    @pytest.fixture(scope="class")
    def url(self, serve_instance: Any, ckpts: dict[str, Path]) -> Any:
        from ray import serve

        args = {"model": str(ckpts["llama"]), "served_model_name": "tiny", "num_replicas": 2,
                "lora_modules": {"a": str(ckpts["adapters"] / "a")}, "lora_dynamic_path": str(ckpts["adapters"]),
                "max_loras": 2, **SMALL}
        url = _deploy(serve_instance, args)
        # HAProxy learns of the router a moment after the replicas answer (tests/test_prefix_routing.py).
        router = serve.get_deployment_handle("PrefixRoute", app_name="qkv")
        wait_until(lambda: requests.post(f"{url}/tokenize", json={"prompt": "probe"}, timeout=10).ok
                   and router.routed_requests.remote().result(timeout_s=10) > 0, 60, "HAProxy to use the router")
        yield url
        serve.delete("qkv")

    def test_requests_for_one_adapter_land_on_one_replica(self, url: str) -> None:
        n = 8
        for i in range(n):  # distinct first blocks: no shared prefix to route by, only the adapter
            complete(url, "a", f"{i} question about adapters, number {i}")
        got = wait_until(lambda: (c := per_replica("ray_qkv_lora_requests_total", lora_name="a")).total() >= n and c,
                         30, "the adapter's requests on Ray's metrics endpoint")
        assert sorted(v for v in got.values() if v > 0) == [n], got  # one replica ran them all

    def test_a_burst_for_a_new_dynamic_adapter_loads_it_on_one_replica(self, url: str) -> None:
        # An earlier load (the test before loads `a` on first use) reaches Ray's endpoint only on the
        # replicas' next 2 s refresh: let it land before the baseline, or it counts as this burst's.
        time.sleep(2 * GAUGE_REFRESH_S + METRICS_INTERVAL_MS / 1000)
        loads_before = per_replica("ray_qkv_lora_adapter_loads_total")
        prompts = [f"{i}: a burst for an adapter nobody holds yet" for i in range(6)]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outs = list(pool.map(lambda p: complete(url, "tiny:c", p), prompts))
        assert all(o["model"] == "tiny:c" for o in outs)

        def served() -> Counter[str] | None:
            c = per_replica("ray_qkv_lora_requests_total", lora_name="tiny:c")
            return c if c.total() >= len(prompts) else None

        by_replica = wait_until(served, 30, "the burst on Ray's metrics endpoint")
        assert len([v for v in by_replica.values() if v > 0]) == 1, by_replica

        def loads() -> Counter[str]:
            grown = per_replica("ray_qkv_lora_adapter_loads_total")
            grown.subtract(loads_before)
            return grown

        # The loads counter follows the engine's total on the replicas' 2 s refresh: wait for the first
        # load, then two more refreshes, so that a load on the other replica would show too.
        wait_until(lambda: loads().total() >= 1, 30, "the adapter load on Ray's metrics endpoint")
        time.sleep(2 * GAUGE_REFRESH_S + METRICS_INTERVAL_MS / 1000)
        grown = loads()
        assert sorted(v for v in grown.values() if v > 0) == [1], grown  # c was loaded once, on one replica
        listed = {m["id"]: m.get("parent") for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert listed.get("a") == "tiny"


class TestTwoModels:
    """`models:` with a tiny Transformer and a tiny Llama (with an adapter) behind one endpoint."""

    @pytest.fixture(scope="class")
    def url(self, serve_instance: Any, ckpts: dict[str, Path]) -> Any:
        args = {"models": [{"model": str(ckpts["transformer"]), "served_model_name": "alpha"},
                           {"model": str(ckpts["llama"]), "served_model_name": "beta",
                            "lora_modules": {"sql": str(ckpts["adapters"] / "d")}}],
                **SMALL}
        yield _deploy(serve_instance, args)
        serve_instance.delete("qkv")

    def test_each_name_gets_its_own_models_greedy_output(self, url: str, ckpts: dict[str, Path]) -> None:
        from model import LLM, SamplingParams
        from model.config import EngineConfig

        prompt = [5, 17, 42, 8, 99, 23, 61]
        params = SamplingParams(**GREEDY)
        engine = {k: SMALL[k] for k in ("max_num_seqs", "num_kv_blocks", "block_size")}  # as the replicas run
        with torch_threads(1):  # the replicas run one thread too (tests compare floats across processes)
            want_alpha = LLM(str(ckpts["transformer"]), device="cpu", engine_config=EngineConfig(**engine)) \
                .generate([prompt], params)[0].text
            beta = LLM(str(ckpts["llama"]), device="cpu",
                       engine_config=EngineConfig(**engine, lora_modules={"sql": str(ckpts["adapters"] / "d")}))
            want_beta = beta.generate([prompt], params)[0].text
            want_sql = beta.generate([prompt], params, lora="sql")[0].text
        got = {name: complete(url, name, prompt) for name in ("alpha", "beta", "sql")}
        assert {n: g["choices"][0]["text"] for n, g in got.items()} == \
            {"alpha": want_alpha, "beta": want_beta, "sql": want_sql}
        assert {n: g["model"] for n, g in got.items()} == {"alpha": "alpha", "beta": "beta", "sql": "sql"}
        assert len({want_alpha, want_beta, want_sql}) == 3  # three different models answered
        # A stream through the front: the same text, SSE to the end.
        with requests.post(f"{url}/v1/chat/completions", timeout=120, stream=True,
                           json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                                 "stream": True, **GREEDY}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith(b"data: ")]
        assert lines[-1] == b"data: [DONE]" and len(lines) >= 3

    def test_models_lists_both_and_an_unknown_model_is_a_404(self, url: str) -> None:
        data = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in data] == [("alpha", None), ("beta", None), ("sql", "beta")]
        r = requests.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "hi"}, timeout=30)
        assert r.status_code == 404
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model") and "'alpha'" in error["message"]
        assert requests.get(f"{url}/v1/models/sql", timeout=10).json()["parent"] == "beta"
        assert requests.get(f"{url}/v1/models/gamma", timeout=10).status_code == 404
