"""What every API of the server shares: `ApiError` (a refusal, written in each API's shape), the
strict pydantic base of the bodies, the rule for fields a server does not implement
(`check_extra_fields`), llama-server's `timings` and the `edgespec` extension field, and `Shape`
(how one API writes an answer, whole or streamed). OpenAI's bodies and answers are openai.py's,
Anthropic's anthropic.py's, the Responses API's responses.py's, Ollama's ollama.py's.

Bodies are pydantic models in strict mode (JSON `true` is not a max_tokens of 1, `"5"` is not
5). Fields that cannot change the answer (user, store, metadata...) are ignored; every other
field this server does not implement (logit_bias, n > 1, logprobs, echo, suffix, a field from a
later API) is refused with a 400 naming it unless it holds its neutral value
(`check_extra_fields`), never silently dropped.
"""
from __future__ import annotations

import time
from typing import Optional

from pydantic import BaseModel, ConfigDict



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
    import json
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
