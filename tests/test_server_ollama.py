"""Ollama's API and the Prometheus metrics, through the official `ollama` client and
`prometheus_client`'s parser against a real `edgespec serve` (SmolLM2, n-gram drafter): the
listings read from the GGUF, chat and generate equal to the OpenAI endpoints' answers at T = 0,
streamed as NDJSON, tool calls and JSON Schema formats that validate, Ollama-shaped errors, the
model-management calls refused with what to do instead, and the guard on the new routes."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from serverproc import ServerProcess

KEY = "ollama-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 1024
FLAGS = ["--ctx", str(N_CTX), "--drafter", "ngram", "--parallel", "1", "--api-key", KEY]
T0 = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "What is a mutex?"}]
COUNTING = [{"role": "user", "content": "Continue: 1, 2, 3, 4, 5, 6, 7, 8,"}]  # n-gram drafts get accepted
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    srv = ServerProcess(["--target", str(smol), *FLAGS], tmp_path_factory.mktemp("ollama"), key=KEY)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    with ollama.Client(host=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def name(client) -> str:
    return client.list().models[0].model


def _post(server, path, body, **kw) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120, **kw)


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def _openai_chat(server, messages, n=24) -> dict:
    r = _post(server, "/v1/chat/completions", {"model": "anything", "messages": messages, "temperature": 0,
                                                "max_tokens": n})
    assert r.status_code == 200, r.text
    return r.json()


# -- discovery: what apps read before they chat -------------------------------------------------
def test_version_list_show_and_ps_describe_the_served_model(server, client, name, smol):
    from edgespec.ggufinfo import read_info
    v = httpx.get(server.url + "/api/version", timeout=30)  # open, as apps probe for it before a key
    assert v.status_code == 200
    assert tuple(int(x) for x in v.json()["version"].split(".")) >= (0, 6, 4)
    # one name in both listings: the GGUF's stem
    listed = client.list().models
    assert [m.model for m in listed] == [smol.stem] == [name]
    ids = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["id"] for m in ids] == [name]
    m = listed[0]
    assert m.size == smol.stat().st_size and len(m.digest) == 64
    assert (m.details.format, m.details.family, m.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert m.details.parameter_size == "134.52M"
    shown = client.show(name + ":latest")  # Ollama's default tag names the same model
    assert shown.capabilities == ["completion", "tools"]
    info = read_info(smol)
    assert shown.template == info.fields["tokenizer.chat_template"]
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == info.fields["llama.context_length"]
    assert shown.details.quantization_level == "Q4_1"
    ps = client.ps().models
    assert [p.model for p in ps] == [name] and ps[0].context_length == N_CTX and ps[0].size > 0
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3.2")
    assert err.value.status_code == 404 and err.value.error == "model 'llama3.2' not found"


# -- answers ----------------------------------------------------------------------------------------
def test_chat_equals_the_openai_endpoint_at_t0_whole_and_streamed(server, client, name):
    ref = _openai_chat(server, ASK)
    text = ref["choices"][0]["message"]["content"]
    assert ref["model"] == name  # the OpenAI route answers any name, and says which model answered
    r = client.chat(model=name, messages=ASK, options=T0)
    assert r.message.role == "assistant" and r.message.content == text
    assert r.done and r.done_reason == ref["choices"][0]["finish_reason"]
    assert r.eval_count == ref["usage"]["completion_tokens"] and r.prompt_eval_count == ref["usage"]["prompt_tokens"]
    assert r.total_duration > r.eval_duration > 0 and r.prompt_eval_duration >= 0 and r.load_duration == 0
    parts = list(client.chat(model=name, messages=ASK, options=T0, stream=True))
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == text
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == r.done_reason
    # the wire: Ollama streams by default, one JSON object a line; speculation beside Ollama's figures
    raw = _post(server, "/api/chat", {"model": name + ":latest", "messages": ASK, "options": T0})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.text.splitlines()]
    last = lines[-1]
    assert "".join(x["message"]["content"] for x in lines) == text and last["done"] is True
    ext = last["edgespec"]
    assert ext["drafter"] == "ngram" and ext["accepted"] <= ext["drafted"]
    assert (last["timings"]["draft_n"], last["timings"]["draft_n_accepted"]) == (ext["drafted"], ext["accepted"])


def test_generate_templated_equals_chat_and_raw_equals_completions(server, client, name):
    system = "You are terse."
    question = "Why is the sky blue?"
    g = client.generate(model=name, prompt=question, system=system, options=T0)
    ref = _openai_chat(server, [{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert g.response == ref["choices"][0]["message"]["content"] and g.done and g.eval_count > 0
    raw = client.generate(model=name, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 8})
    comp = _post(server, "/v1/completions", {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 8}).json()
    assert raw.response == comp["choices"][0]["text"] and raw.done_reason == "length"
    streamed = list(client.generate(model=name, prompt="1, 2, 3, 4,", raw=True, stream=True,
                                    options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    # nothing to generate: Ollama's load answer
    loaded = client.generate(model=name)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_a_tool_call_validates_and_its_result_goes_back(server, client, name):
    ask = [{"role": "user", "content": "Use get_weather for Paris."}]
    r = client.chat(model=name, messages=ask, tools=TOOLS, options={"temperature": 0, "num_predict": 64})
    calls = r.message.tool_calls
    assert r.done_reason == "stop" and calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    args = dict(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER)
    # the call and its result as Ollama's clients send them back (the result names its tool, not a
    # call id) read as the same conversation in OpenAI's words does
    convo = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": "21 C, sunny", "tool_name": "get_weather"}]
    back = client.chat(model=name, messages=convo, tools=TOOLS, options={"temperature": 0, "num_predict": 32})
    ref = _post(server, "/v1/chat/completions", {"temperature": 0, "max_tokens": 32, "tools": TOOLS, "messages": ask + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"}]}).json()["choices"][0]
    assert back.done and back.message.content == (ref["message"]["content"] or "")
    assert [c.function.name for c in back.message.tool_calls or []] == \
        [c["function"]["name"] for c in ref["message"].get("tool_calls") or []]


def test_format_json_schema_and_json_validate(client, name):
    ask = [{"role": "user", "content": "Dana is 41. Give her name and age."}]
    r = client.chat(model=name, messages=ask, format=PERSON, options={"temperature": 0, "num_predict": 32})
    jsonschema.validate(json.loads(r.message.content), PERSON)
    r = client.chat(model=name, messages=ask, format="json", options={"temperature": 0, "num_predict": 32})
    assert isinstance(json.loads(r.message.content), dict)
    g = client.generate(model=name, prompt="Dana is 41. Give her name and age.", format=PERSON,
                        options={"temperature": 1, "seed": 7, "num_predict": 32})
    jsonschema.validate(json.loads(g.response), PERSON)


# -- metrics --------------------------------------------------------------------------------------
def test_metrics_count_a_request_in_llamacpps_names(server, client, name):
    before = server.metrics()
    r = client.chat(model=name, messages=COUNTING, options={"temperature": 0, "num_predict": 24})
    after = server.metrics()
    for family in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                   "llamacpp:spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_accepted_tokens_total",
                   "llamacpp:spec_decode_num_drafts_total", "llamacpp:prompt_seconds_total",
                   "llamacpp:tokens_predicted_seconds_total", "edgespec_drafter_rounds_total{drafter=ngram}"):
        assert after[family][0] == "counter"
        assert after[family][1] > before.get(family, ("counter", 0))[1], family
    grew = {k: after[k][1] - before.get(k, ("", 0))[1] for k in after}
    assert grew["llamacpp:tokens_predicted_total"] == r.eval_count
    assert grew["llamacpp:spec_decode_num_accepted_tokens_total"] <= grew["llamacpp:spec_decode_num_draft_tokens_total"]
    assert after["llamacpp:requests_processing"] == ("gauge", 0) and after["llamacpp:requests_deferred"][1] == 0
    assert after["edgespec_prompt_cache_capacity_bytes"][1] > 0


def test_metrics_can_be_turned_off_and_stay_behind_the_guard(server):
    from argparse import ArgumentParser

    from starlette.testclient import TestClient

    from edgespec.server import add_parser, create_app
    from test_server import TESTSERVER, _fake_engine
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401  # the key, as /v1
    r = httpx.get(server.url + "/metrics", headers={**AUTH, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403
    args = ArgumentParser().add_subparsers()
    p = add_parser(args)
    assert p.parse_args(["--no-metrics"]).metrics is False and p.parse_args([]).metrics is True
    with TestClient(create_app(_fake_engine, model_id="fake", hosts=TESTSERVER, metrics=False)) as c:
        r = c.get("/metrics")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, words", [
    ({"model": None, "messages": ASK}, 400, "model is required"),
    ({"model": "llama3", "messages": ASK}, 404, "model 'llama3' not found"),
    ({"messages": ASK, "bogus": 1}, 400, "unknown field 'bogus'"),
    ({"messages": ASK, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"messages": ASK, "options": {"repeat_penalty": 1.3}}, 400, "options.repeat_penalty"),
    ({"messages": ASK, "options": {"mystery": 1}}, 400, "unknown option 'mystery'"),
    ({"messages": ASK, "options": {"num_predict": 0}}, 400, "num_predict"),
    ({"messages": ASK, "format": "xml"}, 400, "format"),
    ({"messages": ASK, "think": True}, 400, "thinking"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, 400, "images"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "tool", "content": "x", "tool_name": "f"}]}, 400, "tool result"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "context holds 1024"),
    ({"messages": ASK, "stream": "yes"}, 400, "stream"),
])
def test_bad_chat_bodies_get_ollamas_error_shape(server, name, body, status, words):
    body = {"model": name, **body}  # the served model unless the case names another (or none)
    assert words in _error(_post(server, "/api/chat", body), status)


def test_bad_json_and_model_management_are_refused_with_what_to_do(server, client, name):
    r = httpx.post(server.url + "/api/generate", content=b"{nope", headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert "not valid JSON" in _error(r, 400)
    assert "context" in _error(_post(server, "/api/generate", {"model": name, "prompt": "x", "context": [1]}), 400)
    for call in (lambda: client.pull("llama3.2"), lambda: client.push(name), lambda: client.delete(name),
                 lambda: client.copy(name, "other"), lambda: client.create("other", from_=name)):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 501 and "edgespec pull" in err.value.error
    assert client.pull(name).status == "success"  # the served model is there already
    for path in ("/api/embed", "/api/embeddings"):
        assert "embeddings are not served" in _error(_post(server, path, {"model": name, "input": "x"}), 501)
    assert "unknown URL" in _error(httpx.get(server.url + "/api/nothing", headers=AUTH, timeout=30), 404)
    assert _error(httpx.get(server.url + "/api/chat", headers=AUTH, timeout=30), 405)


def test_hostile_pages_and_missing_keys_are_refused_on_the_ollama_routes(server, name):
    served = server.health().json()["served"]
    body = json.dumps({"model": name, "messages": ASK, "stream": False, "options": {"num_predict": 2}})
    # a page's cross-site "simple" request (no preflight): text/plain from a foreign Origin
    r = httpx.post(server.url + "/api/chat", content=body, timeout=30,
                   headers={**AUTH, "Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert "--cors-origin" in _error(r, 403)
    assert "--cors-origin" in _error(_post(server, "/api/generate", {"model": name, "prompt": "hi"},
                                           headers={"Origin": "http://evil.example"}), 403)
    assert "--allowed-host" in _error(_post(server, "/api/chat", {"model": name, "messages": ASK},
                                            headers={"Host": "evil.example"}), 403)
    r = httpx.post(server.url + "/api/chat", data={"model": name}, headers=AUTH, timeout=30)  # a form: no Origin,
    assert r.status_code == 400  # but no JSON either
    r = httpx.post(server.url + "/api/chat", files={"f": b"x"}, headers=AUTH, timeout=30)
    assert "application/json" in _error(r, 415)
    for method, path in (("GET", "/api/tags"), ("POST", "/api/chat"), ("POST", "/api/show"), ("GET", "/api/ps")):
        r = httpx.request(method, server.url + path, json={"model": name, "messages": ASK}, timeout=30)
        assert "API key" in _error(r, 401)
    assert server.health().json()["served"] == served  # none of them generated
    # a local program that sends JSON without saying so (a plain fetch(), curl -d): answered
    r = httpx.post(server.url + "/api/chat", content=body, headers={**AUTH, "Content-Type": "text/plain"}, timeout=120)
    assert r.status_code == 200 and r.json()["done"] is True
