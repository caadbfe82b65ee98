"""The ASGI application: OpenAI-compatible routes over one Engine.

The app owns a Scheduler (worker.py). Loading starts in the lifespan, on the engine thread, so
the server answers (/health: 503) while the model loads; generation requests get 503 until it
is ready. Each generation request becomes a Job; up to the engine's `parallel` jobs generate at
once, each on its own thread. The handler waits for the job to start (so a request that the
engine refuses still gets a plain 400 rather than a broken stream), then either collects the
answer or streams it as server-sent events. A client that disconnects, whether it waits in the
queue or is being answered, cancels its job at once.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional, Sequence

import anyio

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import ConstraintError, ContextLengthError, EdgespecError, UsageError
from . import worker
from .guard import Guard, HostRule
from . import anthropic, ollama, responses
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .openai import ChatRequest, CompletionRequest, Envelope
from .schemas import ApiError, Recorder, Shape, describe_errors, parse_body

log = logging.getLogger("edgespec.server")

# A prompt can only be as long as the context; 8 MiB of JSON is far beyond any context this
# runs with and keeps a single request from exhausting memory before it is even parsed.
MAX_BODY_BYTES = 8 * 2**20
# What a stream gets to end cleanly when the server stops; under the command's 5 s graceful
# shutdown, and far more than the one round a cancelled generation needs.
SHUTDOWN_GRACE_SECONDS = 2.0
# A stream quiet this long (a long prompt being evaluated: 20,000 tokens take minutes on a CPU) gets
# a keep-alive event in its API's own kind (Shape.keepalive: an empty text delta on /v1/messages,
# `response.in_progress` on /v1/responses, a comment on OpenAI's chat): agents give up on a stream
# without events (Claude Code and Codex after 300 s), and a comment line or a `ping` (which
# Anthropic's SDKs drop) is no event to them
KEEPALIVE_SECONDS = 10.0


def create_app(load: Callable[[], Any], *, model_id: str, api_key: Optional[str] = None,
               cors_origins: Sequence[str] = (), hosts: Optional[HostRule] = None,
               queue_size: int = 8, context_overflow: str = "error", on_ready: Optional[Callable[[], None]] = None,
               on_load_error: Optional[Callable[[BaseException], None]] = None, metrics: bool = True,
               record: Optional[str] = None) -> FastAPI:
    """`load()` builds the Engine (it runs on the engine thread once the server listens);
    `on_ready` / `on_load_error` tell the caller how that went. `hosts`: the Host header values
    accepted (None: this machine's loopback names); `cors_origins`: the web origins allowed;
    `metrics`: serve GET /metrics (metrics.py)."""

    sched: Optional[worker.Scheduler] = None

    async def loading(s: worker.Scheduler) -> None:
        try:
            await s.load(load)
        except asyncio.CancelledError:  # the server stops while loading: not a failure to report
            raise
        except BaseException as exc:
            log.debug("loading failed: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)
            return
        if on_ready is not None:
            on_ready()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal sched
        sched = worker.Scheduler(queue_size)
        app.state.scheduler = sched
        task = asyncio.create_task(loading(sched))
        try:
            yield
        finally:
            task.cancel()  # stops waiting for a load that has not finished; the thread is a daemon
            await sched.close()

    app = FastAPI(title="edgespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = ServerMetrics(lambda: sched, model_id) if metrics else None  # fed by _answer
    # serve --record: every body the API reads is appended to this JSONL file (schemas.Recorder)
    app.state.record = Recorder(record) if record is not None else None
    # as the Guard compares them, and as browsers send them: lower case, no trailing slash
    cors_origins = [o if o == "*" else o.strip().rstrip("/").lower() for o in cors_origins]
    if cors_origins:  # closed unless asked: a web page must not drive a local model by default
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    # outermost: a request from a foreign page or a rebound DNS name is refused before anything
    app.add_middleware(Guard, hosts=hosts or HostRule(), origins=cors_origins)

    _install_error_handlers(app)

    # -- routes ----------------------------------------------------------------------------------
    def scheduler() -> worker.Scheduler:
        assert sched is not None, "the app runs without its lifespan"
        return sched

    key_ok = _key_check(api_key)

    @app.get("/health")
    async def health(request: Request):
        s = scheduler()
        status = {"loading": "loading", "ready": "ok"}.get(s.state, s.state)
        body = {"status": status}
        if s.state == "remote_down":  # the target's rpc-server: named, and that it comes back by itself
            body["error"] = str(s.error)
        if key_ok(request):  # with a key, what runs here is for those who hold it; readiness for all
            body.update(model=model_id, parallel=s.parallel, running=s.running, waiting=s.waiting,
                        served=s.served, cancelled=s.cancelled)
        return JSONResponse(body, status_code=200 if s.state == "ready" else 503)

    async def authorized(request: Request) -> None:
        if not key_ok(request):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "edgespec"}]}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest = Depends(_json(ChatRequest))):
        s = scheduler()
        messages = body.engine_messages()
        room = body.requested_tokens() or 1
        prompt = await _prepare(body, _n_ctx(s),
                                lambda req: s.engine.prepare_chat(messages, req, room=room, overflow=context_overflow))
        env = Envelope("chat", model_id, body.include_usage)
        env.dropped_messages = prompt.dropped
        return await _answer(s, request, env, body.stream, lambda engine: engine.stream_prompt(prompt))

    @v1.post("/completions")
    async def completions(request: Request, body: CompletionRequest = Depends(_json(CompletionRequest))):
        s = scheduler()
        prompt = body.engine_prompt()
        room = body.requested_tokens() or 1
        ready = await _prepare(body, _n_ctx(s), lambda req: s.engine.prepare_prompt(prompt, req, room=room), "prompt")
        return await _answer(s, request, Envelope("text", model_id, body.include_usage), body.stream,
                             lambda engine: engine.stream_prompt(ready))

    async def prepared(chat: ChatRequest, overflow: str, api, reserve: bool = True):
        """The ChatPrompt of a request translated from another API (api: anthropic.py,
        responses.py), its errors named as that API names its fields. `reserve`: the answer's
        limit must fit beside the prompt (OpenAI's rule); else it is a cap, and a full context
        ends the answer (Anthropic's, whose max_tokens is required)."""
        s = scheduler()
        try:
            messages = chat.engine_messages()
            room = (chat.requested_tokens() or 1) if reserve else 1
            return await _prepare(chat, _n_ctx(s),
                                  lambda req: s.engine.prepare_chat(messages, req, room=room, overflow=overflow),
                                  api.PARAMS["messages"])
        except ApiError as exc:
            exc.param = api.PARAMS.get(exc.param, exc.param)
            for ours, theirs in api.WORDS:
                exc.message = exc.message.replace(ours, theirs)
            raise

    async def chat_like(request: Request, chat: ChatRequest, shape_for: Callable[[Any], Shape],
                        overflow: str, api, reserve: bool = True):
        """A request of another API translated into `chat` (api: anthropic.py, responses.py):
        checked, prepared and answered as a chat completion, written in the shape
        `shape_for(prompt)` gives."""
        s = scheduler()
        prompt = await prepared(chat, overflow, api, reserve)
        shape = shape_for(prompt)
        shape.dropped_messages = prompt.dropped
        room = _n_ctx(s) - len(prompt.tokens)
        asked = chat.requested_tokens()
        if asked is not None and asked > room:
            shape.capped_max_tokens = room
        return await _answer(s, request, shape, chat.stream, lambda engine: engine.stream_prompt(prompt))

    @v1.post("/messages")
    async def messages(request: Request, body: anthropic.MessagesRequest = Depends(_json(anthropic.MessagesRequest))):
        chat = body.chat()
        return await chat_like(request, chat, lambda prompt: anthropic.Shape(model_id, body, len(prompt.tokens)),
                               context_overflow, anthropic, reserve=False)

    @v1.post("/messages/count_tokens")
    async def count_tokens(request: Request,
                           body: anthropic.CountRequest = Depends(_json(anthropic.CountRequest))):
        try:
            prompt = await prepared(body.chat(), "error", anthropic, reserve=False)
        except _TooLong as exc:  # a count is what a client asks to learn whether it fits: no error
            return {"input_tokens": exc.prompt_tokens}
        return {"input_tokens": len(prompt.tokens)}

    @v1.post("/responses")
    async def create_response(request: Request,
                              body: responses.ResponsesRequest = Depends(_json(responses.ResponsesRequest))):
        chat = body.chat()
        overflow = "drop-oldest" if body.truncation == "auto" else context_overflow
        # agents ask for generous limits (Codex 32,000 tokens): capped to the room, as on /v1/messages
        return await chat_like(request, chat, lambda prompt: responses.Shape(model_id, body), overflow, responses,
                               reserve=False)

    app.include_router(v1)
    async def completion_like(request: Request, comp: CompletionRequest, shape, rename: Callable):
        """A raw prompt of another API answered as /v1/completions answers it (`rename`: its field
        names in a refusal): Ollama's /api/generate with raw."""
        s = scheduler()
        try:
            ready = await _prepare(comp, _n_ctx(s),
                                   lambda req: s.engine.prepare_prompt(comp.engine_prompt(), req, room=1), "prompt")
        except ApiError as exc:
            rename(exc)
            raise
        return await _answer(s, request, shape, comp.stream, lambda engine: engine.stream_prompt(ready))

    app.include_router(ollama.router(model_id, scheduler, authorized, chat_like, context_overflow, completion_like))
    if metrics:
        @app.get("/metrics", dependencies=[Depends(authorized)])
        async def prometheus_metrics():
            return Response(app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in the API's own shape (ApiError.body_for: OpenAI's, Anthropic's under
    /v1/messages, Ollama's under /api): refusals, malformed bodies, unknown URLs, crashes."""
    def error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body_for(request.url.path), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI clients expect 400 for any malformed request
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            why = str((first.get("ctx") or {}).get("error", ""))
            if "recursion" in why.lower():  # valid JSON, nested deeper than the parser follows
                message = "the request body nests JSON deeper than 200 levels: flatten it"
            else:
                message = "the request body is not valid JSON" + (f" ({why})" if why else "")
            param = None
        else:  # in words, not in pydantic's names for a union's branches ("format.str: ..."); param:
            message, param = describe_errors(errors)  # the body's field, as OpenAI names it
        return error(request, ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message, code = f"unknown URL: {request.method} {request.url.path}", "unknown_url"
        elif exc.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error(request, ApiError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        # a bug must cost one request, never the server: uvicorn keeps running either way (and
        # logs the traceback, as Starlette re-raises after this), this keeps the answer in the
        # shape clients parse
        return error(request, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def _key_check(api_key: Optional[str]) -> Callable[[Request], bool]:
    """Whether a request holds the API key (always, without one)."""
    key_bytes = api_key.encode("utf-8") if api_key is not None else None

    def key_ok(request: Request) -> bool:
        if key_bytes is None:
            return True
        # the header's bytes as sent (Starlette decodes headers as latin-1): a key outside ASCII
        # arrives as its UTF-8 bytes. `Authorization: Bearer KEY` (OpenAI's clients) or
        # `x-api-key: KEY` (Anthropic's)
        headers = request.scope["headers"]
        raw = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = raw.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key_bytes):
            return True
        other = next((v for k, v in headers if k == b"x-api-key"), None)
        return other is not None and secrets.compare_digest(other.strip(), key_bytes)

    return key_ok


async def _prepare(body, n_ctx: int, prepare: Callable[[Any], Any], prompt_field: str = "messages") -> Any:
    """In one hop to a worker thread (neither the engine's, which generates meanwhile, nor the
    event loop, which streams other requests' tokens): the body's engine Request, checked once
    (ApiError 400 naming a bad field; its schema or grammar compiled, ~90 ms for a 20,000-value
    enum), then `prepare(request)`: the prompt tokenized, checked against the context, its
    constraint's guide built (the first builds llguidance's tokenizer, about a second). The queue
    only ever holds work that fits."""
    def work():
        req = body.engine_request(n_ctx)
        try:
            return prepare(req)
        except EdgespecError as exc:
            raise _failure(exc, body.constraint()[1], prompt_field) from None
    return await anyio.to_thread.run_sync(work)


def _json(model: type[BaseModel]):
    """A dependency that reads the body as JSON, validated by `model`; errors go through the
    RequestValidationError handler like FastAPI's own. The body must say it is JSON: a browser
    sends text/plain or a form type across sites without asking first (no CORS preflight)."""
    async def parse(request: Request) -> BaseModel:
        request.state.t0 = time.perf_counter()  # the request's own clock (edgespec.server_seconds)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"the request body must be JSON sent as 'Content-Type: application/json', "
                           f"got {kind or 'no Content-Type'!r} (curl: add -H 'Content-Type: application/json')",
                           code="unsupported_media_type")
        return parse_body(request, model, await request.body())  # checked, then recorded (serve --record)
    return parse


def _n_ctx(s: worker.Scheduler) -> int:
    _ready(s)
    return s.engine.target.n_ctx


def _ready(s: worker.Scheduler) -> None:
    if s.state == "loading":
        raise ApiError(503, "the model is still loading: retry when GET /health answers 200",
                       code="model_loading", headers={"Retry-After": "5"})
    if s.state == "remote_down":
        raise ApiError(503, f"{s.error}; retry when GET /health answers 200", code="remote_unavailable",
                       headers={"Retry-After": "5"})
    if s.state != "ready":
        raise ApiError(503, f"the model is not available ({s.state})", code="model_unavailable")


class _TooLong(ApiError):
    """A prompt longer than the context (its length in prompt_tokens)."""
    prompt_tokens = None


class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    # The body has been read in full, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, job: worker.Job, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel the job and raise _ClientGone."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        job.cancel()
        raise _ClientGone()
    return work.result()


async def _collect(job: worker.Job) -> tuple[str, tuple]:
    parts = []
    while True:
        kind, value = await job.next()
        if kind == worker.TEXT:
            parts.append(value)
        else:
            return "".join(parts), (kind, value)


def _failure(exc: BaseException, constraint_field: Optional[str] = None, prompt_field: str = "messages") -> ApiError:
    if isinstance(exc, ConstraintError):  # a schema or grammar nothing satisfies: the field it came in
        return ApiError(400, str(exc), param=constraint_field)
    if isinstance(exc, ContextLengthError):  # OpenAI's code, which clients act on (trim, summarise)
        err = _TooLong(400, str(exc), code="context_length_exceeded", param=prompt_field)
        err.prompt_tokens = getattr(exc, "prompt_tokens", None)
        return err
    if isinstance(exc, UsageError):  # prompt too long for the context, bad token ids, template failure
        return ApiError(400, str(exc))
    from ..rpc import RemoteError
    if isinstance(exc, RemoteError):  # the target's rpc-server was lost: not this request's fault
        return ApiError(503, f"{exc}; retry when GET /health answers 200", code="remote_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(exc, EdgespecError):
        return ApiError(500, str(exc))
    return ApiError(500, f"internal error: {type(exc).__name__}")


def _cancelled() -> ApiError:
    return ApiError(503, "the server is shutting down", code="shutting_down")


async def _answer(s: worker.Scheduler, request: Request, shape: Shape, stream: Optional[bool], opener: Callable):
    _ready(s)
    shape.clock["t0"] = getattr(request.state, "t0", None) or time.perf_counter()
    shape.clock["queued"] = time.perf_counter()
    watching = getattr(request.app.state, "metrics", None)
    if watching is not None:  # the generation's figures, added up when it ends (metrics.py)
        opener = watching.watch(opener)
    try:
        job = s.submit(opener, streamed=bool(stream))
    except worker.QueueFull:
        raise ApiError(503, f"the server is busy ({s.parallel} requests generate, {s.queue_size} wait): "
                       "retry later",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    try:
        kind, value = await _unless_gone(request, job, job.next())
        shape.clock["started"] = time.perf_counter()
        if kind == worker.ERROR:
            raise _failure(value, prompt_field=shape.prompt_field)
        if kind == worker.CANCELLED:
            raise _cancelled()
        if stream:
            # the job belongs to the event stream from here on; it cancels it when the client goes
            owned, job = job, None
            # on shutdown sse-starlette sets this event, then waits the grace period before it
            # cuts the stream: cancelling the job makes the stream end with an error event and
            # [DONE] in that time instead of a connection cut mid-message
            shutdown = anyio.Event()
            watcher = asyncio.ensure_future(_cancel_when(shutdown, owned))

            async def client_closed(message) -> None:
                # also called when the client leaves before the body iterator has started, when
                # closing the iterator would not reach the job
                watcher.cancel()
                owned.cancel()
            custom = getattr(shape, "stream_response", None)  # another framing: Ollama's NDJSON (ollama.py)
            if custom is not None:
                return custom(_events(owned, shape, watcher), client_closed)
            return EventSourceResponse(_events(owned, shape, watcher), sep="\n",
                                       client_close_handler_callable=client_closed,
                                       shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_SECONDS)
        text, (kind, value) = await _unless_gone(request, job, _collect(job))
        if kind == worker.ERROR:
            raise _failure(value, prompt_field=shape.prompt_field)
        stats, reason, calls = value
        if reason == "cancelled":
            raise _cancelled()
        shape.call_errors = _call_errors(calls)
        _told(shape, stats, reason)
        return JSONResponse(shape.whole(text.strip() if calls else text, stats, reason, calls))
    except _ClientGone:
        return Response(status_code=204)  # nobody reads it
    finally:
        if job is not None:
            job.cancel()  # no-op when it has ended; otherwise the handler itself was cancelled


def _told(shape: Shape, stats, reason: str) -> None:
    """One line a request, at the end (serve --verbose shows them): where its time went."""
    log.info("%s: %d prompt tokens (%d reused), %.1f s prompt; %d tokens, %.1f s; %s; %d drafted, %d accepted",
             type(shape).__module__.rsplit(".", 1)[-1], stats.prompt_tokens, stats.reused_prompt_tokens,
             stats.prompt_seconds, stats.generated, stats.decode_seconds, reason, stats.drafted, stats.accepted)


def _call_errors(calls) -> list:
    return [{"id": c.id, "name": c.name, "error": c.error} for c in calls if getattr(c, "error", None)]


async def _cancel_when(event: anyio.Event, job: worker.Job) -> None:
    await event.wait()
    job.cancel()


async def _events(job: worker.Job, shape: Shape, watcher: asyncio.Future):
    """SSE items for one streamed answer, in `shape`'s API; sse-starlette closes this generator
    (and so cancels the job) as soon as the client disconnects."""
    nxt = None
    try:
        for item in shape.opening():
            yield item
        while True:
            nxt = asyncio.ensure_future(job.next())
            # waited on, never cancelled by the timeout: an event that comes with it is not lost
            while not (await asyncio.wait({nxt}, timeout=KEEPALIVE_SECONDS))[0]:
                for item in shape.keepalive():
                    yield item
            kind, value = nxt.result()
            if kind == worker.TEXT:
                for item in shape.text(value):
                    yield item
                continue
            if kind == worker.END:
                stats, reason, calls = value
                _told(shape, stats, reason)
                if reason != "cancelled":
                    shape.call_errors = _call_errors(calls)
                    for item in shape.closing(stats, reason, calls):
                        yield item
                    return
                err = _cancelled()
            else:
                err = _failure(value, prompt_field=shape.prompt_field) if kind == worker.ERROR else _cancelled()
            for item in shape.failure(err):
                yield item
            return
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
        watcher.cancel()
        job.cancel()


class _BodyLimit:
    """Refuses request bodies over `limit` bytes (413) before they are read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                response = JSONResponse(ApiError(413, f"the request body is over {self.limit // 2**20} MiB"
                                                 ).body_for(scope.get("path", "")), status_code=413)
                await response(scope, receive, send)
                return
            receive = self._counting(receive)
        await self.app(scope, receive, send)

    def _counting(self, receive):
        seen = 0

        async def counted():
            # bodies sent without a length (chunked) are cut off at the same limit
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"the request body is over {self.limit // 2**20} MiB")
            return message
        return counted
