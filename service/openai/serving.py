"""The OpenAI endpoints' logic: validate and tokenize, run through the engine, format.

Everything a client can get wrong is checked here, before the engine sees it, and becomes an
`APIError` (400 naming the parameter); checks that need the model are `model.sampling.request_checks`,
the same function the engine calls. One HTTP request is one engine call
(`service.http.engine_call`) carrying all its (prompt, choice) pairs, so Serve's admission limits
count HTTP requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from model.engine.sequence import RequestOutput
from model.multimodal.processor import ImageInputError
from model.sampling.params import SamplingParams
from model.sampling.request_checks import RequestError, check_request, check_token_ids
from model.sampling.structured import check_structured
from service.engine.admission import AdmissionGate
from service.engine.engine_loop import SubRequest
from service.engine.model_info import ModelInfo
from service.errors import APIError, from_value_error, overloaded_error
from service.http.engine_call import EngineCall, OverloadPolicy
from service.http.images import ImageLimits, ImageLoader, ImageRef, chat_image_refs
from service.openai.chat_run import ChatRun
from service.openai.chat_template import ChatTemplate
from service.openai.formats import SSE_DONE, ChatFormat, ChoiceState, CompletionFormat, cached_tokens, sse, usage
from service.openai.protocol import (SAMPLING_PARAM_NAMES, ChatCompletionRequest, CompletionRequest, Prompt,
                                     TokenizeRequest)
from service.tenancy.auth import current_tenant
from service.tools.answer import AnswerPlan, plan_answer
from service.tools.formats import resolve_format
from service.tools.reasoning import MARKER_TOKENS as REASONING_MARKERS
from service.tools.reasoning import ReasoningMode, resolve_reasoning

logger = logging.getLogger(__name__)

MAX_CHOICES_TOTAL = 64  # n x prompts in one request


@dataclass
class ChatPrompt:
    """A chat request's prompt: its text, its token ids (each image's placeholder expanded to the
    image's tokens) and its images as the engine takes them."""

    text: str
    ids: list[int]
    mm: Any = None  # model.multimodal.inputs.MultiModalInputs; None: text only


class OpenAIServing:
    """Completions and chat completions over one engine (`engine.generate(requests)` returns a
    stream: `service.replica.engine_deployment.EngineHost` in the replica, a stand-in in some tests)."""

    def __init__(self, info: ModelInfo, engine: Any, overload: OverloadPolicy,
                 request_timeout_s: float | None = None, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto", app_models: tuple[str, ...] = (), quotas: Any = None,
                 priority_scheduling: bool = False, images: ImageLimits | None = None) -> None:
        """`tool_call_parser`: "auto" (the format the chat template writes calls in), "none" or
        a format name (service/tools/formats.py); `reasoning_parser`: "auto" (split `<think>`
        when the template thinks), "none", "qwen3" or "deepseek_r1"; `app_models`: every served
        model of a multi-model app, named in the 404 for an unknown model (empty: this one);
        `quotas`: the tenants' limits (service/tenancy/quotas.py; None: no keys file);
        `priority_scheduling`: the engine schedules by priority (tenants' default priorities apply);
        `images`: what the edge takes of a request's images (service/http/images.py)."""
        self.info = info
        self.images = ImageLoader(images or ImageLimits())
        self._quotas = quotas
        self.priority_scheduling = priority_scheduling
        self.app_models = tuple(app_models) or (info.served_model_name,)
        self.tokenizer = info.tokenizer
        self._engine = engine
        self._gate = AdmissionGate(overload.capacity, lambda: overloaded_error(overload.status, overload.retry_after_s))
        self._timeout_s = request_timeout_s  # None: no deadline
        tok = info.tokenizer
        self.chat_template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token or "",
                                          eos_token=tok.eos_token or "")
        self.tool_format = resolve_format(tool_call_parser, self.chat_template.source)
        self.reasoning = resolve_reasoning(reasoning_parser, self.chat_template.source)
        # Special tokens a format writes (Mistral's [TOOL_CALLS]) must reach the text that is parsed.
        markers = [*(self.tool_format.marker_tokens if self.tool_format else ()),
                   *(REASONING_MARKERS if self.reasoning else ())]
        revealed = getattr(tok, "reveal_special_tokens", lambda _: [])(markers)
        logger.info("tool calls: %s; reasoning: %s%s", self.tool_format.name if self.tool_format else "text only",
                    "split" if self.reasoning else "off",
                    f"; special tokens written as text: {', '.join(revealed)}" if revealed else "")

    def render_chat(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        """The prompt text of a chat request (tools, tool history and template kwargs included)."""
        assert req.messages is not None
        return self.chat_template.render(req.messages, req.add_generation_prompt, req.template_tools,
                                         req.chat_template_kwargs)

    @property
    def quotas(self) -> Any:
        """The tenants' limits (service/tenancy/quotas.py), or None without a keys file."""
        return self._quotas

    @property
    def engine(self) -> Any:
        """What runs requests: the replica's `EngineHost` (a stand-in in some tests)."""
        return self._engine

    def engine_call(self, requests: list[Any], engine: Any = None) -> EngineCall:
        """The engine call of one HTTP request, through this replica's admission gate and
        deadline; `engine`: another runner with the same `generate` (the embedding batcher)."""
        return EngineCall(self._engine if engine is None else engine, requests, self._gate, self._timeout_s,
                          self._quotas)

    async def _start(self, subs: list[SubRequest]) -> EngineCall:
        """The engine call of `subs`, admitted and started (cancelled if starting fails)."""
        run = self.engine_call(subs)
        try:
            await run.start()
        except BaseException:
            run.cancel()
            raise
        return run

    def routing_prompt(self, body: bytes) -> tuple[list[int], str | None] | None:
        """The prompt token ids a completions or chat request body will run with and the LoRA
        adapter it names (None: the base model), or None when the body is not a valid one (the
        replica then answers it with the error): what the prefix router routes by
        (service/routing/prefix_route.py)."""
        try:
            if b'"messages"' in body:
                chat = ChatCompletionRequest.model_validate_json(body)
                text = self.render_chat(chat)
                return self.tokenizer.encode(text, add_special_tokens=False), self.adapter_of(chat.model)
            req = CompletionRequest.model_validate_json(body)
            first = req.prompts[0]
            ids = self.tokenizer.encode(first, True) if isinstance(first, str) else list(first)
            return ids, self.adapter_of(req.model)
        except Exception:  # anything unparseable or unrenderable: routed by load alone
            return None

    # ---- checks -----------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests waiting in the engine for a place in its running batch (0 where the engine
        does not say): what a batch job's requests hold back for."""
        stats = getattr(getattr(self._engine, "loop", None), "stats", None)
        return int(getattr(stats, "num_waiting", 0) or 0)

    def scheduling(self, priority: int | None) -> tuple[int, str | None]:
        """A request's (priority, tenant): the priority it sent, else (with priority scheduling)
        its tenant's default, else 0. With "fcfs" the engine answers 400 to a priority other than 0."""
        tenant = current_tenant.get()
        if priority is None:
            priority = tenant.priority if tenant is not None and self.priority_scheduling else 0
        return priority, None if tenant is None else tenant.name

    def check_model(self, model: str | None) -> None:
        """No model means the served one; a LoRA adapter's name (or `<served>:<adapter>` with dynamic
        loading, found or not by the engine) is served too; any other name is a 404."""
        if model is not None and model != self.info.served_model_name and self.adapter_of(model) is None:
            raise APIError(f"The model '{model}' does not exist; this server serves "
                           f"{', '.join(map(repr, self.app_models))}.", 404, "invalid_request_error", "model",
                           "model_not_found")
        tenant = current_tenant.get()
        if tenant is not None and not tenant.allows(model or self.info.served_model_name):
            raise APIError(f"The key of '{tenant.name}' may not use the model "
                           f"'{model or self.info.served_model_name}'.", 403, "permission_error", "model",
                           "model_not_allowed")

    def adapter_names(self) -> list[str]:
        """The LoRA adapters to list: the start-up ones, and those `<served>:<adapter>` has loaded since."""
        live = getattr(self._engine, "lora_names", None)  # EngineHost; absent on test stand-ins
        return list(live()) if live is not None else list(self.info.lora_adapters)

    def answer_model(self, model: str | None) -> str:
        """The `model` an answer names: the LoRA adapter asked for (as vLLM answers), else the served model."""
        return self.adapter_of(model) or self.info.served_model_name

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None (the base model, or no adapter of that name)."""
        info = self.info
        if model is None or model == info.served_model_name:
            return None
        if model in info.lora_adapters:
            return model
        base, sep, adapter = model.partition(":")
        return model if info.lora_dynamic and sep and base == info.served_model_name and adapter else None

    def token_ids(self, prompt: Prompt, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; a chat prompt passes add_special_tokens=False: its template writes them."""
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        try:
            check_token_ids(ids, self.info.vocab_size, param)
        except RequestError as exc:
            raise from_value_error(exc, SAMPLING_PARAM_NAMES) from None
        return ids

    def _max_tokens(self, num_prompt: int, req: CompletionRequest | ChatCompletionRequest) -> int:
        """The request's max_tokens, or its default clipped to the context that is left."""
        requested = req.requested_max_tokens()
        if requested is not None:
            return requested
        left = max(self.info.max_model_len - num_prompt, 1)  # a full prompt fails the context check
        default = req.default_max_tokens()
        return left if default is None else min(default, left)

    def _sub_requests(self, request_id: str, prompts: list[list[int]],
                      req: CompletionRequest | ChatCompletionRequest, mm: Any = None) -> list[SubRequest]:
        if len(prompts) * req.n > MAX_CHOICES_TOTAL:
            raise APIError(f"n x number of prompts may be at most {MAX_CHOICES_TOTAL}, got "
                           f"{req.n} x {len(prompts)}", param="n")
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        scheduling = self.scheduling(req.priority)
        subs = []
        for i, ids in enumerate(prompts):
            try:
                max_tokens = self._max_tokens(len(ids), req)
                # generation_config.json's defaults fill the fields the request did not send
                choices = [self.info.generation_config.apply_defaults(req.to_sampling_params(max_tokens, choice=j),
                                                                      req.model_fields_set) for j in range(req.n)]
                # The engine runs the same check; here it is a 400 before anything is queued.
                check_request(ids, choices[0], self.info.vocab_size, self.info.max_model_len, param)
            except ValueError as exc:
                raise from_value_error(exc, SAMPLING_PARAM_NAMES) from None
            lora = self.adapter_of(req.model)
            subs.extend(SubRequest(f"{request_id}-{i * req.n + j}", ids, params, lora, *scheduling, mm=mm)
                        for j, params in enumerate(choices))
        if subs:
            _check_constraint(req, subs[0].params)
        return subs

    # ---- endpoints ----------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/completions`: a response body, or SSE lines when streaming."""
        self.check_model(req.model)
        prompts = [self.token_ids(p) for p in req.prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(request_id, self.answer_model(req.model), int(time.time()), self.tokenizer,
                               req.logprobs, prompts if req.prompt_logprobs_count() is not None else None)
        echoes = [self.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        prefixes = [echoes[i // req.n] for i in range(len(prompts) * req.n)]
        return await self._generate(request_id, prompts, req, fmt, prefixes)

    async def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> ChatPrompt:
        """A chat request's prompt (token ids checked against the vocabulary). Its images are read,
        decoded and processed on worker threads; a model without a vision encoder refuses them."""
        assert req.messages is not None
        refs = chat_image_refs(req.messages)
        if refs:  # the cheap refusals before any work
            self.check_images(refs)
        text = self.render_chat(req)
        ids = self.token_ids(text, param="messages", add_special_tokens=False)
        if not refs:
            return ChatPrompt(text, ids)
        ids, mm = await self.expand_images(refs, ids)
        return ChatPrompt(text, ids, mm)

    async def expand_images(self, refs: list[ImageRef], ids: list[int]) -> tuple[list[int], Any]:
        """The rendered prompt's ids with each image placeholder expanded, and its images as the engine
        takes them (`MultiModalInputs`): the images read, decoded and processed on worker threads."""
        images = await self.images.load_all(refs)
        try:
            return await self._engine.process_images(ids, images)
        except ImageInputError as exc:  # placeholders and images do not pair up
            raise APIError(f"messages: the chat template did not place each image once: {exc}", param="messages",
                           code="invalid_image") from None
        except ValueError as exc:  # the checkpoint's image processor refused one (HF's: an extreme aspect ratio)
            raise APIError(f"messages: the model's image processor cannot take an image: {exc}", param="messages",
                           code="invalid_image") from None

    def check_images(self, refs: list[ImageRef]) -> None:
        """A 400 when the model takes no images, or the request has more than the limit."""
        if not self.info.takes_images:
            raise APIError(f"{refs[0].param}: model {self.info.served_model_name!r} does not take images (it has no "
                           "vision encoder); send text only", param=refs[0].param, code="images_not_supported")
        self.images.check_count(refs)

    async def start_chat(self, req: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Admit and start a chat request (the internal request of every chat-like API) and
        return its run, which yields answer events (service/openai/chat_run.py). Raises APIError for a
        bad request or when overloaded, before anything is queued."""
        self.check_model(req.model)
        prompt = await self.chat_prompt(req)
        plan = self._plan(req, prompt.text)
        subs = self._sub_requests(request_id, [prompt.ids], req, prompt.mm)
        run = await self._start(subs)
        return ChatRun(request_id, run, plan, len(subs), {s.request_id: k for k, s in enumerate(subs)},
                       len(prompt.ids), self.tokenizer)

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """`/v1/chat/completions`: the messages through the chat template, then as completions."""
        self.check_model(req.model)
        prompt = await self.chat_prompt(req)
        plan = self._plan(req, prompt.text)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(request_id, self.answer_model(req.model), int(time.time()), self.tokenizer,
                         req.logprobs_count(), plan)
        return await self._generate(request_id, [prompt.ids], req, fmt, [""] * req.n, prompt.mm)

    def _plan(self, req: ChatCompletionRequest, prompt: str) -> AnswerPlan:
        """How the answer is constrained and read back; binds the tool constraint to `req`."""
        reasoning = ReasoningMode.of_prompt(prompt) if self.reasoning else None
        response_schema = None
        if req.response_format is not None and req.response_format.type == "json_schema":
            response_schema = req.response_format.json_schema.schema_ if req.response_format.json_schema else None
        elif req.response_format is not None and req.response_format.type == "json_object":
            response_schema = {"type": "object"}
        try:
            plan = plan_answer(req.function_tools(), req.tool_mode, req.parallel_tool_calls is not False,
                               self.tool_format, reasoning, response_schema)
        except ValueError as exc:
            raise APIError(str(exc), param="tools") from None
        if plan.constraint is not None and plan.tool_format is not None:
            req.use_tool_constraint("tools", plan.constraint, plan.absorbs_response_format)
        return plan

    async def _generate(self, request_id: str, prompts: list[list[int]],
                        req: CompletionRequest | ChatCompletionRequest, fmt: CompletionFormat | ChatFormat,
                        prefixes: list[str], mm: Any = None) -> dict[str, Any] | AsyncIterator[str]:
        subs = self._sub_requests(request_id, prompts, req, mm)
        index_of = {s.request_id: k for k, s in enumerate(subs)}
        choices = [ChoiceState(k, k // req.n) for k in range(len(subs))]
        num_prompt_tokens = sum(len(p) for p in prompts)
        run = await self._start(subs)
        if req.stream:
            return self._stream(run, fmt, choices, index_of, prefixes, [len(p) for p in prompts],
                                req.include_usage, req.continuous_usage)
        try:
            async for batch in run.batches():
                for out in batch:
                    choices[index_of[out.request_id]].add(out)
        finally:  # cancellation (client gone) lands here too: abort what still runs
            run.cancel()
        completion_tokens = sum(c.num_output_tokens for c in choices)
        return fmt.response(choices, prefixes, usage(num_prompt_tokens, completion_tokens, cached_tokens(choices)))

    async def _stream(self, run: EngineCall, fmt: CompletionFormat | ChatFormat, choices: list[ChoiceState],
                      index_of: dict[str, int], prefixes: list[str], prompt_lens: list[int],  # per prompt
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        """SSE lines: one chunk per choice per batch, optional usage, then [DONE]. An error
        after the stream started is sent as an `error` event before [DONE].

        With `continuous_usage` every chunk also carries its choice's usage so far (its prompt
        and the tokens generated for it, as vLLM reports it); `include_usage` adds the
        request's total in a last chunk without choices."""

        def event(chunk: dict[str, Any], c: ChoiceState) -> str:
            if continuous_usage:
                chunk["usage"] = usage(prompt_lens[c.prompt_index], c.num_output_tokens, c.num_cached_tokens)
            return fmt.lines.line(chunk)

        # echo + logprobs: the echoed prompt goes out with its logprobs, which come with the first token.
        echo_logprobs = isinstance(fmt, CompletionFormat) and fmt.echo_prompts is not None
        try:
            for c in choices:
                if isinstance(fmt, ChatFormat):
                    yield event(fmt.role_chunk(c.index), c)
                elif prefixes[c.index] and not echo_logprobs:
                    yield event(fmt.chunk(c.index, prefixes[c.index], [], None), c)
            async for batch in run.batches():
                lines = []  # the batch's events, written as one piece
                for index, outs in _group(batch, index_of).items():
                    c = choices[index]
                    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
                    if echo_logprobs and prompt_lps is not None:
                        lines.append(event(fmt.echo_chunk(index, c.prompt_index, prefixes[index], prompt_lps), c))
                    lines.extend(event(chunk, c) for chunk in self._delta_chunks(fmt, c, outs, len(prefixes[index])))
                yield "".join(lines)
            if include_usage:
                completion_tokens = sum(c.num_output_tokens for c in choices)
                totals = usage(sum(prompt_lens), completion_tokens, cached_tokens(choices))
                yield sse(fmt.usage_chunk(fmt.add_usage_details(totals, choices)))
        except APIError as exc:
            yield sse(exc.body())
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("stream failed")
            yield sse(APIError("Internal error while streaming.", 500, "server_error").body())
        finally:
            run.cancel()
        yield SSE_DONE

    @staticmethod
    def _delta_chunks(fmt: CompletionFormat | ChatFormat, choice: ChoiceState, outs: list[RequestOutput],
                      prefix_len: int) -> list[dict[str, Any]]:
        offset = prefix_len + choice.num_chars
        lps_before = len(choice.logprobs)
        for out in outs:
            choice.add(out)
        text = "".join(out.new_text for out in outs)
        return fmt.chunks(choice.index, text, choice.logprobs[lps_before:], choice.finish_reason, offset)


def _check_constraint(req: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> None:
    """A schema, regex or grammar that does not compile is a 400 naming its field, before
    anything is queued (tokenizer-independent, cached by text; the engine compiles for real)."""
    try:
        check_structured(params)
    except ValueError as exc:
        field = (req.constraint() or ("response_format", {}))[0]
        raise APIError(f"{field}: {exc}", param=field) from None


def _group(batch: list[RequestOutput], index_of: dict[str, int]) -> dict[int, list[RequestOutput]]:
    """The deltas of one batch by choice index, in order."""
    grouped: dict[int, list[RequestOutput]] = {}
    for out in batch:
        grouped.setdefault(index_of[out.request_id], []).append(out)
    return grouped
