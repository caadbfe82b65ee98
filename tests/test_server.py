"""`edgespec serve`: a real server process on SmolLM2, driven through the official openai client.

Expected answers come from an Engine in this process with the same model and drafter, reset
before each request ("the answer it would have had alone"); the server answers with whatever
KV cache earlier requests left, so equality also checks that prefix reuse and queueing do not
change answers. The drafter is n-gram with a fixed length: its drafts depend only on the
context, so the target's verification batches (whose rounding can part at near-ties) are the
same in both processes. A few tests run the app in-process on a fake engine (loading, CORS).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from edgespec import Engine
from serverproc import ServerProcess

KEY = "test-key"
N_CTX = 1024
QUEUE = 2
# one thread: on this shared two-core machine, llama.cpp with two threads slows ~10x whenever another
# process is busy (its threads wait for each other); both processes must use the same count
THREADS = 2
# one generation at a time: the queue tests below count on it (several at once: test_server_parallel.py)
SERVER_FLAGS = ["--ctx", str(N_CTX), "--drafter", "ngram", "--threads", str(THREADS), "--parallel", "1",
                "--queue-size", str(QUEUE), "--api-key", KEY]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # SmolLM2 keeps counting: a generation as long as max_tokens

M_MUTEX = [{"role": "user", "content": "What is a mutex?"}]
M_COLORS = [{"role": "user", "content": "Name three colors."}]
M_SKY = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    srv = ServerProcess(["--target", str(smol), *SERVER_FLAGS], tmp_path_factory.mktemp("server"), key=KEY)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    # no retries: a 503 must reach the test, not be retried away
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref(smol):
    with Engine.load(str(smol), drafter="ngram", n_ctx=N_CTX, threads=THREADS) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(ref):
    """The answer a request gets on a fresh engine; memoized, the engine is deterministic at T=0."""
    memo = {}

    def answer(messages=None, prompt=None, **kw):
        key = json.dumps([messages, prompt, sorted(kw.items())])
        if key not in memo:
            ref.reset()
            memo[key] = ref.chat(messages, **kw) if messages is not None else ref.generate(prompt, **kw)
        return memo[key]
    return answer


def _reason(stats) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}[stats.finish_reason]


# -- models, chat, streaming -------------------------------------------------------------------
def test_models_lists_the_one_served_model(client, smol):
    assert [m.id for m in client.models.list().data] == [smol.stem]  # the file without .gguf, as /api/tags


def test_chat_at_t0_equals_engine_chat_with_usage_and_speculation_stats(client, solo):
    want = solo(M_MUTEX, max_tokens=16)
    for _ in range(2):  # the second time the whole prompt is in the KV cache: same answer
        got = client.chat.completions.create(model="any name", messages=M_MUTEX, max_tokens=16, temperature=0)
        choice = got.choices[0]
        assert choice.message.content == want.text
        assert choice.message.role == "assistant"
        assert choice.finish_reason == _reason(want.stats)
        assert got.usage.prompt_tokens == want.stats.prompt_tokens
        assert got.usage.completion_tokens == want.stats.generated
        assert got.usage.total_tokens == want.stats.prompt_tokens + want.stats.generated
        spec = got.model_extra["edgespec"]
        assert spec["drafter"] == "ngram"
        assert 0 <= spec["accepted"] <= spec["drafted"]
    assert got.usage.prompt_tokens_details.cached_tokens == want.stats.prompt_tokens


def test_streamed_chat_concatenates_to_the_same_answer_with_usage_when_asked(client, solo):
    want = solo(M_SKY, max_tokens=16)
    chunks = list(client.chat.completions.create(messages=M_SKY, model="x", max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [_reason(want.stats)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.stats.generated
    assert chunks[-1].usage.prompt_tokens == want.stats.prompt_tokens
    plain = list(client.chat.completions.create(messages=M_SKY, model="x", max_tokens=16, temperature=0, stream=True))
    assert all(c.usage is None for c in plain)


def test_stop_string_and_length_limit(client, solo):
    full = solo(M_MUTEX, max_tokens=16).text
    stop = full.split()[3]  # a word in the middle of the answer
    want = solo(M_MUTEX, max_tokens=16, stop=[stop])
    assert want.text == full[:full.index(stop)]
    got = client.chat.completions.create(messages=M_MUTEX, model="x", max_tokens=16, temperature=0, stop=[stop])
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "stop"
    got = client.chat.completions.create(messages=M_MUTEX, model="x", max_completion_tokens=3, temperature=0)
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 3
    assert full.startswith(got.choices[0].message.content)


def test_completions_streamed_and_not(client, solo):
    prompt = "def fib(n):"
    want = solo(prompt=prompt, max_tokens=12)
    got = client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == _reason(want.stats)
    assert got.usage.completion_tokens == want.stats.generated
    chunks = list(client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"top_k": 0, "min_p": 0.0, "user": "u1"}))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_overlapping_requests_each_get_their_solo_answer(client, solo):
    convs = [M_MUTEX, M_COLORS, M_SKY]
    wants = [solo(m, max_tokens=12).text for m in convs]
    got: dict[int, str] = {}
    start = threading.Barrier(len(convs))

    def ask(i):
        start.wait()
        r = client.chat.completions.create(messages=convs[i], model="x", max_tokens=12, temperature=0)
        got[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [got.get(i) for i in range(len(convs))] == wants


# -- cancellation and the queue ----------------------------------------------------------------
def _long_stream(client):
    """A streamed generation that would run for hundreds of tokens."""
    return client.completions.create(model="x", prompt=COUNTING, max_tokens=N_CTX - 32, temperature=0, stream=True)


def test_a_dropped_stream_is_cancelled_and_the_next_request_served(client, server):
    before = server.health().json()["cancelled"]
    stream = _long_stream(client)
    chunks = iter(stream)
    got = [next(chunks) for _ in range(4)]
    assert not any(c.choices[0].finish_reason for c in got)
    stream.close()  # the client goes away mid-answer
    r = client.chat.completions.create(messages=M_COLORS, model="x", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    # the dropped generation had to end before this one ran: it was counted as cancelled,
    # not served (an uncancelled one would have run ~1000 tokens first)
    assert server.health().json()["cancelled"] == before + 1


def _idle(server) -> dict:
    deadline = time.monotonic() + 120
    while True:
        h = server.health().json()
        if h["running"] == h["waiting"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_a_client_that_leaves_a_plain_request_cancels_it(server):
    before = _idle(server)
    body = {"prompt": COUNTING, "max_tokens": N_CTX - 32, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after a second and hangs up
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1)
    after = _idle(server)
    assert (after["cancelled"], after["served"]) == (before["cancelled"] + 1, before["served"])


def test_a_full_queue_answers_503_and_queued_requests_are_served_after(client, server):
    hold = _long_stream(client)
    next(iter(hold))  # it runs now
    results = []

    def queued():
        r = client.chat.completions.create(messages=M_COLORS, model="x", max_tokens=2, temperature=0)
        results.append(r.choices[0].finish_reason)

    waiting = [threading.Thread(target=queued) for _ in range(QUEUE)]
    for t in waiting:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while server.health().json()["waiting"] < QUEUE:
            assert time.monotonic() < deadline, server.health().json()
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(messages=M_COLORS, model="x", max_tokens=2, temperature=0)
        assert err.value.status_code == 503
        assert err.value.response.json()["error"]["code"] == "queue_full"
        assert err.value.response.headers["retry-after"]
    finally:
        hold.close()
        for t in waiting:
            t.join(300)
    assert results == ["length"] * QUEUE


# -- errors ------------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_parameters_and_malformed_bodies_get_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=M_MUTEX, model="x", temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(messages=M_MUTEX, model="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt="x" * 20000)  # longer than the context
    url = server.url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b'{"messages": [', b'[1, 2]', b'{"messages": "hi"}', b'{}', b'',
                 b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
                 b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}',
                 b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'):
        _error(httpx.post(url, content=body, headers=auth, timeout=30), 400)
    err = _error(httpx.post(url, json={"messages": M_MUTEX, "top_p": 2}, headers=auth, timeout=30), 400)
    assert err["param"] == "top_p" and err["type"] == "invalid_request_error"
    assert server.health().status_code == 200


def test_api_key_is_required_on_v1_only(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    _error(httpx.get(server.url + "/v1/models", timeout=30), 401)
    _error(httpx.post(server.url + "/v1/chat/completions", json={"messages": M_MUTEX}, timeout=30), 401)
    assert server.health().status_code == 200  # readiness probes need no key


def test_unknown_routes_get_404(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _error(httpx.get(server.url + "/v1/nope", headers=auth, timeout=30), 404)["code"] == "unknown_url"
    _error(httpx.post(server.url + "/v2/chat/completions", headers=auth, timeout=30), 404)


def test_bind_elsewhere_without_key_warns_and_a_failed_load_stops_the_server(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    r = subprocess.run([sys.executable, "-m", "edgespec.server", "--target", str(bad), "--host", "0.0.0.0",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "without --api-key" in r.stderr and "listening on" in r.stderr
    assert "not a GGUF" in r.stderr and "Traceback" not in r.stderr


def test_the_serve_verb_registers_on_a_cli_parser():
    import argparse

    from edgespec.server import add_parser
    from edgespec.server.command import cmd_serve
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["serve", "smollm2-135m", "--port", "0", "--cors-origin", "http://a", "--queue-size", "1"])
    assert args.func is cmd_serve and args.pair == "smollm2-135m" and args.host == "127.0.0.1"
    assert args.cors_origin == ["http://a"] and args.queue_size == 1 and args.ctx == 4096
    assert args.parallel is None  # as many as the memory plan allows
    for flag in ("--parallel", "-np"):
        assert parser.parse_args(["serve", flag, "3"]).parallel == 3


# -- in process, on a fake engine: loading and CORS ---------------------------------------------
class _TestServerHosts:
    """HostRule for starlette's TestClient, which sends 'Host: testserver'."""

    def allows(self, value):
        return value == "testserver"


TESTSERVER = _TestServerHosts()


def _fake_engine():
    from fakes import FakeBackend
    rng = np.random.default_rng(0)
    return Engine(FakeBackend(rng.normal(size=(32, 32)).astype(np.float32), n_ctx=256))


def test_loading_answers_503_until_the_engine_is_ready():
    from starlette.testclient import TestClient

    from edgespec.server import create_app
    release = threading.Event()

    def load():
        release.wait(60)
        return _fake_engine()

    ready = threading.Event()
    app = create_app(load, model_id="fake", on_ready=ready.set, hosts=TESTSERVER)
    body = {"messages": [{"role": "user", "content": "1 2 3"}], "max_tokens": 4, "temperature": 0}
    with TestClient(app) as c:
        assert c.get("/health").status_code == 503
        assert c.get("/health").json()["status"] == "loading"
        assert _error(c.post("/v1/chat/completions", json=body), 503)["code"] == "model_loading"
        release.set()
        assert ready.wait(60)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_cors_is_closed_unless_an_origin_is_given():
    from starlette.testclient import TestClient

    from edgespec.server import create_app
    preflight = {"Origin": "http://app.local", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(create_app(_fake_engine, model_id="fake", hosts=TESTSERVER)) as c:
        r = c.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    with TestClient(create_app(_fake_engine, model_id="fake", cors_origins=["http://app.local"], api_key="k",
                                hosts=TESTSERVER)) as c:
        r = c.options("/v1/chat/completions", headers=preflight)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.local"
        r = c.options("/v1/chat/completions", headers=dict(preflight, Origin="http://evil.example"))
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
        r = c.get("/v1/models", headers={"Origin": "http://app.local", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.local"


# -- structured output -------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract as JSON: Maria Lopez is 41."}]


def test_response_format_json_schema_and_json_object_are_followed(client):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0, 1):
        r = client.chat.completions.create(model="x", messages=EXTRACT, max_tokens=60, temperature=temperature,
                                           seed=3, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.model_extra["edgespec"]["by_drafter"]["grammar"]["drafted"] > 0
    chunks = client.chat.completions.create(model="x", messages=EXTRACT, max_tokens=60, temperature=0,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)
    r = client.chat.completions.create(model="x", messages=EXTRACT, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model="x", prompt="The answer is", max_tokens=8, temperature=0,
                                  extra_body={"json_schema": {"type": "integer"}})
    assert re.fullmatch(r"-?[0-9]+", r.choices[0].text.strip()), r.choices[0].text
    # an empty schema is any JSON, not no constraint; llama.cpp's json_object with a schema is that schema
    r = client.completions.create(model="x", prompt="def f(x):", max_tokens=12, temperature=0,
                                  extra_body={"json_schema": {}})
    assert r.choices[0].text.lstrip()[:1] in set('{["-0123456789tfn'), r.choices[0].text
    r = client.chat.completions.create(model="x", messages=EXTRACT, max_tokens=12, temperature=0,
                                       response_format={"type": "json_object", "schema": {"type": "integer"}})
    assert re.fullmatch(r"-?[0-9]+", r.choices[0].message.content.strip()), r.choices[0].message.content


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_object", "schema": [1]}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                                      "$ref": "#/$defs/a"}}}, "response_format"),
])
def test_bad_response_formats_are_400_naming_the_field(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=EXTRACT, max_tokens=4, response_format=fmt)
    assert e.value.param == param


def test_an_empty_grammar_is_refused_not_ignored(client):
    for body, param in (({"grammar": ""}, "grammar"), ({"json_schema": {}, "grammar": 'start: "a"'}, "grammar")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt="x", max_tokens=4, extra_body=body)
        assert e.value.param == param, e.value
