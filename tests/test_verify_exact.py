"""The exact output law of `verify`, by enumerating every random choice.

`sample` accepts, instead of a numpy Generator, any object with `categorical(weights)`.
`Enumerator` is such an object: it replays a forced list of choices and is rerun, depth
first, until every branch with non-zero weight has been taken once. A path's probability is
the product of weights[choice] / sum(weights) over its draws, so the law computed here is
the law of the real `verify` and `warp` code up to float64 rounding: no sampling noise, no
statistical threshold.

The property checked is the one speculative decoding promises. One step drafts gamma tokens
from q, verifies them against p and emits draft[:n] + [y]. Extending that emitted prefix
with the target's own conditionals up to m = gamma + 1 tokens must give exactly the law of m
tokens sampled from the target alone. Both laws are computed from float32 probabilities, so
they may differ by rounding (~1e-7) but by no more than 1e-6 on any sequence. Two wrong
verifiers, run through the same harness, land above 0.01: the tolerance is not loose enough
to hide a wrong rejection rule.

Logits depend on the whole prefix (a seeded table per prefix tuple), so a verifier that
confused the rows of p or q across positions would be caught as well.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from edgespec.sampling import SamplingParams, sample, verify, verify_greedy, warp

TOL = 1e-6        # float32 rounding of the warped probabilities, summed over a few factors
WRONG_GAP = 0.01  # a wrong verifier must miss the target law by at least this much somewhere


# --- the enumerating rng --------------------------------------------------------------------

class Enumerator:
    """A `categorical` that follows `forced`, then takes the first non-zero branch; records
    every draw so the caller can find the next path and inspect which branches ran."""

    def __init__(self, forced: list[int]):
        self.forced = forced
        self.draws: list[tuple[np.ndarray, int]] = []

    def categorical(self, weights) -> int:
        w = np.array(weights, dtype=np.float64)
        # sample() on a real Generator refuses these; the enumeration must refuse them too,
        # otherwise a verifier drawing from an all-zero residual would pass here
        assert w.ndim == 1 and np.all(np.isfinite(w)) and np.all(w >= 0) and w.sum() > 0, w
        i = len(self.draws)
        choice = self.forced[i] if i < len(self.forced) else int(np.flatnonzero(w)[0])
        assert w[choice] > 0
        self.draws.append((w, choice))
        return choice

    @property
    def probability(self) -> float:
        return math.prod(w[c] / w.sum() for w, c in self.draws)


def enumerate_paths(run):
    """Every path of `run(rng)`: a list of (outcome, probability, draws). `run` must be a
    deterministic function of its draws, which `verify` is."""
    paths = []
    forced: list[int] = []
    while True:
        rng = Enumerator(forced)
        outcome = run(rng)
        # a path that ignored part of its forced prefix would be counted twice
        assert len(rng.draws) >= len(forced)
        paths.append((outcome, rng.probability, rng.draws))
        for depth in range(len(rng.draws) - 1, -1, -1):
            w, c = rng.draws[depth]
            later = np.flatnonzero(w[c + 1:])
            if later.size:
                forced = [ch for _, ch in rng.draws[:depth]] + [c + 1 + int(later[0])]
                break
        else:
            return paths


def law(paths) -> dict:
    out: dict = {}
    for outcome, prob, _ in paths:
        out[outcome] = out.get(outcome, 0.0) + prob
    return out


def max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())


# --- context-dependent target and draft ------------------------------------------------------

class Pair:
    """Target and draft logits as functions of the whole prefix, warped with one SamplingParams.

    target_ban / draft_ban: a token whose logit is -inf in a context (chosen by the prefix),
    to give q mass where p has none, or p mass where q has none.
    same: the draft's logits are the target's (q == p).
    point: drafts are point masses chosen by a fixed function of the prefix (n-gram-like).
    """

    def __init__(self, params: SamplingParams, vocab: int = 4, seed: int = 0, scale: float = 1.5,
                 target_ban: bool = False, draft_ban: bool = False, same: bool = False,
                 point: bool = False):
        self.params, self.vocab, self.seed, self.scale = params, vocab, seed, scale
        self.target_ban, self.draft_ban, self.same, self.point = target_ban, draft_ban, same, point
        self._p: dict = {}
        self._q: dict = {}
        self._ext: dict = {}

    def _table(self, kind: int, prefix: tuple) -> np.random.Generator:
        # the length is part of the seed: SeedSequence pads short entropy with zeros, so
        # (seed, kind) and (seed, kind, 0) would otherwise share a table
        return np.random.default_rng([self.seed, kind, len(prefix), *prefix])

    def _banned(self, prefix: tuple, salt: int) -> int:
        return (sum(prefix) * 3 + len(prefix) + salt) % self.vocab

    def _raw(self, prefix: tuple) -> np.ndarray:
        return self._table(0, prefix).normal(0, self.scale, self.vocab).astype(np.float32)

    def target_logits(self, prefix: tuple) -> np.ndarray:
        z = self._raw(prefix)
        if self.target_ban:
            z[self._banned(prefix, 0)] = -np.inf
        return z

    def draft_logits(self, prefix: tuple) -> np.ndarray:
        if self.same:
            return self.target_logits(prefix)
        # a draft that resembles the target, as a small model does, but is not it
        noise = self._table(1, prefix).normal(0, self.scale, self.vocab)
        z = (0.6 * self._raw(prefix) + noise).astype(np.float32)
        if self.draft_ban:
            z[self._banned(prefix, 1)] = -np.inf
        return z

    def p(self, prefix: tuple) -> np.ndarray:
        if prefix not in self._p:
            self._p[prefix] = warp(self.target_logits(prefix), self.params)
        return self._p[prefix]

    def q(self, prefix: tuple) -> np.ndarray:
        if prefix not in self._q:
            self._q[prefix] = warp(self.draft_logits(prefix), self.params)
        return self._q[prefix]

    def point_draft(self, prefix: tuple) -> int:
        # any fixed function of the prefix will do; this one proposes the target's raw argmax in
        # some contexts (as a good n-gram hit does) and a table token in others, which reaches
        # tokens the target's filters remove as well as likely ones
        pick = int(self._table(2, prefix).integers(self.vocab + 2))
        return int(np.argmax(self._raw(prefix))) if pick >= self.vocab else pick

    def extensions(self, prefix: tuple, k: int) -> dict:
        """Law of the next k tokens after `prefix`, under the target alone."""
        key = (prefix, k)
        if key not in self._ext:
            if k == 0:
                self._ext[key] = {(): 1.0}
            else:
                out = {}
                p = self.p(prefix).astype(np.float64)
                for x in np.flatnonzero(p):
                    x = int(x)
                    for rest, w in self.extensions(prefix + (x,), k - 1).items():
                        out[(x,) + rest] = p[x] * w
                self._ext[key] = out
        return self._ext[key]


def speculative_step(pair: Pair, gamma: int, verifier, rng) -> tuple:
    """One draft-then-verify step with every draw going through `rng`; returns the emitted tokens."""
    if pair.point:
        draft: list[int] = []
        for _ in range(gamma):
            draft.append(pair.point_draft(tuple(draft)))
        q = None
    else:
        draft = []
        for _ in range(gamma):
            draft.append(sample(pair.q(tuple(draft)), rng))
        q = np.stack([pair.q(tuple(draft[:i])) for i in range(gamma)])
    p = np.stack([pair.p(tuple(draft[:i])) for i in range(gamma + 1)])
    n, y = verifier(draft, p, q, rng)
    return tuple(draft[:n]) + (int(y),)


def extended_law(pair: Pair, gamma: int, verifier) -> dict:
    """Law of m = gamma + 1 tokens: one speculative step, then the target's own conditionals."""
    m = gamma + 1
    out: dict = {}
    for emitted, w in law(enumerate_paths(lambda rng: speculative_step(pair, gamma, verifier, rng))).items():
        assert 1 <= len(emitted) <= m
        for rest, v in pair.extensions(emitted, m - len(emitted)).items():
            out[emitted + rest] = out.get(emitted + rest, 0.0) + w * v
    return out


# --- two wrong verifiers, to show the harness catches mistakes -------------------------------

def _as_rows(draft, q, vocab):
    if q is not None:
        return q
    rows = np.zeros((len(draft), vocab), np.float32)
    rows[np.arange(len(draft)), draft] = 1.0
    return rows


def verify_residual_from_p(draft, p, q, rng):
    """Wrong: correct accept test, but the correction is drawn from p, not norm(max(0, p - q))."""
    q = _as_rows(draft, q, p.shape[1])
    for i, x in enumerate(draft):
        keep = min(float(p[i, x]), float(q[i, x]))
        if sample(np.array([float(q[i, x]) - keep, keep]), rng) == 1:
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


def verify_argmax_accept(draft, p, q, rng):
    """Wrong: accept exactly the drafts that are the target's argmax, otherwise sample p."""
    for i, x in enumerate(draft):
        if x == int(np.argmax(p[i])):
            continue
        return i, sample(p[i], rng)
    return len(draft), sample(p[len(draft)], rng)


# --- cases -----------------------------------------------------------------------------------

# The seeds only pick the random tables. For a few tables a wrong rule happens to matter
# little (e.g. the first point draft is outside top-k, so every step rejects at once and
# any residual is right); these seeds give tables where both wrong verifiers miss by > 0.01
# at every gamma, so the wrong-verifier test below is meaningful for each case.
CASES = {
    "T1": dict(params=SamplingParams(1.0)),
    "T0.7": dict(params=SamplingParams(0.7), seed=1),
    "T1.3": dict(params=SamplingParams(1.3), seed=16),
    "top_k2": dict(params=SamplingParams(1.0, top_k=2), vocab=5, seed=3),
    "top_p0.8": dict(params=SamplingParams(0.9, top_p=0.8), vocab=5, seed=4),
    "min_p0.2": dict(params=SamplingParams(1.0, min_p=0.2), vocab=5, seed=5),
    "all_filters": dict(params=SamplingParams(0.8, top_k=4, top_p=0.9, min_p=0.05), vocab=5, seed=6),
    "q_mass_where_p_none": dict(params=SamplingParams(1.0), target_ban=True, seed=19),
    "p_mass_where_q_none": dict(params=SamplingParams(1.0), draft_ban=True, seed=8),
    "q_equals_p": dict(params=SamplingParams(1.0), same=True, seed=9),
    "point_drafts": dict(params=SamplingParams(1.0), point=True, seed=10),
    "point_drafts_top_k2": dict(params=SamplingParams(1.0, top_k=2), vocab=5, point=True, seed=13),
    "point_drafts_V3": dict(params=SamplingParams(0.7), vocab=3, point=True, seed=12),
}

# A wrong residual only shows when rejections happen; with q == p nothing is ever rejected,
# so that verifier is exact there (which the test below asserts instead).
NEVER_REJECTS = {"q_equals_p"}


def _target_law(pair: Pair, m: int) -> dict:
    return pair.extensions((), m)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_one_speculative_step_leaves_the_target_law_unchanged(case, gamma):
    pair = Pair(**CASES[case])
    target = _target_law(pair, gamma + 1)
    assert sum(target.values()) == pytest.approx(1.0, abs=TOL)
    got = extended_law(pair, gamma, verify)
    assert max_diff(got, target) < TOL


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_wrong_verifiers_are_caught_by_the_same_harness(case, gamma):
    pair = Pair(**CASES[case])
    target = _target_law(pair, gamma + 1)
    wrong_residual = max_diff(extended_law(pair, gamma, verify_residual_from_p), target)
    if case in NEVER_REJECTS:
        assert wrong_residual < TOL
    else:
        assert wrong_residual > WRONG_GAP
    assert max_diff(extended_law(pair, gamma, verify_argmax_accept), target) > WRONG_GAP


def test_the_cases_cover_what_they_are_named_after():
    """Guards the case table: a ban that never bit, or filters that removed nothing, would
    leave a case testing less than its name says."""
    def prefixes(pair, depth=2):
        return [pr for k in range(depth + 1) for pr in itertools.product(range(pair.vocab), repeat=k)]

    a = Pair(**CASES["q_mass_where_p_none"])
    assert any(np.any((a.q(pr) > 0) & (a.p(pr) == 0)) for pr in prefixes(a))
    b = Pair(**CASES["p_mass_where_q_none"])
    assert any(np.any((b.p(pr) > 0) & (b.q(pr) == 0)) for pr in prefixes(b))
    for name in ("top_k2", "top_p0.8", "min_p0.2", "all_filters"):
        c = Pair(**CASES[name])
        assert any(np.any(c.p(pr) == 0) for pr in prefixes(c)), name
    d = Pair(**CASES["point_drafts_top_k2"])
    assert any(d.p(pr)[d.point_draft(pr)] == 0 for pr in prefixes(d))
    for name in ("point_drafts", "point_drafts_top_k2", "point_drafts_V3"):
        e = Pair(**CASES[name])
        drafted = [(e.point_draft(pr), e.p(pr)) for pr in prefixes(e)]
        assert any(x == np.argmax(p) for x, p in drafted), name
        assert any(x != np.argmax(p) and p[x] > 0 for x, p in drafted), name


# --- the harness itself ----------------------------------------------------------------------

def test_enumerator_gives_the_normalised_weights():
    w = np.array([0.0, 2.0, 0.0, 1.0, 1.0], np.float32)
    got = law(enumerate_paths(lambda rng: sample(w, rng)))
    assert got == pytest.approx({1: 0.5, 3: 0.25, 4: 0.25})


def test_enumerator_walks_nested_draws_with_branch_dependent_shapes():
    # the second draw's weights depend on the first choice; the law is the product rule
    def run(rng):
        a = sample(np.array([1.0, 3.0]), rng)
        b = sample(np.array([1.0, 1.0]) if a == 0 else np.array([0.0, 1.0, 4.0]), rng)
        return a, b
    got = law(enumerate_paths(run))
    assert got == pytest.approx({(0, 0): 0.125, (0, 1): 0.125, (1, 1): 0.15, (1, 2): 0.6})


# --- greedy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_verify_greedy_equals_the_target_argmax_chain_for_every_draft(gamma):
    pair = Pair(SamplingParams(0.0), vocab=4, seed=13)
    chain: list[int] = []
    for _ in range(gamma + 1):
        chain.append(int(np.argmax(pair.target_logits(tuple(chain)))))
    for code in range(pair.vocab ** gamma):
        draft = [(code // pair.vocab ** i) % pair.vocab for i in range(gamma)]
        logits = np.stack([pair.target_logits(tuple(draft[:i])) for i in range(gamma + 1)])
        n = 0
        while n < gamma and draft[n] == chain[n]:
            n += 1
        assert verify_greedy(draft, logits) == (n, chain[n])
        # the general verifier on one-hot rows is deterministic and must agree exactly
        p = warp(logits, pair.params)
        q = _as_rows(draft, None, pair.vocab)
        paths = enumerate_paths(lambda rng, draft=draft, p=p, q=q: verify(draft, p, q, rng))
        assert law(paths) == {(n, chain[n]): 1.0}


# --- the all-zero residual fallback ----------------------------------------------------------

def _rounding_pair():
    """p and q equal as distributions but q one float32 ulp above p at token 1: the accept test
    min(1, p/q) can reject, yet max(0, p - q) is zero everywhere."""
    p = np.array([0.25, 0.75, 0.0, 0.0], np.float32)
    q = p.copy()
    q[1] = np.nextafter(np.float32(0.75), np.float32(1.0))
    assert q[1] > p[1] and not np.maximum(p - q, 0).sum() > 0
    bonus = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    return np.stack([p, bonus]), q[None, :]


def test_all_zero_residual_path_is_reached_and_draws_from_p():
    p, q = _rounding_pair()
    paths = enumerate_paths(lambda rng: verify([1], p, q, rng))
    rejected = [(out, prob, draws) for out, prob, draws in paths if out[0] == 0]
    # the rejection branch exists (its weight is q - p, one ulp) ...
    assert rejected and all(draws[0][1] == 0 for _, _, draws in rejected)
    # ... and what it draws from is p itself: not an all-zero residual (the Enumerator would
    # have refused it), not q
    for _, _, draws in rejected:
        np.testing.assert_array_equal(draws[1][0], p[0].astype(np.float64))
    total = sum(prob for _, prob, _ in rejected)
    assert 0 < total < 1e-6
    conditional = {out[1]: prob / total for out, prob, _ in rejected}
    assert conditional == pytest.approx({0: 0.25, 1: 0.75}, abs=1e-12)


def test_all_zero_residual_step_keeps_the_target_law():
    p, q = _rounding_pair()

    def step(rng):
        x = sample(q[0], rng)
        n, y = verify([x], p, q, rng)
        return ([x][:n] + [y])[0]

    got = law(enumerate_paths(step))
    assert max_diff(got, {0: 0.25, 1: 0.75}) < TOL
