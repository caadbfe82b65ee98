"""Many conversations on one engine: the host-RAM prompt cache (promptcache.py) and context
overflow, on SmolLM2 through the library, the CLI and a real server."""
from __future__ import annotations

import subprocess
import sys

import httpx
import psutil
import pytest

from edgespec import ContextLengthError, Engine
from edgespec.promptcache import MIN_TOKENS, PromptCache, Slot
from edgespec.slots import GROUP, PIECE, TILE


def _kept(n: int) -> int:
    """What a later prompt keeps of an earlier n-token one it extends, computed in tiles on this CPU
    (slots.py): all of it where it was longer than a piece, its whole groups where it was one piece."""
    return n if n > PIECE else n - n % GROUP if n >= TILE else 0

# longer than a piece (slots.PIECE): a later turn keeps the earlier prompt, and computes the rest (the
# answer, the new message) as alone
SYSTEMS = ["You are a helpful assistant for a bakery. " * 16, "You are a terse travel agent who loves trains. " * 14,
           "You are a chess coach who explains openings. " * 17]
QUESTIONS = [["What bread is best?", "And for toast?"], ["Paris to Rome?", "How long?"],
             ["Best opening?", "Why?"]]
ROUND_ROBIN = [(t, c) for t in range(2) for c in range(3)]
STRAIGHT = [(t, c) for c in range(3) for t in range(2)]


def _talk(eng: Engine, order, max_tokens=8) -> tuple[dict, dict]:
    convs = [[{"role": "system", "content": s}] for s in SYSTEMS]
    answers, stats = {}, {}
    for turn, c in order:
        convs[c].append({"role": "user", "content": QUESTIONS[c][turn]})
        r = eng.chat(convs[c], max_tokens=max_tokens)
        convs[c].append({"role": "assistant", "content": r.text})
        answers[(turn, c)], stats[(turn, c)] = r.tokens, r.stats
    return answers, stats


@pytest.mark.slow
def test_restored_conversations_continue_as_if_they_never_left(smol):
    """Three conversations in turn through the cache equal each alone, token for token (with a
    draft model: the next test)."""
    kw = dict(drafter="ngram", n_ctx=1024)
    with Engine.load(str(smol), cache_ram="32MiB", **kw) as eng:
        got, stats = _talk(eng, ROUND_ROBIN)
        cache = eng.cache.describe()
    with Engine.load(str(smol), cache_ram=0, **kw) as eng:
        assert eng.cache is None
        want, _ = _talk(eng, STRAIGHT)  # each conversation alone, straight through
    assert got == want  # token for token: a restore is byte-exact
    for c in range(3):  # every later turn came back from the cache: the first turn's prompt
        s = stats[(1, c)]
        assert s.restored_prompt_tokens == s.reused_prompt_tokens == _kept(stats[(0, c)].prompt_tokens) > PIECE
    assert cache["hits"] == 3 and cache["bytes"] <= 32 * 2**20


@pytest.mark.slow
def test_the_draft_models_cache_comes_back_with_the_targets(smol, smol_draft, monkeypatch):
    """A conversation restored with its draft model's KV answers as it does alone (this was the
    previous test's `model` case, which computed two more conversations twice)."""
    kw = dict(draft=str(smol_draft), drafter="model", n_ctx=1024)
    with Engine.load(str(smol), cache_ram="32MiB", **kw) as eng:
        _talk(eng, ROUND_ROBIN[:3])  # three conversations: the first two are in the cache now
        draft = eng.drafter.draft_backend
        conv = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": QUESTIONS[0][0]},
                {"role": "assistant", "content": "Sourdough."}, {"role": "user", "content": "Why?"}]
        prompt = eng.chat_tokens(conv)
        slot, n = eng.cache.best(prompt)
        assert slot is not None and slot.draft is not None and n > 100
        fed = []
        real = draft.eval_batch  # every pass of the draft model (a catch-up, a draft step) goes through it
        monkeypatch.setattr(draft, "eval_batch", lambda parts, **kw: fed.append(sum(len(t) for _, t, _ in parts))
                            or real(parts, **kw))
        r = eng.chat(conv, max_tokens=6)
        restored = r.stats.restored_prompt_tokens
        assert PIECE < restored == n  # the earlier prompt, all of it
        # the draft model caught up on what the target computed again only (brought to a tile, and
        # drafted 6 tokens at most), not on the whole conversation
        assert fed and fed[0] <= max(TILE, len(prompt) - restored + 1) < restored
    with Engine.load(str(smol), cache_ram=0, **kw) as eng:
        assert eng.chat(conv, max_tokens=6).tokens == r.tokens  # a restore is byte-exact


def _slot(n_tokens: int, nbytes: int, start: int = 0) -> Slot:
    return Slot(tuple(range(start, start + n_tokens)), b"x" * nbytes)


def test_the_cache_evicts_least_recently_used_by_bytes_and_drops_what_a_slot_extends():
    cache = PromptCache(12_000)
    a, b, c = _slot(40, 3000, 0), _slot(40, 3000, 100), _slot(40, 3000, 200)
    for s in (a, b, c):
        assert cache.put(s)
    assert len(cache) == 3 and cache.bytes == sum(s.nbytes for s in (a, b, c)) <= 12_000
    d = _slot(40, 3000, 300)
    assert cache.put(d)  # over capacity: the oldest (a) goes
    assert cache.best(a.tokens) == (None, 0) and cache.best(b.tokens)[0] is b and cache.evictions == 1
    grown = Slot(b.tokens + (7, 8, 9), b"y" * 3000)
    cache.put(grown)  # b is a prefix of it: b holds nothing it lacks
    assert cache.best(b.tokens)[0] is grown and len(cache) == 3
    assert not cache.put(_slot(40, 20_000, 500))  # larger than the whole cache
    assert not cache.put(_slot(MIN_TOKENS - 1, 10, 900))  # too short to be worth keeping
    assert cache.best(tuple(range(300, 300 + MIN_TOKENS - 1))) == (None, 0)  # a short match is no match
    cache.take(grown)
    assert cache.best(b.tokens) == (None, 0) and cache.bytes == c.nbytes + d.nbytes


def test_overflow_is_a_context_length_error_or_drops_the_oldest_turns(smol):
    with Engine.load(str(smol), drafter="none", n_ctx=256, cache_ram=0) as eng:
        long = [{"role": "system", "content": "Be brief."}]
        for i in range(12):
            long += [{"role": "user", "content": f"Question {i}: tell me about the number {i} in detail."},
                     {"role": "assistant", "content": f"The number {i} is a number that comes after {i - 1}."}]
        long.append({"role": "user", "content": "And the last one?"})
        with pytest.raises(ContextLengthError, match="the context holds 256") as err:
            eng.conversation_tokens(long, room=16)
        assert err.value.prompt_tokens > 256 - 16 and err.value.n_ctx == 256
        with pytest.raises(ContextLengthError):
            eng.chat(long, max_tokens=4)
        tokens, dropped = eng.conversation_tokens(long, room=16, overflow="drop-oldest")
        assert 0 < dropped < len(long) - 2 and len(tokens) + 16 <= 256
        kept = [m for m in long if m["role"] == "system"] + long[1 + dropped:]
        assert tokens == eng.chat_tokens(kept)  # the oldest turns went, the system message stayed


def test_cli_overflow_exits_2_in_one_line(smol):
    r = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(smol), "--ctx", "64", "--threads",
                        "1", "--drafter", "none", "-p", "word " * 200], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "the context holds 64" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def cached_server(smol, tmp_path_factory):
    from serverproc import ServerProcess
    srv = ServerProcess(["--target", str(smol), "--ctx", "1024", "--drafter", "ngram",
                         "--cache-ram", "48MiB"], tmp_path_factory.mktemp("cache"))
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _chat(srv, messages, max_tokens=8, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)


def test_server_prints_the_cache_and_reports_cached_tokens(cached_server):
    assert "prompt cache 48 MiB" in cached_server.log.read_text()
    convs = [[{"role": "system", "content": s}, {"role": "user", "content": q[0]}] for s, q in zip(SYSTEMS, QUESTIONS)]
    firsts = []
    for conv in convs:
        r = _chat(cached_server, conv)
        assert r.status_code == 200, r.text
        firsts.append(r.json()["usage"]["prompt_tokens"])
        conv.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        conv.append({"role": "user", "content": "Thanks. More?"})
    for conv, first in zip(convs, firsts):  # each comes back after the others: its first prompt
        r = _chat(cached_server, conv).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == _kept(first) > PIECE
        assert r["edgespec"]["restored_prompt_tokens"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]


EVICTIONS = "edgespec_prompt_cache_evictions_total"


@pytest.mark.slow
def test_server_rss_stays_within_the_cache_bound_over_many_conversations(cached_server):
    """Ten conversations of 900-950 tokens that share an 810-token system prompt, as an agent's
    do: each computes only its own last 130-180 tokens, but the cache keeps each one's whole KV. By
    the fifth the 48 MiB cache is full and evicting; over the six that follow the process grows by
    the cache's bound and a margin, no more (measured: 41 MiB grown and 6 evictions; 124 MiB with a
    cache that never evicts)."""
    proc = psutil.Process(cached_server.proc.pid)
    for i in range(10):
        if i == 4:
            before, evicted = proc.memory_info().rss, cached_server.metrics()[EVICTIONS][1]
        conv = [{"role": "system", "content": "You are a helpful assistant for a bakery. " * 90},
                {"role": "user", "content": f"Conversation {i}. " + QUESTIONS[i % 3][0] * 24}]
        r = _chat(cached_server, conv, max_tokens=4)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 896, r.text  # past a piece
    grown = proc.memory_info().rss - before
    assert grown <= (48 + 40) * 2**20, grown / 2**20
    assert cached_server.metrics()[EVICTIONS][1] - evicted >= 3


def test_server_overflow_is_400_context_length_exceeded(cached_server, smol, tmp_path):
    long = [{"role": "user", "content": "tell me more " * 400}]
    r = _chat(cached_server, long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _chat(cached_server, [{"role": "user", "content": "hi"}], max_tokens=1020)  # no room for the answer
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    from serverproc import ServerProcess
    srv = ServerProcess(["--target", str(smol), "--ctx", "256", "--drafter", "none",
                         "--context-overflow", "drop-oldest", "--cache-ram", "0"], tmp_path)
    try:
        srv.wait_ready()
        turns = [{"role": "system", "content": "Be brief."}]
        for i in range(10):
            turns += [{"role": "user", "content": f"Question {i} about the number {i}, in detail please."},
                      {"role": "assistant", "content": f"The number {i} comes after {i - 1} and before {i + 1}."}]
        turns.append({"role": "user", "content": "And the last?"})
        r = _chat(srv, turns, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["edgespec"]["dropped_messages"] > 0
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_a_restart_restores_from_disk_and_a_damaged_entry_is_refused(smol, tmp_path, caplog):
    import logging
    conv = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": QUESTIONS[1][0]}]
    kw = dict(drafter="ngram", n_ctx=1024, cache_ram=0)
    with Engine.load(str(smol), **kw) as eng:
        want = eng.chat(conv, max_tokens=10).tokens  # no cache at all: the conversation alone
    with Engine.load(str(smol), cache_dir=str(tmp_path), **kw) as eng:
        first = eng.chat(conv, max_tokens=10)
        assert first.stats.restored_prompt_tokens == 0 and first.tokens == want
    files = list(tmp_path.glob("*.slot"))
    assert len(files) == 1 and not list(tmp_path.glob("*.part"))  # written whole, under its own name at once
    with Engine.load(str(smol), cache_dir=str(tmp_path), **kw) as eng:  # the app restarts
        again = eng.chat(conv, max_tokens=10)
    # all but the last token, which is always evaluated (a disk entry keeps no logits row)
    assert again.tokens == want and again.stats.restored_prompt_tokens == again.stats.prompt_tokens - 1 > PIECE
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF  # one flipped bit in the KV state
    files[0].write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        with Engine.load(str(smol), cache_dir=str(tmp_path), **kw) as eng:
            damaged = eng.chat(conv, max_tokens=10)
            refused = eng.cache.describe()["disk"]["refused"]
    assert damaged.stats.restored_prompt_tokens == 0 and damaged.tokens == want and refused == 1
    assert "is damaged" in caplog.text
    mine = set(tmp_path.glob("*.slot"))  # the conversation, saved again at close
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgespec"):
        with Engine.load(str(smol), cache_dir=str(tmp_path), **dict(kw, n_ctx=512)) as eng:  # another context
            other = eng.chat(conv, max_tokens=10)
    assert other.stats.restored_prompt_tokens == 0  # an entry of other settings is never used,
    assert "for another setup (n_ctx): kept, not used" in caplog.text  # named by what differs,
    assert mine and mine <= set(tmp_path.glob("*.slot"))  # and kept for that setup


def test_a_fifo_or_a_device_named_like_a_slot_does_not_hang_the_disk_cache(tmp_path):
    import os
    from edgespec.promptcache import DiskCache
    os.mkfifo(tmp_path / "a.slot")  # an open() for reading would wait for a writer forever
    (tmp_path / "b.slot").symlink_to("/dev/zero")  # read() would never end
    cache = DiskCache(tmp_path, "identity")
    assert cache.best(tuple(range(100))) == (None, 0)
    assert cache.load(tmp_path / "b.slot") is None  # refused, not read
