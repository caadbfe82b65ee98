"""Issue 50 at the server: `--record` (checked at start, 0600, Ollama's routes too, never parsing a
body before the checks, never failing a request), the refusals the copied APIs make (a chat ending
with the assistant's turn on /api/chat, `is_error` that is no boolean and a `tool_use` left
unanswered on /v1/messages, an Ollama seed below -1), and errors in words rather than pydantic's
names. Against real `edgespec serve` processes on SmolLM2."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import httpx
import pytest

from serverproc import ServerProcess

FLAGS = ["--ctx", "1024", "--drafter", "none", "--parallel", "1"]
HI = [{"role": "user", "content": "hi"}]
DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # valid JSON, nested 100,000 levels


@pytest.fixture(scope="module")
def recorded(smol, tmp_path_factory):
    """A server recording to a file of a folder of its own (the tests remove and restore the folder)."""
    tmp = tmp_path_factory.mktemp("recorded")
    folder = tmp / "records"
    folder.mkdir()
    srv = ServerProcess(["--target", str(smol), *FLAGS, "--record", str(folder / "session.jsonl")], tmp)
    srv.wait_ready()
    srv.record = folder / "session.jsonl"
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _post(srv, path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, timeout=120,
                      headers={"Content-Type": "application/json", **headers})


def _message(r: httpx.Response, status: int) -> str:
    """The error's text, in whichever API's shape the route answers."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    return err if isinstance(err, str) else err["message"]


def _lines(srv) -> list[dict]:
    return [json.loads(line) for line in srv.record.read_text(encoding="utf-8").splitlines()]


def _model(srv) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]


# -- 1. --record: checked at start, a later failure costs no request ----------------------------------
@pytest.mark.parametrize("where", ["missing/session.jsonl", "."])
def test_record_to_a_path_it_cannot_write_is_refused_at_start(smol, tmp_path, where):
    target = tmp_path / where
    r = subprocess.run([sys.executable, "-m", "edgespec.server", "--target", str(smol), *FLAGS,
                        "--record", str(target), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and f"--record {target}: cannot write there" in r.stderr, r.stderr
    assert "listening" not in r.stderr  # refused before it binds or loads anything


def test_a_recording_that_fails_later_is_logged_and_the_request_answered(recorded):
    folder = recorded.record.parent
    shutil.rmtree(folder)  # the file cannot be written (nor created) any more
    try:
        for path, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                           ("/v1/messages", {"messages": HI, "max_tokens": 2}),
                           ("/api/chat", {"model": _model(recorded), "messages": HI, "stream": False,
                                          "options": {"num_predict": 2}})):
            r = _post(recorded, path, body)
            assert r.status_code == 200, (path, r.text)
    finally:
        folder.mkdir()
    assert _post(recorded, "/v1/chat/completions", {"messages": HI, "max_tokens": 2}).status_code == 200
    assert [line["path"] for line in _lines(recorded)] == ["/v1/chat/completions"]  # recording again
    log = recorded.log.read_text()
    assert log.count("cannot write") == 1 and "recording again" in log, log  # said once, not per request


# -- 2. a body nested 100,000 levels: the same 400 with --record ---------------------------------------
def test_a_deeply_nested_body_is_the_same_400_with_record(recorded):
    before = recorded.record.read_bytes() if recorded.record.exists() else b""
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        message = _message(_post(recorded, path, DEEP), 400)
        assert "nests JSON deeper than 200 levels" in message, (path, message)
    after = recorded.record.read_bytes() if recorded.record.exists() else b""
    assert after == before  # no JSON it could hold: not recorded
    assert "RecursionError" not in recorded.log.read_text()


# -- 3. the record file: 0600, Ollama's routes too, bodies as sent -------------------------------------
def test_the_record_file_is_private_and_holds_every_api_body(recorded):
    name = _model(recorded)
    bodies = [("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "note": "ünïcode\nline"}),
              ("/v1/messages", {"messages": HI, "max_tokens": 2}),
              ("/api/chat", {"model": name, "messages": HI, "stream": False, "options": {"num_predict": 2}}),
              ("/api/generate", {"model": name, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}),
              ("/api/show", {"model": name})]
    start = len(_lines(recorded)) if recorded.record.exists() else 0
    for path, body in bodies:
        _post(recorded, path, json.dumps(body, indent=2).encode())  # pretty-printed: lines inside the body
    assert stat.S_IMODE(os.stat(recorded.record).st_mode) == 0o600
    got = _lines(recorded)[start:]
    assert [(g["path"], g["body"]) for g in got] == bodies


def test_an_existing_record_file_open_to_others_is_made_private(smol, tmp_path):
    record = tmp_path / "old.jsonl"
    record.write_text('{"time": 1, "path": "/v1/messages", "body": {}}\n')
    os.chmod(record, 0o644)  # as an older version left it
    srv = ServerProcess(["--target", str(smol), *FLAGS, "--record", str(record)], tmp_path)
    try:
        assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
        srv.wait_ready()  # SIGINT while the model still loads ends serve with 130 ("interrupted")
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    assert record.read_text().startswith('{"time": 1,')  # appended to, not replaced


# -- 8. refusals the copied APIs make -------------------------------------------------------------------
def test_an_ollama_chat_ending_with_the_assistants_turn_is_refused(recorded):
    name = _model(recorded)
    body = {"model": name, "stream": False, "messages": HI + [{"role": "assistant", "content": "Hello! How"}]}
    message = _message(_post(recorded, "/api/chat", body), 400)
    assert message.startswith("messages.1: the last message is the assistant's") and "prefilled" in message
    body["messages"].append({"role": "user", "content": "go on"})  # ending with the user's: answered
    body["options"] = {"num_predict": 2}
    assert _post(recorded, "/api/chat", body).status_code == 200


CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
TOOLS = [{"name": "get_time", "description": "the time", "input_schema": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("messages, said", [
    (HI + [{"role": "assistant", "content": [CALL]}, {"role": "user", "content": [dict(RESULT, is_error="yes")]}],
     'messages.2.content.0.is_error: must be true or false, got "yes"'),
    (HI + [{"role": "assistant", "content": [CALL]}, {"role": "user", "content": "and now?"}],
     "messages.1: tool_use ids were found without tool_result blocks immediately after: toolu_1"),
    (HI + [{"role": "assistant", "content": [CALL]}, {"role": "assistant", "content": "hm"},
           {"role": "user", "content": [RESULT]}],
     "messages.1: tool_use ids were found without tool_result blocks immediately after: toolu_1"),
])
def test_messages_refuses_what_anthropic_refuses(recorded, messages, said):
    body = {"messages": messages, "max_tokens": 2, "tools": TOOLS}
    assert _message(_post(recorded, "/v1/messages", body), 400).startswith(said)
    assert _message(_post(recorded, "/v1/messages/count_tokens", body), 400).startswith(said)


def test_messages_takes_a_tool_use_answered_in_the_next_turn(recorded):
    for result in (RESULT, dict(RESULT, is_error=True), dict(RESULT, is_error=False)):
        body = {"messages": HI + [{"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, CALL]},
                                  {"role": "user", "content": [result]}], "max_tokens": 2, "tools": TOOLS}
        assert _post(recorded, "/v1/messages", body).status_code == 200


def test_an_ollama_seed_below_minus_one_is_refused(recorded):
    body = {"model": _model(recorded), "messages": HI, "stream": False}
    message = _message(_post(recorded, "/api/chat", dict(body, options={"seed": -5})), 400)
    assert message == "options.seed must be >= 0, or -1 for a random seed; got -5"
    for seed in (-1, 7):  # random, and a seed
        assert _post(recorded, "/api/chat", dict(body, options={"seed": seed, "num_predict": 2})).status_code == 200


# -- 9. errors in words ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path, fields, said", [
    ("/api/chat", {"format": 5}, "format: must be a string or an object, got 5"),
    ("/api/chat", {"options": "hot"}, 'options: must be an object, got "hot"'),
    ("/api/generate", {"prompt": ["hi"]}, 'prompt: must be a string, got ["hi"]'),
    ("/api/chat", {"tools": [5]}, "tools.0: must be an object, got 5"),  # checked as the chat it becomes
    ("/v1/chat/completions", {"stop": [1]}, "stop: must be a string or a list of strings, got [1]"),
])
def test_errors_say_what_a_field_takes_not_pydantics_names(recorded, path, fields, said):
    if path.startswith("/v1"):
        body = {"messages": HI, "max_tokens": 2, **fields}
    else:
        body = {"model": _model(recorded), "stream": False, **({"prompt": "hi"} if "generate" in path else
                                                                {"messages": HI}), **fields}
    message = _message(_post(recorded, path, body), 400)
    assert message == said
    assert ".str" not in message and "Input should" not in message and "dict[" not in message
