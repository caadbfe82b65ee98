"""Several generations on one engine (parallel > 1), on the numpy fake backend.

Exactness per sequence: two generations advanced in the same rounds (one verifying pass for
both, the draft model's steps batched) are enumerated over every random draw, both drawing
from one enumerating rng so that their draws interleave as the rounds make them: the joint law
of the two answers must be the product of the target's own laws for each prompt, up to float32
rounding. At T = 0 each answer equals its answer alone, token for token (no kernel rounding in
the fake). Then the bookkeeping: shared prefixes copied between sequences, cancel, the context
limit, a constraint per sequence, admission beyond `parallel`, threads and close().
"""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

import edgespec.engine as engine_mod
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.copy import CopyDrafter
from edgespec.drafters.model import ModelDrafter
from edgespec.engine import Engine
from edgespec.errors import UsageError
from edgespec.costs import Costs
from edgespec.policy import Policy
from edgespec.sampling import SamplingParams, warp

from fakes import FakeBackend
from test_verify_exact import enumerate_paths, law, max_diff

V = 3
M = 2
PARAMS = SamplingParams(1.0)
TOL = 1e-6


def _tables(seed: int = 3):
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    q = (p + rng.normal(0, 1.5, (V, V))).astype(np.float32)
    q[:, 2] = -np.inf  # the draft never proposes 2: the residual must supply it
    return p, q


def single_law(p, prompt) -> dict:
    P = warp(p, PARAMS).astype(np.float64)
    out = {}
    for seq in itertools.product(range(V), repeat=M):
        prob, prev = 1.0, prompt[-1]
        for x in seq:
            prob *= P[prev, x]
            prev = x
        out[seq] = prob
    return out


def _model_engine(p, q, n=2, gamma=2):
    target = FakeBackend(p, n_seq=n)
    return Engine(target, ModelDrafter(FakeBackend(q, n_seq=n, name="draft"), V, gamma), parallel=n)


def _auto_engine(p, q, n=2):
    target = FakeBackend(p, n_seq=n)
    costs = Costs(tuple(0.01 * (1 + 0.02 * k) for k in range(16)), draft_step=0.001)
    model = ModelDrafter(FakeBackend(q, n_seq=n, name="draft"), V, 2)
    return Engine(target, AutoDrafter(Policy(costs), CopyDrafter(), model), parallel=n)


def _pair_law(engine, monkeypatch, prompts=((0, 1), (2, 0))):
    """The enumerated joint law of two generations run side by side."""
    def run(rng):
        monkeypatch.setattr(engine_mod, "_rng", lambda seed: rng)
        engine.reset()
        a = engine.stream(list(prompts[0]), max_tokens=M, temperature=1.0)
        b = engine.stream(list(prompts[1]), max_tokens=M, temperature=1.0)
        for s in itertools.cycle((a, b)):  # both read a token at a time: their rounds are shared
            if all(x.finish_reason for x in (a, b)):
                break
            if not s.finish_reason:
                next(s, None)
        return tuple(a.tokens), tuple(b.tokens)
    return law(enumerate_paths(run))


@pytest.mark.parametrize("make", [_model_engine, _auto_engine], ids=["model", "auto"])
def test_two_sequences_in_one_batch_each_have_the_target_law(make, monkeypatch):
    p, q = _tables()
    engine = make(p, q)
    got = _pair_law(engine, monkeypatch)
    la, lb = single_law(p, (0, 1)), single_law(p, (2, 0))
    want = {(x, y): la[x] * lb[y] for x in la for y in lb}
    assert max_diff(got, want) < TOL
    # they really shared passes: a verifying pass with both sequences' rows in it
    assert any(len(parts) == 2 for parts in engine.target.batches)
    if make is _model_engine:  # and the draft model's steps for both in one batch
        assert any(len(parts) == 2 for parts in engine.drafter.draft_backend.batches)


def test_a_wrong_batched_verifier_misses_the_product_law(monkeypatch):
    """The harness can fail: rows of the two sequences swapped in the verifying pass."""
    p, q = _tables()
    engine = _model_engine(p, q)
    real = engine.target.eval_batch

    def swapped(parts):
        out = real(parts)
        if len(out) == 2 and out[0].shape == out[1].shape:
            out = [out[1], out[0]]
        return out
    monkeypatch.setattr(engine.target, "eval_batch", swapped)
    got = _pair_law(engine, monkeypatch)
    la, lb = single_law(p, (0, 1)), single_law(p, (2, 0))
    want = {(x, y): la[x] * lb[y] for x in la for y in lb}
    assert max_diff(got, want) > 0.01


def _greedy_tables(seed):
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 1.5, (8, 8)).astype(np.float32)
    return p, (p + rng.normal(0, 1.0, (8, 8))).astype(np.float32)


PROMPTS = [[0, 1, 2], [3, 4], [5, 6, 7, 1], [2, 2, 3]]


def _four_at_once(engine, n: int) -> list:
    """PROMPTS' greedy answers from four threads, all four admitted before any reads (the first
    round is everyone's)."""
    out: dict = {}
    start = threading.Barrier(4)

    def worker(i):
        s = engine.stream(PROMPTS[i], max_tokens=n)
        start.wait()
        out[i] = s.result().tokens
        s.close()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [out.get(i) for i in range(4)]


def test_greedy_answers_in_a_batch_equal_their_answers_alone_from_four_threads():
    p, q = _greedy_tables(4)
    alone = [Engine(FakeBackend(p)).generate(pr, max_tokens=40).tokens for pr in PROMPTS]
    engine = _auto_engine(p, q, n=4)
    assert _four_at_once(engine, 40) == alone
    assert max(len(parts) for parts in engine.target.batches) >= 2  # rounds were shared


def test_a_prompt_starting_with_another_sequences_tokens_copies_them_instead_of_evaluating():
    p, q = _greedy_tables(5)
    engine = _model_engine(p, q, n=2)
    system = [1, 2, 3, 4, 5, 6, 7, 0] * 6  # a long shared system prompt
    first = engine.stream(system + [1, 1], max_tokens=30)
    next(first)  # running on sequence 0
    engine.target.batches.clear()
    second = engine.stream(system + [2, 2], max_tokens=5)
    r = second.result()
    assert r.stats.reused_prompt_tokens == len(system)
    # its prompt pass fed only what follows the shared part (the first stream, alone until then, may have
    # read one round ahead after its first token: engine._wanted)
    assert [b for b in engine.target.batches if any(part[0] == 1 for part in b)][0] == [(1, 2, 1)]
    assert engine.target.held(1)[:len(system)] == system
    alone = Engine(FakeBackend(p)).generate(system + [2, 2], max_tokens=5).tokens
    assert r.tokens == alone
    first.close()


def test_cancel_ends_one_sequence_and_the_other_runs_on():
    p, q = _greedy_tables(6)
    engine = _model_engine(p, q)
    a = engine.stream([0, 1], max_tokens=50)
    b = engine.stream([2, 3], max_tokens=50)
    next(a), next(b)
    a.cancel()
    rest = b.result()
    a.result()
    assert a.finish_reason == "cancelled" and len(a.tokens) < 50
    assert rest.stats.finish_reason == "length" and len(rest.tokens) == 50


def test_a_full_context_ends_one_sequence_not_the_other():
    p, q = _greedy_tables(7)
    target = FakeBackend(p, n_ctx=24, n_seq=2)
    engine = Engine(target, ModelDrafter(FakeBackend(q, n_ctx=24, n_seq=2), 8, 3))
    long_prompt = list(range(8)) * 2 + [1, 2]          # 18 tokens: 6 more fit
    a = engine.stream(long_prompt, max_tokens=20)
    b = engine.stream([0, 1], max_tokens=10)
    ra, rb = None, None
    for _ in range(40):
        ra = ra or (None if next(a, None) is not None and a.finish_reason is None else a.result())
        rb = rb or (None if next(b, None) is not None and b.finish_reason is None else b.result())
        if ra and rb:
            break
    assert ra.stats.finish_reason == "context" and len(ra.tokens) == 24 - 18
    assert rb.stats.finish_reason == "length" and len(rb.tokens) == 10


def test_constraints_are_per_sequence():
    vocab = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos = len(vocab) - 1
    rng = np.random.default_rng(0)
    t = rng.normal(0, 1, (len(vocab), len(vocab))).astype(np.float32)
    target = FakeBackend(t, eos=eos, vocab_bytes=vocab, n_seq=2)
    engine = Engine(target, ModelDrafter(FakeBackend(t * 0.8, eos=eos, n_seq=2), len(vocab), 3))
    a = engine.stream([65, 66], max_tokens=8, regex="[0-9]{3}")
    b = engine.stream([67, 68], max_tokens=8)
    ta, tb = [], []
    for s, acc in itertools.cycle(((a, ta), (b, tb))):
        if a.finish_reason and b.finish_reason:
            break
        if not s.finish_reason:
            ev = next(s, None)
            if ev is not None and ev.token is not None:
                acc.append(ev.token)
    assert len(ta) == 3 and all(48 <= x <= 57 for x in ta) and a.finish_reason == "stop"
    alone = Engine(FakeBackend(t, eos=eos)).generate([67, 68], max_tokens=8).tokens
    assert tb == alone


def test_more_requests_than_sequences_wait_for_a_free_one():
    p, q = _greedy_tables(8)
    engine = _model_engine(p, q, n=2)
    a = engine.stream([0, 1], max_tokens=5)
    b = engine.stream([2, 3], max_tokens=5)
    got = []

    def third():
        got.append(engine.generate([4, 5], max_tokens=5).tokens)
    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert not got and t.is_alive()  # waits: both sequences are taken
    a.result()
    a.close()
    t.join(10)
    assert got and got[0] == Engine(FakeBackend(p)).generate([4, 5], max_tokens=5).tokens
    b.close()


def test_one_thread_may_hold_as_many_streams_as_sequences_then_the_oldest_is_outdated():
    p, q = _greedy_tables(9)
    engine = _model_engine(p, q, n=2)
    a = engine.stream([0, 1], max_tokens=5)
    b = engine.stream([2, 3], max_tokens=5)
    c = engine.stream([4, 5], max_tokens=5)
    with pytest.raises(UsageError, match="outdated"):
        next(a)
    assert len(b.result().tokens) == 5 and len(c.result().tokens) == 5


def test_close_from_another_thread_while_four_generate():
    p, q = _greedy_tables(10)
    engine = _auto_engine(p, q, n=4)
    errors, started = [], threading.Barrier(5)

    def worker(i):
        try:
            s = engine.stream(PROMPTS[i], max_tokens=100_000 // 100)
            started.wait()
            for _ in s:
                pass
        except Exception as exc:  # closed under it: an EdgespecError, nothing else
            errors.append(exc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    engine.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    from edgespec.errors import EdgespecError
    assert all(isinstance(e, EdgespecError) for e in errors)
    assert engine.target.closed


def test_parallel_beyond_the_sequences_the_models_hold_is_refused():
    p, q = _greedy_tables(11)
    with pytest.raises(UsageError, match="parallel must be in 1..2"):
        Engine(FakeBackend(p, n_seq=2), ModelDrafter(FakeBackend(q, n_seq=2), 8), parallel=3)
    with pytest.raises(UsageError, match="parallel must be in 1..1"):
        Engine(FakeBackend(p, n_seq=4), ModelDrafter(FakeBackend(q, n_seq=1), 8), parallel=2)


def test_the_policy_prices_a_shared_pass_so_a_cpu_drafts_less_beside_other_sequences():
    """On a CPU a row costs most of a step (T(k) = T1 (1 + 0.6 (k - 1))): a copy that pays for
    several drafts alone pays for far fewer in a pass with three other sequences' rows, where a
    plain token costs T(4)/4; on a GPU (rows nearly free) it pays as much either way."""
    from edgespec.policy import Offer
    cpu = Costs(tuple(0.05 * (1 + 0.6 * (k - 1)) for k in range(1, 33)))
    gpu = Costs(tuple(0.05 * (1 + 0.02 * (k - 1)) for k in range(1, 33)))
    offer = Offer(16, 8, "aligned")  # an aligned copy sixteen tokens long
    alone = Policy(cpu).choose(offer, room=8)
    shared = Policy(cpu).choose(offer, room=8, base=(4, 4), seqs=4)
    assert alone.drafter == "copy" and alone.gamma >= 2
    assert shared.gamma <= alone.gamma // 2  # measured: 4 alone, 1 shared
    # on a GPU too a draft beside the others is a micro-batch of its own (one more computation):
    # alone it drafts at least as long as the CPU, beside three plain sequences shorter than alone
    from edgespec.costs import Part, Share
    gpu_alone = Policy(gpu).choose(offer, room=8)
    beside = Policy(gpu).choose(offer, room=8, share=Share(0, tuple(Part(s, 1, 1) for s in (1, 2, 3))))
    assert gpu_alone.gamma >= alone.gamma and beside.gamma < gpu_alone.gamma


def test_a_long_prompt_joining_a_running_answer_goes_in_by_pieces_between_its_rounds(monkeypatch):
    """A prompt beside a running generation is evaluated PIECE tokens a round, so the running
    one keeps getting tokens; both answers equal their answers alone."""
    monkeypatch.setattr(engine_mod, "PIECE", 8)
    p, q = _greedy_tables(12)
    target = FakeBackend(p, n_seq=2, n_batch=8)
    target.canonical_piece = 8  # the canonical pieces are the pieces beside others here
    engine = Engine(target, ModelDrafter(FakeBackend(q, n_seq=2), 8, 2))
    running = engine.stream([0, 1], max_tokens=40)
    next(running)
    long_prompt = [1, 2, 3, 4, 5, 6, 7] * 6  # 42 tokens: six pieces of 8
    rounds_before = running.generation.stats.rounds
    joining = engine.stream(long_prompt, max_tokens=5)
    while joining.generation.seq < 0 or not joining.generation.started:
        next(running)
    got_between = running.generation.stats.rounds - rounds_before
    pieces = [parts for parts in engine.target.batches if any(n == 8 and r == 0 for _, n, r in parts)]
    assert len(pieces) >= 4 and got_between >= 4  # the running answer went on between the pieces
    r = joining.result()
    rest = running.result()
    assert r.tokens == Engine(FakeBackend(p)).generate(long_prompt, max_tokens=5).tokens
    assert rest.tokens == Engine(FakeBackend(p)).generate([0, 1], max_tokens=40).tokens
    assert r.stats.reused_prompt_tokens == 0 and r.stats.prompt_tokens == 42


def test_a_long_prompt_steps_aside_while_a_short_answer_runs_then_goes_on(monkeypatch):
    """A prompt with more than LONG_PROMPT tokens to evaluate waits while others run, up to
    YIELD_SECONDS (an agent's side request answers alone first); past that it goes in by pieces."""
    monkeypatch.setattr(engine_mod, "PIECE", 8)
    monkeypatch.setattr(engine_mod, "LONG_PROMPT", 16)
    p, q = _greedy_tables(12)
    long_prompt = [1, 2, 3, 4, 5, 6, 7] * 6  # 42 tokens

    def run(yield_seconds):
        monkeypatch.setattr(engine_mod, "YIELD_SECONDS", yield_seconds)
        target = FakeBackend(p, n_seq=2, n_batch=8)
        target.canonical_piece = 8
        engine = Engine(target, ModelDrafter(FakeBackend(q, n_seq=2), 8, 2))
        running = engine.stream([0, 1], max_tokens=12)
        next(running)
        joining = engine.stream(long_prompt, max_tokens=5)
        list(running)
        r = joining.result()
        # the passes, in order: how many of the short answer's came after the long prompt's first piece?
        short, long_ = running.generation.seq, joining.generation.seq
        passes = target.batches
        first = next(i for i, parts in enumerate(passes) if any(s == long_ and n == 8 for s, n, _ in parts))
        return sum(1 for parts in passes[first:] if any(s == short for s, _, _ in parts)), r
    after, r = run(1000.0)
    assert after == 0  # nothing of the long prompt went in while the short answer ran
    assert r.tokens == Engine(FakeBackend(p)).generate(long_prompt, max_tokens=5).tokens
    after, r = run(0.0)  # stepping aside for no time at all: pieces between its rounds
    assert after > 0
    assert r.tokens == Engine(FakeBackend(p)).generate(long_prompt, max_tokens=5).tokens


def test_micro_batches_follow_llama_cpp_split_of_separate_kv_streams():
    """llama.cpp (split_equal, sequential) puts consecutive sequence ids with equal token counts in
    one computation: one sequence's draft beside three plain ones is two, a gap in the ids another."""
    from edgespec.costs import Part, micro_batches
    plain4 = [Part(s, 1, 1) for s in range(4)]
    assert micro_batches(plain4) == [(4, 4)]
    assert micro_batches([Part(0, 9, 9)] + plain4[1:]) == [(4, 4), (8, 8)]
    assert micro_batches([Part(0, 4, 4), Part(1, 4, 4)]) == [(8, 8)]  # equal drafts stay one
    assert micro_batches([Part(2, 1, 1), Part(0, 1, 1)]) == [(1, 1), (1, 1)]  # 0 and 2: never together
    assert micro_batches([Part(0, 1, 1), Part(1, 1, 1), Part(3, 1, 1)]) == [(2, 2), (1, 1)]
    # rows are a part's last tokens: 3 pending tokens with one row, beside a plain sequence
    assert micro_batches([Part(0, 3, 1), Part(1, 1, 1)]) == [(2, 1), (2, 1)]
    assert micro_batches([Part(0, 0, 0), Part(1, 2, 2)]) == [(2, 2)]


def test_a_shared_pass_is_priced_by_its_micro_batches():
    """A draft beside other sequences makes llama.cpp compute the pass twice, every weight read
    again: where a computation's fixed cost dominates (a GPU-like curve) a short copy that pays
    alone is not drafted beside three plain sequences, but rides along where another sequence's
    draft of the same length already makes that second computation."""
    from edgespec.costs import Part, Share
    from edgespec.policy import Offer
    costs = Costs(tuple(0.020 + 0.002 * k for k in range(1, 33)))  # T(k) = 20 ms + 2 ms a row
    assert costs.split_cost([Part(0, 9, 9)] + [Part(s, 1, 1) for s in (1, 2, 3)]) == pytest.approx(
        costs.verify_cost(4) + costs.verify_cost(8))
    offer = Offer(16, 2, "aligned")  # an aligned copy, two tokens on offer
    alone = Policy(costs).choose(offer, room=8)
    assert alone.drafter == "copy" and alone.gamma == 2
    beside = Policy(costs).choose(offer, room=8, share=Share(0, tuple(Part(s, 1, 1) for s in (1, 2, 3))))
    assert beside.drafter == "none"
    joined = Policy(costs).choose(offer, room=8, share=Share(1, (Part(0, 3, 3), Part(2, 1, 1), Part(3, 1, 1))))
    assert joined.drafter == "copy" and joined.gamma == 2


def test_a_new_generation_takes_a_sequence_that_keeps_the_running_ids_consecutive():
    """With sequences 0 and 2 running, a new request takes 1 (not 3, nor an idle one holding
    more of its prompt: that prefix is copied over), so that every pass stays one computation."""
    from edgespec.slots import Sequences, _runs
    assert _runs({0, 1, 3}) == 2 and _runs({0, 1, 2}) == 1 and _runs(set()) == 0
    p, _ = _greedy_tables(11)
    target = FakeBackend(p, n_seq=4)
    seqs = Sequences(target, None, n=4)
    seqs.prefill(3, [1, 2, 3, 4, 5, 6, 7, 0] * 3 + [6])  # sequence 3 holds the prompt's head, in whole pieces
    prompt = [1, 2, 3, 4, 5, 6, 7, 0] * 3 + [5]
    seq, _ = seqs.claim(prompt, busy={0, 2})
    assert seq == 1 and target.held(1) == prompt[:24]
    target.batches.clear()
    seqs.prefill(1, prompt)
    assert target.batches == [[(1, 1, 1)]]  # only the prompt's own last token was evaluated
    # an exact repeat of a prompt another sequence holds comes over whole, its last row too:
    # nothing is evaluated (the row alone would round otherwise than in its batch)
    seqs.prompt_row.clear()
    target.reset()
    seqs.prefill(3, prompt)
    target.batches.clear()
    seq, _ = seqs.claim(prompt, busy={0, 2})
    assert seq == 1 and seqs.prefill(1, prompt)[1] == len(prompt) and target.batches == []


def test_a_shared_pass_is_cut_into_the_cheapest_exact_passes():
    """Past the rows llama.cpp computes exactly (exact_rows) a shared pass is cut into passes within
    it, in sequence order, the cheapest such cut (within `slack` of one pass, when one is given)."""
    from edgespec.costs import Part, exact_groups
    four = [Part(s, 1, 1) for s in (3, 0, 2, 1)]  # any order: cut in sequence order
    linear = Costs((1.0, 1.64, 2.5, 3.05, 4.0))  # rows nearly a step each (this CPU, calibrated)
    assert exact_groups(four, 3, linear) == [[1, 3], [2, 0]]  # sequences 0,1 then 2,3: 3.28 against 3.5
    assert exact_groups(four, None, linear) is None and exact_groups(four[:3], 3, linear) is None
    cheap = Costs((1.0, 1.75, 2.4, 3.0, 3.5))  # batching pays: three rows and one cost 13% more
    assert exact_groups(four, 3, cheap) == [[1, 3, 2], [0]] and exact_groups(four, 3, cheap, slack=0.1) is None
    # a part beyond the limit goes alone; the others are grouped within it
    parts = [Part(0, 5, 5), Part(1, 1, 1), Part(2, 1, 1)]
    flat = Costs(tuple(1.0 + 0.9 * k for k in range(8)))
    assert exact_groups(parts, 3, flat) == [[0], [1, 2]]


def test_a_round_of_four_sequences_is_cut_into_exact_passes():
    """With exact_shared (--parallel-exact) and an exact_rows limit, the rounds of four sequences
    are computed as passes of at most that many tokens (the fake records each eval_batch), and
    every greedy answer equals its answer alone (the fake has no kernel rounding: what the real
    kernels round otherwise is in docs/exactness.md)."""
    p, _ = _greedy_tables(4)
    alone = [Engine(FakeBackend(p)).generate(pr, max_tokens=24).tokens for pr in PROMPTS]
    policy = Policy(Costs(tuple(0.01 * (1 + 0.9 * k) for k in range(16))))
    policy.exact_rows, policy.exact_shared = 2, True
    engine = Engine(FakeBackend(p, n_seq=4), AutoDrafter(policy, CopyDrafter()), parallel=4)
    assert _four_at_once(engine, 24) == alone
    batches = engine.target.batches
    assert sum(len(b) == 2 for b in batches) >= 8  # rounds were shared, two sequences a pass
    assert all(sum(n for _, n, _ in b) <= 2 for b in batches if len(b) > 1)
    engine.close()


def test_parallel_exact_is_on_by_default_and_reaches_autos_policy():
    from edgespec.assemble import Settings
    from edgespec.cli import build_parser
    from edgespec.frontend import settings_from_args
    assert Settings(parallel=2).validate().parallel_exact
    with pytest.raises(UsageError, match="True or False"):
        Settings(parallel_exact="yes").validate()
    parser = build_parser()
    base = ["serve", "smollm2-135m", "-np", "2"]
    assert settings_from_args(parser.parse_args(base)).parallel_exact is True
    assert settings_from_args(parser.parse_args(base + ["--no-parallel-exact"])).parallel_exact is False


def test_an_exact_cut_returns_each_parts_rows_in_the_order_given():
    from types import SimpleNamespace

    from edgespec.rounds import _exact_cut, _verify
    p, _ = _greedy_tables(6)
    target = FakeBackend(p, n_seq=4)
    policy = Policy(Costs(tuple(0.01 * (1 + 0.9 * k) for k in range(8))))
    policy.exact_rows, policy.exact_shared = 2, True
    live = [SimpleNamespace(drafter=SimpleNamespace(policy=policy))]
    parts = [(3, [1], [0]), (0, [2], [0]), (2, [3], [0]), (1, [4, 5], [0, 1])]
    got = _verify(target, parts, _exact_cut(live, parts))
    assert len(target.batches) > 1  # cut
    for (_, tokens, rows), out in zip(parts, got):
        assert np.array_equal(out, np.stack([target.table[tokens[r]] for r in rows]))


def test_the_exact_limit_beside_others_prices_the_shared_pass():
    """With --bit-exact and --parallel-exact a draft is kept within exact_rows beside others too, and the shorter
    draft it falls back to is priced on the shared pass (its micro-batches), not as if alone: here
    one more token makes a third computation, which the pass's cap does not allow."""
    from edgespec.costs import Part, Share
    from edgespec.policy import Offer
    costs = Costs(tuple(0.020 + 0.0005 * k for k in range(1, 33)))
    policy = Policy(costs)
    policy.exact_rows, policy.exact_shared, policy.bit_exact = 2, True, True
    share = Share(1, (Part(0, 3, 3), Part(2, 1, 1), Part(3, 1, 1)))  # sequence 0 drafted 2
    assert policy.choose(Offer(16, 8, "aligned"), room=8, share=share).drafter == "none"


def test_no_reader_loses_the_last_tokens_of_a_generation(monkeypatch):
    """The loop may commit a generation's last tokens and finish it while its reader is between
    finding the queue empty and looking at `finished`: that reader is held here, at that very point,
    until the round has finished the generation. It must still hand out the token (a reader that
    read `finished` after the empty queue would end the answer without it)."""
    from collections import deque
    reader = threading.current_thread()

    class Held(deque):
        gen = None

        def __bool__(self):
            if not len(self) and threading.current_thread() is reader and not self.gen.finished:
                deadline = time.monotonic() + 5
                while not self.gen.finished and time.monotonic() < deadline:
                    time.sleep(0.001)
                return False  # empty when it was looked at
            return bool(len(self))

    class HeldGeneration(engine_mod.Generation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.out = Held()
            self.out.gen = self

    monkeypatch.setattr(engine_mod, "Generation", HeldGeneration)
    p, _ = _greedy_tables(5)
    r = Engine(FakeBackend(p)).generate([0, 1], max_tokens=1)
    assert len(r.tokens) == 1 and r.stats.finish_reason == "length"
