"""Exactness of the whole speculative loop at T > 0, on a fake numpy backend.

`verify` itself is checked exactly, by enumerating every outcome, in test_verify_exact.py.
Here one statistical test drives the whole engine (auto mode: draft model and n-gram drafts
interleaved, KV caches cut back) and compares the law of its output with the target's.

Target p and draft q are order-1 Markov tables over V = 6 tokens. The engine generates 3
tokens N times; the empirical joint law of the first two tokens and the marginal of the
third are compared with the exact law computed from the warped p table.

Threshold: Pearson's chi-square test (tests/chisq.py; outcomes expected fewer than 10 times
pooled), each of the two laws at p-value > 1e-6, so a correct sampler fails with probability
< 2e-6. With N = 10,000 draws it finds a shift of 0.025 in total variation between two outcomes
of probability 0.15 or less (chi-square 83 against the 1e-6 critical value of 56 at 15 degrees
of freedom); a wrong verifier (residual sampled from p) gives p-values below 1e-40 with a tenth
of the draws.
"""
import numpy as np
import pytest

import edgespec.rounds as rounds
from edgespec.drafters.model import ModelDrafter
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams, sample, warp

from chisq import chi2_pvalue
from fakes import FakeBackend

V = 6
N = 10_000
ALPHA = 1e-6      # each law's p-value must exceed it
MIN_EXPECTED = 10  # outcomes expected fewer times are pooled
NEG = -np.inf


def exact_laws(p_table, params, first):
    """Exact joint law of tokens 1-2 and marginal of token 3 under the target alone."""
    P = warp(p_table, params).astype(np.float64)  # row = previous token
    p1 = P[first]
    joint = p1[:, None] * P                       # joint[x1, x2]
    third = joint.sum(axis=0) @ P
    return joint, third


def empirical(engine, params, n, seed=0, prompt=(0, 1)):
    """Counts of the first two tokens (joint) and of the third, over `n` generations."""
    rng = np.random.default_rng(seed)
    prompt = list(prompt)
    joint = np.zeros((V, V))
    third = np.zeros(V)
    drafted = accepted = 0
    kw = dict(max_tokens=3, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
              min_p=params.min_p)
    for _ in range(n):
        r = engine.generate(prompt, seed=int(rng.integers(2**63)), **kw)
        out = r.tokens
        joint[out[0], out[1]] += 1
        third[out[2]] += 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    engine.totals = (drafted, accepted)
    return joint, third


def _tables(seed, p_zero=(), q_zero=(), noise=1.5):
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    q = (p + rng.normal(0, noise, (V, V))).astype(np.float32)  # related but different
    for j in p_zero:
        p[:, j] = NEG       # the target never emits j
    for j in q_zero:
        q[:, j] = NEG       # the draft never proposes j
    return p, q


def make_engine(p, q, gamma):
    return Engine(FakeBackend(p), ModelDrafter(FakeBackend(q, name="draft"), V, gamma))


REPEATING = (0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 5, 0, 1)  # ends in 0 1: lookups find 2 3 / 2 5


def auto_engine(p, q):
    """Cheap verification: the policy drafts with both the draft model and the n-grams."""
    from edgespec.drafters.auto import AutoDrafter
    from edgespec.drafters.ngram import NgramDrafter
    from edgespec.costs import Costs
    from edgespec.policy import Policy
    # the draft model catches up on the prompt at its first draft: cheap here, as on a GPU
    costs = Costs(verify=tuple(0.01 + 0.0005 * k for k in range(1, 9)), draft_step=0.004, draft_prefill=0.00001)
    drafter = AutoDrafter(Policy(costs, max_gamma=7), NgramDrafter(), ModelDrafter(FakeBackend(q, name="draft"), V))
    return Engine(FakeBackend(p), drafter)


PARAMS = SamplingParams(0.9, top_k=4, min_p=0.02)


@pytest.mark.slow
def test_auto_drafts_keep_the_target_law_through_the_whole_engine():
    p, q = _tables(5, q_zero=(3,))
    eng = auto_engine(p, q)
    joint, third = empirical(eng, PARAMS, N, prompt=REPEATING)
    want_joint, want_third = exact_laws(p, PARAMS, first=1)
    assert chi2_pvalue(joint, want_joint, MIN_EXPECTED) > ALPHA
    assert chi2_pvalue(third, want_third, MIN_EXPECTED) > ALPHA
    drafted, accepted = eng.totals
    assert 0.05 < accepted / drafted < 0.95
    assert set(eng.drafter.policy.decisions) >= {"ngram", "model"}


def wrong_verify_no_residual(draft, p, q, rng):
    """Bug: on rejection samples the correction from p instead of norm(max(0, p - q))."""
    for i, x in enumerate(draft):
        if q is None or rng.random() * q[i, x] < p[i, x]:
            if q is None and sample(p[i], rng) != x:
                return i, sample(p[i], rng)
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def test_the_statistical_test_catches_a_wrong_verifier(monkeypatch):
    wrong = wrong_verify_no_residual
    p, q = _tables(5, q_zero=(3,))
    monkeypatch.setattr(rounds, "verify", wrong)
    joint, _ = empirical(auto_engine(p, q), PARAMS, N // 10, prompt=REPEATING)
    want_joint, _ = exact_laws(p, PARAMS, first=1)
    # with a tenth of the draws the wrong sampler still lands far outside the threshold
    # (measured: p-value 1e-40, TV 0.19); test_verify_exact.py catches subtler bugs exactly
    assert chi2_pvalue(joint, want_joint, MIN_EXPECTED) < ALPHA**2


def test_kv_caches_hold_exactly_the_committed_tokens_after_every_round():
    p, q = _tables(8)
    target, draft = FakeBackend(p, n_ctx=1200), FakeBackend(q, n_ctx=1200, name="draft")
    eng = Engine(target, ModelDrafter(draft, V, 4))
    seen = []
    observe = eng.drafter.observe

    def checking_observe(round):
        observe(round)
        seen.append((list(target.cache), list(draft.cache), list(round.tokens)))
    eng.drafter.observe = checking_observe
    eng.generate([0, 1], max_tokens=1000, temperature=1.0, seed=11)
    assert len(seen) >= 200
    for t_cache, d_cache, tokens in seen:
        # the target holds every committed token but the newest, which the next round feeds;
        # the draft holds a prefix of that (one shorter when all its drafts were accepted)
        assert t_cache == tokens[:-1]
        assert d_cache == tokens[: len(d_cache)] and len(d_cache) >= len(tokens) - 2
    # 1,000 tokens in a 1,200-token context: rejected drafts never accumulated
    assert len(target.cache) == 2 + 1000 - 1


@pytest.mark.parametrize("gamma", [1, 2, 5, 8])
def test_greedy_speculative_equals_plain_greedy_exactly(gamma):
    # no kernel rounding here, so T = 0 output must match plain decoding token for token
    drafted = accepted = 0
    for seed in range(20):
        p, q = _tables(seed, noise=1.0)
        plain = Engine(FakeBackend(p)).generate([0, seed % V], max_tokens=60).tokens
        r = make_engine(p, q, gamma).generate([0, seed % V], max_tokens=60)
        assert r.tokens == plain
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    assert 0 < accepted < drafted
