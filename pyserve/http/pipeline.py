"""The one generation pipeline under every API route.

A route parses its body into a ``GenerationRequest`` (generation.py) and hands it here with a
``Format``, its dialect's writer. ``Pipeline.prepare`` renders the chat template (or takes the
token-id prompts), fits the chat policy (tools, response format, reasoning) into a grammar and
an output parser, checks the grammar and builds one (prompt, sampling) per choice; everything
that can be refused is refused there, before anything reaches the engine. ``Pipeline.run``
admits the job, starts one engine generation per choice, and either collects the choices into
one body or streams them: the chunks of each choice are read by the chat policy's parser into
``OutputDelta``s (text, reasoning, tool-call fragments), which the format writes as its own
events, and finish reasons and usage close them.

Errors before a stream's first byte are plain HTTP errors; after it, the format's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from aiohttp import web

from pyserve.chat.output import ChatOutput, ChatOutputStream, OutputDelta, ParsedMessage
from pyserve.chat.policy import ChatPolicy
from pyserve.grammars import schema_error
from pyserve.http.chat_tools import ChatPlan
from pyserve.http.direct_events import direct_events
from pyserve.http.errors import APIError
from pyserve.http.generation import ChatSpec, GenerationRequest
from pyserve.http.merge import merge_choices
from pyserve.http.metrics import RequestLatencies
from pyserve.http.params import unsupported
from pyserve.http.sse import SSEStream
from pyserve.http.state import QueueTicket, ServerState, engine_error, next_item
from pyserve.outputs import GenerationChunk, TokenLogprob
from pyserve.wire.main_to_worker import DetokParams, Grammar, ImageInput, SamplingParams

log = logging.getLogger("pyserve.http")

Merged = AsyncIterator[tuple[int, GenerationChunk]]


@dataclass
class ChoiceResult:
    """One choice, accumulated from its chunks."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_accepted_tokens: int | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.text:
            self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.spec_accepted_tokens is not None:
            self.spec_accepted_tokens = chunk.spec_accepted_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Format(Protocol):
    """A dialect's writer: whole bodies, or the SSE frames of a stream (``sse.event``)."""

    id: str  # the response's id: what /abort_request and the logs know it by
    token_text: object | None  # not None: logprobs are written (token ids resolved to text)
    stateless: bool  # content(0, chunk, None) is now a pure render: the direct-sink fast path
    eager: bool  # the stream opens at once, pinging while the prompt prefills

    def preamble(self) -> list[bytes]:
        """Frames that open the stream (before any choice)."""
        ...

    def ping(self) -> bytes | None:
        """A keep-alive frame while an eager stream waits for its first token."""
        ...

    def opening(self, index: int) -> list[bytes]:
        """Frames before choice ``index``'s first content."""
        ...

    def content(
        self, index: int, chunk: GenerationChunk, delta: OutputDelta | None
    ) -> bytes | None:
        """The frame(s) of one chunk of choice ``index``; ``delta`` is the chunk as the chat
        policy read it (None when the output is not parsed: its text is all content)."""
        ...

    def closing(
        self, index: int, result: ChoiceResult, held: OutputDelta | None, finish: str | None
    ) -> list[bytes]:
        """Frames that end choice ``index``: ``held`` is what its parser kept back to the end,
        ``finish`` its finish reason as the chat policy reports it."""
        ...

    def end(self, results: list[ChoiceResult]) -> list[bytes]:
        """Frames after every choice has ended (usage, the terminator)."""
        ...

    def error(self, error: APIError) -> list[bytes]:
        """Frames that report an error after the stream began; the stream then ends."""
        ...

    def response(self, results: list[ChoiceResult], messages: list[ParsedMessage] | None) -> bytes:
        """The whole body; ``messages``: each choice as the chat policy read it (None: the
        output is not parsed)."""
        ...


@dataclass
class Job:
    """Everything one request asks the engine for: one (prompt, sampling) per choice, choice
    j of prompt i at index i*n + j."""

    id: str
    choices: list[tuple[list[int], SamplingParams]]
    detok: DetokParams
    stream: bool
    arrival: float
    output: ChatOutput | None = None  # how the output is read back; None: all of it is text
    rids: list[str] = field(default_factory=list)
    prompt_tokens: list[list[int]] = field(default_factory=list)  # one per prompt
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images
    priority: int = 0  # lower runs first (--schedule-policy priority)
    timeout: float | None = None  # seconds, queue and generation (None: --request-timeout)
    tenant: str | None = None  # whose request (--fairness tenant; None: the anonymous tenant)

    def __post_init__(self) -> None:
        if not self.rids:
            if len(self.choices) == 1:
                self.rids = [self.id]
            else:
                self.rids = [f"{self.id}-{i}" for i in range(len(self.choices))]


class Pipeline:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self._policy: ChatPolicy | None = None

    @property
    def policy(self) -> ChatPolicy:
        """The served model's chat policy (its tokenizer exists once the engine started)."""
        if self._policy is None:
            config = self.engine.config
            self._policy = ChatPolicy(
                self.engine.tokenizer, config.tool_call_parser, config.reasoning_parser
            )
        return self._policy

    # ------------------------------------------------------------------ prepare

    async def prepare(self, req: GenerationRequest, id: str, rids: list[str] | None = None) -> Job:
        """The job of ``req``, refused here (APIError) if anything about it cannot run."""
        arrival = time.perf_counter()
        state, engine = self.state, self.engine
        if req.priority and engine.config.schedule_policy != "priority":
            raise unsupported("priority", "start the server with --schedule-policy priority")
        grammar, output, keep_special = req.grammar, None, False
        sampling = req.sampling
        images: list[ImageInput] = []
        if req.chat is not None:
            spec = req.chat
            loose = await self._loose_tools(spec)
            plan = ChatPlan.of(spec, req.grammar, req.grammar_param, self.policy, loose)
            kwargs = dict(spec.template_kwargs)
            if spec.enable_thinking is not None and engine.chat_template_reads("enable_thinking"):
                kwargs.setdefault("enable_thinking", spec.enable_thinking)
            if spec.images:
                pictures = await state.read_images(spec.images)
                with_images = await state.call(
                    engine.apply_chat_template_with_images(
                        plan.template_messages(spec.messages),
                        pictures,
                        chat_template_kwargs=kwargs,
                        tools=plan.template_tools,
                    )
                )
                prompt, images = with_images.ids, with_images.images
            else:
                prompt = await state.call(
                    engine.apply_chat_template(
                        plan.template_messages(spec.messages),
                        chat_template_kwargs=kwargs,
                        tools=plan.template_tools,
                    )
                )
            plan = plan.for_prompt(prompt, self.policy)
            prompts = [prompt]
            grammar, output, keep_special = plan.grammar, plan.output, plan.keep_special_tokens
            param = plan.grammar_param
            if plan.stop_token_ids and not sampling.ignore_eos:  # they end the turn, as EOS does
                stops = [*sampling.stop_token_ids, *plan.stop_token_ids]
                sampling = dataclasses.replace(sampling, stop_token_ids=stops)
            if state.options.log_requests:
                log.info("%s messages: %r", id, spec.messages)
        else:
            assert req.prompts is not None
            assert not req.prompt_images or len(req.prompts) == 1
            prompts, param, images = req.prompts, req.grammar_param, req.prompt_images
            if state.options.log_requests:
                log.info("%s prompts: %r", id, prompts)
        if grammar is not None:
            await state.call(engine.check_grammar(grammar, param))
        detok = sampling.detok()
        if keep_special:
            detok.skip_special_tokens = False
        choices = [
            (
                prompt,
                sampling.params(
                    max_new_tokens=state.max_new_tokens(len(prompt), req.max_tokens),
                    choice=i,
                    grammar=grammar,
                ),
            )
            for prompt in prompts
            for i in range(req.n)
        ]
        return Job(
            id=id,
            choices=choices,
            detok=detok,
            stream=req.stream,
            arrival=arrival,
            output=output,
            rids=list(rids or []),
            prompt_tokens=prompts,
            images=images,
            priority=req.priority,
            timeout=req.timeout,
            tenant=req.tenant,
        )

    async def _loose_tools(self, spec: ChatSpec) -> set[str]:
        """The tools whose valid parameters schema the grammar engine cannot enforce (a
        ``uniqueItems`` or an ``if``/``then`` somewhere in an agent's tool). A forced call of one
        is held to a JSON object of arguments rather than failing the whole request, since the
        template still shows the model the schema; a tool marked ``strict``, or a schema that is
        not valid JSON Schema, is refused instead."""
        if spec.tool_choice == "none" or not spec.tools:
            return set()
        loose = set()
        for i, tool in enumerate(spec.tools):
            function = tool.function
            if function.parameters is None:
                continue
            schema = Grammar("json_schema", msgspec.json.encode(function.parameters).decode())
            try:
                await self.engine.check_grammar(schema, f"tools[{i}].function.parameters")
            except ValueError as exc:
                if function.strict or schema_error(function.parameters) is not None:
                    raise engine_error(exc) from exc  # refused, or not a schema at all
                loose.add(function.name)
                log.warning(
                    "tool %r: its calls are held to any JSON object: %s", function.name, exc
                )
        return loose

    def check_thinking(self, enable: bool | None, param: str) -> None:
        """A request that asks for a thought from a model that writes none is refused."""
        if enable and not self.policy.reads_thoughts:
            raise unsupported(
                param, "this server reads no thoughts (start it with --reasoning-parser)"
            )

    # ------------------------------------------------------------------ run

    async def run(self, request: web.Request, job: Job, fmt: Format) -> web.StreamResponse:
        state = self.state
        ticket = state.admit()
        try:
            with state.serving(request, job.id, job.rids):
                streams = [
                    self.engine.generate(
                        prompt,
                        sampling,
                        job.detok,
                        rid,
                        images=job.images,
                        priority=job.priority,
                        timeout=job.timeout,
                        tenant=job.tenant,
                    )
                    for (prompt, sampling), rid in zip(job.choices, job.rids, strict=True)
                ]
                latencies = [state.metrics.request(job.arrival) for _ in streams]
                async with contextlib.aclosing(merge_choices(streams, latencies)) as merged:
                    if job.stream:
                        return await self._stream(request, job, merged, fmt, latencies, ticket)
                    return await self._collect(job, merged, fmt, ticket)
        finally:
            ticket.release()

    async def _collect(
        self, job: Job, merged: Merged, fmt: Format, ticket: QueueTicket
    ) -> web.Response:
        results = [ChoiceResult() for _ in job.choices]
        try:
            async for index, chunk in merged:
                ticket.release()
                results[index].add(chunk)
        except Exception as exc:
            raise engine_error(exc) from exc
        if fmt.token_text is not None:
            for result in results:
                self.state.token_texts.resolve_logprobs(result.logprobs)
        messages = None
        if job.output is not None:
            messages = [job.output.message(r.text, r.finish_reason) for r in results]
        if self.state.options.log_requests:
            log.info("%s output: %r", job.id, [r.text for r in results])
        return web.Response(body=fmt.response(results, messages), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        merged: Merged,
        fmt: Format,
        latencies: list[RequestLatencies],
        ticket: QueueTicket,
    ) -> web.StreamResponse:
        count = len(job.choices)
        results = [ChoiceResult() for _ in range(count)]
        parsers: list[ChatOutputStream | None] = [
            job.output.stream() if job.output is not None else None for _ in range(count)
        ]
        opened = [False] * count
        sse = SSEStream(request)
        if fmt.eager:
            await sse.start()
            for frame in fmt.preamble():
                await sse.send_frame(frame)
            try:
                first = await self._first_with_pings(merged, fmt, sse)
            except APIError as error:
                return await self._fail(sse, fmt, error)
        else:
            first = await next_item(merged)  # an error here is still a plain HTTP error
            await sse.start()
            for frame in fmt.preamble():
                await sse.send_frame(frame)
        ticket.release()
        # see direct_events: installed once the format's content is a pure render (a format
        # may need its first chunks to get there)
        direct = count == 1 and fmt.token_text is None
        item = first
        try:
            while item is not None:
                index, chunk = item
                results[index].add(chunk)
                if not opened[index]:
                    opened[index] = True
                    for frame in fmt.opening(index):
                        await sse.send_frame(frame)
                if fmt.token_text is not None and chunk.logprobs:
                    self.state.token_texts.resolve_logprobs(chunk.logprobs)
                parser = parsers[index]
                delta = parser.feed(chunk.text) if parser is not None and chunk.text else None
                frame = fmt.content(index, chunk, delta)
                if frame is not None:
                    await sse.send_frame(frame)
                if chunk.finish_reason is not None:
                    held, finish = None, chunk.finish_reason
                    if parser is not None:
                        held, finish = parser.finish(), parser.finish_reason(finish)
                    for frame in fmt.closing(index, results[index], held, finish):
                        await sse.send_frame(frame)
                if direct and fmt.stateless:
                    direct = False
                    sink = direct_events(sse, fmt, results[0], latencies[0])
                    self.engine.stream_directly(job.rids[0], sink)
                item = await anext(merged, None)
        except ConnectionError:
            raise  # the client is gone: there is nobody to tell
        except Exception as exc:
            return await self._fail(sse, fmt, engine_error(exc))
        for frame in fmt.end(results):
            await sse.send_frame(frame)
        if self.state.options.log_requests:
            log.info("%s output: %r", job.id, [r.text for r in results])
        return await sse.close()

    async def _first_with_pings(
        self, merged: Merged, fmt: Format, sse: SSEStream
    ) -> tuple[int, GenerationChunk] | None:
        """The first item, pinging every PING_INTERVAL seconds while the prompt prefills."""
        first = asyncio.ensure_future(next_item(merged))
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=PING_INTERVAL)
                if done:
                    return first.result()
                ping = fmt.ping()
                if ping is not None:
                    await sse.send_frame(ping)
        finally:
            if not first.done():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first

    async def _fail(self, sse: SSEStream, fmt: Format, error: APIError) -> web.StreamResponse:
        for frame in fmt.error(error):
            await sse.send_frame(frame)
        return await sse.close()


def _ping_interval() -> float:
    """Seconds between keep-alive events while an eager stream waits: 10, or
    PYSERVE_PING_INTERVAL (tests set a tiny one to see pings without slow prompts)."""
    try:
        value = float(os.environ.get("PYSERVE_PING_INTERVAL", "10"))
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


PING_INTERVAL = _ping_interval()
