"""Exactness of the whole speculative loop at T > 0, on a fake numpy backend.

Target p and draft q are order-1 Markov tables over V = 6 tokens. For every case the engine
generates 3 tokens 100,000 times; the empirical joint law of the first two tokens and the
marginal of the third are compared with the exact law computed from the warped p table.

Threshold: by the Bretagnolle-Huber-Carol inequality, for K outcomes and N draws,
P(||p_hat - p||_1 >= eps) <= 2^K exp(-N eps^2 / 2). With K = 36, N = 1e5 and a failure
probability of 1e-6 this gives eps = 0.0278, i.e. total variation <= 0.0139 (0.0058 for the
K = 6 third-token marginal). A correct sampler fails with probability < 1e-6; the wrong
verifiers at the end land far above it.
"""
import math
import zlib

import numpy as np
import pytest

import edgespec.engine as engine_mod
from edgespec.drafters.model import ModelDrafter
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams, sample, warp

from fakes import FakeBackend

V = 6
N = 100_000
DELTA = 1e-6
NEG = -np.inf


def tv_threshold(k: int, n: int = N, delta: float = DELTA) -> float:
    return 0.5 * math.sqrt(2 * (k * math.log(2) + math.log(1 / delta)) / n)


def exact_laws(p_table, params, first):
    """Exact joint law of tokens 1-2 and marginal of token 3 under the target alone."""
    P = warp(p_table, params).astype(np.float64)  # row = previous token
    p1 = P[first]
    joint = p1[:, None] * P                       # joint[x1, x2]
    third = joint.sum(axis=0) @ P
    return joint, third


def empirical(engine, params, n, seed=0, prompt=(0, 1)):
    rng = np.random.default_rng(seed)
    prompt = list(prompt)
    joint = np.zeros((V, V))
    third = np.zeros(V)
    drafted = accepted = 0
    for _ in range(n):
        out = [t for t, _ in engine.generate_tokens(prompt, 3, params, rng)]
        joint[out[0], out[1]] += 1
        third[out[2]] += 1
        drafted += engine.last_stats.drafted
        accepted += engine.last_stats.accepted
    engine.totals = (drafted, accepted)
    return joint / n, third / n


def tv(a, b):
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum()


def _tables(seed, p_zero=(), q_zero=(), noise=1.5):
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    q = (p + rng.normal(0, noise, (V, V))).astype(np.float32)  # related but different
    for j in p_zero:
        p[:, j] = NEG       # the target never emits j
    for j in q_zero:
        q[:, j] = NEG       # the draft never proposes j
    return p, q


CASES = {
    # name: (gamma, params, p never emits, q never proposes)
    "plain-T1-gamma1": (1, SamplingParams(1.0), (), ()),
    "q-mass-where-p-none-gamma3": (3, SamplingParams(1.0), (4, 5), ()),
    "p-mass-where-q-none-gamma8": (8, SamplingParams(0.8), (), (0, 2)),
    "top-k3-gamma2": (2, SamplingParams(1.3, top_k=3), (), ()),
    "top-p0.7-gamma5": (5, SamplingParams(1.0, top_p=0.7), (), (1,)),
    "min-p0.15-gamma4": (4, SamplingParams(0.7, min_p=0.15), (5,), ()),
}


def make_engine(p, q, gamma):
    return Engine(FakeBackend(p), ModelDrafter(FakeBackend(q, name="draft"), V), gamma=gamma)


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_output_has_the_target_law(name):
    gamma, params, p_zero, q_zero = CASES[name]
    p, q = _tables(zlib.crc32(name.encode()) % 1000, p_zero, q_zero)
    eng = make_engine(p, q, gamma)
    joint, third = empirical(eng, params, N)
    want_joint, want_third = exact_laws(p, params, first=1)
    assert tv(joint, want_joint) < tv_threshold(V * V), (tv(joint, want_joint), name)
    assert tv(third, want_third) < tv_threshold(V), (tv(third, want_third), name)
    # the draft really was used, and both acceptance and rejection happened often
    drafted, accepted = eng.totals
    assert 0.05 < accepted / drafted < 0.95, (drafted, accepted)


REPEATING = (0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 1, 2, 5, 0, 1)  # ends in 0 1: lookups find 2 3 / 2 5


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_ngram_and_auto_drafts_keep_the_target_law(mode):
    from edgespec.drafters.ngram import NgramDrafter
    from edgespec.policy import Costs, Policy
    params = SamplingParams(0.9, top_k=4)
    p, q = _tables(5)
    if mode == "ngram":
        eng = Engine(FakeBackend(p), ngram=NgramDrafter(), gamma=4)
    else:  # cheap verification: the policy drafts with both the model and the n-grams
        costs = Costs(verify=tuple(0.01 + 0.0005 * k for k in range(1, 9)), draft_step=0.004)
        eng = Engine(FakeBackend(p), ModelDrafter(FakeBackend(q, name="draft"), V), ngram=NgramDrafter(),
                     policy=Policy(costs, max_gamma=7))
    joint, third = empirical(eng, params, N, prompt=REPEATING)
    want_joint, want_third = exact_laws(p, params, first=1)
    assert tv(joint, want_joint) < tv_threshold(V * V)
    assert tv(third, want_third) < tv_threshold(V)
    drafted, accepted = eng.totals
    assert 0.05 < accepted / drafted < 0.95
    if mode == "auto":
        assert set(eng.last_stats.by_drafter) | set(eng.policy.decisions) >= {"ngram", "model"}


def wrong_verify_no_residual(draft, p, q, rng):
    """Bug: on rejection samples the correction from p instead of norm(max(0, p - q))."""
    for i, x in enumerate(draft):
        if rng.random() * q[i, x] < p[i, x]:
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def wrong_verify_accept_argmax(draft, p, q, rng):
    """Bug: accepts a draft whenever it is the target's most likely token (llama.cpp-server style
    greedy acceptance) and otherwise samples from p."""
    for i, x in enumerate(draft):
        if x == int(np.argmax(p[i])):
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


@pytest.mark.parametrize("wrong", [wrong_verify_no_residual, wrong_verify_accept_argmax])
def test_the_statistical_test_catches_a_wrong_verifier(monkeypatch, wrong):
    name = "q-mass-where-p-none-gamma3"
    gamma, params, p_zero, q_zero = CASES[name]
    p, q = _tables(zlib.crc32(name.encode()) % 1000, p_zero, q_zero)
    monkeypatch.setattr(engine_mod, "verify", wrong)
    joint, _ = empirical(make_engine(p, q, gamma), params, N // 5)
    want_joint, _ = exact_laws(p, params, first=1)
    # even with a fifth of the draws the wrong sampler lands far outside the threshold
    # (measured: TV 0.126 and 0.156 against a threshold of 0.031)
    assert tv(joint, want_joint) > 2 * tv_threshold(V * V, N // 5)


def test_kv_caches_hold_exactly_the_committed_tokens_after_every_round():
    p, q = _tables(8)
    target, draft = FakeBackend(p, n_ctx=1200), FakeBackend(q, n_ctx=1200, name="draft")
    eng = Engine(target, ModelDrafter(draft, V), gamma=4)
    seen = []
    accept = eng.drafter.accept

    def checking_accept(tokens):
        accept(tokens)
        seen.append((list(target.cache), list(draft.cache), list(tokens)))
    eng.drafter.accept = checking_accept
    list(eng.generate_tokens([0, 1], 1000, SamplingParams(1.0), 11))
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
    greedy = SamplingParams(0.0)
    drafted = accepted = 0
    for seed in range(20):
        p, q = _tables(seed, noise=1.0)
        plain = [t for t, _ in Engine(FakeBackend(p)).generate_tokens([0, seed % V], 60, greedy)]
        eng = make_engine(p, q, gamma)
        assert [t for t, _ in eng.generate_tokens([0, seed % V], 60, greedy)] == plain
        drafted += eng.last_stats.drafted
        accepted += eng.last_stats.accepted
    assert 0 < accepted < drafted
