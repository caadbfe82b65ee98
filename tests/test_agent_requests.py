"""Requests as the coding agents send them (recorded from Claude Code 2.1.197 and Codex 0.171.0
against a capture server, ids zeroed: tests/data/), and the smaller findings of a probing pass
over the two APIs: each translated or refused as the API would, without a model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.chat import fold_system, render
from edgespec.errors import UsageError
from edgespec.server import anthropic, responses
from edgespec.server.schemas import ApiError
from edgespec.tools import ToolCall, ToolSpec

DATA = Path(__file__).parent / "data"
CLAUDE = json.loads((DATA / "claude-code-2.1.197-first-request.json").read_text())
CODEX = json.loads((DATA / "codex-0.171.0-first-request.json").read_text())


def messages(body: dict) -> anthropic.MessagesRequest:
    return anthropic.MessagesRequest.model_validate(body)


def refused(make, *, match: str) -> ApiError:
    with pytest.raises(ApiError) as err:
        make()
    assert err.value.status == 400 and match in err.value.message, err.value.message
    return err.value


# -- Claude Code -------------------------------------------------------------------------------------
def test_claude_codes_first_request_is_taken_whole():
    body = CLAUDE["body"]
    assert body["messages"][1]["role"] == "system"  # the mid-conversation-system beta
    chat = messages(body).chat()
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "system"], roles
    assert chat.messages[2].content.startswith(body["messages"][1]["content"][:40])
    req = chat.engine_request(32768)
    names = [t.name for t in req.tools.tools]
    assert names == [t["name"] for t in body["tools"]]  # every tool callable, none refused
    # one schema uses propertyNames, which llguidance does not implement: compiled leniently
    loose = [t.name for t in req.tools.tools if t.enforced != "strict"]
    assert loose and req.tools.lenient
    assert all("propertyNames" in json.dumps(t.parameters) for t in req.tools.tools if t.name in loose)
    assert chat.max_tokens == 64000 and chat.stream is True


def test_a_call_to_a_leniently_compiled_tool_is_checked_after_generation():
    schema = {"type": "object", "properties": {"env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                                                       "additionalProperties": {"type": "string"}}},
              "required": ["env"]}
    spec = ToolSpec.build([{"type": "function", "function": {"name": "run", "parameters": schema}},
                           {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}])
    assert [t.enforced for t in spec.tools] == ["lenient", "strict"]
    good, bad = ToolCall("c1", "run", {"env": {"PATH": "/bin"}}), ToolCall("c2", "run", {"env": {"path": "/bin"}})
    checked = spec.check([good, bad, ToolCall("c3", "ls", {"x": 1})])
    assert checked[0].error is None and checked[2].error is None
    assert checked[1].error is not None and "env" in checked[1].error and "path" in checked[1].error
    # a schema that does not compile even leniently (a look-ahead in a pattern): any object is
    # generated, then checked
    broken = {"type": "object", "properties": {"n": {"type": "string", "pattern": "^[a-z]+(?!x)$"}}}
    spec = ToolSpec.build([{"type": "function", "function": {"name": "f", "parameters": broken}}])
    assert spec.tools[0].enforced == "none" and spec.tools[0].grammar_parameters() == {"type": "object"}
    assert spec.check([ToolCall("c4", "f", {"n": 5})])[0].error == "n: 5 is not of type 'string'"
    # not JSON Schema at all: refused, by what is wrong
    with pytest.raises(UsageError, match=r"tools\[0\].function.parameters is not a usable JSON Schema: .*minimum"):
        ToolSpec.build([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": "zero"}}}}}])


def test_server_tools_are_passed_over_and_client_tools_kept():
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                      {"name": "Read", "input_schema": {"type": "object"}},
                      {"type": "custom", "name": "Write", "input_schema": {"type": "object"}}]}
    chat = messages(body).chat()
    assert [t["function"]["name"] for t in chat.tools] == ["Read", "Write"]


# -- Codex -------------------------------------------------------------------------------------------
def test_codexs_first_request_is_taken_whole():
    body = CODEX["body"]
    assert "client_metadata" in body and any(t["type"] == "namespace" for t in body["tools"])
    req = responses.ResponsesRequest.model_validate(body)
    chat = req.chat()
    assert [m.role for m in chat.messages] == ["system", "user", "user"]  # developer items: one system turn
    names = [t["function"]["name"] for t in chat.tools]
    ns = next(t for t in body["tools"] if t["type"] == "namespace")
    assert [t["name"] for t in ns["tools"]] == [n for n in names if req.call_name(n)[0] == ns["name"]]
    assert not any(t["type"] == "web_search" for t in chat.tools)
    assert chat.engine_request(32768).tools is not None


def test_namespace_functions_are_named_back_as_codex_expects():
    tools = [{"type": "function", "name": "close", "parameters": {"type": "object"}},
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}},
                        {"type": "function", "name": "close", "parameters": {"type": "object"}}]},
             {"type": "custom", "name": "apply_patch"}, {"type": "local_shell"}, {"type": "web_search"}]
    req = responses.ResponsesRequest.model_validate(
        {"input": [{"type": "function_call", "call_id": "c1", "name": "close", "namespace": "agents",
                    "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "closed"},
                   {"type": "reasoning", "summary": []}, {"role": "user", "content": "next"}],
         "tools": tools, "tool_choice": {"type": "function", "name": "spawn", "namespace": "agents"}})
    chat = req.chat()
    assert [t["function"]["name"] for t in chat.tools] == ["close", "spawn", "agents.close"]
    assert chat.messages[0].tool_calls[0]["function"]["name"] == "agents.close"
    assert chat.tool_choice == {"type": "function", "function": {"name": "spawn"}}
    shape = responses.Shape("m", req)
    item = shape._call(ToolCall("call_1", "agents.close", {}))
    assert (item["name"], item["namespace"]) == ("close", "agents")
    assert "namespace" not in shape._call(ToolCall("call_2", "close", {}))


# -- the probe's smaller findings ---------------------------------------------------------------------
def test_messages_bodies_refused_by_name():
    user = [{"role": "user", "content": "hi"}]
    refused(lambda: messages({"max_tokens": 5, "system": 5, "messages": user}).chat(),
            match="system: must be a string or a list of text blocks")
    refused(lambda: messages({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}).chat(), match="messages.0.content.0.text: must be a string")
    refused(lambda: messages({"max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]}).chat(),
            match="messages.0.content.0: a content block is an object with a 'type'")
    refused(lambda: messages({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}).chat(),
            match="messages.0.content: must not be empty")
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    refused(lambda: messages({"max_tokens": 5, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [use, use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]}).chat(),
        match="'toolu_1' is used twice")


def test_responses_bodies_refused_by_name():
    refused(lambda: responses.ResponsesRequest.model_validate({"input": 5}).chat(),
            match="input: must be a string or a list of items")
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    refused(lambda: responses.ResponsesRequest.model_validate({"input": [call, call]}).chat(),
            match="'c1' is used by two function_call items")
    # Codex's additional_tools item: its tools are offered beside `tools`, named by where they stand
    extra = {"type": "additional_tools", "tools": [{"type": "function", "name": "g", "parameters": {"type": "object"}}]}
    chat = responses.ResponsesRequest.model_validate({"input": [{"role": "user", "content": "hi"}, extra]}).chat()
    assert [t["function"]["name"] for t in chat.tools] == ["g"]
    refused(lambda: responses.ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": "hi"}, {"type": "additional_tools", "tools": 5}]}).chat(),
        match="input.1: an additional_tools item holds a list of 'tools'")
    refused(lambda: responses.ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": "hi"}, {"type": "additional_tools", "tools": [5]}]}).chat(),
        match="input.1.tools.0: a tool is an object")


def test_a_system_message_mid_conversation_is_folded_where_the_template_refuses_it():
    strict = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
              "{{ raise_exception('System role only first') }}{% endif %}"
              "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>")
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
             {"role": "system", "content": "Agents: a, b"}, {"role": "user", "content": "U2"}]
    assert render(strict, convo) == "<system>S</system><user>U1\n\nAgents: a, b\n\nU2</user><assistant>"
    assert fold_system([{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]) == [
        {"role": "user", "content": "q\n\nlate"}]
    # a template that takes them renders them where they are
    takes_them = strict.replace("and not loop.first", "and false")
    assert render(takes_them, convo) == ("<system>S</system><user>U1</user><system>Agents: a, b</system>"
                                         "<user>U2</user><assistant>")


def test_a_forced_tool_choice_with_every_tool_passed_over_is_refused_not_dropped():
    hosted = [{"type": "web_search_20250305", "name": "web_search"}]
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": hosted}
    with pytest.raises(ApiError, match="tool_choice needs tools"):
        messages(dict(body, tool_choice={"type": "any"})).chat().engine_request(1024)
    assert messages(dict(body, tool_choice={"type": "auto"})).chat().tools is None
    with pytest.raises(ApiError, match="tool_choice needs tools"):
        responses.ResponsesRequest.model_validate({"input": "hi", "tools": [{"type": "web_search"}],
                                                   "tool_choice": "required"}).chat().engine_request(1024)


def test_claude_codes_billing_header_is_left_out_so_sessions_share_a_prefix():
    """Claude Code puts `x-anthropic-billing-header: cc_version=2.1.197.<3 hex>; ...` first in system,
    its suffix different in each session (recorded: 123, ece, 3bb): left in, no two sessions' prompts
    would share even their first token, and the prompt cache could keep nothing across sessions."""
    def system_of(version: str) -> str:
        body = json.loads(json.dumps(CLAUDE["body"]))
        body["system"][0]["text"] = f"x-anthropic-billing-header: cc_version=2.1.197.{version}; cc_entrypoint=sdk-cli;"
        return messages(body).chat().messages[0].content
    assert system_of("123") == system_of("3bb")
    assert "billing" not in system_of("123") and system_of("123").startswith("You are a Claude agent")
    # a system prompt that merely begins with other text keeps every block
    body = dict(CLAUDE["body"], system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}])
    assert messages(body).chat().messages[0].content == "Be brief.\nBe kind."
    # only a first text block of one line is the header: one that goes on, or comes later, is read
    header = "x-anthropic-billing-header: cc_version=1;"
    for system in ([{"type": "text", "text": header + "\nBe brief."}],
                   [{"type": "text", "text": "Be brief."}, {"type": "text", "text": header}]):
        assert header in messages(dict(CLAUDE["body"], system=system)).chat().messages[0].content


def test_tojson_writes_json_as_templates_expect_it():
    """Chat templates' `tojson` as Hugging Face's apply_chat_template and llama.cpp define it: keys in
    their order and text as is. Jinja's own sorted the keys of every tool schema and wrote <, >, &
    and ' as \\u escapes: Claude Code's tools rendered 650 tokens longer than llama-server renders them."""
    tools = [{"type": "function", "function": {"name": "Bash", "description": "Run <cmd> & 'quote' it — é",
                                                "parameters": {"type": "object", "required": ["cmd"]}}}]
    text = render("{{ tools | tojson }}", [{"role": "user", "content": "x"}], tools=tools)
    assert text == json.dumps(tools, ensure_ascii=False)
    assert render("{{ x | tojson(indent=2) }}", [{"role": "user", "content": "x"}], x={"b": 1, "a": [1]}) == \
        json.dumps({"b": 1, "a": [1]}, indent=2)
