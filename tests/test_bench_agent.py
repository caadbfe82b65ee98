"""`bench --kinds agent`: a recorded session (as `serve --record` writes it) replayed through real
servers (SmolLM2), each request's first-token time, decode rate and the prompt cache's share."""
from __future__ import annotations

import json

import pytest

from edgespec.cli import main

SYSTEM = "You are a terse coding agent. " * 24  # ~190 tokens: a whole piece, which the cache keeps
TURN1 = [{"role": "user", "content": "Name a sorting algorithm."}]
TURN2 = TURN1 + [{"role": "assistant", "content": "Merge sort."}, {"role": "user", "content": "Its complexity?"}]


@pytest.mark.slow
def test_a_recorded_session_replays_through_plain_and_auto(smol, tmp_path, capsys):
    session = tmp_path / "session.jsonl"
    lines = [{"time": 1.0, "path": "/v1/messages?beta=true", "body": {"model": "m", "max_tokens": 8, "system": SYSTEM,
                                                                     "messages": TURN1}},
             {"time": 2.0, "path": "/health", "body": {}},  # not a generation: left out
             {"time": 3.0, "path": "/v1/messages", "body": {"model": "m", "max_tokens": 8, "system": SYSTEM,
                                                            "messages": TURN2}},
             {"time": 4.0, "path": "/v1/responses", "body": {"model": "m", "max_output_tokens": 8,
                                                             "instructions": SYSTEM, "input": "Say hi."}}]
    session.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "agent.json"
    assert main(["bench", "--kinds", "agent", "--agent-session", str(session), "--target", str(smol),
                 "--ctx", "1024", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 3 and set(report["servers"]) == {"edgespec none", "edgespec auto"}
    for turns in report["servers"].values():
        assert [t["output_tokens"] > 0 for t in turns] == [True] * 3
        assert all(0 < t["ttft"] <= t["total"] for t in turns)
        # the second turn's prompt begins with the first's: the prompt cache kept it
        assert turns[1]["cached"] >= 128 and turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"]
    table = capsys.readouterr().out
    assert "edgespec auto" in table and "vs plain" in table


def test_a_session_file_that_is_not_one_is_a_usage_error(smol, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["bench", "--kinds", "agent", "--agent-session", str(bad), "--target", str(smol)]) == 2
    assert "bad.jsonl:1: not a JSON line" in capsys.readouterr().err
    assert main(["bench", "--kinds", "agent", "--agent-session", str(tmp_path / "none.jsonl"),
                 "--target", str(smol)]) == 2
    assert "record one with `serve --record FILE`" in capsys.readouterr().err


def test_the_shipped_session_is_codex_at_work():
    from edgespec.bench.agent import load_session
    from edgespec.registry import _shipped
    from edgespec.server.responses import ResponsesRequest
    session = load_session(_shipped("workloads/agent-session.jsonl"))
    assert len(session) == 7 and {t["path"] for t in session} == {"/v1/responses"}
    for turn in session:  # every request of it is one this server takes
        ResponsesRequest.model_validate(turn["body"]).chat()
    # a tool result goes back in a later turn (a file was written by a shell command)
    outputs = [i for t in session for i in t["body"]["input"] if i.get("type") == "function_call_output"]
    assert outputs


def test_a_refused_request_is_reported_and_left_out_of_the_ratios():
    """llama-server answers 400 to Codex's side request: the session goes on, the refusal is
    counted, and the ratios compare only the requests every server answered."""
    from edgespec.bench.agent import format_table, summarize
    ok = lambda total, ttft=1.0, n=10: {"ttft": ttft, "total": total, "output_tokens": n}  # noqa: E731
    results = {"edgespec none": [ok(100.0), ok(50.0), ok(10.0)],
               "llama-server ngram-mod": [ok(80.0), {"error": "/v1/responses answered 400"}, ok(10.0)]}
    s = summarize(results)
    theirs = s["llama-server ngram-mod"]
    assert theirs["refused"] == 1 and theirs["total_s"] == 90.0 and theirs["common_s"] == 90.0
    assert s["edgespec none"]["common_s"] == 110.0 and s["edgespec none"]["total_s"] == 160.0
    assert abs(s["edgespec none"]["vs_llama_server_best"] - 110.0 / 90.0) < 1e-9
    assert "every server answered" in format_table(s)


def test_requests_answered_at_different_lengths_are_left_out_of_the_comparison_with_plain():
    """At T = 0 a near-tie may send auto into a longer answer than plain's (the recorded Claude Code
    session's last request: 123 tokens against 71): the totals then compare different work, so auto is
    also compared with plain over the requests both answered with as many tokens."""
    from edgespec.bench.agent import format_table, summarize
    ok = lambda total, n: {"ttft": 1.0, "total": total, "output_tokens": n}  # noqa: E731
    results = {"edgespec none": [ok(40.0, 34), ok(9.0, 71)],
               "edgespec auto": [ok(39.0, 34), ok(13.0, 123)],
               "llama-server ngram-mod": [ok(38.0, 35), ok(7.0, 72)]}
    s = summarize(results)
    auto = s["edgespec auto"]
    assert auto["common_s"] == 52.0 and auto["vs_plain"] > 1.0  # the longer answer decides the totals
    assert auto["alike_s"] == 39.0 and auto["alike_requests"] == 1
    assert abs(auto["vs_plain_alike"] - 39.0 / 40.0) < 1e-9
    assert "alike_s" not in s["llama-server ngram-mod"]  # it counts the same answer a token longer
    table = format_table(s)
    assert "edgespec auto: over the 1 request it answered with as many tokens as plain, 39.0 s, x0.97" in table
    # every answer alike: no second comparison
    same = summarize({"edgespec none": [ok(40.0, 34)], "edgespec auto": [ok(39.0, 34)]})
    assert same["edgespec auto"]["alike_s"] == 39.0 and "as many tokens" not in format_table(same)
    # a request one of them refused is in neither comparison; none alike is said so
    refused = {"error": "answered 503"}
    s = summarize({"edgespec none": [ok(40.0, 34), refused], "edgespec auto": [ok(39.0, 35), ok(9.0, 71)]})
    assert s["edgespec auto"]["alike_requests"] == 0 and s["edgespec auto"]["common_s"] == 39.0
    assert "edgespec auto: no request answered with as many tokens as plain" in format_table(s)
    # without edgespec none (llama-server alone), or a summary of an older run: no comparison, no error
    alone = summarize({"llama-server ngram-mod": [ok(38.0, 35)]})
    assert "alike_s" not in alone["llama-server ngram-mod"] and "as many" not in format_table(alone)
    old = {k: {f: v for f, v in row.items() if "alike" not in f and f != "common_requests"}
           for k, row in summarize(results).items()}
    assert "as many" not in format_table(old)


def test_both_accept_gives_every_server_the_codex_session_it_can_read():
    """llama-server refuses Codex's `additional_tools` item (400) and leaves out its `namespace` tool,
    which edgespec flattens: with --peer every server gets the requests without them (the item's
    tools moved to `tools`, a namespace's functions offered one by one), so that both render the
    same prompt."""
    from edgespec.bench.agent import both_accept, load_session, session_path
    session = load_session(session_path("codex"))
    common, changed = both_accept(session)
    assert len(common) == len(session) and session[2]["body"]["input"][0]["type"] == "additional_tools"
    for turn in common:
        assert {i.get("type", "message") for i in turn["body"]["input"]} <= {"message", "function_call",
                                                                            "function_call_output"}
        assert {t["type"] for t in turn["body"]["tools"]} == {"function"}
    assert "spawn_agent" in [t["name"] for t in common[0]["body"]["tools"]]  # multi_agent_v1's, flattened
    moved = [t["name"] for t in common[2]["body"]["tools"]]
    assert moved and "exec_command" not in moved  # the side request's own tools, not the main one's
    assert any("additional_tools" in c for c in changed) and any("namespace" in c for c in changed)
    assert session[2]["body"]["input"][0]["type"] == "additional_tools"  # the recorded bodies untouched


def test_both_accept_joins_claude_codes_system_blocks_as_edgespec_reads_them():
    from edgespec.bench.agent import both_accept, load_session, session_path
    from edgespec.server.anthropic import MessagesRequest
    session = load_session(session_path("claude-code"))
    common, changed = both_accept(session)
    for turn, mine in zip(session, common):
        assert isinstance(mine["body"]["system"], str) and not mine["body"]["system"].startswith("x-anthropic")
        # edgespec reads both forms alike: the change only spells out how it reads the recorded one
        assert MessagesRequest.model_validate(turn["body"]).chat().messages == \
            MessagesRequest.model_validate(mine["body"]).chat().messages


def test_the_shipped_claude_code_session_reads_rewrites_and_asks_for_a_title():
    from edgespec.bench.agent import load_session, session_path
    session = load_session(session_path("claude-code"))
    assert len(session) == 6 and {t["path"] for t in session} == {"/v1/messages"}
    assert not session[0]["body"].get("tools") and "title" in json.dumps(session[0]["body"]["system"])
    calls = [b for m in session[-1]["body"]["messages"] if m["role"] == "assistant"
             for b in (m["content"] if isinstance(m["content"], list) else []) if b.get("type") == "tool_use"]
    assert [c["name"] for c in calls][:2] == ["Read", "Write"]
    assert "def most_valuable" in calls[1]["input"]["content"]  # the file read, written again


def test_llama_servers_counts_in_message_start_are_read():
    """llama-server says a Messages answer's prompt and cached tokens in message_start only; edgespec
    says them again in message_delta. Either way the report has them."""
    from edgespec.bench.agent import _usage
    usage = {}
    for ev in ({"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 3000, "input_tokens": 113,
                                                               "output_tokens": 0}}},
               {"type": "message_delta", "usage": {"output_tokens": 42}}):
        usage.update(_usage(ev) or {})
    assert usage == {"input": 3113, "cached": 3000, "output": 42}
    usage = {}
    for ev in ({"type": "message_start", "message": {"usage": {"input_tokens": 3113, "output_tokens": 0}}},
               {"type": "message_delta", "usage": {"output_tokens": 42, "input_tokens": 113,
                                                   "cache_read_input_tokens": 3000}}):
        usage.update(_usage(ev) or {})
    assert usage == {"input": 3113, "cached": 3000, "output": 42}


def test_each_request_is_shown_per_server_with_differing_counts_said():
    from edgespec.bench.agent import format_requests, per_request
    row = lambda p, c, o: {"ttft": 1.0, "total": 2.0, "output_tokens": o, "prompt_tokens": p, "cached": c}  # noqa: E731
    rows = per_request({"edgespec auto": [row(3113, 0, 40), row(3630, 3072, 500)],
                        "llama-server ngram-mod": [row(3113, 0, 40), row(3630, 3113, 497)]})
    assert [(r["same_prompt"], r["same_output"]) for r in rows] == [(True, True), (True, False)]
    text = format_requests(rows)
    assert "request 2: the servers' output token counts differ" in text and "request 1:" not in text


def test_every_replayed_answer_is_capped_alike():
    """At T = 0 a small model can loop where the agent's own sampling would not (llama-server wrote
    6,600 tokens of a Codex side request edgespec answered in 41): the replay holds every server's
    answers to one cap, the agent's own limit where lower."""
    from edgespec.bench.agent import capped
    session = [{"path": "/v1/messages", "body": {"max_tokens": 32000}},
               {"path": "/v1/responses", "body": {}},
               {"path": "/v1/chat/completions", "body": {"max_completion_tokens": 100}},
               {"path": "/v1/chat/completions", "body": {"max_tokens": 9000}}]
    got = [t["body"] for t in capped(session, 4096)]
    assert got == [{"max_tokens": 4096}, {"max_output_tokens": 4096}, {"max_completion_tokens": 100},
                   {"max_tokens": 4096}]
    assert capped(session, 0) is session and session[0]["body"] == {"max_tokens": 32000}


def test_a_negative_cap_is_refused(smol, capsys):
    assert main(["bench", "--kinds", "agent", "--agent-max-tokens", "-1", "--target", str(smol)]) == 2
    assert "--agent-max-tokens must be >= 0" in capsys.readouterr().err
