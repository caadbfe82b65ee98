"""The APIs coding agents speak, through their official SDKs against a real `edgespec serve`
(SmolLM2, the generic tool format): Anthropic's Messages API (`anthropic`) and OpenAI's
Responses API (`openai`), plus llama.cpp's `timings` in every answer. At T = 0 an answer equals
the library's own answer to the same conversation, token for token. The Qwen pair (its own
<tool_call> format) runs behind the qwen marker."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from edgespec import Engine
from serverproc import ServerProcess

KEY = "agents-key"
N_CTX = 1024
FLAGS = ["--ctx", str(N_CTX), "--drafter", "ngram", "--parallel", "1", "--api-key", KEY]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "What is a mutex?"}]
# the anthropic SDK (2.x) no longer has sampling arguments; the API, llama-server's and this one take them
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    srv = ServerProcess(["--target", str(smol), *FLAGS], tmp_path_factory.mktemp("agents"), key=KEY)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def solo(smol):
    """The library's answer on a fresh engine (deterministic at T = 0), memoized."""
    memo = {}
    with Engine.load(str(smol), drafter="ngram", n_ctx=N_CTX) as eng:
        def answer(messages, **kw):
            key = json.dumps([messages, sorted(kw.items())])
            if key not in memo:
                eng.reset()
                memo[key] = eng.chat(messages, **kw)
            return memo[key]
        yield answer


# -- Anthropic Messages ----------------------------------------------------------------------------
def test_messages_text_with_a_system_prompt_equals_the_library_and_reports_usage(claude, solo):
    msg = claude.messages.create(model="local", max_tokens=24, system=SYSTEM, messages=ASK, extra_body=T0)
    ref = solo([{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref.text
    assert msg.stop_reason == {"eos": "end_turn", "length": "max_tokens"}[ref.stats.finish_reason]
    u = msg.usage
    assert u.output_tokens == ref.stats.generated
    assert u.input_tokens + u.cache_read_input_tokens == ref.stats.prompt_tokens
    # llama.cpp's names beside ours
    extra = msg.model_extra
    assert extra["timings"]["predicted_n"] == ref.stats.generated
    assert extra["timings"]["draft_n"] == extra["edgespec"]["drafted"]
    assert extra["timings"]["draft_n_accepted"] == extra["edgespec"]["accepted"]


def test_messages_streamed_in_anthropics_event_order_give_the_same_answer(claude, solo, server):
    ref = solo([{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24)
    with claude.messages.stream(model="local", max_tokens=24, system=[{"type": "text", "text": SYSTEM}],
                                messages=ASK, extra_body=T0) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert final.content[0].text == ref.text and final.usage.output_tokens == ref.stats.generated
    # the raw sequence, as Anthropic documents it (the SDK adds its own "text" events)
    raw = [k for k in kinds if k != "text"]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1:4] == ["content_block_start", "content_block_delta", "content_block_delta"] or \
        raw[1:3] == ["content_block_start", "content_block_delta"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == 1
    # the wire: named events
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                   json={"model": "x", "max_tokens": 4, "messages": ASK, "stream": True})
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "ping" in names


def test_messages_forced_tool_call_validates_and_a_tool_result_round_trip_answers(claude, solo):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
    msg = claude.messages.create(model="local", max_tokens=64, messages=ask, tools=tools, extra_body=T0,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER)
    # "any" forces a call too, streamed as an input_json_delta that assembles to the same input
    with claude.messages.stream(model="local", max_tokens=64, messages=ask, tools=tools, extra_body=T0,
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed[0].input == use[0].input
    # the result goes back; the answer is what the library says to the same conversation
    convo = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather",
                                                      "input": use[0].input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                 "content": [{"type": "text", "text": "-3 C, snow"}]}]}]
    back = claude.messages.create(model="local", max_tokens=24, messages=convo, tools=tools, extra_body=T0)
    ref = solo(ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(use[0].input)}}]},
        {"role": "tool", "tool_call_id": use[0].id, "content": "-3 C, snow"}],
        max_tokens=24, tools=[{"type": "function", "function": {"name": "get_weather", "description":
                                                                 "Weather in a city", "parameters": WEATHER}}])
    assert back.stop_reason in ("end_turn", "max_tokens", "tool_use")
    if ref.tool_calls:
        assert [b.type for b in back.content] == ["tool_use"]
    else:
        assert back.content[0].text == ref.text


def test_messages_stop_sequences_and_invalid_requests_in_anthropics_shape(claude, server):
    msg = claude.messages.create(model="local", max_tokens=48, extra_body=T0, stop_sequences=["3"],
                                 messages=[{"role": "user", "content": "Count from 1 to 10: 1, 2,"}])
    # SmolLM2 counts on ("1, 2, 3, ..."): the stop string ends it, and is named
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "3"
    assert msg.content[0].text.strip(" ,") == "1, 2"
    with pytest.raises(anthropic.BadRequestError) as err:  # max_tokens is required
        claude.messages.create(model="local", messages=ASK, max_tokens=None)  # type: ignore[arg-type]
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model="local", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    with pytest.raises(anthropic.BadRequestError, match='input_schema must be a schema of type "object"'):
        claude.messages.create(model="local", max_tokens=8, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "n", "input_schema": {"type": "integer"}}])
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(model="local", max_tokens=8, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY, "Origin": "https://evil.example"},
                   json={"max_tokens": 4, "messages": ASK}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


# -- OpenAI Responses ----------------------------------------------------------------------------
def test_responses_text_equals_the_library_and_streams_its_events(oai, solo):
    ref = solo([{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24)
    r = oai.responses.create(model="local", instructions=SYSTEM, input="What is a mutex?", max_output_tokens=24,
                             temperature=0)
    assert r.object == "response" and r.output_text == ref.text
    assert r.status == ("incomplete" if ref.stats.finish_reason == "length" else "completed")
    assert r.usage.output_tokens == ref.stats.generated and r.usage.input_tokens == ref.stats.prompt_tokens
    assert r.model_extra["timings"]["predicted_n"] == ref.stats.generated
    with oai.responses.stream(model="local", instructions=SYSTEM, max_output_tokens=24, temperature=0,
                              input=[{"role": "user", "content": [{"type": "input_text",
                                                                   "text": "What is a mutex?"}]}]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == ref.text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_forced_function_call_and_json_schema_validate(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    r = oai.responses.create(model="local", input="Weather in Lima?", tools=tools, tool_choice="required",
                             max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the call and its output go back as items
    back = oai.responses.create(model="local", tools=tools, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "Weather in Lima?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"}])
    assert back.status in ("completed", "incomplete") and back.output
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oai.responses.create(model="local", input="Dana is 41. Give her name and age.", max_output_tokens=48,
                             temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                             "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_refuses_what_it_does_not_keep_or_serve(oai):
    with pytest.raises(openai.BadRequestError, match="previous_response_id") as err:
        oai.responses.create(model="local", input="hi", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
    # a hosted tool is passed over (the model never sees it): the answer is the one without it
    hosted = oai.responses.create(model="local", input="hi", tools=[{"type": "web_search"}], max_output_tokens=6,
                                  temperature=0)
    assert hosted.output_text == oai.responses.create(model="local", input="hi", max_output_tokens=6,
                                                      temperature=0).output_text
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="local", input="hi", max_output_tokens=0)
    assert err.value.body["param"] == "max_output_tokens"


# -- llama.cpp's timings on the OpenAI endpoints ---------------------------------------------------
def test_chat_and_completions_carry_llama_cpp_timings(oai):
    r = oai.chat.completions.create(model="x", messages=ASK, max_tokens=8, temperature=0)
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["draft_n"] == r.model_extra["edgespec"]["drafted"]
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens and t["predicted_per_second"] >= 0
    chunks = list(oai.chat.completions.create(model="x", messages=ASK, max_tokens=8, temperature=0, stream=True))
    assert chunks[-1].model_extra["timings"]["predicted_n"] == r.usage.completion_tokens


# -- what the probing pass found, at the server ------------------------------------------------------
def test_probe_fixes_at_the_server(server, oai):
    auth = {"Authorization": f"Bearer {KEY}"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    for cut in ({"max_tokens": 6}, {"max_tokens": 64, "stop": [","]}):  # a call cut off: no markup as content
        r = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                        tools=tools, tool_choice="required", temperature=0, **cut)
        c = r.choices[0]
        assert c.finish_reason in ("length", "stop") and not c.message.tool_calls
        assert not c.message.content, c.message.content
    deep = '{"a":' * 300 + "1" + "}" * 300  # valid JSON, deeper than the parser follows
    r = httpx.post(server.url + "/v1/chat/completions", content=deep, timeout=30,
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "deeper than 200 levels" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello " * 1500, "max_tokens": 4},
                   headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_messages_takes_what_claude_code_sends_and_counts_tokens(claude, solo):
    body = dict(model="local", max_tokens=32000, system=SYSTEM, messages=ASK,  # beyond the 1,024-token context
                metadata={"user_id": "u1"}, thinking={"type": "enabled", "budget_tokens": 1024},
                extra_body={"temperature": 0, "max_tokens": 16, "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    msg = claude.messages.create(**body)  # max_tokens is a cap there: the answer ends at 16 here
    ref = solo([{"role": "system", "content": SYSTEM}, *ASK], max_tokens=16)
    assert msg.content[0].text == ref.text
    big = claude.messages.create(model="local", max_tokens=32000, system=SYSTEM, messages=ASK, stop_sequences=["."],
                                 extra_body={"temperature": 0})
    assert big.stop_reason in ("stop_sequence", "end_turn") and big.content[0].text
    counted = claude.messages.count_tokens(model="local", system=SYSTEM, messages=ASK)
    assert counted.input_tokens == ref.stats.prompt_tokens
    with pytest.raises(anthropic.BadRequestError, match="role"):
        claude.messages.count_tokens(model="local", messages=[{"role": "tool", "content": "x"}])


def test_responses_merges_instructions_and_developer_items_and_reports_cache_writes(oai, solo):
    r = oai.responses.create(model="local", instructions="You are terse.", max_output_tokens=16, temperature=0,
                             input=[{"role": "developer", "content": "Answer in English."},
                                    {"role": "user", "content": "What is a mutex?"}])
    ref = solo([{"role": "system", "content": "You are terse.\n\nAnswer in English."}, *ASK], max_tokens=16)
    assert r.output_text == ref.text
    assert r.usage.input_tokens_details.cache_write_tokens == 0


def test_what_agents_send_now_is_answered(claude, oai, solo, server):
    # a system message inside the conversation (Claude Code's mid-conversation-system beta), read in place
    convo = [ASK[0], {"role": "system", "content": "Answer in one sentence."}]
    msg = claude.messages.create(model="local", max_tokens=12, messages=[
        ASK[0], {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Go on."}], extra_body=T0)
    ref = solo([*convo, {"role": "user", "content": "Go on."}], max_tokens=12)
    assert msg.content[0].text == ref.text
    # a generous limit on /v1/responses is capped to the room in the context, and says so
    r = oai.responses.create(model="local", input="Count to three.", max_output_tokens=32000, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.model_extra["edgespec"]["max_tokens_capped_to"] == N_CTX - r.usage.input_tokens
    # count_tokens counts a prompt longer than the context rather than refusing it
    long = [{"role": "user", "content": "word " * 3000}]
    assert claude.messages.count_tokens(model="local", messages=long).input_tokens > N_CTX
