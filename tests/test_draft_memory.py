"""The draft memory (drafters/recall.py): earlier answers drafted again, bounded, evicted oldest
first, shared by an engine's lanes, and never a change to what is accepted."""
import threading

import numpy as np
import pytest
from fakes import FakeBackend

from edgespec.drafters.copy import CopyDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.recall import KEYS, DraftMemory
from edgespec.engine import Engine


def _answer(seed: int, n: int = 40, vocab: int = 1000) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, n)]


def _consistent(m: DraftMemory) -> None:
    """Every key points at a stored position whose n-gram hashes to it, inside one answer,
    with a continuation; the store holds at most the capacity."""
    assert len(m) <= m.capacity
    stored = list(m._tokens)
    for i in m._index.values():
        assert i >= m._base
        j = i - m._base
        assert stored[j] != -1 and stored[j + 1] != -1


def test_a_stored_answer_is_drafted_from_its_start_and_not_past_its_end():
    m = DraftMemory(1000)
    prompt, a = [1, 2, 3, 4, 5, 6, 7, 8, 9], _answer(0)
    m.add(a, prompt)
    # a new request with the same turn header: the answer's first tokens come from the memory
    r = m.match([50, 51] + prompt[-8:], 5)
    assert r.continuation == a[:5] and r.run >= 8
    # in the middle of the answer, a long agreement
    r = m.match(prompt[-8:] + a[:20], 8)
    assert r.continuation == a[20:28] and r.run == 28
    # at its end: nothing past it (the next stored answer is another request's)
    m.add(_answer(1), prompt)
    r = m.match(prompt[-8:] + a[:-2], 8)
    assert r.continuation == a[-2:]
    # a suffix shorter than the shortest key, or seen nowhere: no hit
    assert m.match(a[:min(KEYS) - 1], 8).run == 0
    assert m.match([999, 998, 997, 996, 995], 8).run == 0


def test_the_bound_holds_and_evicted_answers_are_never_returned():
    cap = 500
    m = DraftMemory(cap)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    answers = [_answer(s, 30 + 7 * (s % 5)) for s in range(40)]
    for s, a in enumerate(answers):
        m.add(a, prompt)
        _consistent(m)
        # the newest answers are there, whole
        assert m.match(prompt + a[:12], 200).continuation == a[12:]
    assert m.evicted > 0
    kept = [a for a in answers if m.match(prompt + a[:12], 200).continuation == a[12:]]
    gone = answers[:len(answers) - len(kept)]
    assert kept == answers[len(gone):]  # oldest first
    for a in gone:  # their own n-grams (random tokens: shared with no kept answer) find nothing
        assert m.match(a[:20], 8).run == 0
    # the index holds exactly what a memory of the kept answers alone would
    fresh = DraftMemory(cap)
    for a in kept:
        fresh.add(a, prompt)
    assert m.index_size() == fresh.index_size()


def test_an_evicted_occurrence_leaves_a_later_one_in_the_index():
    m = DraftMemory(120)
    shared = _answer(7, 20)
    first = shared + _answer(8, 20)
    m.add(first, [])
    m.add(_answer(9, 30), [])
    second = _answer(10, 10) + shared + [5, 6, 7]
    m.add(second, [])
    m.add(_answer(11, 30), [])  # evicts `first` (120 tokens: 41 + 31 + 34 + 31 > 120)
    assert m.evicted == 1
    _consistent(m)
    r = m.match(shared, 8)  # the shared passage now continues as in `second`
    assert r.continuation == [5, 6, 7]


def test_an_answer_longer_than_the_bound_keeps_its_last_part():
    m = DraftMemory(50)
    a = _answer(3, 200)
    m.add(a, [1, 2, 3])
    assert len(m) <= 50
    assert m.match(a[170:185], 10).continuation == a[185:195]
    assert m.match(a[:20], 5).run == 0


def test_lanes_share_one_memory_under_threads():
    m = DraftMemory(2000)
    errors = []

    def work(seed):
        try:
            for k in range(60):
                a = _answer(seed * 100 + k, 25)
                m.add(a, [1, 2, 3, 4])
                m.match([1, 2, 3, 4] + a[:10], 8)
        except Exception as exc:  # pragma: no cover - what the test looks for
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _consistent(m)
    assert m.answers == 240


# -- in an engine (the fake backend: exact, no rounding) ---------------------------------------

def _table(v: int = 400, seed: int = 5) -> np.ndarray:
    """Greedy answers that walk one long cycle through every token: an answer never repeats
    itself within 400 tokens, so its own context has little to copy."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0, 1, (v, v)).astype(np.float32)
    order = rng.permutation(v)
    table[order, np.roll(order, -1)] += 8.0
    return table


def _memory_drafts(r) -> tuple[int, int]:
    d = r.stats.by_drafter.get("memory", {})
    return d.get("drafted", 0), d.get("accepted", 0)


@pytest.mark.parametrize("kind", ["ngram", "copy", "auto"])
def test_a_repeated_answer_is_drafted_from_memory_and_the_tokens_do_not_change(kind):
    from edgespec.costs import Costs
    from edgespec.drafters.auto import AutoDrafter
    from edgespec.policy import Policy

    def drafter():
        if kind == "ngram":
            return NgramDrafter(gamma=6)
        if kind == "copy":
            return CopyDrafter(gamma=6)
        # rows nearly free, as on a GPU: the policy drafts what it trusts
        return AutoDrafter(Policy(Costs(tuple(0.01 + 0.0005 * k for k in range(1, 33)))), CopyDrafter())

    prompt = [0, 3, 9, 14, 2]
    plain = Engine(FakeBackend(_table())).generate(prompt, max_tokens=60).tokens
    off = Engine(FakeBackend(_table()), drafter())
    on_drafter = drafter()
    on_drafter.use_memory(DraftMemory(10_000))
    on = Engine(FakeBackend(_table()), on_drafter)
    for other in ([1, 7, 7, 30], [22, 5]):  # other answers in the memory too
        on.generate(other, max_tokens=30)
    first = on.generate(prompt, max_tokens=60)
    second = on.generate(prompt, max_tokens=60)
    for r in (first, second, off.generate(prompt, max_tokens=60)):
        assert r.tokens == plain
    drafted, accepted = _memory_drafts(second)
    assert accepted >= 20, second.stats.by_drafter
    assert second.stats.accepted >= first.stats.accepted + 10
    assert second.stats.target_forwards < first.stats.target_forwards


def test_engine_reset_forgets_the_memory_and_a_new_lane_shares_it():
    d = NgramDrafter(gamma=4)
    m = DraftMemory(1000)
    d.use_memory(m)
    eng = Engine(FakeBackend(_table(), n_seq=2), d)
    eng.generate([0, 3, 9, 14, 2], max_tokens=30)
    assert m.answers == 1 and len(m) > 0
    assert eng._lane(1).memory is m  # a lane forked later draws on the same answers
    eng.reset()
    assert len(m) == 0 and m.index_size() == 0


def test_draft_memory_setting_and_flag():
    from edgespec.assemble import Settings
    from edgespec.errors import UsageError
    assert Settings().draft_memory == 0
    with pytest.raises(UsageError, match="draft_memory"):
        Settings(draft_memory=-1).validate()
    from edgespec.frontend import _add_model_args, _Parser, settings_from_args
    p = _Parser(prog="x")
    _add_model_args(p)
    assert settings_from_args(p.parse_args(["--target", "m.gguf", "--draft-memory", "4096"])).draft_memory == 4096
    assert settings_from_args(p.parse_args(["--target", "m.gguf"])).draft_memory == 0


def test_make_drafter_gives_every_lookup_drafter_the_memory():
    from edgespec.assemble import make_drafter
    backend = FakeBackend(_table())
    for mode in ("ngram", "copy"):
        d = make_drafter(mode, backend, memory=512)
        ngram = d if mode == "ngram" else d.ngram
        assert isinstance(ngram.memory, DraftMemory) and ngram.memory.capacity == 512
        assert make_drafter(mode, backend).__dict__.get("memory", None) is None
    assert make_drafter("none", backend, memory=512) is None


# -- on the real SmolLM2 -----------------------------------------------------------------------

PROMPTS = ["Write a JSON object for a user named Ada Lovelace, born 1815, with a list of three hobbies.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List the planets of the solar system, one per line."]


def test_a_filled_memory_changes_no_token_on_smollm2(smol):
    """T = 0, flash attention on and one thread, where llama.cpp computes SmolLM2's rows in a batch
    as alone (docs/exactness.md): drafts from memory change the passes, never a token."""
    kw = dict(drafter="ngram", gamma=4, n_ctx=1024, flash_attn="on", threads=1, cache_ram=0, parallel=1)
    answers = {}
    with Engine.load(str(smol), **kw) as eng:
        for p in PROMPTS:
            answers[p] = eng.chat([{"role": "user", "content": p}], max_tokens=64).tokens
    with Engine.load(str(smol), draft_memory=65536, **kw) as eng:
        for p in PROMPTS:
            eng.chat([{"role": "user", "content": p}], max_tokens=64)
        recalled = 0
        for p in PROMPTS:
            r = eng.chat([{"role": "user", "content": p}], max_tokens=64)
            assert r.tokens == answers[p], p
            recalled += _memory_drafts(r)[0]
    assert recalled > 0  # the memory did draft: the passes were other than without it


def test_a_repeated_answer_is_drafted_from_memory_on_smollm2(smol):
    """The second of two identical requests, its prompt cache off and its sequence reset (the
    context holds no earlier answer): with the memory, at least 40% of its tokens are accepted
    drafts from memory and it takes at most 60% of the target passes of the first."""
    with Engine.load(str(smol), drafter="ngram", gamma=6, n_ctx=1024, cache_ram=0, parallel=1,
                     draft_memory=65536) as eng:
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        first = eng.chat(msgs, max_tokens=80)
        with eng._work:
            eng.sequences.reset()
        second = eng.chat(msgs, max_tokens=80)
    assert second.stats.reused_prompt_tokens == 0
    drafted, accepted = _memory_drafts(second)
    assert _memory_drafts(first) == (0, 0)
    assert accepted >= 0.4 * second.stats.generated, second.stats.by_drafter
    assert second.stats.target_forwards <= 0.6 * first.stats.target_forwards
