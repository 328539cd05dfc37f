"""`POST /v1/embeddings` (OpenAI's Embeddings API).

Embeddings run on the replica's step thread between engine steps (`EngineLoop.run_between_steps`),
so one thread does the replica's torch work and a step never races an embedding forward. The
requests that arrive while a step runs are embedded together in the next gap, in one forward
pass of prefill chunks (`model.engine.embedder.Embedder`) that keeps no KV. Each request passes
the replica's admission gate and deadline like a completion (`service.http.engine_call.EngineCall`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import Response

from model.loading.pooling_config import check_embedding_inputs
from model.sampling.request_checks import RequestError
from service.engine.engine_loop import EngineFailure
from service.errors import APIError

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request
TokenIds = list[Annotated[int, Field(strict=True)]]
UNSUPPORTED = ("truncate_prompt_tokens", "messages")  # vLLM fields that would change the inputs


class EmbeddingRequest(BaseModel):
    """The body of `POST /v1/embeddings`; unknown fields are ignored, as on the other routes."""

    model_config = ConfigDict(extra="allow", strict=True)

    input: Union[str, list[str], TokenIds, list[TokenIds]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    add_special_tokens: bool = True  # vLLM's extension

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        """One message for any wrong shape (rather than one per member of the union)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if not (isinstance(value, str) or ids(value) or (isinstance(value, list) and (
                all(isinstance(t, str) for t in value) or all(ids(t) for t in value)))):
            raise ValueError("input must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids")
        if any(t == "" for t in ([value] if isinstance(value, str) else value)):
            raise ValueError("input must not contain empty strings")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or one prompt's token ids."""
        raw = self.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]  # type: ignore[list-item]
        return list(raw)  # type: ignore[arg-type]

    def unsupported_field(self) -> str | None:
        extra = self.model_extra or {}
        return next((name for name in UNSUPPORTED if extra.get(name) is not None), None)


@dataclass(eq=False)
class _Job:
    """One request's prompts waiting for (or in) a batch; `future` lives on the event loop,
    `vectors` is filled by the step thread, prompt by prompt."""

    prompts: list[list[int]]
    dimensions: int
    future: asyncio.Future[Any]
    cancelled: bool = False
    vectors: list[Any] = field(default_factory=list)
    taken: int = 0  # prompts handed to a forward pass so far

    def settle(self, result: Any) -> None:
        if not self.future.done():
            self.future.set_result(result)


@dataclass
class EmbeddingBatcher:
    """The replica's embedding requests, run together on its step thread between steps.

    Each gap between two steps embeds at most `embedder.max_batch_tokens` tokens (one prompt
    at least) of the requests queued, oldest first; what is left waits for the next gap, so a
    large request delays a generation step by one batch, never by the whole request."""

    loop: Any  # service.engine.engine_loop.EngineLoop
    embedder: Any  # model.engine.embedder.Embedder
    _pending: list[_Job] = field(default_factory=list)
    _scheduled: bool = False  # a gap is asked for (touched on the event loop only)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # `_pending`: event loop and step thread

    def submit(self, job: _Job) -> None:
        with self._lock:
            self._pending.append(job)
        if not self._scheduled:  # else the gap already asked for takes this job too
            self._schedule()

    def _schedule(self) -> None:
        self._scheduled = True
        self.loop.run_between_steps(self._run_some).add_done_callback(self._deliver)

    def _take(self) -> list[tuple[_Job, list[int]]]:
        """Up to one batch of (job, prompt), in arrival order; cancelled jobs are dropped."""
        budget, tokens, work = self.embedder.max_batch_tokens, 0, []
        with self._lock:
            self._pending = [j for j in self._pending if not j.cancelled]
            for job in self._pending:
                while job.taken < len(job.prompts):
                    prompt = job.prompts[job.taken]
                    if work and tokens + len(prompt) > budget:
                        return work
                    work.append((job, prompt))
                    tokens += len(prompt)
                    job.taken += 1
        return work

    def _run_some(self) -> list[tuple[_Job, Any]]:
        """On the step thread: one batch; the jobs it completed with their vectors (or its error)."""
        work = self._take()
        if not work:
            return []
        jobs = list(dict.fromkeys(job for job, _ in work))
        try:
            vectors = self.embedder.embed([p for _, p in work], [job.dimensions for job, _ in work])
        except Exception as exc:  # the callers' 500, not the step loop's death
            logger.exception("embedding %d prompt(s) failed", len(work))
            with self._lock:
                self._pending = [j for j in self._pending if j not in jobs]
            return [(job, exc) for job in jobs]
        for (job, _), vector in zip(work, vectors):
            job.vectors.append(vector)
        done = [job for job in jobs if len(job.vectors) == len(job.prompts)]
        with self._lock:
            self._pending = [j for j in self._pending if j not in done]
        return [(job, job.vectors) for job in done]

    def _deliver(self, gap: asyncio.Future[Any]) -> None:
        """On the event loop: hand finished jobs their vectors (or the loop's failure to every
        job), and ask for another gap while jobs wait."""
        result = gap.result()
        if isinstance(result, EngineFailure):
            with self._lock:
                jobs, self._pending = self._pending, []
            result = [(job, result) for job in jobs]
        for job, out in result:
            job.settle(out)
        with self._lock:
            waiting = bool(self._pending)
        self._scheduled = False
        if waiting:
            self._schedule()


class _EmbedStream:
    """`EngineCall`'s stream for one embedding job: one item (the vectors), then the end."""

    def __init__(self, batcher: EmbeddingBatcher, job: _Job) -> None:
        self._batcher, self._job = batcher, job
        self._submitted = self._done = False

    def __aiter__(self) -> _EmbedStream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        if not self._submitted:
            self._submitted = True
            self._batcher.submit(self._job)
        result = await asyncio.shield(self._job.future)  # a deadline cancels the wait, not the job's future
        self._done = True
        if isinstance(result, Exception):
            raise result
        return result if isinstance(result, EngineFailure) else [result]

    def cancel(self) -> None:
        self._job.cancelled = True


class _EmbedEngine:
    """What `EngineCall` calls `generate` on, for embedding jobs."""

    def __init__(self, batcher: EmbeddingBatcher) -> None:
        self.batcher = batcher

    def generate(self, jobs: list[_Job]) -> _EmbedStream:
        return _EmbedStream(self.batcher, jobs[0])


class EmbeddingServing:
    """The route's logic over the replica's `OpenAIServing` and its `EngineHost`."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving
        self._batcher: EmbeddingBatcher | None = None

    def _embedder(self) -> Any:
        host = self.serving.engine  # the EngineHost (a stand-in in some tests)
        embedder = getattr(getattr(host, "engine", None), "embedder", None)
        if embedder is None or not hasattr(host, "loop"):
            raise APIError(f"The model '{self.serving.info.served_model_name}' does not serve embeddings here.",
                           param="model")
        if self._batcher is None:
            self._batcher = EmbeddingBatcher(host.loop, embedder)
        return embedder

    def prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Every input as token ids, checked (count, emptiness, vocabulary, context)."""
        raw = req.inputs()
        if len(raw) > MAX_INPUTS:  # before tokenizing them all
            raise RequestError(f"input may hold at most {MAX_INPUTS} inputs, got {len(raw)}", "input")
        tok = self.serving.tokenizer
        ids = [tok.encode(p, req.add_special_tokens) if isinstance(p, str) else list(p) for p in raw]
        info = self.serving.info
        check_embedding_inputs(ids, info.vocab_size, info.max_model_len, MAX_INPUTS)
        return ids

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        s = self.serving
        s.check_model(req.model)
        if s.adapter_of(req.model) is not None:
            raise APIError(f"embeddings come from the base model '{s.info.served_model_name}', not a LoRA adapter; "
                           f"got model '{req.model}'", param="model")
        if (name := req.unsupported_field()) is not None:
            raise APIError(f"{name} is not supported by this server; leave it out", param=name)
        embedder = self._embedder()
        pooling = embedder.pooling
        if pooling.unsupported is not None:
            raise APIError(f"The model '{s.info.served_model_name}' cannot serve embeddings: {pooling.unsupported}.",
                           param="model")
        try:
            dims = pooling.check_dimensions(req.dimensions)
            prompts = self.prompts(req)
        except RequestError as exc:
            raise APIError(str(exc), param=exc.param, code=exc.code) from None
        job = _Job(prompts, dims, asyncio.get_running_loop().create_future())
        vectors = await self._run(job)
        num_tokens = sum(map(len, prompts))
        self.serving.engine.metrics.observe_embeddings(num_tokens)
        return _body(vectors, req.encoding_format, s.info.served_model_name, num_tokens)

    async def _run(self, job: _Job) -> list[Any]:
        s = self.serving
        assert self._batcher is not None
        run = s.engine_call([job], engine=_EmbedEngine(self._batcher))
        try:
            await run.start()
            async for batch in run.batches():
                return batch[0]
        finally:  # client gone, deadline or failure: a job not yet run is skipped
            run.cancel()
        raise APIError("The embedding request ended without vectors.", 500, "server_error")


def _encode(vector: Any, encoding_format: str) -> Any:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _body(vectors: list[Any], encoding_format: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def add_embeddings_routes(app: FastAPI, serving: Any, limit: int, read_model: Any, respond: Any) -> None:
    """`POST /v1/embeddings` on the replica's app."""
    embeddings = EmbeddingServing(serving)

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request) -> Response:
        async def work() -> Any:
            return await embeddings.embeddings(await read_model(request, EmbeddingRequest, limit))
        return await respond(work())
