"""What a probing pass found (issue 27, item 4), each fixed and held here: deep schemas, tools
whose parameters are no object, call markup of a cut-off call, drop-oldest and tool results, a
cancel during a long prompt, the reason of a failed generation in the log."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

from edgespec import ContextLengthError, Engine, UsageError
from edgespec.constraints import Constraint
from edgespec.errors import Aborted
from edgespec.tools import Generic, Hermes, Llama3, Mistral, StreamParser, ToolSpec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_a_thousand_levels_is_a_usage_error_in_the_library_and_exit_2_in_the_cli(smol, tmp_path):
    deep = _deep(1000)
    with pytest.raises(UsageError, match="nests too deeply"):
        Constraint.build(json_schema=deep)
    with pytest.raises(UsageError, match="parameters is not a usable JSON Schema: .* nests too deeply"):
        ToolSpec.build([{"type": "function", "function": {"name": "f", "parameters": deep}}])
    path = tmp_path / "deep.json"
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    path.write_text(json.dumps(deep))
    r = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(smol), "--json-schema", str(path),
                        "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "nests too deeply" in r.stderr


@pytest.mark.parametrize("params", [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}])
def test_tool_parameters_must_be_an_object_schema(params):
    with pytest.raises(UsageError, match='must be a schema of type "object"'):
        ToolSpec.build([{"type": "function", "function": {"name": "n", "parameters": params}}], "required")
    # an object schema, or one without a type, is fine
    assert ToolSpec.build([{"type": "function", "function": {"name": "n", "parameters": {"properties": {}}}}])


@pytest.mark.parametrize("cut", ['<tool_call>', '<tool_call>\n', '<tool_call>\n{"name": "', '<tool_call>\n{"name": '
                                 '"get_weather", "arguments": {"city": "Os'])
def test_a_cut_off_hermes_call_shows_no_markup(cut):
    for text in (cut, "Let me look. " + cut):
        p = StreamParser(Hermes(), ToolSpec.build(TOOLS, "auto"))
        shown = p.feed(text)
        rest, calls = p.finish()
        assert calls == [] and "<tool_call>" not in shown + rest and "name" not in shown + rest
        assert (shown + rest).strip() == ("Let me look." if text != cut else "")


def test_cut_off_answers_of_the_json_formats_keep_a_reply_and_drop_a_call():
    spec = ToolSpec.build(TOOLS, "auto")
    g = Generic()
    assert g.parse('{"tool_call": {"name": "get_we', spec) == ("", [])
    assert g.parse('{"content": "It is sunny in Os', spec) == ("It is sunny in Os", [])
    assert g.parse('{"content": "Line\\nTwo \\u00e9\\u00', spec) == ("Line\nTwo é", [])
    assert g.parse('{"content": "done"', spec) == ("done", [])
    assert Llama3().parse('{"name": "get_weather", "parameters": {"ci', spec) == ("", [])
    assert Llama3().parse("Plain prose.", spec) == ("Plain prose.", [])
    assert Mistral().parse('Sure. [TOOL_CALLS][{"name": "get_wea', spec) == ("Sure.", [])


def test_drop_oldest_never_keeps_a_tool_result_without_its_call():
    from fakes import FakeBackend
    eng = Engine(FakeBackend(np.zeros((64, 64), np.float32), n_ctx=24))
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    # the probe's conversation: dropping the user turn and the call would leave the result alone
    msgs = [{"role": "user", "content": "1 2 3"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "a", "content": " ".join(map(str, range(30)))}]
    with pytest.raises(ContextLengthError):
        eng.conversation_tokens(msgs, room=4, overflow="drop-oldest")
    # when a later turn follows, the call goes with its result and what is left is a valid conversation
    msgs.append({"role": "user", "content": "9"})
    msgs[2]["content"] = " ".join(map(str, range(16)))  # too long to keep: the call goes with it
    tokens, dropped = eng.conversation_tokens(msgs, room=4, overflow="drop-oldest")
    assert dropped == 3 and len(tokens) + 4 <= 24


def test_a_cancel_stops_a_long_prompt_inside_its_pass(smol):
    from edgespec.backend import LlamaBackend
    prompt = list(range(100, 400))
    b = LlamaBackend(smol, n_ctx=512)
    try:
        b.eval([1, 2, 3], [], 0)
        with pytest.raises(Aborted):
            with b.abort_when(lambda: True):
                b.eval(prompt, [len(prompt) - 1], 0)
        assert b.held(0) == [1, 2, 3] and b.pos_max(0) == 2  # nothing of the stopped pass is kept
        after = b.eval(prompt, [len(prompt) - 1], 0)  # and the sequence goes on as if it never ran
        fresh = LlamaBackend(smol, n_ctx=512)
        try:
            fresh.eval([1, 2, 3], [], 0)
            assert np.array_equal(after, fresh.eval(prompt, [len(prompt) - 1], 0))
        finally:
            fresh.close()
        with b.abort_when(lambda: False):  # a predicate that never fires changes nothing
            b.eval([5], [0], 0)
    finally:
        b.close()


def test_an_engine_stream_cancelled_while_its_prompt_goes_in_ends_at_once(smol, monkeypatch):
    from edgespec import slots
    with Engine.load(str(smol), drafter="ngram", n_ctx=1024) as eng:
        real = slots.Sequences.prefill
        holder = {}

        def cancel_then_prefill(self, seq, tokens, limit=None):
            holder["stream"].cancel()  # the client leaves as the pass starts
            return real(self, seq, tokens, limit)
        monkeypatch.setattr(slots.Sequences, "prefill", cancel_then_prefill)
        stream = eng.stream("word " * 300, max_tokens=8)
        holder["stream"] = stream
        with stream:
            events = list(stream)
        assert stream.finish_reason == "cancelled" and stream.tokens == [] and len(events) == 1
        assert len(eng.target.held(0)) < 300  # the prompt's pass was stopped, not run
        monkeypatch.setattr(slots.Sequences, "prefill", real)
        assert eng.generate("word " * 300, max_tokens=4).stats.generated == 4  # and the engine goes on


def test_a_failed_generation_logs_its_reason(caplog):
    import asyncio

    from edgespec.server import worker

    class Broken:
        stats, finish_reason, tool_calls = None, None, []

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def __iter__(self):
            raise RuntimeError("the KV cache could not be cut back")

    loop = asyncio.new_event_loop()
    try:
        job = worker.Job(loop, lambda engine: Broken())
        with caplog.at_level(logging.ERROR, logger="edgespec.server"):
            t = threading.Thread(target=job.run, args=(None,))
            t.start()
            t.join()
    finally:
        loop.close()
    assert "generation failed: RuntimeError: the KV cache could not be cut back" in caplog.text
