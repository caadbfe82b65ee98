"""Anthropic's Messages API (`POST /v1/messages`), as coding agents (Claude Code) speak it.

The body is translated into the OpenAI chat request this server already checks and answers
(openai.ChatRequest): `system` becomes the first message, `tool_use` blocks an assistant turn's
`tool_calls`, `tool_result` blocks `tool` turns, `tools[].input_schema` the functions'
parameters, `tool_choice` auto / any / tool / none -> auto / required / the function / none.
Tool calls therefore go through the same constrained machinery, in the model's own format. The
`output_config.format` (a JSON Schema) the constraint. The
answer is written back in Anthropic's shape (`Shape`): content blocks, `stop_reason`, `usage`
with the prompt cache's tokens as `cache_read_input_tokens`, and its event sequence when
streamed. Errors are in Anthropic's shape too (schemas.ApiError.anthropic_body).

Not served: images and documents (the models read text), server tools (web search...), a
prefilled assistant turn to continue. `thinking` and `output_config.effort` are accepted and
have no effect: these models answer without a thinking block, which its budget allows. The
sampling fields (temperature, top_p, top_k), which Anthropic's newest SDK no longer has, are
taken as llama-server takes them.
"""
from __future__ import annotations

import json
import secrets
import logging
from typing import Any, Optional

from pydantic import ConfigDict

from .openai import ChatRequest
from .schemas import ApiError, Shape as _Shape, _Body, check_extra_fields, timings

log = logging.getLogger("edgespec.server")

# Anthropic's fields that cannot change the answer here; any other unknown field is refused
IGNORED = frozenset({"metadata", "service_tier", "thinking", "anthropic_version", "container",
                     "context_management", "mcp_servers", "cache_control", "inference_geo", "speed", "diagnostics",
                     "user_profile_id", "workspace_id"})
# context_management (Claude Code sends it: clearing old thinking or tool results) is taken as
# "keep everything": the conversation as sent is what the model reads
NEUTRAL = {"container": lambda v: v is None, "mcp_servers": lambda v: not v}
# the translated request's field names -> this API's, for the errors
PARAMS = {"max_tokens": "max_tokens", "stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice",
          "messages": "messages", "response_format": "output_config"}
# ... and in the errors' text
WORDS = ((".function.parameters", ".input_schema"), ("response_format", "output_config.format"))
STOP_REASONS = {"eos": "end_turn", "stop": "end_turn", "length": "max_tokens",
                "context": "model_context_window_exceeded", "tool_calls": "tool_use"}


class MessagesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None      # one model is served, whatever the client names
    max_tokens: int                  # required, as Anthropic's API has it
    messages: list
    system: Any = None               # text, or text blocks (checked in _messages: errors name the field)
    tools: Optional[list] = None
    tool_choice: Optional[dict] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = None
    output_config: Optional[dict] = None  # {"format": {"type": "json_schema", "schema"}}, {"effort"} (no effect)

    def chat(self) -> ChatRequest:
        """The OpenAI chat request this body asks for (ApiError 400 naming what is wrong)."""
        check_extra_fields(self.model_extra, IGNORED, NEUTRAL)
        if self.max_tokens < 1:
            raise ApiError(400, f"max_tokens: must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise ApiError(400, f"temperature: must be in 0..1, got {self.temperature}", param="temperature")
        body = {"max_tokens": self.max_tokens, "messages": self._messages(), "stream": bool(self.stream),
                "temperature": 1.0 if self.temperature is None else self.temperature}
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        tools = [f for f in (_tool(i, t) for i, t in enumerate(self.tools or ())) if f is not None]
        if tools:
            body["tools"] = tools
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:  # structured output: the same constraint as OpenAI's json_schema
            if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
                raise ApiError(400, "output_config.format: must be {'type': 'json_schema', 'schema': {...}}",
                               param="output_config")
            schema = fmt["schema"]
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        # with every tool passed over, auto / none mean no call; any / tool stay (and are refused: no tools)
        if self.tool_choice is not None and (tools or self.tool_choice.get("type") not in ("auto", "none")):
            choice, parallel = _choice(self.tool_choice)
            if choice is not None:
                body["tool_choice"] = choice
            if parallel is not None:
                body["parallel_tool_calls"] = parallel
        return ChatRequest.model_validate(body)

    def _messages(self) -> list[dict]:
        out = []
        if self.system is not None and not isinstance(self.system, (str, list)):
            raise ApiError(400, f"system: must be a string or a list of text blocks, got {type(self.system).__name__}",
                           param="system")
        system = _without_billing(self.system)
        if system:
            out.append({"role": "system", "content": _text(system, "system")})
        if not self.messages:
            raise ApiError(400, "messages: at least one message is required", param="messages")
        seen_ids: set[str] = set()
        # the tool_use ids of the last assistant turn, which the next turn must answer (Anthropic's rule)
        pending, pending_at = [], ""
        for i, m in enumerate(self.messages):
            where = f"messages.{i}"
            # a system message inside the conversation (Claude Code's mid-conversation-system beta)
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
                role = m.get("role") if isinstance(m, dict) else None
                raise ApiError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}",
                               param=where)
            role, content = m["role"], m.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list):
                raise ApiError(400, f"{where}.content: must be a string or a list of content blocks", param=where)
            if not blocks and not (role == "assistant" and i == len(self.messages) - 1):
                raise ApiError(400, f"{where}.content: must not be empty (give at least one content block)",
                               param=where)
            if role == "system":
                out.append({"role": "system", "content": _text(blocks, f"{where}.content")})
                continue
            texts, calls, results = [], [], []
            for j, b in enumerate(blocks):
                at = f"{where}.content.{j}"
                if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                    raise ApiError(400, f"{at}: a content block is an object with a 'type' (text, tool_use, "
                                   "tool_result, ...)", param=where)
                kind = b["type"]
                if kind == "text":
                    if not isinstance(b.get("text"), str):
                        raise ApiError(400, f"{at}.text: must be a string, got {type(b.get('text')).__name__}",
                                       param=where)
                    texts.append(b["text"])
                elif kind == "tool_use" and role == "assistant":
                    call = _call(b, at)
                    if call["id"] in seen_ids:
                        raise ApiError(400, f"{at}.id: tool_use ids must be unique: {call['id']!r} is used twice",
                                       param=where)
                    seen_ids.add(call["id"])
                    calls.append(call)
                elif kind == "tool_result" and role == "user":
                    results.append(_result(b, at))
                elif kind in ("thinking", "redacted_thinking"):
                    continue  # an earlier answer's reasoning: not part of what the model reads back
                else:
                    raise ApiError(400, f"{at}: a {kind!r} block is not served here in a {role} turn; this "
                                   "server's models read text, tool_use (assistant) and tool_result (user) blocks",
                                   param=where)
            answered = {r["tool_call_id"] for r in results}
            missing = [cid for cid in pending if cid not in answered]
            if missing:
                raise ApiError(400, f"{pending_at}: tool_use ids were found without tool_result blocks immediately "
                               f"after: {', '.join(missing)}. Each tool_use block must have a corresponding "
                               "tool_result block in the next message", param=pending_at)
            pending, pending_at = [c["id"] for c in calls], where
            out.extend(results)
            text = "\n".join(texts)
            if role == "assistant":
                out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            elif texts or not results:
                out.append({"role": "user", "content": text})
        if self.messages[-1].get("role") == "assistant":
            raise ApiError(400, "messages: the last message is the assistant's; this server does not continue a "
                           "prefilled answer: end with a user message", param="messages")
        return out


class CountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens; the prompt's tokens."""
    max_tokens: int = 1


BILLING = "x-anthropic-billing-header:"


def _without_billing(system):
    """`system` without Claude Code's billing header: a first text block `x-anthropic-billing-header:
    cc_version=2.1.197.3bb; cc_entrypoint=...;` that Anthropic's API reads as metadata. Its version
    suffix changes from one session to the next, and at the head of the prompt it would make every
    new session's prompt differ from the first token: the prompt cache could keep nothing of an
    earlier session's 20,000-token prefix. (llama-server, which keeps the block, only masks its
    `cch=` field.)"""
    if isinstance(system, list) and system and isinstance(system[0], dict) and system[0].get("type") == "text" \
            and isinstance(system[0].get("text"), str) and system[0]["text"].startswith(BILLING) \
            and "\n" not in system[0]["text"].strip():
        return system[1:]
    return system


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    parts = []
    for j, b in enumerate(value if isinstance(value, list) else [value]):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            raise ApiError(400, f"{where}.{j}: only text blocks are served here", param=where)
        parts.append(b["text"])
    return "\n".join(parts)


def _call(b: dict, where: str) -> dict:
    name, cid, args = b.get("name"), b.get("id"), b.get("input", {})
    if not isinstance(name, str) or not isinstance(cid, str) or not isinstance(args, dict):
        raise ApiError(400, f"{where}: a tool_use block has a string id and name and an object input",
                       param=where.rsplit(".content", 1)[0])
    arguments = json.dumps(args, ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _result(b: dict, where: str) -> dict:
    cid, content = b.get("tool_use_id"), b.get("content", "")
    if not isinstance(cid, str):
        raise ApiError(400, f"{where}: a tool_result block names the call it answers in tool_use_id",
                       param=where.rsplit(".content", 1)[0])
    if isinstance(content, list):  # references to tools found by tool search are no text to read back
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_reference")]
    text = _text(content, f"{where}.content") if content else ""
    if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
        raise ApiError(400, f"{where}.is_error: must be true or false, got {json.dumps(b['is_error'])[:60]}",
                       param=where.rsplit(".content", 1)[0])
    if b.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": cid, "content": text}


def _tool(i: int, t) -> Optional[dict]:
    """The function a client tool offers; None for a server tool (web_search_..., code_execution_...,
    mcp toolsets), which this server cannot run: it is passed over and the model never sees it."""
    if not isinstance(t, dict):
        raise ApiError(400, f"tools.{i}: a tool is an object {{'name', 'description', 'input_schema'}}",
                       param="tools")
    if t.get("type") not in (None, "custom"):
        log.debug("tools.%d: tool type %r is run by Anthropic's servers, not here: passed over", i, t.get("type"))
        return None
    if not isinstance(t.get("input_schema"), dict):
        raise ApiError(400, f"tools.{i}.input_schema: a JSON Schema object is required", param="tools")
    return {"type": "function", "function": {"name": t.get("name"), "description": t.get("description") or "",
                                             "parameters": t["input_schema"]}}


def _choice(c: dict) -> tuple[object, Optional[bool]]:
    kind = c.get("type")
    # one call unless the client allows more explicitly: small models otherwise repeat a call
    parallel = True if c.get("disable_parallel_tool_use") is False else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(c.get("name"), str):
            raise ApiError(400, "tool_choice: {'type': 'tool'} names the tool in 'name'", param="tool_choice")
        return {"type": "function", "function": {"name": c["name"]}}, None
    raise ApiError(400, f"tool_choice.type: must be auto, any, tool or none, got {kind!r}", param="tool_choice")


def _tool_id(call_id: str) -> str:
    return "toolu_" + (call_id[5:] if call_id.startswith("call_") else call_id)


class Shape(_Shape):
    """An answer as Anthropic writes it: a message with content blocks, or its event stream
    (message_start, content_block_start / delta / stop, message_delta, message_stop)."""

    def __init__(self, model: str, body: MessagesRequest, prompt_tokens: int):
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.index = 0              # the next content block's index
        self.text_open = False

    def usage(self, stats) -> dict:
        # Anthropic counts the prompt tokens read from a cache apart from the input tokens
        return {"input_tokens": max(0, stats.prompt_tokens - stats.reused_prompt_tokens),
                "output_tokens": stats.generated, "cache_read_input_tokens": stats.reused_prompt_tokens,
                "cache_creation_input_tokens": 0}

    def _stop(self, stats, reason: str) -> tuple[str, Optional[str]]:
        if reason == "stop" and stats.stop_sequence:
            return "stop_sequence", stats.stop_sequence
        return STOP_REASONS.get(reason, "end_turn"), None

    def whole(self, text: str, stats, reason: str, tool_calls=()) -> dict:
        content = [{"type": "text", "text": text}] if text or not tool_calls else []
        content += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": c.arguments}
                    for c in tool_calls]
        stop_reason, stop_sequence = self._stop(stats, reason)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self.usage(stats),
                "timings": timings(stats), "edgespec": self._extension(stats, reason)}

    # -- the event stream -------------------------------------------------------------------------
    @staticmethod
    def _event(data: dict) -> dict:
        return {"event": data["type"], "data": json.dumps(data, separators=(",", ":"), ensure_ascii=False)}

    def opening(self) -> list:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [self._event({"type": "message_start", "message": message}), self._event({"type": "ping"})]

    def keepalive(self) -> list:
        # an empty text delta, in a text block opened for it: Anthropic's SDKs drop `ping` events
        # before their readers see them, and Claude Code's stream watchdog (300 s without an event)
        # would give up on a long prompt and resend it unstreamed. An empty text block is one
        # clients skip (Claude Code does), also before a tool_use block
        out = [] if self.text_open else self._open_text()
        return out + [self._event({"type": "content_block_delta", "index": self.index,
                                   "delta": {"type": "text_delta", "text": ""}})]

    def _open_text(self) -> list:
        self.text_open = True
        return [self._event({"type": "content_block_start", "index": self.index,
                             "content_block": {"type": "text", "text": ""}})]

    def _close_block(self) -> list:
        out = [self._event({"type": "content_block_stop", "index": self.index})]
        self.index += 1
        return out

    def text(self, piece: str) -> list:
        out = [] if self.text_open else self._open_text()
        return out + [self._event({"type": "content_block_delta", "index": self.index,
                                   "delta": {"type": "text_delta", "text": piece}})]

    def closing(self, stats, reason: str, tool_calls) -> list:
        out = []
        if not self.text_open and not tool_calls:  # an empty answer is still one (empty) text block
            out += self._open_text()
        if self.text_open:
            out += self._close_block()
            self.text_open = False
        for c in tool_calls:
            out.append(self._event({"type": "content_block_start", "index": self.index, "content_block": {
                "type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": {}}}))
            out.append(self._event({"type": "content_block_delta", "index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}}))
            out += self._close_block()
        stop_reason, stop_sequence = self._stop(stats, reason)
        out.append(self._event({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                   "stop_sequence": stop_sequence},
                                "usage": self.usage(stats), "timings": timings(stats),
                                "edgespec": self._extension(stats, reason)}))
        out.append(self._event({"type": "message_stop"}))
        return out

    def failure(self, err: ApiError) -> list:
        return [self._event(err.anthropic_body())]

