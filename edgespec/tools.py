"""Tool calls: OpenAI's `tools` / `tool_choice`, in each model's own format, constrained.

A `ToolSpec` is the request's tools and choice, checked. A `Format` knows how one family of
chat templates writes calls (found from the template's text):
- `hermes`: Qwen2.5 and Hermes-style templates, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
- `generic`: templates without tool support (SmolLM2, gemma-3): the tools are described in a
  system message and the answer is one JSON object, either {"tool_call": {"name", "arguments"}}
  or {"content": "..."}.
Each format gives the grammar that constrains the answer (llguidance's Lark syntax, with the
call's JSON Schema inline), renders the conversation (assistant turns with `tool_calls`, `tool`
turns) and parses an answer back into text and calls, whole or as it streams.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, replace
from typing import Optional

from .errors import UsageError

log = logging.getLogger("edgespec.tools")

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")
# the separators templates' tojson writes (json.dumps's, chat.tojson), how calls were shown to the model in training
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    # how the grammar holds the arguments to `parameters`: "strict" (all of it), "lenient" (keywords
    # llguidance does not implement, e.g. propertyNames, are left out of the grammar) or "none" (the
    # schema does not compile at all: any JSON object). Arguments not held in full are checked
    # against `parameters` once generated (ToolSpec.check).
    enforced: str = "strict"

    def grammar_parameters(self) -> dict:
        return self.parameters if self.enforced != "none" else {"type": "object"}

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict
    error: Optional[str] = None  # the arguments break the tool's schema (one the grammar could not hold in full)
    free: bool = False           # written in free text (a bare or fenced call), not under the call grammar

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str = "auto"            # auto | none | required | function
    function: Optional[str] = None  # the one function when choice == "function"
    parallel: bool = False

    @classmethod
    def build(cls, tools, tool_choice=None, parallel_tool_calls=None) -> Optional["ToolSpec"]:
        """None when no tools are given (then tool_choice must be absent or "none"/"auto")."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise UsageError("tool_choice needs tools: give the functions in tools")
            return None
        if not isinstance(tools, (list, tuple)):
            raise UsageError("tools must be a list of {'type': 'function', 'function': {...}}")
        out, seen = [], set()
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise UsageError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise UsageError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
            if name in seen:
                raise UsageError(f"tools[{i}]: two functions are named {name!r}")
            seen.add(name)
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise UsageError(f"tools[{i}].function.parameters must be a JSON Schema object")
            enforced = _check_schema(params, f"tools[{i}].function.parameters")
            kind = params.get("type", "object")
            if kind != "object" and not (isinstance(kind, list) and "object" in kind):
                # a call's arguments are a JSON object (OpenAI's and Anthropic's rule): anything
                # else could not be sent back as `arguments` / `input`
                raise UsageError(f"tools[{i}].function.parameters must be a schema of type \"object\" (the "
                                 f"arguments are an object of named parameters), got type {kind!r}: wrap the "
                                 "value in a property, e.g. {\"type\": \"object\", \"properties\": {\"value\": ...}}")
            desc = fn.get("description") or ""
            if not isinstance(desc, str):
                raise UsageError(f"tools[{i}].function.description must be text")
            out.append(Tool(name, desc, params, enforced))
        choice, function = "auto", None
        if isinstance(tool_choice, dict):
            fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
            function = fn.get("name") if isinstance(fn, dict) else None
            if function is None:
                raise UsageError("tool_choice must be auto, none, required or "
                                 "{'type': 'function', 'function': {'name': ...}}")
            if function not in seen:
                raise UsageError(f"tool_choice names {function!r}, which is not in tools "
                                 f"({', '.join(sorted(seen))})")
            choice = "function"
        elif tool_choice is not None:
            if tool_choice not in CHOICES:
                raise UsageError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {tool_choice!r}")
            choice = tool_choice
        # one call unless asked for more, as llama.cpp's server does: small models otherwise repeat a call
        spec = cls(tuple(out), choice, function, parallel_tool_calls is True)
        try:  # what the grammar will be built from: a schema too deep for it is refused here, by name
            json.dumps(spec.call_schema())
        except RecursionError:
            raise UsageError("tools: a function's parameters nest too deeply (hundreds of levels): flatten "
                             "them, or use $defs and $ref for recursive structures") from None
        return spec

    @property
    def lenient(self) -> bool:
        """A tool's schema is not held in full by the grammar (it is compiled leniently)."""
        return any(t.enforced != "strict" for t in self.tools)

    def check(self, calls: list["ToolCall"]) -> list["ToolCall"]:
        """`calls`, each whose tool's schema the grammar did not hold in full (or that was written in
        free text) checked against it
        (jsonschema): a call that breaks it carries the first error in `error` (the client still
        gets the call: agents answer such a call with an error result, and the model retries)."""
        tools = {t.name: t for t in self.tools}
        out = []
        for c in calls:
            tool = tools.get(c.name)
            if tool is not None and (tool.enforced != "strict" or c.free):
                why = _schema_error(tool.parameters, c.arguments)
                if why is not None:
                    log.info("tool call %s: arguments break its schema: %s", c.name, why)
                    c = replace(c, error=why)
            out.append(c)
        return out

    def callable_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.function is None or t.name == self.function)

    def call_schema(self, args_key: str = "arguments") -> dict:
        """One call: {"name": one of the functions, args_key: valid against its parameters}. Each
        tool's $defs move to the root (renamed per tool), where its $refs still find them."""
        defs: dict = {}
        options = []
        for i, t in enumerate(self.callable_tools()):
            params = _hoist_defs(t.grammar_parameters(), f"t{i}_", defs)
            options.append({"type": "object", "properties": {"name": {"const": t.name}, args_key: params},
                            "required": ["name", args_key], "additionalProperties": False})
        out = options[0] if len(options) == 1 else {"anyOf": options}
        if defs:
            out = {**out, "$defs": defs}
        return out


def _hoist_defs(schema: dict, prefix: str, into: dict) -> dict:
    """`schema` without its own $defs / definitions, which go to `into` under `prefix`ed names;
    its local $refs rewritten to match (so it can sit anywhere inside a larger schema)."""
    local = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                local[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
    if not local:
        return schema

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (local.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items() if k not in ("$defs", "definitions") or node is not schema}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            into[f"{prefix}{name}"] = rewrite(sub)
    return rewrite(schema)


def _check_schema(schema: dict, where: str) -> str:
    """How the grammar can hold arguments to `schema` (Tool.enforced). A schema llguidance cannot
    compile is no reason to refuse the request: agents send dozens of tools, and one keyword in one
    of them (propertyNames) would cost the whole request. Its tool stays callable; its calls are
    checked after generation."""
    from .constraints import Constraint
    try:
        Constraint.build(json_schema=schema)
        return "strict"
    except UsageError as exc:
        first = str(exc)
    if "nests too deeply" in first:  # hundreds of levels: not a schema to generate under, or to check with
        raise UsageError(f"{where} is not a usable JSON Schema: {first}")
    invalid = _not_a_schema(schema)
    if invalid is not None:  # not JSON Schema at all: the client's mistake, said as such
        raise UsageError(f"{where} is not a usable JSON Schema: {invalid}")
    try:
        Constraint.build(json_schema={**schema, "x-guidance": {"lenient": True}})
        log.info("%s: compiled leniently (%s); its calls are checked after generation", where, first)
        return "lenient"
    except UsageError as exc:
        log.info("%s: not compiled (%s); any JSON object is generated, then checked", where, exc)
        return "none"


def _not_a_schema(schema: dict) -> Optional[str]:
    """What makes `schema` invalid against its JSON Schema metaschema (jsonschema), or None."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{where + ': ' if where else ''}{exc.message}"[:300]
    except (RecursionError, TypeError, ValueError):
        return None
    return None


def _schema_error(schema: dict, value) -> Optional[str]:
    """The first way `value` breaks `schema` (jsonschema), None if it holds or cannot be checked."""
    try:
        import jsonschema
    except ImportError:  # the server's extra brings it; a bare library install checks nothing
        log.warning("jsonschema is not installed: tool call arguments are not checked")
        return None
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        err = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    except (jsonschema.exceptions.SchemaError, RecursionError, TypeError, ValueError):
        return None  # not a schema jsonschema can apply either
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    return f"{where or 'arguments'}: {err.message}"[:300]


def _json_lark(schema: dict, lenient: bool = False) -> str:
    style = {**JSON_STYLE, "lenient": True} if lenient else JSON_STYLE
    return "%json " + json.dumps({**schema, "x-guidance": style})


# A call written without the template's markup, as Qwen2.5-Coder writes one it is not forced to
# make: once the answer has written its opening, the rest is constrained to one call of an offered
# function and the answer ends with it (a *lazy* grammar, as llama.cpp's server has for this
# model). The openings, as regexes that llguidance (Rust) and Python read alike:
# - LAZY_BARE: the answer opens with a JSON object whose first key is "name" (or "function", as the
#   1.5B also writes) and a string, or with one of the tags of LAZY_TAGS and then that object
#   (`<tools>{"name": ...}</tools>`: llama.cpp's list);
# - LAZY_FENCED: the same object in a ```json (or bare ```) block, opening the answer or at the
#   start of a later line (after a preamble: "I'll run this:"). Blocks in other languages never
#   open a call (a Python dict `{"name": ...}` stays code); a JSON block in prose whose first key
#   is "name" does (docs/structured-output.md#tools);
# - LAZY_DOUBLED: the object in doubled braces (`{{"name": ...}}}`), opening the answer or a later
#   line: a slip of the 1.5B's (3 answers in 12 at T = 1 to one of Codex's requests).
_WS = r"[ \t\r\n]*"
_HEAD_KEY = r'\{' + _WS + r'"(name|function)"' + _WS + ":" + _WS + '"'
LAZY_BARE = _WS + _HEAD_KEY
LAZY_DOUBLED = r"([ \t\r\n]*|(?s:.*\n)[ \t]*)\{" + _WS + _HEAD_KEY
LAZY_TAGS = ("tools", "function_call", "response", "json")
LAZY_FENCED = r"([ \t\r\n]*|(?s:.*\n)[ \t]*)```(json)?[ \t]*\n" + _WS + _HEAD_KEY
# Python's view of the same openings: where the call starts (the fence or the brace), first match
_OPENS = re.compile(_WS + r"(?:```(?:json)?[ \t]*\n" + _WS + r"|<(?:" + "|".join(LAZY_TAGS) + ")>" + _WS
                    + r"|\{" + _WS + r")?(?=" + _HEAD_KEY + ")")
_OPENS_LATER = re.compile(r"\n[ \t]*(?:```(?:json)?[ \t]*\n|\{)" + _WS + "(?=" + _HEAD_KEY + ")")


# After the opening the model keeps its own layout (a call opened over lines goes on over lines:
# held to one line, Qwen2.5-Coder ran a number on for a hundred digits where it meant to break the
# line), with at most a line break and indentation between tokens, bounded as llama.cpp bounds its
# JSON grammars' space: unbounded, a model that closed a string too early (Qwen2.5-Coder-1.5B writing
# a file through Claude Code's Write: `"low stock: "` inside the content) wrote spaces until
# max_tokens (32,000 from Claude Code) where the grammar allowed nothing else it wanted.
LAZY_SPACE = r"[ \t]{0,16}(\r?\n[ \t]{0,64})?"
_LAZY_RULES = (f"fenced: fenced_head lazy_fn /{LAZY_SPACE}```/\nfenced_head[lazy]: /{LAZY_FENCED}/\n"
               f"bare: bare_head lazy_fn\nbare_head[lazy]: /{LAZY_BARE}/\n"
               f"doubled: doubled_head lazy_fn /{LAZY_SPACE}\\}}/\ndoubled_head[lazy]: /{LAZY_DOUBLED}/\n"
               + "".join(f"tagged{i}: tagged{i}_head lazy_fn /{LAZY_SPACE}<\\/{tag}>/\n"
                         f"tagged{i}_head[lazy]: /{_WS}<{tag}>{LAZY_BARE}/\n" for i, tag in enumerate(LAZY_TAGS)))
_LAZY_START = " | ".join(["fenced", "bare", "doubled"] + [f"tagged{i}" for i in range(len(LAZY_TAGS))])


def _lazy_rules(spec: ToolSpec) -> str:
    """_LAZY_RULES and `lazy_fn`: what follows `{"name": "` in a call opened without markup, laid
    out as the model likes (LAZY_SPACE)."""
    options, rules = [], []
    for i, t in enumerate(spec.callable_tools()):
        options.append(f'"{t.name}\\"" /{LAZY_SPACE},{LAZY_SPACE}"arguments"{LAZY_SPACE}:{LAZY_SPACE}/ '
                       f"lazy_args{i} /{LAZY_SPACE}\\}}/")
        style = {"whitespace_flexible": True, "whitespace_pattern": LAZY_SPACE}
        if t.enforced == "lenient":
            style["lenient"] = True
        rules.append(f"lazy_args{i}: %json " + json.dumps({**t.grammar_parameters(), "x-guidance": style}))
    return _LAZY_RULES + "lazy_fn: " + " | ".join(options) + "\n" + "\n".join(rules) + "\n"


def lazy_call_grammar(spec: ToolSpec) -> str:
    """Free text, or one call of `spec`'s functions opened without markup (LAZY_*): Hermes' `auto`
    grammar without its <tool_call> branch, for a vocabulary that has no such token."""
    return f"start: TEXT? | {_LAZY_START}\nTEXT: /(?s:.+)/\n" + _lazy_rules(spec)


def _lazy_call(text: str, spec: ToolSpec) -> Optional[tuple[str, list[ToolCall]]]:
    """(text before it, [the call]) for an answer that opened a call without markup (LAZY_*), with
    no call when it was cut off; None when no such call was opened, or it names no offered tool
    (only a grammar-free answer can do that)."""
    m = _OPENS.match(text)
    if m is not None:
        at, brace = 0, m.end()
    else:
        later = _OPENS_LATER.search(text)
        if later is None:
            return None
        at, brace = later.start(), later.end()
    try:
        obj, _ = json.JSONDecoder().raw_decode(text, brace)
    except (json.JSONDecodeError, RecursionError):
        # cut off (length, a stop string): the call is lost, and none of its text is content
        return text[:at].rstrip(), []
    name = obj.get("name", obj.get("function")) if isinstance(obj, dict) else None
    if not (isinstance(name, str) and isinstance(obj.get("arguments", {}), dict)
            and name in {t.name for t in spec.tools}):
        return None
    # not held by the grammar in every answer this parses (ToolSpec.check looks at it)
    return text[:at].rstrip(), [ToolCall(new_call_id(), name, obj.get("arguments", {}), free=True)]


# -- formats ----------------------------------------------------------------------------------
class Format:
    name = "generic"

    def grammar(self, spec: ToolSpec) -> Optional[str]:
        raise NotImplementedError

    def render_messages(self, messages: list[dict], spec: Optional[ToolSpec]) -> tuple[list[dict], dict]:
        """(messages for the template, extra template variables)."""
        raise NotImplementedError

    def parse(self, text: str, spec: Optional[ToolSpec] = None) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


def _arguments(call: dict) -> dict:
    """OpenAI sends arguments as JSON text; templates (tojson) want the object it encodes."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise UsageError(f"the arguments of tool call {fn.get('name')!r} are not JSON: {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise UsageError(f"the arguments of tool call {fn.get('name')!r} must be a JSON object")
    return args


def _for_template(messages: list[dict], spec: Optional[ToolSpec]) -> tuple[list[dict], dict]:
    """For templates with tool support: calls with their arguments as objects, the tools offered."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                "function": {"name": c.get("function", c).get("name"), "arguments": _arguments(c)}}
                               for c in m["tool_calls"]]
        out.append(m)
    extra = {"tools": [t.openai() for t in spec.tools]} if spec is not None and spec.choice != "none" else {}
    return out, extra


class Hermes(Format):
    """<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>, the template renders tools."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

    def grammar(self, spec: ToolSpec) -> Optional[str]:
        call = f'tc: <tool_call> "\\n" call "\\n" </tool_call>\ncall: {_json_lark(spec.call_schema(), spec.lenient)}\n'
        calls = 'tc ("\\n" tc)*' if spec.parallel and spec.choice != "function" else "tc"
        if spec.choice in ("required", "function"):
            return f"start: {calls}\n" + call
        if spec.choice == "auto":  # free text, or calls once the model opens one, with markup or not
            return f"start: TEXT? | TEXT? {calls} | {_LAZY_START}\nTEXT: /(?s:.+)/\n" + _lazy_rules(spec) + call
        return None

    def render_messages(self, messages, spec):
        return _for_template(messages, spec)

    def parse(self, text: str, spec: Optional[ToolSpec] = None) -> tuple[str, list[ToolCall]]:
        calls = [c for c in map(_call, self.CALL.findall(text)) if c is not None]
        if calls:
            return self.CALL.sub("", text).strip(), calls
        if spec is not None and spec.choice != "none":
            found = _lazy_call(text, spec)  # opened without markup: constrained from there (LAZY_*)
            if found is not None:
                return found
            # the whole answer a call in another layout ("arguments" first): only when it names
            # one of the request's functions
            fenced = FENCED.fullmatch(text.strip())
            bare = _call(fenced.group(1) if fenced else text.strip())
            if bare is not None and bare.name in {t.name for t in spec.tools}:
                return "", [replace(bare, free=True)]  # no grammar held it: checked (ToolSpec.check)
        return text, []


# a call written as a fenced JSON block (Qwen2.5-Coder does that when a call is not forced)
FENCED = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.S)


def _opens_bare(head: str) -> Optional[bool]:
    """Whether an answer that begins with `head` may be a call without markup: "{", a fenced JSON
    block or a tag of LAZY_TAGS and "{"; None while "```", "<too" and what follows cannot tell yet."""
    if head.startswith("{"):
        return True
    for tag in LAZY_TAGS:
        opener = f"<{tag}>"
        if opener.startswith(head):
            return None
        if head.startswith(opener):
            body = head[len(opener):]
            return body.lstrip().startswith("{") if body.strip() else None
    if not head.startswith("```"):
        return False
    rest = head[3:]
    if "json".startswith(rest) or (rest.startswith("json") and not rest[4:].strip()) or not rest.strip():
        return None
    body = rest[4:] if rest.startswith("json") else rest
    return body.lstrip().startswith("{")


# The later openings (LAZY_FENCED, LAZY_DOUBLED) step by step: characters any number of times, or
# one of some literals (optional or not)
_KEY_STEPS = ((" \t\r\n", None, False), (None, ('"name"', '"function"'), False), (" \t\r\n", None, False),
              (None, (":",), False), (" \t\r\n", None, False), (None, ('"',), False))
_LATER_STEPS = (
    ((" \t", None, False), (None, ("```",), False), (None, ("json",), True), (" \t", None, False),
     (None, ("\n",), False), (" \t\r\n", None, False), (None, ("{",), False)) + _KEY_STEPS,
    ((" \t", None, False), (None, ("{",), False), (" \t\r\n", None, False), (None, ("{",), False)) + _KEY_STEPS)


def _later_opens(line: str) -> Optional[bool]:
    """Whether text from the start of a line opens a call (LAZY_FENCED's or LAZY_DOUBLED's later
    form): True, False, or None while it still may (it ends inside an opening: "```", "{{")."""
    states = [_walk(line, steps) for steps in _LATER_STEPS]
    return True if True in states else None if None in states else False


def _walk(line: str, steps) -> Optional[bool]:
    i = 0
    for chars, lits, optional in steps:
        if chars is not None:
            while i < len(line) and line[i] in chars:
                i += 1
            continue
        if i == len(line):
            return None
        if optional and not any(line[i] == lit[0] for lit in lits):
            continue
        got = [lit for lit in lits if line[i:i + len(lit)] == lit[:len(line) - i]]
        if not got:
            return False
        if not any(line[i:i + len(lit)] == lit for lit in got):
            return None  # the line ends inside the literal
        i += len(next(lit for lit in got if line[i:i + len(lit)] == lit))
    return True


def _call(raw: str) -> Optional[ToolCall]:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments", {}), dict):
        return ToolCall(new_call_id(), obj["name"], obj.get("arguments", {}))
    return None


class Generic(Format):
    """Templates without tool support: tools described in a system message, the answer one JSON
    object, {"tool_call": {"name", "arguments"}} or {"content": "..."}."""

    name = "generic"

    def _answer_schema(self, spec: ToolSpec) -> dict:
        inner = spec.call_schema()
        defs = inner.pop("$defs", None)  # back at the root, where the rewritten $refs point
        call = {"type": "object", "properties": {"tool_call": inner}, "required": ["tool_call"],
                "additionalProperties": False}
        if spec.choice in ("required", "function"):
            out = call
        else:
            reply = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                     "additionalProperties": False}
            out = {"anyOf": [call, reply]}
        return {**out, "$defs": defs} if defs else out

    def grammar(self, spec: ToolSpec) -> Optional[str]:
        if spec.choice == "none":
            return None
        return "start: answer\nanswer: " + _json_lark(self._answer_schema(spec), spec.lenient)

    def describe(self, spec: ToolSpec) -> str:
        lines = ["You can call these functions (JSON Schema of their arguments):"]
        for t in spec.callable_tools():
            lines.append(f"- {t.name}: {t.description}".rstrip(": ") + f" {json.dumps(t.parameters)}")
        how = ('Answer with one JSON object: {"tool_call": {"name": "<function>", "arguments": {...}}} to call a '
               'function')
        how += "." if spec.choice in ("required", "function") else ', or {"content": "<your reply>"} to reply.'
        return "\n".join(lines + [how])

    def render_messages(self, messages, spec):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # an earlier call, as the model itself would have written it
                c = m["tool_calls"][0]
                m["content"] = json.dumps({"tool_call": {"name": c.get("function", c).get("name"),
                                                         "arguments": _arguments(c)}})
                m.pop("tool_calls")
            elif m.get("role") == "tool":  # results arrive as the user's turn in these templates
                m = {"role": "user", "content": f"Result of the function call: {m.get('content', '')}"}
            out.append(m)
        if spec is not None and spec.choice != "none":
            desc = self.describe(spec)
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + desc)
            else:
                out.insert(0, {"role": "system", "content": desc})
        return out, {}

    def parse(self, text: str, spec: Optional[ToolSpec] = None) -> tuple[str, list[ToolCall]]:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            # the answer was cut off (length, a stop string): a reply keeps what it had written,
            # a call in progress is no text at all
            return _partial_content(text), []
        if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
            c = obj["tool_call"]
            args = c.get("arguments", {})
            return "", [ToolCall(new_call_id(), str(c.get("name")), args if isinstance(args, dict) else {})]
        if isinstance(obj, dict) and isinstance(obj.get("content"), str):
            return obj["content"], []
        return text, []


def _partial_content(text: str) -> str:
    """The reply in a cut-off generic answer `{"content": "...`, decoded; "" for anything else."""
    m = re.match(r'\s*\{\s*"content"\s*:\s*"', text)
    if m is None:
        return ""
    rest = text[m.end():]
    for cut in range(len(rest), max(len(rest) - 8, -1), -1):  # a closing quote, or an escape cut in half
        try:
            return json.loads('"' + rest[:cut] + '"')
        except json.JSONDecodeError:
            continue
    return ""


class Llama3(Format):
    """Llama 3.1-3.3: a call is the whole answer, one JSON object {"name", "parameters"}, after
    `<|python_tag|>` or not; results come back in `ipython` turns (the template renders them)."""

    name = "llama3"
    TAG = "<|python_tag|>"

    def grammar(self, spec: ToolSpec) -> Optional[str]:
        if spec.choice == "none":
            return None
        call = "call: " + _json_lark(spec.call_schema("parameters"), spec.lenient) + "\n"
        if spec.choice in ("required", "function"):
            return "start: call\n" + call
        return "start: TEXT? | call\nTEXT: /(?s:[^{].*)/\n" + call  # free text, or a call from its first brace

    def render_messages(self, messages, spec):
        return _for_template(messages, spec)

    def parse(self, text: str, spec: Optional[ToolSpec] = None) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            # under the tools grammar an answer opening with "{" is a call: cut off, it is no text
            return ("", []) if spec is not None and body.startswith("{") else (text, [])
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("parameters", obj.get("arguments", {}))
            if isinstance(args, dict) and (spec is None or obj["name"] in {t.name for t in spec.tools}):
                return "", [ToolCall(new_call_id(), obj["name"], args)]
        return text, []


class Mistral(Format):
    """Mistral / Mixtral instruct v0.3+: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    marker_id: Optional[int] = None  # set from the vocabulary (Engine.prepare_chat)

    def grammar(self, spec: ToolSpec) -> Optional[str]:
        if spec.choice == "none":
            return None
        most = None if spec.parallel and spec.choice != "function" else 1
        items = spec.call_schema()
        defs = items.pop("$defs", None)
        array = {"type": "array", "items": items, "minItems": 1, **({"$defs": defs} if defs else {})}
        if most:
            array["maxItems"] = most
        # the marker is a control token of these vocabularies: llguidance names it by its id
        marker = f"<[{self.marker_id}]>" if self.marker_id is not None else json.dumps(self.TAG)
        call = f"calls: {marker} " + _json_lark(array, spec.lenient) + "\n"
        if spec.choice in ("required", "function"):
            return "start: calls\n" + call
        return "start: TEXT? | calls\nTEXT: /(?s:.+)/\n" + call

    def render_messages(self, messages, spec):
        out, extra = _for_template(messages, spec)
        for m in out:  # its templates insist on 9-character alphanumeric call ids
            if m.get("tool_calls"):
                m["tool_calls"] = [dict(c, id=_short_id(c.get("id"))) for c in m["tool_calls"]]
            if m.get("tool_call_id") is not None:
                m["tool_call_id"] = _short_id(m["tool_call_id"])
        return out, extra

    def parse(self, text: str, spec: Optional[ToolSpec] = None) -> tuple[str, list[ToolCall]]:
        at = text.find(self.TAG)
        if at < 0 and text.lstrip().startswith("["):  # the marker is a control token: not in the text
            text, at = self.TAG + text, 0
        if at < 0:
            return text, []
        try:
            items = json.loads(text[at + len(self.TAG):].strip())
        except (json.JSONDecodeError, RecursionError):  # calls cut off: only the text before them
            return text[:at].strip(), []
        calls = [ToolCall(new_call_id(), c["name"], c.get("arguments", {})) for c in (items if isinstance(items, list)
                 else [items]) if isinstance(c, dict) and isinstance(c.get("name"), str)
                 and isinstance(c.get("arguments", {}), dict)]
        return (text[:at].strip(), calls) if calls else (text, [])


def _short_id(cid) -> str:
    import hashlib
    return hashlib.sha1(str(cid).encode()).hexdigest()[:9]


def detect(template: Optional[str]) -> Format:
    """The tool-call format a chat template speaks."""
    if not template:
        return Generic()
    if "<tool_call>" in template:
        return Hermes()
    if "[TOOL_CALLS]" in template:
        return Mistral()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3()
    return Generic()


@dataclass
class StreamParser:
    """Text as it streams -> (content to show now, calls when complete). Markup never reaches
    the content: text inside a call, or that may open one, is held back until it is known."""

    fmt: Format
    spec: Optional[ToolSpec] = None
    text: str = ""
    shown: int = 0       # text[:shown] has been shown or belongs to a call
    inside: bool = False
    opened: int = 0      # where the last call marker began
    bare: Optional[bool] = None  # the answer opens with "{" (a call without markup); None: nothing written yet
    lazy: Optional[int] = None   # where a fenced call opened later in the answer (LAZY_FENCED) begins

    def feed(self, piece: str) -> str:
        self.text += piece
        if not isinstance(self.fmt, Hermes):
            return ""  # a JSON answer (generic, Llama 3) or list (Mistral): known only when complete
        out = []
        while True:
            if self.inside:
                end = self.text.find(Hermes.CLOSE, self.shown)
                if end < 0:
                    return "".join(out)
                self.shown, self.inside = end + len(Hermes.CLOSE), False
                continue
            opened = self.text.find(Hermes.OPEN, self.shown)
            if opened >= 0:
                out.append(self.text[self.shown:opened])
                self.shown, self.inside, self.opened = opened + len(Hermes.OPEN), True, opened
                continue
            if self.bare is None and self.text.strip():  # decided by how the answer opens
                self.bare = _opens_bare(self.text.lstrip())
                if self.bare is None:
                    return "".join(out)  # "```" or "```js": not known yet
            if self.spec is not None and (self.bare or self.lazy is not None):
                return "".join(out)  # may be a call written without its markup: known at the end
            # hold back a tail that could be the start of the marker
            safe = len(self.text)
            for k in range(min(len(Hermes.OPEN) - 1, len(self.text) - self.shown), 0, -1):
                if Hermes.OPEN.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
            if self.spec is not None and self.spec.choice != "none":
                # ... or of a call opened later in the answer (LAZY_FENCED, LAZY_DOUBLED): from the
                # first line that may open one, until the text shows whether it does
                for start in self._line_starts():
                    state = _later_opens(self.text[start:])
                    if state is not False:
                        hold = start  # with the blank lines before it, which a call's content drops
                        while hold > self.shown and self.text[hold - 1] in " \t\r\n":
                            hold -= 1
                        safe = min(safe, hold)
                        if state is True:  # the rest of the answer is the call
                            self.lazy = start
                        break
            out.append(self.text[self.shown:safe])
            self.shown = safe
            return "".join(out)

    def _line_starts(self):
        """Where each line of the unshown text begins."""
        at = self.shown
        if at == 0 or self.text[at - 1] == "\n":
            yield at
        while (nl := self.text.find("\n", at)) >= 0:
            at = nl + 1
            yield at

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet shown, the calls, checked: ToolSpec.check)."""
        content, calls = self._finish()
        return content, (self.spec.check(calls) if self.spec is not None and calls else calls)

    def _finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.fmt.parse(self.text, self.spec)
        if not isinstance(self.fmt, Hermes):
            return content, calls
        if Hermes.OPEN not in self.text and (self.lazy is not None or (self.bare and self.spec is not None)):
            # a call without markup, held back (cut off: none); what came before it is content
            rest = content[self.shown:]  # content is a prefix of the text here
            self.shown = len(self.text)
            return rest, calls
        if self.inside and not calls:
            after = self.text[self.opened + len(Hermes.OPEN):]
            # a call cut off (by the length limit, a stop string, a cancel) is no content, its markup
            # least of all; the marker's text in prose ("use the <tool_call> tag") is
            rest = "" if not after.strip() or after.lstrip().startswith("{") else self.text[self.opened:]
        else:
            rest = "" if self.inside else self.text[self.shown:]
        self.shown = len(self.text)
        return rest, calls
