"""A stream that waits on a long prompt carries keep-alive events in its API's own kind (an agent gives
up on a stream without events), and none of the answer's events is lost to the wait."""
from __future__ import annotations

import asyncio
import json

import edgespec.server.app as app_mod
from edgespec.server import anthropic, responses, worker
from edgespec.server.openai import Envelope


class SlowJob:
    """A job whose first text comes after `delay` seconds (its prompt being evaluated)."""

    def __init__(self, delay: float):
        self.events = [(worker.TEXT, "Paris"), (worker.END, (Stats(), "eos", []))]
        self.delay = delay

    async def next(self):
        if self.delay:
            await asyncio.sleep(self.delay)
            self.delay = 0
        return self.events.pop(0)

    def cancel(self):
        pass


class Stats:
    prompt_tokens, reused_prompt_tokens, restored_prompt_tokens, generated = 20000, 0, 0, 1
    drafter, drafted, accepted, acceptance_rate, target_forwards, by_drafter = "auto", 0, 0, 0.0, 1, {}
    prompt_seconds, decode_seconds, tokens_per_second, stop_sequence = 300.0, 0.1, 10.0, None
    draft_forwards, accept_histogram, costs = 0, {}, {}


async def _collect(shape, delay):
    watcher = asyncio.ensure_future(asyncio.sleep(3600))
    return [item async for item in app_mod._events(SlowJob(delay), shape, watcher)]


def test_a_quiet_stream_gets_keepalives_in_its_apis_kind(monkeypatch):
    monkeypatch.setattr(app_mod, "KEEPALIVE_SECONDS", 0.05)
    messages = anthropic.MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user",
                                                                                           "content": "?"}]})
    items = asyncio.run(_collect(anthropic.Shape("m", messages, 20000), 0.3))
    kinds = [json.loads(i["data"])["type"] for i in items]
    # message_start, ping, then an empty text block's deltas while it waits, the text in the same block
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    waits = [json.loads(i["data"]) for i in items if '"text_delta"' in i["data"]]
    assert len(waits) >= 3 and all(w["delta"]["text"] == "" for w in waits[:-1])
    assert waits[-1]["delta"]["text"] == "Paris"
    assert kinds.count("content_block_start") == 1 and kinds[-2:] == ["message_delta", "message_stop"]

    body = responses.ResponsesRequest.model_validate({"input": "?"})
    items = asyncio.run(_collect(responses.Shape("m", body), 0.3))
    kinds = [json.loads(i["data"])["type"] for i in items]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds.count("response.in_progress") >= 3
    seq = [json.loads(i["data"])["sequence_number"] for i in items]
    assert seq == list(range(len(seq)))  # the keep-alives are numbered in order with the rest
    assert "Paris" in "".join(i["data"] for i in items if "output_text.delta" in i["data"])

    items = asyncio.run(_collect(Envelope("chat", "m"), 0.3))
    assert sum(1 for i in items if isinstance(i, dict) and i.get("comment")) >= 3
    assert any("Paris" in i for i in items if isinstance(i, str))


def test_a_prompt_evaluated_quickly_gets_no_keepalive(monkeypatch):
    monkeypatch.setattr(app_mod, "KEEPALIVE_SECONDS", 5.0)
    messages = anthropic.MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user",
                                                                                           "content": "?"}]})
    items = asyncio.run(_collect(anthropic.Shape("m", messages, 20000), 0.0))
    deltas = [json.loads(i["data"])["delta"] for i in items if '"text_delta"' in i["data"]]
    assert deltas == [{"type": "text_delta", "text": "Paris"}]
