"""Quoted sources: a call's arguments copy the prompt's text as a JSON string writes it.

An agent that has read a file (Claude Code's Read: the file with `cat -n` line numbers) and writes it
again (Write, Edit) writes its text inside a JSON string: newlines as \\n, quotes as \\". Prompt lookup
finds no such tokens in the prompt. With tools, the prompt's tool results and user turns are also
tokenized as a JSON string writes them (prompts.quoted_sources), and the copy drafter draws on them
(source "quoted"). Drafts only: the answer is the same with them or without."""
from __future__ import annotations

import json

import pytest

from edgespec.drafters.copy import CopyDrafter
from edgespec.drafters.recall import DraftMemory
from edgespec.prompts import PromptBuilder, _without_line_numbers

FILE = 'import sys\n\n\ndef main(argv):\n    """Print "hello" and the arguments."""\n    print("hello", argv)\n'
LISTING = "".join(f"{i}\t{line}\n" for i, line in enumerate(FILE.split("\n")[:-1], 1))
WRITE = {"type": "function", "function": {"name": "Write", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["file_path", "content"], "additionalProperties": False}}}


def test_a_cat_n_listing_loses_its_line_numbers_and_other_text_is_kept():
    assert _without_line_numbers(LISTING) == FILE
    note = "<system-reminder>Consider whether the file is malicious.</system-reminder>\n"
    assert _without_line_numbers(LISTING + note) == FILE + note
    prose = "1\tone thing\nand then another\nand a third\nwith a fourth"
    assert _without_line_numbers(prose) == prose
    assert _without_line_numbers("     1\u2192import sys\n     2\u2192x = 1\n") == "import sys\nx = 1\n"  # earlier Read


def test_the_copy_drafter_drafts_from_a_source_and_forgets_it_with_the_next_generation():
    d = CopyDrafter()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    source = list(range(100, 140))
    d.begin(prompt)
    d.use_sources(DraftMemory.of_sources([source]))
    m = d.match(prompt + [9] + source[:6], 8)
    assert m.continuation == source[6:14] and m.source == "quoted" and m.run == 6 and m.state == "fresh"
    # agreeing as long as an aligned copy does, it is judged as one (a file written again)
    m = d.match(prompt + [9] + source[:20], 8)
    assert m.continuation == source[20:28] and m.state == "aligned" and m.in_prompt
    # where the context's own copy agrees as long or longer, the context's is drafted
    ctx = prompt + source[:10] + [9] + [50] + source[:10]
    d.begin(ctx[:len(prompt) + 11])
    d.use_sources(DraftMemory.of_sources([[51] + source[:12] + [77] * 10]))
    assert d.match(ctx, 4).source is None and d.match(ctx, 4).continuation == [9, 50] + source[:2]
    d.end(ctx)
    assert d.sources is None  # the index goes with its generation
    d.begin(prompt)  # a new generation: no sources until it is given its own
    assert d.match(prompt + source[:6], 8).continuation == []


def test_of_two_versions_of_a_text_the_latest_is_drafted():
    """quoted_sources gives the latest text first: an agent that read a file, edited it and read it
    again writes from the second version."""
    old = list(range(100, 120)) + [1, 2, 3, 4]
    new = list(range(100, 120)) + [5, 6, 7, 8]
    d = CopyDrafter()
    d.begin([0])
    d.use_sources(DraftMemory.of_sources([new, old]))
    assert d.match([0] + list(range(100, 120)), 4).continuation == [5, 6, 7, 8]
    assert DraftMemory.of_sources([[1, 2], [3]]) is None  # nothing long enough to index


@pytest.fixture(scope="module")
def smol_engine(smol):
    from edgespec import Engine
    with Engine.load(str(smol), drafter="auto", n_ctx=2048, flash_attn="on", threads=1, cache_ram=0,
                     parallel=1) as eng:
        yield eng


def _conversation(content: str) -> list[dict]:
    return [{"role": "user", "content": "Read main.py, then write it again unchanged."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "Read", "arguments": '{"path": "main.py"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": content}]


def test_a_requests_tool_results_are_its_quoted_sources(smol_engine):
    from edgespec.request import Request
    eng = smol_engine
    with_tools = Request.build(max_tokens=16, tools=[WRITE])
    quoted = eng.target.tokenize(json.dumps(FILE)[1:-1], add_bos=False, special=False)
    assert eng.quoted_sources(_conversation(LISTING)) == (quoted,)
    prompt = eng.prepare_chat(_conversation(LISTING), with_tools)
    assert len(prompt.sources) == len(quoted) + 1  # and a separator
    assert prompt.sources.match([7] + quoted[:6], 4).continuation == quoted[6:10]
    assert eng.prepare_chat(_conversation(LISTING), Request.build(max_tokens=16)).sources is None  # no tools
    assert eng.quoted_sources(_conversation("1\tx = 1\n")) == ()  # shorter than QUOTED_MIN


INVENTORY = (
    "import json\nimport sys\n\n\ndef load_items(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def total_value(items):\n    total = 0.0\n    for item in items:\n"
    "        total += item[\"price\"] * item[\"quantity\"]\n"
    "    return total\n\n\ndef low_stock(items, threshold=5):\n"
    "    return [item[\"name\"] for item in items if item[\"quantity\"] < threshold]\n\n\n"
    "def most_valuable(items):\n    best = None\n    for item in items:\n"
    "        value = item[\"price\"] * item[\"quantity\"]\n"
    "        if best is None or value > best[1]:\n            best = (item[\"name\"], value)\n    return best\n\n\n"
    "def format_report(items):\n    lines = []\n    lines.append(f\"items: {len(items)}\")\n"
    "    lines.append(f\"total value: {total_value(items):.2f}\")\n    name, value = most_valuable(items)\n"
    "    lines.append(f\"most valuable: {name} ({value:.2f})\")\n    low = low_stock(items)\n    if low:\n"
    "        lines.append(\"low stock: \" + \", \".join(low))\n    return \"\\n\".join(lines)\n")


@pytest.mark.qwen
def test_a_forced_write_of_a_file_read_is_drafted_from_it_and_changes_no_token(qwen_pair, monkeypatch):
    """Qwen2.5-Coder-0.5B writes back the file it read (Claude Code's Read listing, a forced Write):
    with `bit_exact` (T = 0 rows as plain decoding computes them) the call is the same token for token
    with quoted sources and without; with them most of the file is drafted from its escaped text
    (measured: 29 of 30 quoted drafts accepted, 68 target passes against 91 for 120 tokens)."""
    from edgespec import Engine
    from edgespec.request import Request
    listing = "".join(f"{i}\t{line}\n" for i, line in enumerate(INVENTORY.split("\n")[:-1], 1))
    msgs = [{"role": "user", "content": "Read inventory.py, then write it again with the Write tool, renaming "
                                        "total_value to inventory_value everywhere."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "Read", "arguments": '{"path": "inventory.py"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": listing}]
    read = {"type": "function", "function": {"name": "Read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    req = Request.build(max_tokens=120, tools=[read, WRITE],
                        tool_choice={"type": "function", "function": {"name": "Write"}})
    with Engine.load(str(qwen_pair[1]), drafter="auto", n_ctx=4096, cache_ram=0, parallel=1, bit_exact=True) as eng:
        quoted = eng.stream_prompt(eng.prepare_chat(msgs, req)).result()
        monkeypatch.setattr(PromptBuilder, "quoted_sources", lambda self, messages: ())
        eng.reset()
        plain = eng.stream_prompt(eng.prepare_chat(msgs, req)).result()
    assert quoted.tokens == plain.tokens
    drafted = quoted.stats.by_drafter.get("quoted", {})
    assert drafted.get("accepted", 0) >= 15, quoted.stats.by_drafter
    assert "quoted" not in plain.stats.by_drafter
    assert quoted.stats.target_forwards < plain.stats.target_forwards
