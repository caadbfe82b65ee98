"""OpenAI's Responses API (`POST /v1/responses`), the subset agents use without server state.

As anthropic.py, the body is translated into the chat request this server already answers:
`instructions` becomes the system message, `input` (a string, or items: messages,
`function_call`, `function_call_output`) the conversation, `tools` of type function the
functions, `text.format` (json_schema, json_object) the constraint, `max_output_tokens` the
limit, `truncation: "auto"` drops the oldest turns when the context is full. The answer comes
back as `output` items (a message with `output_text`, `function_call`s) and `output_text`, or
streamed as the Responses events (response.created ... response.completed).

Nothing is stored: `previous_response_id` and `conversation` are refused with a 400 that says
to send the whole conversation in `input`; `store` is accepted and keeps nothing.
"""
from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Optional, Union

from pydantic import ConfigDict, PrivateAttr

from .openai import ChatRequest
from .schemas import ApiError, Shape as _Shape, _Body, check_extra_fields, timings

log = logging.getLogger("edgespec.server")

IGNORED = frozenset({"metadata", "user", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "reasoning", "include", "stream_options", "top_logprobs", "background", "prompt_cache_retention",
                     "client_metadata"})
# input items that are an earlier answer's reasoning or the record of a server-run tool: not part of
# what the model reads back
PASSED_ITEMS = frozenset({"reasoning", "web_search_call", "file_search_call", "image_generation_call",
                          "code_interpreter_call", "mcp_list_tools", "compaction"})
NEUTRAL = {"background": lambda v: not v, "top_logprobs": lambda v: not v}
WORDS = ((".function.parameters", ".parameters"), ("max_tokens", "max_output_tokens"),
         ("response_format", "text.format"))
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
          "tools": "tools", "tool_choice": "tool_choice"}


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    input: Any = None                # a string or items (checked in _messages: errors name the field)
    instructions: Optional[str] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = None
    truncation: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Union[str, dict, None] = None
    _functions: Optional[list] = PrivateAttr(default=None)
    _flat: dict = PrivateAttr(default_factory=dict)

    def _check_extra(self) -> None:
        check_extra_fields(self.model_extra, IGNORED, NEUTRAL)
        if self.previous_response_id is not None or self.conversation is not None:
            field = "previous_response_id" if self.previous_response_id is not None else "conversation"
            raise ApiError(400, f"{field}: this server keeps no responses or conversations; send the whole "
                           "conversation in input", param=field)
        if self.truncation not in (None, "disabled", "auto"):
            raise ApiError(400, f"truncation must be 'disabled' or 'auto', got {self.truncation!r}",
                           param="truncation")

    def chat(self) -> ChatRequest:
        """The chat request this body asks for (ApiError 400 naming what is wrong)."""
        self._check_extra()
        body = {"messages": self._messages(), "stream": bool(self.stream)}
        for ours, theirs in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                             ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls)):
            if theirs is not None:
                body[ours] = theirs
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ApiError(400, f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                           param="max_output_tokens")
        tools = self.functions()
        if tools:
            body["tools"] = tools
        if self.tool_choice is not None and (tools or self.tool_choice not in ("auto", "none")):
            body["tool_choice"] = _choice(self.tool_choice, self.flat_name)
        fmt = _format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        return ChatRequest.model_validate(body)

    def functions(self) -> list[dict]:
        """The functions of `tools` as the chat request takes them: a `namespace` tool's functions
        flattened (named as before, or `namespace.name` where two would share a name; the answer
        names them back as `namespace` and `name`); tools this server cannot run (hosted tools:
        web_search, file_search, mcp...; `custom` and `local_shell`, whose calls are no JSON
        function calls) passed over."""
        if self._functions is not None:
            return self._functions
        found: list[tuple[Optional[str], dict, str]] = []
        offered = [(f"tools.{i}", t) for i, t in enumerate(self.tools or ())]
        # Codex also offers tools inside the input, in an `additional_tools` item: the same as these
        for k, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                if not isinstance(item.get("tools"), list):
                    raise ApiError(400, f"input.{k}: an additional_tools item holds a list of 'tools'", param="input")
                offered += [(f"input.{k}.tools.{j}", t) for j, t in enumerate(item["tools"])]
        for where, t in offered:
            param = where.split(".")[0]
            if not isinstance(t, dict):
                raise ApiError(400, f"{where}: a tool is an object with a 'type'", param=param)
            if t.get("type") == "function":
                found.append((None, t, where))
            elif t.get("type") == "namespace":
                if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                    raise ApiError(400, f"{where}: a namespace tool has a 'name' and a list of 'tools'", param=param)
                for j, sub in enumerate(t["tools"]):
                    if isinstance(sub, dict) and sub.get("type") == "function":
                        found.append((t["name"], sub, f"{where}.tools.{j}"))
            else:
                log.debug("%s: tool type %r is not run here: passed over", where, t.get("type"))
        names = [t.get("name") for _, t, _ in found]
        self._flat = {}  # the model's name -> (namespace, name) as the client named it
        out = []
        for (ns, t, where), name in zip(found, names):
            flat = f"{ns}.{name}" if ns is not None and names.count(name) > 1 else name
            if isinstance(name, str):
                self._flat[flat] = (ns, name)
            out.append(_tool(where, t, flat))
        self._functions = out
        return out

    def flat_name(self, namespace: Optional[str], name: str) -> str:
        """The model's name of a function the client names `name` in `namespace` (call_name's inverse)."""
        return next((flat for flat, ns_name in self._flat.items() if ns_name == (namespace, name)), name)

    def call_name(self, flat: str) -> tuple[Optional[str], str]:
        """(namespace, name) of a function as the client named it."""
        self.functions()
        return self._flat.get(flat, (None, flat))

    def _messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if not isinstance(self.input, (str, list)):
            raise ApiError(400, f"input: must be a string or a list of items, got {type(self.input).__name__}",
                           param="input")
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        self.functions()
        call_ids: set[str] = set()
        if not items:
            raise ApiError(400, "input: give the prompt as a string or a non-empty list of items", param="input")
        for i, item in enumerate(items):
            where = f"input.{i}"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ApiError(400, f"{where}.role: must be user, system, developer or assistant, got {role!r}",
                                   param="input")
                role = "system" if role == "developer" else role
                text = _content(item.get("content"), f"{where}.content")
                if role == "system" and out and all(m["role"] == "system" for m in out):
                    out[-1]["content"] += "\n\n" + text  # instructions and developer items: one system turn
                else:
                    out.append({"role": role, "content": text})
            elif kind == "function_call":
                name, cid, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
                if not (isinstance(name, str) and isinstance(cid, str) and isinstance(args, str)):
                    raise ApiError(400, f"{where}: a function_call item has string name, call_id and arguments",
                                   param="input")
                if cid in call_ids:
                    raise ApiError(400, f"{where}.call_id: {cid!r} is used by two function_call items; each "
                                   "call has its own call_id", param="input")
                call_ids.add(cid)
                ns = item.get("namespace")
                name = self.flat_name(ns if isinstance(ns, str) else None, name)
                call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # the same turn: its text and calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                cid, output = item.get("call_id"), item.get("output", "")
                if cid is None and isinstance(item.get("name"), str):
                    # an output no call asked for: Codex adds its goal's objective so (name
                    # "goal_objective", namespace "agent"), after the output of create_goal
                    out.append({"role": "system", "content": f"{item['name']}: {_content(output, f'{where}.output')}"})
                    continue
                if not isinstance(cid, str):
                    raise ApiError(400, f"{where}: a function_call_output item names its call in call_id",
                                   param="input")
                out.append({"role": "tool", "tool_call_id": cid, "content": _content(output, f"{where}.output")})
            elif kind in PASSED_ITEMS or kind == "additional_tools":  # its tools: functions()
                continue
            else:
                raise ApiError(400, f"{where}: items of type {kind!r} are not served here (message, function_call "
                               "and function_call_output are)", param="input")
        return out


def _content(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(400, f"{where}: must be text or a list of text parts", param="input")
    parts = []
    for j, p in enumerate(value):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif kind == "refusal":
            continue
        else:
            raise ApiError(400, f"{where}.{j}: a {kind!r} part is not served here; this server's models read text",
                           param="input")
    return "".join(parts)


def _tool(where: str, t: dict, name: str) -> dict:
    if not isinstance(t.get("name"), str):
        raise ApiError(400, f"{where}.name: a function tool has a string name", param="tools")
    fn = {"name": name, "description": t.get("description") or ""}
    if t.get("parameters") is not None:
        fn["parameters"] = t["parameters"]
    return {"type": "function", "function": fn}


def _choice(c, flat_name):
    if isinstance(c, str):
        return c
    if isinstance(c, dict) and c.get("type") == "function" and isinstance(c.get("name"), str):
        ns = c.get("namespace") if isinstance(c.get("namespace"), str) else None
        return {"type": "function", "function": {"name": flat_name(ns, c["name"])}}
    raise ApiError(400, "tool_choice must be auto, none, required or {'type': 'function', 'name': ...}",
                   param="tool_choice")


def _format(text: Optional[dict]) -> Optional[dict]:
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format: a json_schema format has {'name', 'schema': {...}}", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt["schema"]}}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                   param="text.format")


class Shape(_Shape):
    """An answer as the Responses API writes it: a response object with output items, or its
    events, each with a sequence number."""

    prompt_field = "input"

    def __init__(self, model: str, body: ResponsesRequest):
        self.id = "resp_" + secrets.token_hex(12)
        self.msg_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model, self.body = model, body
        self.seq = 0
        self.parts: list[str] = []   # streamed text so far
        self.message_open = False

    def _response(self, status: str, output: list, stats=None, reason: Optional[str] = None) -> dict:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
               "output": output, "parallel_tool_calls": bool(b.parallel_tool_calls),
               "previous_response_id": None, "reasoning": None, "store": False,
               "temperature": 1.0 if b.temperature is None else b.temperature,
               "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
               "tools": b.tools or [], "top_p": 1.0 if b.top_p is None else b.top_p,
               "truncation": b.truncation or "disabled", "metadata": {}, "usage": None}
        if stats is not None:
            out["output_text"] = "".join(p["text"] for item in output if item["type"] == "message"
                                         for p in item["content"] if p["type"] == "output_text")
            out["usage"] = {"input_tokens": stats.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": stats.reused_prompt_tokens,
                                                     "cache_write_tokens": 0},
                            "output_tokens": stats.generated, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": stats.prompt_tokens + stats.generated}
            out["timings"] = timings(stats)
            out["edgespec"] = self._extension(stats, reason)
        return out

    @staticmethod
    def _status(reason: str) -> str:
        return "incomplete" if reason in ("length", "context") else "completed"

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _call(self, c) -> dict:
        ns, name = self.body.call_name(c.name)
        item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": c.id, "name": name,
                "arguments": json.dumps(c.arguments, ensure_ascii=False), "status": "completed"}
        if ns is not None:
            item["namespace"] = ns
        return item

    def whole(self, text: str, stats, reason: str, tool_calls=()) -> dict:
        status = self._status(reason)
        output = [self._message(text, status)] if text or not tool_calls else []
        output += [self._call(c) for c in tool_calls]
        return self._response(status, output, stats, reason)

    # -- the event stream -------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return {"event": kind, "data": json.dumps(data, separators=(",", ":"), ensure_ascii=False)}

    def opening(self) -> list:
        head = self._response("in_progress", [])
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def keepalive(self) -> list:
        return [self._event("response.in_progress", response=self._response("in_progress", []))]

    def _open_message(self) -> list:
        self.message_open = True
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def text(self, piece: str) -> list:
        out = [] if self.message_open else self._open_message()
        self.parts.append(piece)
        return out + [self._event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                  content_index=0, delta=piece, logprobs=[])]

    def closing(self, stats, reason: str, tool_calls) -> list:
        out, output = [], []
        status = self._status(reason)
        if not self.message_open and not tool_calls:
            out += self._open_message()
        if self.message_open:
            text = "".join(self.parts)
            if tool_calls:
                text = text.strip()  # as the whole answer has it
            message = self._message(text, status)
            out += [self._event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                                text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                                part=message["content"][0]),
                    self._event("response.output_item.done", output_index=0, item=message)]
            output.append(message)
        for c in tool_calls:
            item = self._call(c)
            i = len(output)
            out += [self._event("response.output_item.added", output_index=i,
                                item=dict(item, arguments="", status="in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=i, item=item)]
            output.append(item)
        # response.completed also when the limit cut the answer (its status says "incomplete"), as vLLM
        # does: the openai client's stream helpers wait for that event (OpenAI sends response.incomplete)
        return out + [self._event("response.completed", response=self._response(status, output, stats, reason))]

    def failure(self, err: ApiError) -> list:
        # the openai client raises an `error` event that carries an "error" object
        return [self._event("error", code=err.code, message=err.message, param=err.param,
                            error={"type": err.type, "code": err.code, "message": err.message, "param": err.param})]
