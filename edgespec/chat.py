"""Chat templates: the GGUF's own `tokenizer.chat_template`, rendered by Jinja in a sandbox."""
from __future__ import annotations

import re
import secrets
from functools import lru_cache

from .errors import UsageError

# Used only when a GGUF carries no template: ChatML, which most small instruct models follow.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)


def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """`tojson` as chat templates were written and trained for (Hugging Face's apply_chat_template,
    llama.cpp's minja): keys in their order, text as it is. Jinja's own filter sorts keys and writes
    <, >, & and ' as \\u escapes, for HTML: a tool's schema and a call's arguments would reach the
    model in a form it never saw (and differ from what llama-server renders)."""
    import json
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# The roles chat templates are written for. Any other role text would reach the template (and
# the tokenizer) verbatim: "user<|im_end|>..." could open a turn of its own.
ROLES = ("system", "user", "assistant", "tool")


class Checked(list):
    """Messages validate_messages has already checked (its copies): checking them again is a
    no-op, so a request's messages are checked once however many steps render them."""


def validate_messages(messages) -> list[dict]:
    """Checked copies: string role and content (an assistant turn that only calls tools may have
    none), a known role, and `tool` turns that answer a call made before them."""
    if isinstance(messages, Checked):
        return messages
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UsageError("messages must be a non-empty list of {'role', 'content'} dicts")
    out, calls = [], set()
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") is None:
            m = dict(m, content="")
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"message {i} must be a dict with string 'role' and 'content', got {_short(m)}")
        if m["role"] not in ROLES:
            raise UsageError(f"message {i} has role {_short(m['role'])}; a role is one of {', '.join(ROLES)}")
        if m.get("tool_calls"):
            if m["role"] != "assistant" or not isinstance(m["tool_calls"], (list, tuple)):
                raise UsageError(f"message {i}: only assistant turns carry tool_calls (a list)")
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise UsageError(f"message {i}: each tool call is {{'id', 'type': 'function', "
                                     "'function': {'name', 'arguments'}}")
                calls.add(c.get("id"))
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if cid not in calls:
                raise UsageError(f"message {i} is a tool result for call {cid!r}, which no earlier assistant turn "
                                 "made: give the tool_call_id of the call it answers")
        out.append(dict(m))
    return Checked(out)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def render(template: str | None, messages, *, bos_token: str = "", eos_token: str = "", **extra) -> str:
    """The prompt text for `messages`, ending where the assistant's answer starts; `extra`:
    more template variables (`tools`)."""
    messages = validate_messages(messages)
    try:
        try:
            return _compile(template or CHATML).render(messages=messages, add_generation_prompt=True,
                                                       bos_token=bos_token, eos_token=eos_token, **extra)
        except Exception:
            folded = fold_system(messages)
            if folded == messages:
                raise
            # a template that takes a system message only first (gemma's, Llama 2's raise on any
            # other): the later ones are read as part of the user turn they come beside
            return _compile(template or CHATML).render(messages=folded, add_generation_prompt=True,
                                                       bos_token=bos_token, eos_token=eos_token, **extra)
    except Exception as exc:  # a template is a program: any error in it is the template's
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"the model's chat template failed ({type(exc).__name__}: {what}); "
                         "use --raw to send the prompt as is") from None


def fold_system(messages: list[dict]) -> list[dict]:
    """`messages` with each system message after the first turn (agents send them mid-conversation)
    merged into the user turn after it (or before it, at the end), as text; consecutive user turns
    joined."""
    out: list[dict] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m["role"] == "system" and (i > 0 or out):
            pending.append(m["content"])
            continue
        if m["role"] == "user" and pending:
            m = dict(m, content="\n\n".join(pending + [m["content"]]))
            pending = []
        if m["role"] == "user" and out and out[-1]["role"] == "user" and not out[-1].get("tool_calls"):
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + m["content"])
            continue
        out.append(m)
    if pending:
        if out and out[-1]["role"] == "user":
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + "\n\n".join(pending))
        else:
            out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def render_segments(template: str | None, messages, **tokens) -> list[tuple[str, bool]]:
    """The rendered prompt cut into (text, is_message_content) pieces: each content is put in
    as a unique marker and the template's output is split at the markers."""
    messages = validate_messages(messages)
    nonce = secrets.token_hex(8)
    marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
    # an empty content stays empty (templates test it: an assistant turn that only calls tools)
    text = render(template, Checked(dict(m, content=mk if m["content"] else "") for m, mk in zip(messages, marks)),
                  **tokens)
    pieces: list[tuple[str, bool]] = []
    for part in re.split(f"(\x00{nonce}:\\d+\x00)", text):
        if part.startswith(f"\x00{nonce}:"):
            pieces.append((messages[int(part[len(nonce) + 2:-1])]["content"], True))
        elif part:
            pieces.append((part, False))
    return pieces
