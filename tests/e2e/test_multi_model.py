"""Many adapters and many models behind one endpoint (issue 28), on one local Ray with two apps
deployed in turn:

- adapter-aware routing over two engine replicas behind real HAProxy and the prefix router:
  the router picks a replica holding the adapter for every request for one adapter (no shared
  prefix) after the first, and for a burst for a new dynamic adapter, read from the router's own
  record of its picks (`PrefixRoute.recent_picks`), not from where requests landed, which depends
  on load (HAProxy balances by itself when the router is slow to answer);
- a two-model app (`models:`), in each layout (service/app/multi.py): one deployment whose
  replicas serve one model each, HAProxy routing by the body's `model` (the default), and the
  ModelRouter front (entries that need different replica options): both names answered with each
  model's own greedy output, an adapter of one of them by its name, `/v1/models` listing both and
  the adapter from any replica, an unknown model the edge's 404; in the one-deployment layout a
  killed replica is replaced by one serving the same model, and a request sent to the other
  model's replica is forwarded, not refused.

Before Ray: the `models` argument checks, the layout decision, the ASGI forwarding, model names,
the rank -> entry map and the middleware that forwards a request for another model.
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

from tests.support.local_serve import write_tiny_checkpoint
from tests.support.serve_fixtures import METRICS_INTERVAL_MS, engine_replica_ids, engine_replica_ports, router_picks, \
    scrape, wait_until
from tests.support.tiny_models import build_tiny_llama, torch_threads, write_tiny_llama
from tests.support.requirements import need_module

pytestmark = pytest.mark.slow  # starts Ray Serve or a browser

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
    need_module("peft")
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
    from service.app.multi import model_args

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


def test_model_names_resolve_served_names_adapters_and_dynamic_names() -> None:
    from service.routing.model_names import UNREADABLE, ModelNames, ServedModel, body_model

    names = ModelNames([ServedModel("alpha"), ServedModel("beta", ("sql",), lora_dynamic=True)])
    assert [names.target(m) for m in (None, "alpha", "beta", "sql", "beta:new", "alpha:new", "beta:", "gamma")] == \
        ["alpha", "alpha", "beta", "beta", "beta", None, None, None]
    assert body_model(b'{"model": "beta", "prompt": "x"}') == "beta"
    assert body_model(b'{"prompt": "x"}') is None and body_model(b'{"model": 3}') is None and body_model(b"") is None
    assert body_model(b"[1, 2]") is UNREADABLE and body_model(b'{"model": "be') is UNREADABLE


def test_ranks_map_to_entries_in_order_and_wrap() -> None:
    from service.app.multi import entry_for_rank

    assert [entry_for_rank(r, [2, 1, 3]) for r in range(8)] == [0, 0, 1, 2, 2, 2, 0, 0]


def test_entries_with_the_same_replica_options_make_one_deployment_else_the_front() -> None:
    from service.app import AppArgs
    from service.app.multi import model_args, why_not_one_deployment

    def reason(args: dict[str, Any]) -> str | None:
        return why_not_one_deployment(model_args(AppArgs.model_validate(args)))

    assert reason({"models": [{"model": "/m/x", "num_replicas": 2, "max_num_seqs": 4},
                              {"model": "/m/y", "lora_modules": {"a": "/a"}, "enable_prefix_caching": False}],
                   "accelerator": "cpu"}) is None
    assert "engine_num_cpus" not in (reason({"models": [{"model": "/m/x"}, {"model": "/m/y", "engine_num_cpus": 2}],
                                             "accelerator": "cpu"}) or "engine_num_cpus")
    assert "ray_actor_options" in reason({"models": [{"model": "/m/x"}, {"model": "/m/y", "engine_num_cpus": 2}],
                                          "accelerator": "cpu"})
    assert "autoscales" in reason({"models": [{"model": "/m/x"}, {"model": "/m/y", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2}}], "accelerator": "cpu"})
    assert "backpressure_config" in reason({"models": [{"model": "/m/x"}, {"model": "/m/y", "overload_status": 429}],
                                            "accelerator": "cpu"})


def test_a_post_for_another_model_is_forwarded_and_every_other_request_reaches_the_edge_whole() -> None:
    """`ForwardOtherModels` (a one-deployment replica's outermost middleware): the edge gets its own
    model's requests, unknown models, unreadable and oversized bodies and GETs with the body as it
    came (in pieces, or cut by the client); another entry's POST goes to `forward` with its body."""
    from starlette.responses import PlainTextResponse

    from service.app.multi import ForwardOtherModels
    from service.routing.model_names import ModelNames, ServedModel

    seen: list[tuple[str, bytes, str]] = []
    forwarded: list[tuple[str, bytes]] = []

    async def edge(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more, last = b"", True, "http.request"
        while more:
            message = await receive()
            last = message["type"]
            body += message.get("body", b"")
            more = last == "http.request" and message.get("more_body", False)
        seen.append((scope["method"], body, last))
        await PlainTextResponse("edge")(scope, receive, send)

    async def forward(model: str, request: Any) -> Any:
        forwarded.append((model, request.body))
        return PlainTextResponse(f"from {model}")

    app = ForwardOtherModels(edge, own="alpha", names=ModelNames([ServedModel("alpha"), ServedModel("beta", ("sql",))]),
                             max_body_bytes=64, forward=forward)

    async def call(method: str, parts: list[bytes], cut: bool = False) -> bytes:
        messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1 or cut}
                    for i, p in enumerate(parts)] + ([{"type": "http.disconnect"}] if cut else [])
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app({"type": "http", "method": method, "path": "/v1/completions", "headers": [],
                   "query_string": b""}, receive, send)
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    async def main() -> list[bytes]:
        return [await call("POST", [b'{"model": "be', b'ta", "prompt": "x"}']),
                await call("POST", [b'{"model": "sql"}']),
                await call("POST", [b'{"model": "alpha", ', b'"prompt": "x"}']),
                await call("POST", [b'{"model": "gamma"}']),
                await call("POST", [b'{"prompt": "x"}']),
                await call("POST", [b"not json"]),
                await call("POST", [b'{"model": "beta", "prompt": "' + b"x" * 80, b'"}']),
                await call("POST", [b'{"model": "beta"'], cut=True),
                await call("GET", [b""])]

    answers = asyncio.run(main())
    assert answers == [b"from beta", b"from beta"] + [b"edge"] * 7
    assert forwarded == [("beta", b'{"model": "beta", "prompt": "x"}'), ("beta", b'{"model": "sql"}')]
    assert seen == [("POST", b'{"model": "alpha", "prompt": "x"}', "http.request"),
                    ("POST", b'{"model": "gamma"}', "http.request"), ("POST", b'{"prompt": "x"}', "http.request"),
                    ("POST", b"not json", "http.request"),
                    ("POST", b'{"model": "beta", "prompt": "' + b"x" * 80 + b'"}', "http.request"),
                    ("POST", b'{"model": "beta"', "http.disconnect"), ("GET", b"", "http.request")]


def test_the_forwarded_request_gets_the_edge_answer_and_a_cancel_aborts(ckpts: dict[str, Path]) -> None:
    """`run_asgi` (what the front's handle call runs in a replica) over the real edge: the same
    answer as a direct call (JSON and SSE), and a stream closed early aborts the engine's request."""
    import httpx

    from tests.support.in_process import edge_app
    from model.config import EngineConfig
    from model.engine.builder import build_engine
    from service.http.asgi_forward import ForwardedRequest, ResponseStart, run_asgi

    def fwd(body: dict[str, Any], path: str = "/v1/completions") -> ForwardedRequest:
        raw = json.dumps(body).encode()
        return ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json")], raw)

    async def main() -> tuple[Any, ...]:
        engine = build_engine(str(ckpts["transformer"]), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu")
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

    from service.launch import reap_orphaned_haproxy
    from tests.support.local_serve import stop_shared_service

    stop_shared_service()  # one Ray per process: this module's has its own metrics settings
    started = time.time()
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
            reap_orphaned_haproxy(started)  # a HAProxy Ray left running would hold Serve's ports


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
        # HAProxy learns of the router a moment after the replicas answer (tests/e2e/test_prefix_routing.py).
        router = serve.get_deployment_handle("PrefixRoute", app_name="qkv")
        wait_until(lambda: requests.post(f"{url}/tokenize", json={"prompt": "probe"}, timeout=10).ok
                   and router.routed_requests.remote().result(timeout_s=10) > 0, 60, "HAProxy to use the router")
        yield url
        serve.delete("qkv")

    def test_requests_for_one_adapter_land_on_one_replica(self, url: str) -> None:
        n = 8
        for i in range(n):  # distinct first blocks: no shared prefix to route by, only the adapter
            complete(url, "a", f"{i} question about adapters, number {i}")
        picks = adapter_picks("a", n)
        # The first finds no replica holding "a" (by load); every later one goes to a holder.
        assert [p["why"] for p in picks] == ["load"] + ["adapter"] * (n - 1), picks
        assert_one_replica_unless_haproxy_balanced(picks, "a")

    def test_a_burst_for_a_new_dynamic_adapter_loads_it_on_one_replica(self, url: str) -> None:
        """Six requests at once for an adapter no replica holds: the router remembers its first pick,
        so the other five go to that replica (which loads the adapter once) before it reports it."""
        prompts = [f"{i}: a burst for an adapter nobody holds yet" for i in range(6)]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outs = list(pool.map(lambda p: complete(url, "tiny:c", p), prompts))
        assert all(o["model"] == "tiny:c" for o in outs)
        picks = adapter_picks("tiny:c", len(prompts))
        # Picks are recorded as they return, not in the router's order: count the reasons.
        assert Counter(p["why"] for p in picks) == {"load": 1, "adapter": len(prompts) - 1}, picks
        assert_one_replica_unless_haproxy_balanced(picks, "tiny:c")
        listed = {m["id"]: m.get("parent") for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert listed.get("a") == "tiny"


def adapter_picks(lora: str, n: int) -> list[dict[str, Any]]:
    """The router's record of its picks for requests under `lora`, once all `n` are in: what it
    chose and why, whatever HAProxy then did with the answer."""
    def picks() -> list[dict[str, Any]] | None:
        got = [p for p in router_picks() if p["lora"] == lora]
        return got if len(got) >= n else None

    got = wait_until(picks, 60, f"the router's record of the picks for {lora!r}")
    assert len(got) == n, got
    return got


def assert_one_replica_unless_haproxy_balanced(picks: list[dict[str, Any]], lora: str) -> None:
    """All picks chose one replica, unless a request ran where it was not picked for: under load
    HAProxy may give up waiting for the router and balance by itself, after which the other replica
    holds the adapter too and is rightly a candidate (Ray's `replica` label is the id's last part)."""
    picked = Counter(p["replica_id"].rsplit("#", 1)[1] for p in picks)
    ran = wait_until(lambda: (c := per_replica("ray_qkv_lora_requests_total", lora_name=lora)).total() >= len(picks)
                     and c, 60, f"the requests for {lora!r} on Ray's metrics endpoint")
    assert ran.total() == len(picks), ran  # each request ran once
    assert set(+ran) | set(picked) <= engine_replica_ids(), (ran, picked)  # one way of naming replicas
    if +ran == picked:  # each ran where the router sent it
        assert len(picked) == 1, (picked, picks)


ONE_DEPLOYMENT, FRONT = "one deployment", "front"


class TestTwoModels:
    """`models:` with a tiny Transformer and a tiny Llama (with an adapter) behind one endpoint, in
    both layouts: the default one deployment, and the front (chosen here because the entries ask
    for different replica CPUs)."""

    @pytest.fixture(scope="class", params=[ONE_DEPLOYMENT, FRONT])
    def app(self, request: Any, serve_instance: Any, ckpts: dict[str, Path]) -> Any:
        beta_cpus = {"engine_num_cpus": 0.4} if request.param == FRONT else {}
        args = {"models": [{"model": str(ckpts["transformer"]), "served_model_name": "alpha"},
                           {"model": str(ckpts["llama"]), "served_model_name": "beta",
                            "lora_modules": {"sql": str(ckpts["adapters"] / "d")}, **beta_cpus}],
                **SMALL}
        url = _deploy(serve_instance, args)
        if request.param == ONE_DEPLOYMENT:  # serve.run returns with both replicas up, HAProxy may list one yet
            wait_until(lambda: len(engine_replica_ports()) == 2, 60, "HAProxy to list both engine replicas")
        yield request.param, url
        serve_instance.delete("qkv")

    @pytest.fixture(scope="class")
    def wanted(self, ckpts: dict[str, Path]) -> dict[str, str]:
        """Each name's greedy text for PROMPT, from the offline engine."""
        from model import LLM, SamplingParams
        from model.config import EngineConfig

        params = SamplingParams(**GREEDY)
        engine = {k: SMALL[k] for k in ("max_num_seqs", "num_kv_blocks", "block_size")}  # as the replicas run
        with torch_threads(1):  # the replicas run one thread too (tests compare floats across processes)
            alpha = LLM(str(ckpts["transformer"]), device="cpu", engine_config=EngineConfig(**engine))
            beta = LLM(str(ckpts["llama"]), device="cpu",
                       engine_config=EngineConfig(**engine, lora_modules={"sql": str(ckpts["adapters"] / "d")}))
            return {"alpha": alpha.generate([PROMPT], params)[0].text, "beta": beta.generate([PROMPT], params)[0].text,
                    "sql": beta.generate([PROMPT], params, lora="sql")[0].text}

    def test_the_layout_is_the_one_asked_for(self, app: tuple[str, str]) -> None:
        from ray import serve

        layout, _ = app
        deployments = set(serve.status().applications["qkv"].deployments)
        assert deployments == ({"EngineDeployment", "PrefixRoute"} if layout == ONE_DEPLOYMENT else
                               {"ModelRouter", "EngineDeployment-0-alpha", "EngineDeployment-1-beta"})

    def test_each_name_gets_its_own_models_greedy_output(self, app: tuple[str, str], wanted: dict[str, str]) -> None:
        _, url = app
        got = {name: complete(url, name, PROMPT) for name in ("alpha", "beta", "sql")}
        assert {n: g["choices"][0]["text"] for n, g in got.items()} == wanted
        assert {n: g["model"] for n, g in got.items()} == {"alpha": "alpha", "beta": "beta", "sql": "sql"}
        assert len(set(wanted.values())) == 3  # three different models answered
        for _ in range(3):  # a stream: the same text, SSE to the end (several times: both replicas' edges)
            with requests.post(f"{url}/v1/chat/completions", timeout=120, stream=True,
                               json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                                     "stream": True, **GREEDY}) as r:
                assert r.status_code == 200
                lines = [ln for ln in r.iter_lines() if ln.startswith(b"data: ")]
            assert lines[-1] == b"data: [DONE]" and len(lines) >= 3

    def test_models_lists_both_and_an_unknown_model_is_a_404(self, app: tuple[str, str]) -> None:
        _, url = app
        for _ in range(4):  # under HAProxy a GET reaches either replica: each lists every model
            data = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
            assert [(m["id"], m.get("parent")) for m in data] == [("alpha", None), ("beta", None), ("sql", "beta")]
            assert requests.get(f"{url}/v1/models/sql", timeout=10).json()["parent"] == "beta"
            assert requests.get(f"{url}/v1/models/alpha", timeout=10).json()["id"] == "alpha"
            assert requests.get(f"{url}/v1/models/gamma", timeout=10).status_code == 404
        r = requests.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "hi"}, timeout=30)
        assert r.status_code == 404
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "'alpha', 'beta'" in error["message"]

    def test_each_replica_lists_every_model_and_forwards_a_request_for_the_other(
            self, app: tuple[str, str], wanted: dict[str, str]) -> None:
        """One deployment: each replica's own HTTP port (as HAProxy reaches it before it knows the
        router, or when a pin misses) lists both models and answers a request for either model
        with that model's output: its own, or forwarded to the other model's replica."""
        layout, _ = app
        if layout != ONE_DEPLOYMENT:
            pytest.skip("the front layout has no replica that serves another model's requests")
        ports = engine_replica_ports()
        assert len(ports) == 2, ports
        for port in ports:
            url = f"http://127.0.0.1:{port}"
            assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]] == \
                ["alpha", "beta", "sql"]
            for name in ("alpha", "beta", "sql"):
                got = complete(url, name, PROMPT)
                assert (got["model"], got["choices"][0]["text"]) == (name, wanted[name])

    def test_a_stored_response_is_found_from_either_replica(self, app: tuple[str, str]) -> None:
        """The Responses store is per replica: a GET or DELETE that reaches a replica without the
        response is answered by the replica that has it (the front asks each model in turn; one
        deployment's replicas ask each other)."""
        _, url = app
        r = requests.post(f"{url}/v1/responses", json={"model": "beta", "input": "hi", "max_output_tokens": 3,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        rid = r.json()["id"]
        for _ in range(4):  # under HAProxy a GET reaches either replica
            got = requests.get(f"{url}/v1/responses/{rid}", timeout=30)
            assert got.status_code == 200 and got.json()["id"] == rid, got.text[:300]
        assert requests.delete(f"{url}/v1/responses/{rid}", timeout=30).json()["deleted"] is True
        for _ in range(2):
            assert requests.get(f"{url}/v1/responses/{rid}", timeout=30).status_code == 404

    def test_a_killed_replica_is_replaced_by_one_serving_the_same_model(
            self, app: tuple[str, str], wanted: dict[str, str]) -> None:
        import ray

        layout, url = app
        if layout != ONE_DEPLOYMENT:
            pytest.skip("the front layout's models are deployments of their own")
        # each replica's gauges reach Ray's metrics endpoint on its first refresh after start
        before = wait_until(lambda: now if set(now := replicas_by_model()) == {"alpha", "beta"} else None, 60,
                            "both models' replicas in the metrics")
        ray.kill(ray.get_actor(f"SERVE_REPLICA::qkv#EngineDeployment#{before['beta']}", namespace="serve"),
                 no_restart=True)

        def beta_again() -> dict[str, str] | None:
            now = replicas_by_model()
            return now if now.get("beta") not in (None, before["beta"]) else None

        after = wait_until(beta_again, 90, "a new replica serving beta")
        assert after["alpha"] == before["alpha"]  # the alpha replica was left alone
        answers: list[str] = []  # what beta's requests got meanwhile, for the failure message
        try:
            got = wait_until(lambda: _try_complete(url, "beta", answers), 60, "beta to answer again")
        except AssertionError as e:
            raise AssertionError(f"{e}; its last answers: {answers[-3:]}") from None
        assert got["choices"][0]["text"] == wanted["beta"]
        assert complete(url, "alpha", PROMPT)["choices"][0]["text"] == wanted["alpha"]


PROMPT = [5, 17, 42, 8, 99, 23, 61]


def replicas_by_model() -> dict[str, str]:
    """The engine replica (its id) serving each model, from the model_name and replica labels of
    the engine gauges on Ray's metrics endpoint (refreshed every GAUGE_REFRESH_S by each replica)."""
    live = {a["name"].rsplit("#", 1)[1] for a in __import__("ray").util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::qkv#EngineDeployment#")}
    return {lab["model_name"]: lab["replica"] for n, lab, _ in scrape(METRICS_URL)
            if n == "ray_qkv_num_requests_running" and lab.get("replica") in live}


def _try_complete(url: str, model: str, answers: list[str] | None = None) -> dict[str, Any] | None:
    """The completion when it succeeds; else None, and what came back (or the error) in `answers`."""
    try:
        r = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY}, timeout=30)
    except requests.RequestException as e:
        if answers is not None:
            answers.append(f"{type(e).__name__}: {e}"[:300])
        return None
    if r.status_code != 200 and answers is not None:
        answers.append(f"{r.status_code} {r.text[:300]}")
    return r.json() if r.status_code == 200 else None
