"""Ollama's API (`/api/...`), as desktop apps and the official `ollama` client speak it.

`POST /api/chat` and `POST /api/generate` are translated into the OpenAI chat request this server
already checks and answers (openai.ChatRequest; a `raw` generate into its text completion), so
they run through the same chat template, prompt cache, speculation, constraints (`format`: "json"
or a JSON Schema) and tool calls; answers come back in Ollama's shape (`Shape`), streamed by
default as newline-delimited JSON objects, the last one with `done: true`, Ollama's counts and
durations (nanoseconds), and the speculation figures (`edgespec`, llama.cpp's `timings`).
`/api/tags`, `/api/show` and `/api/ps` describe the one served model from its GGUF header;
`/api/version` says which Ollama API this follows.

Ollama's sampling defaults apply (temperature 0.8, top_k 40, top_p 0.9). Not served: images,
thinking, log probabilities, fill-in-the-middle (`suffix`), custom templates, an assistant message
to continue (a chat ending with one is a 400, as on /v1/messages; Ollama continues it), the token
`context` of older clients, embeddings (501) and model management: pull, push, create, copy and
delete say to use `edgespec pull` and restart `serve` instead. A model name other than the
served one is Ollama's 404. Errors have Ollama's shape, `{"error": "..."}` (schemas.ApiError.body_for).
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import StreamingResponse

from .openai import ChatRequest, CompletionRequest
from .schemas import ApiError, Shape as _Shape, check_extra_fields, describe_errors, parse_body, timings

# the Ollama API this follows (VS Code's Ollama provider wants >= 0.6.4)
OLLAMA_VERSION = "0.12.0"
# Ollama's own sampling defaults (its Modelfile parameters when a model sets none)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
NEVER = "9999-12-31T23:59:59Z"  # a model here stays loaded as long as the server runs

# the translated request's field names -> Ollama's, in the errors (app.prepared reads these)
CHAT = SimpleNamespace(
    PARAMS={"messages": "messages", "max_tokens": "options.num_predict", "stop": "options.stop",
            "response_format": "format", "tools": "tools", "temperature": "options.temperature",
            "top_p": "options.top_p", "top_k": "options.top_k", "min_p": "options.min_p", "seed": "options.seed"},
    WORDS=(("max_tokens", "num_predict"), ("response_format", "format")))
GENERATE = SimpleNamespace(PARAMS=dict(CHAT.PARAMS, messages="prompt"), WORDS=CHAT.WORDS)

# options taken as Ollama documents them
SAMPLING = ("temperature", "top_p", "min_p")
# options that set up the model's loading or threads: the server's own flags decide these
RUNTIME = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "numa", "use_mmap",
                     "use_mlock", "vocab_only", "f16_kv", "embedding_only", "num_keep", "penalize_newline",
                     "repeat_last_n", "mirostat_tau", "mirostat_eta"})
# options accepted only at the value that changes nothing (this server does not implement them)
NEUTRAL = {"repeat_penalty": lambda v: v in (0, 1), "presence_penalty": lambda v: v == 0,
           "frequency_penalty": lambda v: v == 0, "typical_p": lambda v: v in (0, 1), "tfs_z": lambda v: v in (0, 1),
           "mirostat": lambda v: v == 0, "logits_all": lambda v: not v}
# body fields that cannot change the answer here
IGNORED = frozenset({"keep_alive"})
MESSAGE_KEYS = frozenset({"role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"})


# -- request bodies ---------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None

    def extras(self) -> None:
        check_extra_fields(self.model_extra, IGNORED, {})


class _Generating(_Body):
    format: Union[str, dict, None] = None
    options: Optional[dict] = None
    stream: Optional[bool] = None
    keep_alive: Union[str, int, float, None] = None
    think: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None

    def _common(self, model: str) -> dict:
        """The ChatRequest / CompletionRequest fields of everything but the prompt."""
        self.extras()
        if self.think not in (None, False):
            raise ApiError(400, f"'{model}' does not support thinking: leave think out or false")
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs are not served by this server: leave them out")
        body = dict(_options(self.options), stream=self.stream is not False)  # Ollama streams by default
        fmt = self.format
        if fmt == "json":
            body["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, dict):
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
        elif fmt not in (None, ""):
            raise ApiError(400, f'format must be "json" or a JSON Schema object, got {_short(fmt)}')
        return body


class ChatBody(_Generating):
    messages: Optional[list] = None
    tools: Optional[list] = None

    def chat(self, model: str) -> ChatRequest:
        body = self._common(model)
        body["messages"] = _messages(self.messages or [])
        if self.tools:
            body["tools"] = self.tools
        return _validated(ChatRequest, body)


class GenerateBody(_Generating):
    prompt: Optional[str] = None
    system: Optional[str] = None
    raw: Optional[bool] = None
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list] = None
    images: Optional[list] = None

    def _refused(self) -> None:
        if self.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not served by this server")
        if self.template:
            raise ApiError(400, "template: this server renders the model's own chat template; send raw: true with "
                           "the prompt formatted instead")
        if self.context:
            raise ApiError(400, "context: conversations are not kept between requests here; send the whole "
                           "conversation to /api/chat")
        if self.images:
            raise ApiError(400, "images: the served model reads text only")

    def chat(self, model: str) -> ChatRequest:
        body = self._common(model)
        self._refused()
        system = [{"role": "system", "content": self.system}] if self.system else []
        body["messages"] = system + [{"role": "user", "content": self.prompt}]
        return _validated(ChatRequest, body)

    def completion(self, model: str) -> CompletionRequest:
        """raw: the prompt as it is, no chat template."""
        body = self._common(model)
        self._refused()
        if self.system:
            raise ApiError(400, "system is not applied to a raw prompt: write it into the prompt")
        body["prompt"] = self.prompt
        return _validated(CompletionRequest, body)


class ShowBody(_Body):
    name: Optional[str] = None      # the older name of `model`
    verbose: Optional[bool] = None


def _validated(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:  # a value of the wrong type inside options or messages
        raise ApiError(400, describe_errors(exc.errors(include_url=False))[0]) from None


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"options.{name} must be a number, got {_short(value)}")
    return float(value)


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"options.{name} must be an integer, got {_short(value)}")
    return value


def _options(options: Optional[dict]) -> dict:
    """Ollama's options -> the OpenAI request's sampling fields (Ollama's defaults where absent)."""
    out: dict[str, Any] = dict(DEFAULTS)
    for name, value in (options or {}).items():
        if value is None:
            continue
        if name in SAMPLING:
            out[name] = _number(name, value)
        elif name == "top_k":
            out["top_k"] = max(0, _integer(name, value))  # 0 or less: no top-k
        elif name == "seed":
            seed = _integer(name, value)
            if seed < -1:  # Ollama's -1 is the one way to ask for a random seed
                raise ApiError(400, f"options.seed must be >= 0, or -1 for a random seed; got {seed}")
            out.pop("seed", None) if seed == -1 else out.update(seed=seed)
        elif name == "num_predict":
            n = _integer(name, value)
            if n in (-1, -2):  # no limit / fill the context: until the answer or the context ends
                out.pop("max_tokens", None)
            elif n < 1:
                raise ApiError(400, f"options.num_predict must be >= 1, or -1 for no limit; got {n}")
            else:
                out["max_tokens"] = n
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
                raise ApiError(400, f"options.stop must be a list of strings, got {_short(value)}")
            out["stop"] = stops
        elif name == "num_ctx":  # the context is the one loaded (serve --ctx); a request cannot resize it
            if _integer(name, value) < 1:
                raise ApiError(400, f"options.num_ctx must be >= 1, got {value}")
        elif name in RUNTIME:
            continue
        elif name in NEUTRAL:
            if not NEUTRAL[name](value):
                raise ApiError(400, f"options.{name} is not supported by this server: leave it out (or send its "
                               "neutral value) rather than get an answer that ignores it")
        else:
            raise ApiError(400, f"unknown option {name!r}: this server does not implement it; leave it out")
    return out


def _messages(messages: list) -> list[dict]:
    """Ollama's messages -> OpenAI's: tool calls with ids and arguments as JSON text, tool results
    tied to the call they answer (Ollama names the tool, `tool_name`; OpenAI the call's id)."""
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list of {'role', 'content'} objects")
    out, open_calls = [], []  # open_calls: (id, name) of the calls not answered yet
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content")
        unknown = sorted(set(m) - MESSAGE_KEYS)
        if unknown:
            raise ApiError(400, f"{where}.{unknown[0]}: unknown field; a message has "
                           f"{', '.join(sorted(MESSAGE_KEYS))}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string")
        if m.get("images"):
            raise ApiError(400, f"{where}.images: the served model reads text only")
        msg: dict[str, Any] = {"role": m.get("role"), "content": content or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls.{j}", f"call_{i}_{j}")
                                 for j, c in enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))]
            open_calls += [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.get("role") == "tool":
            msg["tool_call_id"] = _answered(m, open_calls, where)
        out.append(msg)
    if out and out[-1]["role"] == "assistant":  # Ollama would continue it; /v1/messages refuses it too
        raise ApiError(400, f"messages.{len(out) - 1}: the last message is the assistant's; this server does not "
                       "continue a prefilled answer: end with a user (or tool) message")
    return out


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ApiError(400, f"{where} must be a list")
    return value


def _call(c, where: str, default_id: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must be {{'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments", {})
    if not isinstance(args, (dict, str)):
        raise ApiError(400, f"{where}.function.arguments must be an object")
    cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else default_id
    return {"id": cid, "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _answered(m: dict, open_calls: list, where: str) -> str:
    """The id of the call a tool message answers: its tool_call_id, else the first open call of
    its tool_name, else the first open call."""
    cid, name = m.get("tool_call_id"), m.get("tool_name")
    for i, (oid, oname) in enumerate(open_calls):
        if (cid is not None and oid == cid) or (cid is None and (name is None or oname == name)):
            del open_calls[i]
            return oid
    raise ApiError(400, f"{where} is a tool result, but no earlier assistant message made "
                   + (f"a {name!r} call" if name else "a tool call") + " that it could answer")


# -- the served model, from its GGUF header ----------------------------------------------------------
def human_number(n: int) -> str:
    """Parameter counts as Ollama writes them: 135M, 134.52M, 1.5B, 8B."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else (f"{x:.1f}{unit}" if unit != "M" else f"{x:.2f}{unit}")
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def quantization(file_type) -> str:
    import gguf
    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except (ValueError, TypeError):
        return "unknown"
    return name.split("_", 1)[1] if name.startswith(("MOSTLY_", "ALL_")) else name


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class Model:
    """What the Ollama listings say of the served model: read once, from the GGUF header and
    the loaded engine."""

    def __init__(self, name: str, engine):
        from ..ggufinfo import read_info
        from ..tools import detect
        target = engine.target
        self.name, self.engine = name, engine
        self.path = Path(target.path)
        st = self.path.stat()
        info = read_info(self.path)
        fields = info.fields
        self.size, self.modified_at = info.file_size, _iso(st.st_mtime)
        # Ollama's digest names a manifest, not the weights' hash: here, the file (name, size, time)
        ident = f"{self.path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode()
        self.digest = hashlib.sha256(ident).hexdigest()
        n_params = fields.get("general.parameter_count")
        if not isinstance(n_params, int) or n_params <= 0:
            n_params = sum(math.prod(dims) for dims, _ in (fields.get("_tensors") or {}).values())
        arch = info.architecture
        self.details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                        "parameter_size": human_number(n_params),
                        "quantization_level": quantization(fields.get("general.file_type"))}
        info_fields = {k: _json_safe(v) for k, v in fields.items()
                       if not k.startswith("_") and not k.endswith(".count") and k != "tokenizer.chat_template"}
        info_fields["general.parameter_count"] = n_params
        info_fields.setdefault("tokenizer.ggml.tokens", None)  # arrays, as Ollama shows them unless verbose
        self.model_info = info_fields
        self.license = str(fields.get("general.license") or "")
        self.template = target.chat_template() or ""
        self.tool_format = detect(self.template or None).name
        self.n_ctx = int(target.n_ctx)
        draft = engine.drafter.draft_backend if engine.drafter is not None else None
        self.draft = Path(draft.path).name if draft is not None and getattr(draft, "path", None) else None
        settings = getattr(target, "settings", {}) or {}
        gpu = settings.get("gpu_offload") and settings.get("n_gpu_layers", 0) != 0
        self.size_vram = self.size if gpu else 0  # the weights llama.cpp offloads; the KV cache aside

    def listing(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}

    def show(self) -> dict:
        params = "\n".join(f"{k} {v}" for k, v in {**DEFAULTS, "num_ctx": self.n_ctx}.items())
        modelfile = (f"# served by edgespec: {self.name}\nFROM {self.path.name}\n"
                     + "".join(f"PARAMETER {line}\n" for line in params.splitlines()))
        return {"license": self.license, "modelfile": modelfile, "parameters": params, "template": self.template,
                "details": self.details, "model_info": self.model_info,
                # every model answers tool calls here: in its template's format, or edgespec's generic one
                "capabilities": ["completion", "tools"], "modified_at": self.modified_at,
                "edgespec": {"tool_format": self.tool_format, "drafter": getattr(self.engine, "mode", None),
                             "draft": self.draft, "context_length": self.n_ctx}}

    def running(self) -> dict:
        import psutil
        rss = psutil.Process().memory_info().rss
        return {**self.listing(), "size": rss, "size_vram": self.size_vram, "expires_at": NEVER,
                "context_length": self.n_ctx}


class Served:
    """The one model's name, and its description once the engine has loaded."""

    def __init__(self, name: str):
        self.name = name
        self._model: Optional[Model] = None

    def check(self, asked: Optional[str]) -> None:
        """Ollama's answers for a missing or unknown name; `NAME` and `NAME:latest` are served."""
        if not asked or not asked.strip():
            raise ApiError(400, "model is required")
        name = asked.strip().lower()
        if name.endswith(":latest"):
            name = name[:-len(":latest")]
        if name != self.name.lower():
            raise ApiError(404, f"model '{asked}' not found")

    async def model(self, s) -> Model:
        if self._model is None:
            _ready(s)
            self._model = await anyio.to_thread.run_sync(Model, self.name, s.engine)
        return self._model


def _ready(s) -> None:
    if s.state == "loading":
        raise ApiError(503, "the model is still loading: retry when GET /health answers 200",
                       headers={"Retry-After": "5"})
    if s.state != "ready":
        raise ApiError(503, f"the model is not available ({s.state})")


# -- answers ---------------------------------------------------------------------------------------
def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _line(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


DONE = {"eos": "stop", "stop": "stop", "tool_calls": "stop", "length": "length", "context": "length"}


class Shape(_Shape):
    """An answer as Ollama writes it: one object, or newline-delimited objects as it streams, the
    last with `done: true` and the counts. `kind`: "chat" (a `message`) or "generate" (`response`)."""

    def __init__(self, model: str, kind: str):
        self.model, self.chat = model, kind == "chat"
        self.prompt_field = "messages" if self.chat else "prompt"

    def _piece(self, text: str, tool_calls=()) -> dict:
        out = {"model": self.model, "created_at": _now()}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = [{"id": c.id, "function": {"index": i, "name": c.name,
                                                                   "arguments": c.arguments}}
                                         for i, c in enumerate(tool_calls)]
            out["message"] = message
        else:
            out["response"] = text
        out["done"] = False
        return out

    def _final(self, stats, reason: str, text: str = "", tool_calls=()) -> dict:
        out = self._piece(text, tool_calls)
        t0 = self.clock.get("t0")
        out.update(done=True, done_reason=DONE.get(reason, "stop"),
                   total_duration=_ns(time.perf_counter() - t0) if t0 is not None else 0, load_duration=0,
                   prompt_eval_count=stats.prompt_tokens, prompt_eval_duration=_ns(stats.prompt_seconds),
                   eval_count=stats.generated, eval_duration=_ns(stats.decode_seconds),
                   timings=timings(stats), edgespec=self._extension(stats, reason))
        return out

    def whole(self, text: str, stats, reason: str, tool_calls=()) -> dict:
        return self._final(stats, reason, text, tool_calls)

    def text(self, piece: str) -> list:
        return [_line(self._piece(piece))]

    def closing(self, stats, reason: str, tool_calls) -> list:
        calls = [_line(self._piece("", tool_calls))] if tool_calls else []
        return calls + [_line(self._final(stats, reason))]

    def failure(self, err: ApiError) -> list:
        return [_line({"error": err.message})]  # the ollama client raises a stream's error object

    def keepalive(self) -> list:
        # a quiet stream (a long prompt) shows it is alive with an empty piece: clients parse every
        # line as JSON, so a blank line or a comment would break them
        return [_line(self._piece(""))]

    def stream_response(self, events, on_close: Callable) -> StreamingResponse:
        """app._answer: the stream as NDJSON rather than server-sent events."""
        return NDJSONResponse(events, on_close)


class NDJSONResponse(StreamingResponse):
    """A streamed answer that cancels its generation as soon as the client leaves, also before
    the first line (then the body iterator never starts, and only `on_close` can reach the job)."""

    media_type = "application/x-ndjson"

    def __init__(self, content, on_close: Callable):
        super().__init__(content)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left mid-write
                        pass
                    tg.cancel_scope.cancel()
                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            closing = getattr(self.body_iterator, "aclose", None)
            if closing is not None:
                with anyio.CancelScope(shield=True):
                    await closing()
            closed = self._on_close(None)
            if inspect.isawaitable(closed):
                await closed


def _loaded(model: str, chat: bool) -> dict:
    """Ollama's answer to a request with nothing to generate: the model is loaded (and stays)."""
    out = {"model": model, "created_at": _now()}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    out.update(done=True, done_reason="load")
    return out


def not_served(what: str) -> ApiError:
    return ApiError(501, f"{what} is not served here: edgespec serves the one model it was started with. "
                    "Run `edgespec pull NAME` on the command line to download a model, then restart "
                    "`edgespec serve NAME`")


# -- routes ----------------------------------------------------------------------------------------
def _body(model: type[BaseModel]):
    """A dependency reading the body as JSON into `model`. Ollama's clients do not all say the body
    is JSON (curl -d sends a form type, a plain fetch text/plain): a request that carries no Origin
    header (no web page's) may send those too; a page's must say application/json, which it can
    only do after a CORS preflight (guard.py)."""
    async def parse(request: Request) -> BaseModel:
        request.state.t0 = time.perf_counter()
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        loose = kind in ("", "text/plain", "application/x-www-form-urlencoded") and "origin" not in request.headers
        if kind != "application/json" and not loose:
            raise ApiError(415, f"the request body must be JSON sent as 'Content-Type: application/json', "
                           f"got {kind or 'no Content-Type'!r}")
        return parse_body(request, model, await request.body())  # checked, then recorded (serve --record)
    return parse


def router(model_id: str, scheduler: Callable[[], Any], authorized: Callable, chat_like: Callable,
           overflow: str, completion_like: Callable) -> APIRouter:
    """Ollama's routes over the app's scheduler; `authorized` is the API-key dependency,
    `chat_like` app.py's answer to a translated chat request, `completion_like` to a raw prompt
    (passed in: this module does not import app.py, which imports it)."""
    served = Served(model_id)
    api = APIRouter(prefix="/api")
    keyed = [Depends(authorized)]

    @api.get("/version")
    async def version():  # open, as /health's status: clients probe for a server with it
        from .. import __version__
        return {"version": OLLAMA_VERSION, "edgespec": __version__}

    @api.get("/tags", dependencies=keyed)
    async def tags():
        return {"models": [(await served.model(scheduler())).listing()]}

    @api.post("/show", dependencies=keyed)
    async def show(body: ShowBody = Depends(_body(ShowBody))):
        served.check(body.model or body.name)
        body.extras()
        return (await served.model(scheduler())).show()

    @api.get("/ps", dependencies=keyed)
    async def ps():
        s = scheduler()
        if s.state != "ready":
            return {"models": []}  # nothing is loaded yet
        return {"models": [(await served.model(s)).running()]}

    async def load(request: Request, chat: bool) -> JSONResponse:
        s = scheduler()
        while s.state == "loading":  # Ollama's load request returns once the model is in memory
            await asyncio.sleep(0.1)
        _ready(s)
        return JSONResponse(_loaded(served.name, chat))

    @api.post("/chat", dependencies=keyed)
    async def chat(request: Request, body: ChatBody = Depends(_body(ChatBody))):
        served.check(body.model)
        if not body.messages:
            body._common(served.name)
            return await load(request, True)
        req = body.chat(served.name)
        return await chat_like(request, req, lambda prompt: Shape(served.name, "chat"), overflow, CHAT,
                               reserve=False)

    @api.post("/generate", dependencies=keyed)
    async def generate(request: Request, body: GenerateBody = Depends(_body(GenerateBody))):
        served.check(body.model)
        if not body.prompt:
            body._common(served.name)
            body._refused()
            return await load(request, False)
        if body.raw:
            return await completion_like(request, body.completion(served.name), Shape(served.name, "generate"),
                                         _generate_words)
        return await chat_like(request, body.chat(served.name), lambda prompt: Shape(served.name, "generate"),
                               overflow, GENERATE, reserve=False)

    @api.post("/embed", dependencies=keyed)
    @api.post("/embeddings", dependencies=keyed)
    async def embed():
        raise ApiError(501, "embeddings are not served here: this server generates text with one model; "
                       "run an embedding model elsewhere")

    @api.post("/pull", dependencies=keyed)
    async def pull(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except (ValueError, RecursionError):
            body = {}
        name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
        try:
            served.check(name)
        except ApiError:
            raise not_served("pulling a model over the API") from None
        return {"status": "success"}  # the model asked for is the one served: nothing to fetch

    for path, method, what in (("/push", "POST", "pushing a model"), ("/create", "POST", "creating a model"),
                               ("/copy", "POST", "copying a model"), ("/delete", "DELETE", "deleting a model"),
                               ("/blobs/{digest}", "POST", "uploading a blob"),
                               ("/blobs/{digest}", "HEAD", "uploading a blob")):
        api.add_api_route(path, _refusal(what), methods=[method], dependencies=keyed)

    return api


def _refusal(what: str):
    async def refuse():
        raise not_served(what)
    return refuse


def _generate_words(exc: ApiError) -> None:
    """/api/generate's field names in an error of the completion it is answered as."""
    for ours, theirs in GENERATE.WORDS:
        exc.message = exc.message.replace(ours, theirs)
