"""What every API of the server shares: `ApiError` (a refusal, written in each API's shape), the
strict pydantic base of the bodies, the rule for fields a server does not implement
(`check_extra_fields`), llama-server's `timings` and the `edgespec` extension field, and `Shape`
(how one API writes an answer, whole or streamed). OpenAI's bodies and answers are openai.py's,
Anthropic's anthropic.py's, the Responses API's responses.py's, Ollama's ollama.py's.

Bodies are pydantic models in strict mode (JSON `true` is not a max_tokens of 1, `"5"` is not
5). Fields that cannot change the answer (user, store, metadata...) are ignored; every other
field this server does not implement (logit_bias, n > 1, logprobs, echo, suffix, a field from a
later API) is refused with a 400 naming it unless it holds its neutral value
(`check_extra_fields`), never silently dropped. A body that fails its model is described in
words (`describe_errors`: "format: must be a string or an object, got 5"), never in pydantic's
names for the branches of a union. `parse_body` checks a body and then hands it to the
`Recorder` (serve --record).
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from typing import Any, Optional

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("edgespec.server")


class ApiError(Exception):
    """An error answer in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    # Anthropic's error types by status (its Messages API: {"type": "error", "error": {...}})
    ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                       415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}

    def anthropic_body(self) -> dict:
        kind = self.ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict:
        """The error in the shape of the API `path` belongs to."""
        if is_ollama(path):  # Ollama's: {"error": "..."} (ollama.py)
            return {"error": self.message}
        return self.anthropic_body() if is_anthropic(path) else self.body()


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_ollama(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# Fields a client may send that cannot change the answer here: ignored. Every other field this
# server does not implement is refused (400 naming it) unless it holds its neutral value: an app
# that asked for something gets it or an error, never an answer to another question.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "cache_prompt", "id_slot",  # llama.cpp server's: prefix reuse, which this server always does
})


def _off(value) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


NEUTRAL = {  # field -> is this value the one that changes nothing
    "frequency_penalty": _off, "presence_penalty": _off, "logit_bias": _off,
    "functions": _off, "audio": _off, "prediction": _off, "web_search_options": _off,
    "reasoning_effort": _off, "verbosity": _off,
    "function_call": lambda v: v in (None, "none", "auto"),  # the old names of tools and tool_choice
    "modalities": lambda v: v in (None, ["text"]),
    # llama.cpp server's sampling fields, which its clients send
    "repeat_penalty": lambda v: v in (None, 1, 1.0), "typical_p": lambda v: v in (None, 1, 1.0),
    "tfs_z": lambda v: v in (None, 1, 1.0), "mirostat": _off,
    "n_probs": _off, "dry_multiplier": _off, "xtc_probability": _off, "ignore_eos": _off,
}


def check_extra_fields(extra: Optional[dict], ignored=IGNORED_FIELDS, neutral=None) -> None:
    """400 for the first field of the body that this server would otherwise drop in silence;
    `ignored`, `neutral`: another API's lists (anthropic.py, responses.py)."""
    neutral = NEUTRAL if neutral is None else neutral
    for name, value in (extra or {}).items():
        if name in ignored and name not in neutral:
            continue
        test = neutral.get(name)
        if test is None:
            raise ApiError(400, f"unknown field {name!r}: this server does not implement it; leave it out",
                           param=name)
        if not test(value):
            raise ApiError(400, f"{name} is not supported by this server: leave it out (or send its neutral "
                           "value) rather than get an answer that ignores it", param=name)


def timings(stats) -> dict:
    """The same report in llama.cpp's server's names (its `timings` object), for tools written for
    llama-server. predicted_per_second is the decode rate after the first token, as edgespec's own."""
    prompt_n = max(0, stats.prompt_tokens - stats.reused_prompt_tokens)
    prompt_ms, predicted_ms = stats.prompt_seconds * 1000, stats.decode_seconds * 1000
    return {"cache_n": stats.reused_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": (round(prompt_n / stats.prompt_seconds, 2)
                                  if prompt_n and stats.prompt_seconds else 0.0),
            "predicted_n": stats.generated, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / (stats.generated - 1), 3) if stats.generated > 1 else 0.0,
            "predicted_per_second": round(stats.tokens_per_second, 2),
            "draft_n": stats.drafted, "draft_n_accepted": stats.accepted}


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def speculation(stats, reason: str) -> dict:
    """The `edgespec` extension field: what speculation did for this request."""
    return {"drafter": stats.drafter, "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4), "target_forwards": stats.target_forwards,
            "reused_prompt_tokens": stats.reused_prompt_tokens,
            "restored_prompt_tokens": stats.restored_prompt_tokens, "by_drafter": stats.by_drafter,
            "prompt_seconds": round(stats.prompt_seconds, 4), "decode_seconds": round(stats.decode_seconds, 4),
            "tokens_per_second": round(stats.tokens_per_second, 2), "finish_reason": reason}


class Shape:
    """How one API writes an answer: whole (`whole`), or as server-sent events, each item a data
    string or an {"event", "data"} dict: `opening()` once the request is accepted, `text(piece)`
    per piece, then `closing(stats, reason, calls)` or `failure(error)`."""

    prompt_field = "messages"   # the request field a context error names
    dropped_messages = 0        # --context-overflow drop-oldest: turns left out of the prompt
    call_errors: list = []      # [{id, name, error}] of the answer's tool calls (tools.ToolSpec.check)
    capped_max_tokens: Optional[int] = None  # the limit asked for was more than the context's room: this

    @property
    def clock(self) -> dict:
        """perf_counter times of the request: t0 (its body read), queued, started (app.py)."""
        if "_clock" not in self.__dict__:
            self._clock = {}
        return self._clock

    def whole(self, text: str, stats, reason: str, tool_calls=()) -> dict:
        raise NotImplementedError

    def opening(self) -> list:
        return []

    def keepalive(self) -> list:
        """What a quiet stream sends to show it is alive (app.KEEPALIVE_SECONDS)."""
        return [{"comment": "keep-alive"}]

    def text(self, piece: str) -> list:
        raise NotImplementedError

    def closing(self, stats, reason: str, tool_calls) -> list:
        raise NotImplementedError

    def failure(self, err: ApiError) -> list:
        raise NotImplementedError

    def _extension(self, stats, reason: str) -> dict:
        out = speculation(stats, reason)
        if self.dropped_messages:
            out["dropped_messages"] = self.dropped_messages
        if self.call_errors:  # calls whose arguments break a schema the grammar could not hold in full
            out["tool_call_errors"] = self.call_errors
        if self.capped_max_tokens is not None:  # the answer's limit, cut to the room left in the context
            out["max_tokens_capped_to"] = self.capped_max_tokens
        c = self.clock
        if {"t0", "queued", "started"} <= c.keys():
            # where the request's time went at the server: checking, templating and tokenizing it
            # (and compiling its constraint), waiting for a place, and in all until this answer
            out["server_seconds"] = {"prepare": round(c["queued"] - c["t0"], 4),
                                     "queue": round(c["started"] - c["queued"], 4),
                                     "total": round(time.perf_counter() - c["t0"], 4)}
        return out


# -- a body that fails its model, in words ------------------------------------------------------------
# what pydantic's error types and union branches (its tags: 'str', 'dict[any,any]', 'list[str]') expect
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "true or false", "dict_type": "an object", "list_type": "a list", "model_type": "an object"}
_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "none": "null",
          "dict": "an object", "list": "a list"}
_PLURALS = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans", "dict": "objects",
            "list": "lists"}


def _is_branch(part) -> bool:
    """Whether a part of an error's location is a union branch's tag rather than a field or an index."""
    return isinstance(part, str) and (part in _KINDS or re.match(r"[a-z][a-z-]*\[", part) is not None)


def _branch_words(tag: str) -> str:
    base, _, inner = tag.partition("[")
    if base == "list" and inner:
        plural = _PLURALS.get(inner.partition("[")[0].rstrip("]"))
        return f"a list of {plural}" if plural else "a list"
    return _KINDS.get(base, "another value")


def _shown(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _either(words: list) -> str:
    words = list(dict.fromkeys(words))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def describe_errors(errors: list) -> tuple[str, Optional[str]]:
    """The first of pydantic's errors as one line for a person, and the body field it names:
    "format: must be a string or an object, got 5" (every branch of a union the value may take),
    "max_tokens: must be an integer, got \"5\"", "messages: is required"."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    cut = next((i for i, p in enumerate(loc) if _is_branch(p)), None)
    if cut is not None:  # a value none of a union's branches took: say what each would take
        field, words, value, known = loc[:cut], [], None, False
        for e in errors:
            at = [p for p in e.get("loc", ()) if p != "body"]
            if at[:cut] == field and len(at) > cut and _is_branch(at[cut]):
                words.append(_branch_words(at[cut]))
                if len(at) == cut + 1 and not known:
                    value, known = e.get("input"), True
        where = ".".join(str(p) for p in field)
        said = f"must be {_either(words)}" + (f", got {_shown(value)}" if known else "")
        return (f"{where}: {said}" if where else f"the request body {said}"), (str(field[0]) if field else None)
    where = ".".join(str(p) for p in loc)
    kind = first.get("type")
    if kind in _EXPECTED:
        said = f"must be {_EXPECTED[kind]}, got {_shown(first.get('input'))}"
    elif kind == "missing":
        said = "is required"
    else:
        said = str(first.get("msg", "invalid value"))
    return (f"{where}: {said}" if where else f"the request body {said}"), (str(loc[0]) if loc else None)


# -- serve --record -------------------------------------------------------------------------------
class Recorder:
    """serve --record FILE: every request body the API reads, one JSON line each
    ({"time", "path", "body"}; a session to replay with `bench --kinds agent`). The file is its
    owner's alone (0600, as the prompt cache's files): it holds the prompts. A body is written as
    it was sent, after the route's check, and never parsed here (its line breaks, which JSON
    only has between tokens, dropped). A failure to write is logged; the request is answered
    all the same."""

    _FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
              | getattr(os, "O_CLOEXEC", 0))  # O_NONBLOCK: a FIFO without a reader is an error, not a hang

    def __init__(self, path):
        self.path = os.fspath(path)
        self.failing = False

    def check(self) -> None:
        """Open the file as a recording does (created 0600 if missing): OSError when it cannot be written."""
        os.close(self._open())

    def _open(self) -> int:
        fd = os.open(self.path, self._FLAGS, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(0, "not a regular file")
            if st.st_mode & 0o077 and hasattr(os, "fchmod") and st.st_uid == os.geteuid():
                os.fchmod(fd, 0o600)  # a file an older version wrote, open to others: it holds prompts
        except BaseException:
            os.close(fd)
            raise
        return fd

    def add(self, route: str, raw: bytes) -> None:
        body = (raw or b"{}").strip().replace(b"\r", b"").replace(b"\n", b"")
        line = b'{"time": %s, "path": %s, "body": %s}\n' % (
            json.dumps(round(time.time(), 3)).encode(), json.dumps(route).encode(), body)
        try:
            fd = self._open()
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except Exception as exc:  # a full disk, a removed folder: the request goes on unrecorded
            if not self.failing:
                log.warning("--record %s: cannot write (%s); requests are answered but not recorded until it can",
                            self.path, getattr(exc, "strerror", None) or exc)
            self.failing = True
            return
        if self.failing:
            log.warning("--record %s: recording again", self.path)
            self.failing = False


def parse_body(request, model: type[BaseModel], raw: bytes) -> Any:
    """`raw` checked as `model` (RequestValidationError otherwise, as FastAPI raises it), then
    recorded when the server records (serve --record): after the check, so that a body the parser
    refuses (JSON nested deeper than it follows) gets the same 400 with or without recording. A
    body that is no JSON is not recorded; one of the wrong shape is (what a client sent)."""
    recorder = getattr(request.app.state, "record", None)
    try:
        body = model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if recorder is not None and not any(e.get("type") == "json_invalid" for e in errors):
            recorder.add(request.url.path, raw)
        raise RequestValidationError(errors) from None
    if recorder is not None:
        recorder.add(request.url.path, raw)
    return body
