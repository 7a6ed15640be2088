"""The OpenAI-compatible HTTP server: FastAPI routes over the scheduler, run by uvicorn.

    /v1/models, /v1/completions, /v1/chat/completions (streamed as server-sent events or not), /health, /metrics

Errors are OpenAI's error bodies, {"error": {"message", "type", "param", "code"}}: 400 for a request that
cannot run (naming the field at fault), 401 without the API key, 429 with Retry-After while the queue is
full, 500 for a request that failed in the engine (the others go on), 503 for one cancelled by shutdown.
A streamed request that fails after its first chunk ends with an error event instead of [DONE].
"""

import asyncio
import json
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from hybridjit import __version__
from hybridjit.sampling import SamplingParams
from hybridjit.serving import scheduler as sched
from hybridjit.serving.chat import ChatTemplate, ChatTemplateError, ToolCall, ToolCallFormat, ToolCallStream
from hybridjit.serving.metrics import RequestTiming, ServerMetrics
from hybridjit.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    error_text,
    field_name,
    field_path,
)
from hybridjit.tokenizer import IncrementalDecoder, no_tokenizer

# After SIGTERM, requests in flight have this long to finish before they are cancelled.
GRACEFUL_SHUTDOWN_SECONDS = 5
# Then their responses have this long to send their ends (a streamed one its error event) before uvicorn cuts
# their connections.
CLOSING_SECONDS = 5
# An idle keep-alive connection stays open this long. Clients must close theirs first: httpx (the openai client's
# transport) keeps an idle connection 5 s, uvicorn's default too, and a request sent on a connection just as the
# server closes it fails with a connection reset (seen under load in tests/test_server.py's soak).
KEEP_ALIVE_SECONDS = 75
DONE = "data: [DONE]\n\n"


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


class Generation:
    """One request on the scheduler, seen from the event loop: its text as it comes (stop strings applied),
    then how it ended. A consumer that leaves before the end cancels the request, which frees its slot."""

    def __init__(self, scheduler, metrics: ServerMetrics, request: sched.Request, decoder: IncrementalDecoder):
        self.metrics, self.decoder = metrics, decoder
        self.timing = RequestTiming()
        self.finished: sched.Finished | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        # The scheduler calls back from its thread: the event loop takes each event in.
        self.ticket = scheduler.submit(request, partial(asyncio.get_running_loop().call_soon_threadsafe, self._receive))

    def _receive(self, event: sched.Token | sched.Finished):
        """On the event loop. Metrics are taken here, when the scheduler reports the end, which it also does
        for a request whose consumer has left (its reason "cancelled")."""
        if isinstance(event, sched.Finished):
            self.finished = event
            self.metrics.request_ended(self.finish_reason, event.prompt_tokens, event.completion_tokens, self.timing)
        else:
            self.timing.token()
        self._events.put_nowait(event)

    async def deltas(self) -> AsyncIterator[str]:
        read_to_the_end = False
        try:
            while not isinstance(event := await self._events.get(), sched.Finished):
                if delta := self.decoder.push(event.id):
                    yield delta
                if self.decoder.stopped:  # the tokens that still come before the cancellation takes are dropped
                    self.ticket.cancel()
            if rest := self.decoder.flush():
                yield rest
            read_to_the_end = True
        finally:
            if not read_to_the_end:
                self.ticket.cancel()

    @property
    def finish_reason(self) -> str:
        """OpenAI's "stop" or "length"; else the scheduler's reason ("cancelled": also a consumer that left)."""
        return "stop" if self.decoder.stopped else self.finished.reason

    def failure(self) -> ApiError | None:
        """The error to report for a request that did not complete."""
        if self.finish_reason in ("stop", "length"):
            return None
        if self.finished.reason == "error":
            return ApiError(500, f"generation failed: {self.finished.error}", kind="server_error")
        return ApiError(503, f"the request ended early ({self.finished.reason})", kind="server_error")

    def usage(self) -> dict:
        done = self.finished
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        }


class Reply:
    """The envelope of one response's objects: its id, creation time, model and object type."""

    def __init__(self, prefix: str, kind: str, model: str):
        self.id, self.kind, self.model = f"{prefix}-{secrets.token_hex(12)}", kind, model
        self.created = int(time.time())

    def object(self, **fields) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, **fields}

    def usage_chunk(self, generation: Generation) -> dict:
        return self.object(choices=[], usage=generation.usage())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def tool_call_json(call: ToolCall) -> dict:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def collect(generation: Generation, request: Request) -> str:
    """The whole text of a request answered in one piece; a client that disconnects meanwhile cancels it."""

    async def cancel_on_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        generation.ticket.cancel()

    watcher = asyncio.create_task(cancel_on_disconnect())
    try:
        return "".join([delta async for delta in generation.deltas()])
    finally:
        watcher.cancel()


async def completion_events(generation: Generation, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, finish_reason: str | None = None) -> dict:
        return reply.object(choices=[{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])

    async for delta in generation.deltas():
        yield sse(chunk(delta))
    if error := generation.failure():
        yield sse(error.body())
        return
    yield sse(chunk("", generation.finish_reason))
    if include_usage:
        yield sse(reply.usage_chunk(generation))
    yield DONE


async def chat_events(
    generation: Generation, reply: Reply, tool_format: ToolCallFormat | None, include_usage: bool
) -> AsyncIterator[str]:
    """Chat chunks: the role first, then content deltas; tool calls, held back as they are written, come
    whole at the end, one delta each, in OpenAI's streaming format."""

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return reply.object(choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    yield sse(chunk({"role": "assistant", "content": ""}))
    held = ToolCallStream(tool_format) if tool_format else None
    async for delta in generation.deltas():
        if content := held.push(delta) if held else delta:
            yield sse(chunk({"content": content}))
    if error := generation.failure():
        yield sse(error.body())
        return
    finish_reason = generation.finish_reason
    if held:
        content, calls = held.finish()
        if content:
            yield sse(chunk({"content": content}))
        if calls:
            yield sse(chunk({"tool_calls": [{"index": i, **tool_call_json(c)} for i, c in enumerate(calls)]}))
            finish_reason = "tool_calls"
    yield sse(chunk({}, finish_reason))
    if include_usage:
        yield sse(reply.usage_chunk(generation))
    yield DONE


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint about a body, as a 400 naming the field (param: the top-level field)."""
    error = exc.errors()[0]
    path = field_path(error["loc"][1:])
    if error["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
    if not path:
        return ApiError(400, f"the body must be a JSON object: {error['msg']}")
    return ApiError(400, f"{field_name(path)}: {error_text(error)}", param=path[0], code=error["type"])


class JsonBodies:
    """Reads every POST body as JSON, whatever its Content-Type says, as llama-server does: `curl -d` (the README's
    example) sends JSON as application/x-www-form-urlencoded, and some clients send no type at all. The API takes
    nothing but JSON, so nothing else is lost."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(scheduler, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server of one model, over a scheduler that is not started yet: the app's lifespan starts it and,
    on shutdown, shuts it down."""
    model = scheduler.model
    if model.tokenizer is None:
        raise ValueError(f"{no_tokenizer(model.path)}: the server needs one to read and write text")
    tokenizer, context = model.tokenizer, model.config.max_position_embeddings
    template = ChatTemplate.of_model(model)
    metrics = ServerMetrics(scheduler)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.shutdown)

    app = FastAPI(title="hybridjit", version=__version__, lifespan=lifespan)
    app.add_middleware(JsonBodies)
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda request, exc: validation_error(exc).response())
    app.add_exception_handler(
        HTTPException, lambda request, exc: ApiError(exc.status_code, exc.detail, headers=exc.headers).response()
    )

    def authorize(authorization: str = Header("")):
        if not secrets.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)] if api_key is not None else [])

    def check_model(body: GenerationParams):
        if body.model not in (None, model_name):
            raise ApiError(
                400, f"model {body.model!r} is not served here; this server has {model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    def start(body: GenerationParams, prompt: list[int], prompt_field: str, max_tokens: int | None, max_tokens_field):
        """Submits a request to the scheduler, after the checks that name the client's fields."""
        if len(prompt) >= context:
            raise ApiError(
                400, f"{prompt_field}: the prompt is {len(prompt)} tokens; the model's context is {context}",
                param=prompt_field, code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:  # as OpenAI: as many as the context leaves
            max_tokens = context - len(prompt)
        elif len(prompt) + max_tokens > context:
            raise ApiError(
                400, f"the prompt's {len(prompt)} tokens + {max_tokens_field} {max_tokens} exceed the model's "
                f"context of {context}", param=max_tokens_field, code="context_length_exceeded",
            )  # fmt: skip
        seed = secrets.randbits(64) if body.seed is None else body.seed
        request = sched.Request(prompt, max_tokens, SamplingParams(body.temperature, body.top_k, body.top_p, seed))
        try:
            return Generation(scheduler, metrics, request, IncrementalDecoder(tokenizer, body.stops))
        except sched.QueueFull as e:
            metrics.rejected.inc()
            retry_after = str(max(1, math.ceil(e.retry_after)))
            raise ApiError(429, str(e), kind="rate_limit_exceeded", headers={"Retry-After": retry_after}) from None
        except ValueError as e:  # a request the scheduler cannot run; its message begins with the field
            field = {"prompt": prompt_field, "max_tokens": max_tokens_field}.get(str(e).partition(":")[0])
            raise ApiError(400, str(e), param=field) from None

    @v1.get("/models")
    async def models():
        entry = {"id": model_name, "object": "model", "created": started, "owned_by": "hybridjit"}
        return {"object": "list", "data": [{**entry, "max_model_len": context}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        if isinstance(body.prompt, str):
            prompt = tokenizer.encode(body.prompt)
        elif bad := [t for t in body.prompt if t >= model.config.vocab_size]:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})",
                           param="prompt")  # fmt: skip
        else:
            prompt = body.prompt
        generation = start(body, prompt, "prompt", body.max_tokens, "max_tokens")
        reply = Reply("cmpl", "text_completion", model_name)
        if body.stream:
            return event_stream(completion_events(generation, reply, body.include_usage))
        text = await collect(generation, request)
        if error := generation.failure():
            raise error
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": generation.finish_reason}
        return reply.object(choices=[choice], usage=generation.usage())

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        if template is None:
            raise ApiError(
                400, f"{model.path} has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja): send prompts to /v1/completions", param="messages", code="no_chat_template",
            )  # fmt: skip
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        try:
            text = template.render([message.for_template() for message in body.messages], tools)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        generation = start(body, tokenizer.encode(text), "messages", body.max_new_tokens, body.max_tokens_field)
        tool_format = template.tool_call_format if tools and body.tool_choice == "auto" else None
        if body.stream:
            reply = Reply("chatcmpl", "chat.completion.chunk", model_name)
            return event_stream(chat_events(generation, reply, tool_format, body.include_usage))
        text = await collect(generation, request)
        if error := generation.failure():
            raise error
        content, calls = tool_format.parse(text) if tool_format else (text, [])
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
        finish_reason = "tool_calls" if calls else generation.finish_reason
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return Reply("chatcmpl", "chat.completion", model_name).object(choices=[choice], usage=generation.usage())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for `serve`: made before the model loads, a port in use is an error at once
    rather than after minutes of loading."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: restarts reuse the port at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def serve(
    model,
    *,
    model_name: str,
    sock: socket.socket,
    api_key: str | None,
    slots: int,
    max_queue: int,
    cache_len: int | None = None,
    prefix_cache_bytes: int | None = None,
    online_placement: bool | None = None,
    disaggregate: str = "auto",
):
    """Serves `model` on `sock` (listening_socket) until SIGINT or SIGTERM; then requests in flight get
    GRACEFUL_SHUTDOWN_SECONDS to end."""
    scheduler = sched.Scheduler(
        model, slots=slots, max_queue=max_queue, cache_len=cache_len, prefix_cache_bytes=prefix_cache_bytes,
        online_placement=online_placement, disaggregate=disaggregate,
    )
    app = create_app(scheduler, model_name=model_name, api_key=api_key)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS + CLOSING_SECONDS,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    GracefulServer(config, scheduler).run(sockets=[sock])


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown cancels the scheduler's requests once they have had
    GRACEFUL_SHUTDOWN_SECONDS: each then ends as a request cancelled by shutdown (503, or a stream's error event)
    and its connection closes. uvicorn's own end of the grace period, cancelling the handlers' tasks, would cut a
    stream mid-body and log a traceback; it stays as the backstop."""

    def __init__(self, config: uvicorn.Config, scheduler: sched.Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    async def shutdown(self, sockets=None):
        async def cancel_after_the_grace_period():
            await asyncio.sleep(GRACEFUL_SHUTDOWN_SECONDS)
            await asyncio.to_thread(self.scheduler.shutdown)

        canceller = asyncio.create_task(cancel_after_the_grace_period())
        try:
            await super().shutdown(sockets)
        finally:
            canceller.cancel()
