"""`POST /v1/attention` and the explorer page (`GET /explorer`).

An attention request runs through the engine like a completion (one engine call: the
admission gate, the engine's queue, metrics, abort when the client goes away); its last delta carries the weights (`model.inspect.attention_maps.AttentionMaps`). The answer
is bounded by `max_attention_floats` (an app argument): a larger request is a 400 saying the
bound and how to narrow it, before anything is queued.
"""

from __future__ import annotations

import codecs
import uuid
from importlib import resources
from typing import Annotated, Any, Literal, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import Response

from model.inspect.attention_spec import AttentionRequestError, AttentionSpec, check_attention
from model.sampling.params import SamplingParams
from service.engine.engine_loop import SubRequest
from service.errors import APIError
from service.http.images import chat_image_refs
from service.openai.protocol import ChatMessage

MAX_INDEXES = 4096
STATIC_FILES = {"explorer.html": "text/html; charset=utf-8", "explorer.js": "text/javascript; charset=utf-8",
                "explorer.css": "text/css; charset=utf-8"}

Indexes = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_INDEXES)]


class AttentionRequest(BaseModel):
    """`POST /v1/attention`: a prompt (text or token ids) or chat messages, and which weights."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Union[str, Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)], None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    layers: Indexes | None = None
    heads: Indexes | None = None
    rows: Union[Literal["all", "last"], Indexes] = "all"
    max_tokens: Annotated[int, Field(ge=0, le=4096)] = 0
    scale: Literal["sqrt_dk", "none"] = "sqrt_dk"

    @model_validator(mode="after")
    def _one_input(self) -> AttentionRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self

    def spec(self) -> AttentionSpec:
        rows = self.rows if isinstance(self.rows, str) else tuple(self.rows)
        return AttentionSpec(None if self.layers is None else tuple(self.layers),
                             None if self.heads is None else tuple(self.heads), rows, self.max_tokens, self.scale)


def display_tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text as a person reads it. A character split over byte-level tokens shows
    in the token that completes it; a token's bytes of a still unfinished character (or bytes
    that are not UTF-8) show as \\xNN escapes; special tokens show as <eos> or <id>."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    shown = []
    for token_id in ids:
        raw = tokenizer.id_to_bytes(token_id)
        if not raw:
            shown.append("<eos>" if token_id == tokenizer.eos_token_id else f"<{token_id}>")
            continue
        text = decoder.decode(raw)
        pending = decoder.getstate()[0][-len(raw):]  # this token's bytes of an unfinished character
        shown.append(text + "".join(f"\\x{b:02x}" for b in pending))
    return shown


class AttentionServing:
    """The route's logic over the replica's `OpenAIServing` (tokenizer, chat template, engine)."""

    def __init__(self, serving: Any, max_floats: int) -> None:
        self.serving = serving
        self.max_floats = max_floats

    async def attention(self, req: AttentionRequest) -> dict[str, Any]:
        serving = self.serving
        serving.check_model(req.model)
        if serving.adapter_of(req.model) is not None:
            raise APIError(f"attention maps come from the base model '{serving.info.served_model_name}', not a "
                           f"LoRA adapter; got model '{req.model}'", param="model")
        shape = serving.info.attention
        mm = None
        if req.messages is not None:
            refs = chat_image_refs(req.messages)
            if refs:  # a vision model's maps over its images' patches
                serving.check_images(refs)
            text = serving.chat_template.render(req.messages, req.add_generation_prompt)
            ids = serving.token_ids(text, param="messages", add_special_tokens=False)
            if refs:
                ids, mm = await serving.expand_images(refs, ids)
        else:
            ids = serving.token_ids(req.prompt)
        spec = req.spec()
        try:
            check_attention(spec, shape, len(ids), self.max_floats)
            params = SamplingParams(max_tokens=max(1, req.max_tokens), temperature=0.0, attention=spec)
        except AttentionRequestError as exc:
            raise APIError(str(exc), param=exc.param) from None
        if len(ids) + params.max_tokens > serving.info.max_model_len:
            raise APIError(f"prompt ({len(ids)} tokens) plus max_tokens ({req.max_tokens}, at least 1 is run) "
                           f"exceeds the model's context of {serving.info.max_model_len} tokens",
                           param="max_tokens" if req.max_tokens else "prompt")
        maps = await self._run(SubRequest(f"attn-{uuid.uuid4().hex}", ids, params, mm=mm))
        return _body(maps, serving, shape)

    async def _run(self, sub: SubRequest) -> Any:
        s = self.serving
        run = s.engine_call([sub])  # admission gate included
        maps = None
        try:
            await run.start()
            async for batch in run.batches():
                for out in batch:
                    if out.finished:
                        maps = out.attention
        finally:  # client gone or failure: abort what still runs
            run.cancel()
        if maps is None:
            raise APIError("The attention request ended without weights (aborted).", 500, "server_error")
        return maps


def _body(maps: Any, serving: Any, shape: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "object": "attention", "model": serving.info.served_model_name,
        "tokens": display_tokens(serving.tokenizer, maps.token_ids), "token_ids": maps.token_ids,
        "attention_kind": shape.kind, "num_layers": shape.num_layers, "num_heads": shape.num_heads,
        "head_dim": shape.d_head,
    }
    if shape.num_kv_heads != shape.num_heads:
        body["num_kv_heads"] = shape.num_kv_heads
    body |= {
        "layers": maps.layers, "heads": maps.heads, "rows": maps.rows, "scale": maps.scale,
        "masked_keys": "zero",  # keys after a row's position are present with weight 0
        "attention": maps.weights.tolist(),
        "score_std": maps.score_std.tolist(), "entropy": maps.entropy.tolist(),
    }
    if maps.images:  # token offset + j shows patch j - (length - rows * cols), row-major
        body["images"] = [{"offset": o, "length": n, "rows": r, "cols": c} for o, n, r, c in maps.images]
    return body


def static_file(name: str) -> Response:
    """One of the explorer's files, read from the installed package."""
    data = resources.files("service").joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})


def add_attention_routes(app: FastAPI, serving: Any, max_floats: int, limit: int,
                         read_model: Any, respond: Any) -> None:
    """`POST /v1/attention`, `GET /explorer` and its static files, on the replica's app."""
    attention = AttentionServing(serving, max_floats)

    @app.post("/v1/attention")
    async def attention_route(request: Request) -> Response:
        async def work() -> Any:
            return await attention.attention(await read_model(request, AttentionRequest, limit))
        return await respond(work())

    @app.get("/explorer")
    async def explorer() -> Response:
        return static_file("explorer.html")

    @app.get("/explorer/{name}")
    async def explorer_file(name: str) -> Response:
        if name not in STATIC_FILES:
            return await respond(_not_found(name))
        return static_file(name)


async def _not_found(name: str) -> Any:
    raise APIError(f"no explorer file named {name!r}", 404, "not_found_error")
