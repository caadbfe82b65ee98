"""OpenAI's side of the server: the chat and text completion bodies (ChatRequest, the request every
other API is translated into, and CompletionRequest) and how their answers are written (Envelope).

Range checks are the engine's own (one source of truth), run here so that a bad request never
waits in the queue.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional, Union

from pydantic import ConfigDict

from ..chat import ROLES
from ..constraints import json_object_schema
from ..errors import UsageError
from ..request import Request, check_seed
from ..sampling import SamplingParams
from ..tools import ToolSpec
from .schemas import ApiError, Shape, _Body, check_extra_fields, dumps, timings


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


class _Generation(_Body):
    model_config = ConfigDict(extra="allow", strict=True)  # extras are checked: check_extra_fields

    model: Optional[str] = None  # one model is served, whatever the client names
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None      # not OpenAI's, but llama.cpp's server and most local clients send them
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict] = None
    json_schema: Optional[dict] = None   # llama.cpp server's names for the same constraints
    grammar: Optional[str] = None

    def _limit(self) -> Optional[int]:
        return self.max_tokens

    def constraint(self) -> tuple[dict, Optional[str]]:
        """(Request.build's constraint option, the field it came from)."""
        # given means present: an empty schema ({}: any JSON) or grammar ("": refused) is not absent
        given = [(name, v) for name, v in (("response_format", self._response_format()), ("json_schema",
                 None if self.json_schema is None else {"json_schema": self.json_schema}), ("grammar",
                 None if self.grammar is None else {"grammar": self.grammar})) if v is not None]
        if len(given) > 1:
            raise ApiError(400, f"give one of {' and '.join(n for n, _ in given)}, not both", param=given[1][0])
        return (given[0][1], given[0][0]) if given else ({}, None)

    def _response_format(self) -> Optional[dict]:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":  # llama.cpp's server also takes a schema here
            schema = rf.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise ApiError(400, "response_format schema must be a JSON Schema object",
                               param="response_format.schema")
            return {"json_schema": schema if schema is not None else json_object_schema()}
        if kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format json_schema needs {\"name\", \"schema\": {...}}",
                               param="response_format.json_schema.schema")
            return {"json_schema": schema}
        raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format.type")

    def engine_request(self, n_ctx: int) -> Request:
        """The engine's Request for this body, checked (ApiError 400 naming the field)."""
        check_extra_fields(self.model_extra)
        if self.n not in (None, 1):
            raise ApiError(400, "this server returns one choice per request: n must be 1", param="n")
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
        # OpenAI's defaults: temperature 1, top_p 1 (a client that wants greedy says 0)
        sampling = dict(temperature=1.0 if self.temperature is None else self.temperature,
                        top_p=1.0 if self.top_p is None else self.top_p,
                        top_k=self.top_k or 0, min_p=self.min_p or 0.0)
        for name, value in sampling.items():  # one at a time, so that the error names its field
            try:
                SamplingParams(**{name: value})
            except UsageError as exc:
                raise ApiError(400, str(exc), param=name) from None
        try:
            check_seed(self.seed)
        except UsageError as exc:
            raise ApiError(400, str(exc), param="seed") from None
        limit = self._limit()
        if limit is not None and limit < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {limit}", param=self._limit_name())
        constraint, field = self.constraint()
        tools = self.tool_options() if hasattr(self, "tool_options") else {}
        if tools.get("tools") and constraint:
            raise ApiError(400, f"give tools or {field}, not both", param=field)
        if tools.get("tools") or tools.get("tool_choice") not in (None, "none", "auto"):
            try:  # built here, once, so that an error names its field
                tools = {"tools": ToolSpec.build(**tools)}
            except UsageError as exc:
                raise ApiError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None
        try:
            # no limit: until the end of the answer or of the context, as OpenAI does
            return Request.build(**sampling, max_tokens=n_ctx if limit is None else limit, seed=self.seed,
                                 stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                                 **constraint, **tools)
        except UsageError as exc:  # a schema or grammar llguidance refuses, a bad stop string
            raise ApiError(400, str(exc), param=field or "stop") from None

    def _limit_name(self) -> str:
        return "max_tokens"

    def requested_tokens(self) -> Optional[int]:
        """The answer's length limit when the client set one (the room the prompt must leave)."""
        return self._limit()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[dict]] = None   # an assistant turn's calls
    tool_call_id: Optional[str] = None        # a tool turn: the call it answers


class ChatRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None  # the newer name of max_tokens
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None

    def tool_options(self) -> dict:
        return dict(tools=self.tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls)

    def _limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def engine_messages(self) -> list[dict]:
        """[{'role', 'content'}] for the chat template: text parts joined, the 'developer' role
        (OpenAI's new name for system) renamed for templates that only know 'system'."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                parts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise ApiError(400, f"message {i} has a {part.type!r} part; this server's model reads "
                                       "text only", param=f"messages.{i}.content")
                    parts.append(part.text)
                content = "".join(parts)
            else:
                content = m.content or ""  # assistant turns that held only tool calls
            role = "system" if m.role == "developer" else m.role
            if role not in ROLES:
                shown = repr(m.role) if len(m.role) <= 40 else repr(m.role[:40]) + "..."
                raise ApiError(400, f"message {i} has role {shown}; a role is one of {', '.join(ROLES)} "
                               "(or developer)", param=f"messages.{i}.role")
            msg = {"role": role, "content": content}
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class CompletionRequest(_Generation):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def engine_prompt(self) -> Union[str, list[int]]:
        """The one prompt, as text or token ids."""
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1", param="best_of")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "this server takes one prompt per request", param="prompt")
            p = p[0]
        if not p:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return p


# -- responses ----------------------------------------------------------------------------------


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "tool_calls": "tool_calls"}


def finish_reason(reason: str) -> str:
    """The engine's reason in OpenAI's words: the context filling up is a length limit too."""
    return FINISH.get(reason, "stop")


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
            "total_tokens": stats.prompt_tokens + stats.generated,
            # OpenAI's field for a prompt prefix served from cache: here, the reused KV cache
            "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens}}


class Envelope(Shape):
    """OpenAI's chat and text completions: id, object, created and model, shared by every chunk
    of one response."""

    def __init__(self, kind: str, model: str, include_usage: bool = False):
        self.chat = kind == "chat"
        self.include_usage = include_usage
        self.prompt_field = "messages" if self.chat else "prompt"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _head(self, streamed: bool) -> dict:
        obj = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, stats, reason: str, tool_calls=()) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message.update(content=text or None, tool_calls=[c.openai() for c in tool_calls])
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason(reason))
        return {**self._head(False), "choices": [choice], "usage": usage(stats),
                "timings": timings(stats), "edgespec": self._extension(stats, reason)}

    # -- as a stream: data-only events, ended by [DONE] --------------------------------------------
    def opening(self) -> list:
        return [dumps(self.chunk("", role=True))] if self.chat else []  # OpenAI's chat streams open with the role

    def text(self, piece: str) -> list:
        return [dumps(self.chunk(piece))]

    def closing(self, stats, reason: str, tool_calls) -> list:
        out = [dumps(c) for c in self.tool_call_chunks(tool_calls)] + [dumps(self.last(stats, reason))]
        if self.include_usage:
            out.append(dumps(self.usage_chunk(stats)))
        return out + ["[DONE]"]

    def failure(self, err: ApiError) -> list:
        # after the headers an error can only travel in the stream; OpenAI's clients raise it
        return [dumps(err.body()), "[DONE]"]

    def chunk(self, text: Optional[str], *, role: bool = False, reason: Optional[str] = None) -> dict:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish_reason(reason) if reason else None)
        return {**self._head(True), "choices": [choice]}

    def last(self, stats, reason: str) -> dict:
        out = self.chunk(None if self.chat else "", reason=reason)
        out["timings"] = timings(stats)
        out["edgespec"] = self._extension(stats, reason)
        return out

    def tool_call_chunks(self, tool_calls) -> list[dict]:
        """A call as OpenAI streams it: its id and name first, then its arguments."""
        out = []
        for i, c in enumerate(tool_calls):
            full = c.openai()
            head = {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            out.append(self._delta({"tool_calls": [head]}))
            args = {"index": i, "function": {"arguments": full["function"]["arguments"]}}
            out.append(self._delta({"tool_calls": [args]}))
        return out

    def _delta(self, delta: dict) -> dict:
        return {**self._head(True), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

    def usage_chunk(self, stats) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(stats)}
