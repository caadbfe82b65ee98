import numpy as np
import pytest

from edgespec.errors import UsageError
from edgespec.sampling import SamplingParams, sample, verify, warp


def test_greedy_is_one_hot_at_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    np.testing.assert_array_equal(warp(logits, SamplingParams(0.0)), [0, 1, 0, 0])
    np.testing.assert_array_equal(warp(logits, SamplingParams(0.7, top_k=1)), [0, 1, 0, 0])


def test_temperature_one_is_softmax_in_float32():
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    p = warp(logits, SamplingParams(1.0))
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)


def test_top_k_keeps_k_most_likely():
    p = warp(np.array([5, 1, 4, 2, 3], np.float32), SamplingParams(1.0, top_k=2))
    assert set(np.flatnonzero(p)) == {0, 2}
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    assert set(np.flatnonzero(warp(logits, SamplingParams(1.0, top_p=0.8)))) == {0, 1}
    assert set(np.flatnonzero(warp(logits, SamplingParams(1.0, top_p=0.81)))) == {0, 1, 2}
    assert set(np.flatnonzero(warp(logits, SamplingParams(1.0, top_p=0.1)))) == {0}


def test_top_p_on_a_large_vocabulary_matches_a_full_sort():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 152_000).astype(np.float32)
    got = np.flatnonzero(warp(logits, SamplingParams(1.0, top_p=0.9)))
    probs = np.exp(logits - logits.max(), dtype=np.float64)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order]), 0.9)) + 1
    assert set(got) == set(order[:n])


def test_min_p_drops_tokens_below_fraction_of_the_top():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    p = warp(np.log(probs).astype(np.float32), SamplingParams(1.0, min_p=0.1))
    assert set(np.flatnonzero(p)) == {0, 1, 2}


def test_filters_apply_before_temperature():
    logits = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    # at T=1 top-p 0.75 keeps {0, 1}; a high temperature must not widen that set
    p = warp(logits, SamplingParams(5.0, top_p=0.75))
    assert set(np.flatnonzero(p)) == {0, 1}


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.1), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=-1), "top_k must be"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(min_p=-0.5), "min_p must be in [0, 1]"),
])
def test_bad_parameters_say_the_range_and_the_value(kwargs, fragment):
    with pytest.raises(UsageError) as e:
        SamplingParams(**kwargs)
    assert fragment in str(e.value) and repr(list(kwargs.values())[0]) in str(e.value)


def test_sample_never_returns_zero_probability_tokens():
    rng = np.random.default_rng(1)
    p = np.array([0, 0.5, 0, 0.5, 0], np.float32)
    assert {sample(p, rng) for _ in range(2000)} == {1, 3}


def test_verify_accepts_everything_when_draft_equals_target():
    rng = np.random.default_rng(2)
    p = np.full((4, 5), 0.2, np.float32)
    for _ in range(200):
        n, _ = verify([0, 1, 2], p, p[:3], rng)
        assert n == 3


def test_verify_rejects_a_token_the_target_cannot_emit_and_never_emits_it():
    rng = np.random.default_rng(3)
    p = np.array([[0.0, 0.5, 0.5], [1 / 3] * 3], np.float32)
    q = np.array([[0.9, 0.05, 0.05]], np.float32)
    for _ in range(200):
        n, y = verify([0], p, q, rng)
        assert n == 0 and y in (1, 2)


class RejectThenRecord:
    """An rng for `sample`: the first draw (verify's accept test, weights [reject, accept]) is
    forced to reject; later draws are recorded and answered by a real generator."""

    def __init__(self, seed):
        self.gen = np.random.default_rng(seed)
        self.calls = []

    def categorical(self, weights):
        self.calls.append(np.array(weights, dtype=np.float64))
        if len(self.calls) == 1:
            assert self.calls[0][0] > 0, "the accept test cannot reject here"
            return 0
        return sample(weights, self.gen)


def test_verify_with_all_zero_residual_falls_back_to_p():
    # q is one float32 ulp above p at the drafted token, so min(1, p/q) < 1 can reject while
    # max(0, p - q) is zero everywhere. A real generator rejects here with probability ~1e-7,
    # so the rejection is forced; the correction must then be drawn from p itself.
    p = np.array([[0.25, 0.75, 0.0], [0.2, 0.3, 0.5]], np.float32)
    q = p[:1].copy()
    q[0, 1] = np.nextafter(np.float32(0.75), np.float32(1.0))
    assert not np.maximum(p[0] - q[0], 0).sum() > 0
    seen = set()
    for seed in range(200):
        rng = RejectThenRecord(seed)
        n, y = verify([1], p, q, rng)
        assert n == 0 and len(rng.calls) == 2
        np.testing.assert_array_equal(rng.calls[1], p[0])
        seen.add(y)
    assert seen == {0, 1}


def test_point_mass_drafts_accept_while_target_samples_match():
    rng = np.random.default_rng(5)
    p = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], np.float32)
    assert verify([1, 2], p, None, rng) == (2, 0)
    assert verify([1, 0], p, None, rng) == (1, 2)


def test_greedy_verification_on_logits_matches_the_general_verifier():
    from edgespec.sampling import verify_greedy
    rng = np.random.default_rng(6)
    for _ in range(300):
        logits = rng.normal(0, 1, (4, 7)).astype(np.float32)
        draft = [int(np.argmax(r)) if rng.random() < 0.7 else int(rng.integers(7)) for r in logits[:3]]
        p = warp(logits, SamplingParams(0.0))
        q = np.zeros((3, 7), np.float32)
        q[np.arange(3), draft] = 1
        assert verify_greedy(draft, logits) == verify(draft, p, q, rng) == verify(draft, p, None, rng)


# -- the law on its support (sampling.row_law) against the whole row in float64 ----------------------
def _reference(z: np.ndarray, params: SamplingParams, allowed=None) -> np.ndarray:
    """The law by its definition: every token of the row, float64, full sorts (ties: lowest id)."""
    z = z.astype(np.float64)
    cand = np.arange(z.size) if allowed is None else np.flatnonzero(allowed)
    if 0 < params.top_k < cand.size:
        cand = np.sort(cand[np.lexsort((cand, -z[cand]))[:params.top_k]])
    zc = z[cand]
    m = zc.max()
    keep = np.isfinite(zc)
    if params.top_p < 1.0:
        w = np.exp(zc - m)
        order = np.lexsort((np.arange(zc.size), -w))
        n = int(np.searchsorted(np.cumsum(w[order]), params.top_p * w.sum())) + 1
        top = np.zeros(zc.size, bool)
        top[order[:n]] = True
        keep &= top
    if params.min_p > 0.0:
        keep &= zc.astype(np.float32) >= np.float32(m) + np.float32(np.log(params.min_p))
    p = np.where(keep, np.exp((zc - m) / params.temperature), 0.0)
    out = np.zeros(z.size)
    out[cand] = p / p.sum()
    return out


def _rows(n_vocab: int, seed: int):
    """Rows of every shape the support must hold for: peaked, flat, heavy-tailed, quantized (ties at
    every cut), with -inf entries."""
    rng = np.random.default_rng(seed)
    peaked = rng.normal(0, 2.5, n_vocab)
    peaked[rng.integers(n_vocab, size=3)] += (18, 15, 14)
    flat = rng.normal(0, 0.3, n_vocab)
    heavy = rng.standard_t(2, n_vocab) * 3
    ties = np.round(rng.normal(0, 2, n_vocab) * 2) / 2
    holes = rng.normal(0, 4, n_vocab)
    holes[rng.integers(n_vocab, size=n_vocab // 3)] = -np.inf
    # shelves: a head of equal tokens, and a band 16-20 below the maximum whose mass moves top-p's cut
    # by more than one head token (decided 20 below, or on the whole row) or by less (decided 16 below)
    shelves = []
    for band, head in ((n_vocab // 8, 200), (n_vocab // 5, 30), (n_vocab // 50, 60)):
        r = np.full(n_vocab, -60.0)
        r[0], r[1:head + 1] = 0.0, np.log(0.05)
        r[rng.choice(np.arange(head + 1, n_vocab), size=min(band, n_vocab - head - 1), replace=False)] = \
            rng.uniform(-19.9, -16.1, min(band, n_vocab - head - 1))
        shelves.append(r)
    return [r.astype(np.float32) for r in (peaked, flat, heavy, ties, holes, *shelves)]


def _same_law(got, want):
    """The same support (up to float32 underflow: a token at 1e-60 in float64 is 0 in float32, as it
    always was) and the same probabilities to float32 rounding."""
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))
    assert set(np.flatnonzero(want > 1e-30)) <= set(np.flatnonzero(got))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-30)


LAW_PARAMS = [SamplingParams(0.8, top_p=0.95), SamplingParams(0.7, top_k=40, top_p=0.9),
              SamplingParams(0.8, min_p=0.05), SamplingParams(1.3), SamplingParams(0.5, top_p=0.3, min_p=0.2),
              SamplingParams(1.0, top_k=5), SamplingParams(1.0, top_p=0.999)]


@pytest.mark.parametrize("n_vocab", [300, 49_152, 151_936])
@pytest.mark.parametrize("params", LAW_PARAMS, ids=str)
def test_the_law_on_its_support_is_the_law_of_the_whole_row(n_vocab, params):
    for i, z in enumerate(_rows(n_vocab, n_vocab)):
        want = _reference(z, params)
        got = warp(z, params)
        _same_law(got, want)


def test_the_law_under_a_mask_is_the_law_of_the_allowed_tokens():
    from edgespec.sampling import row_law
    for z in _rows(49_152, 7):
        allowed = np.random.default_rng(1).random(z.size) < 0.2
        for params in LAW_PARAMS:
            want = _reference(np.where(allowed, z, -np.inf).astype(np.float32), params)
            got = row_law(z, params, z.size, allowed).dense(z.size)
            _same_law(got, want)


def test_a_law_draws_as_its_dense_row_does():
    from edgespec.sampling import row_law
    z = _rows(49_152, 3)[2]
    law = row_law(z, SamplingParams(0.9, top_p=0.9))
    dense = law.dense(z.size)
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert [law.sample(a) for _ in range(200)] == [sample(dense, b) for _ in range(200)]


def test_greedy_token_is_the_first_maximum_among_the_allowed():
    from edgespec.sampling import greedy_token
    row = np.array([1.0, 5.0, 3.0, 5.0, 3.0], np.float32)
    assert greedy_token(row) == 1
    assert greedy_token(row, np.array([1, 1, 1, 1, 1], bool)) == 1
    assert greedy_token(row, np.array([1, 0, 1, 1, 1], bool)) == 3   # the global argmax forbidden
    assert greedy_token(row, np.array([1, 0, 1, 0, 1], bool)) == 2   # ties: the first allowed
    with pytest.raises(FloatingPointError):
        greedy_token(np.array([1.0, np.nan, 0.0], np.float32))
    # a NaN where the mask forbids it is never read
    assert greedy_token(np.array([1.0, np.nan, 0.0], np.float32), np.array([1, 0, 1], bool)) == 0


def test_a_nan_anywhere_in_a_large_row_is_refused_under_top_k():
    """The column pass that finds top-k's floor must carry a NaN through, wherever it lies (here in the
    tail a vocabulary of 151,943 tokens leaves outside the 128 columns)."""
    from edgespec.sampling import row_law
    z = np.random.default_rng(0).standard_normal(151_943).astype(np.float32)
    z[-1] = np.nan
    with pytest.raises(FloatingPointError):
        row_law(z, SamplingParams(1.0, top_k=40))
    z = np.random.default_rng(0).standard_normal(5_000).astype(np.float32)
    z[-3] = np.nan
    with pytest.raises(FloatingPointError):
        row_law(z, SamplingParams(1.0, top_k=10))


@pytest.mark.parametrize("n_vocab", [1_000, 151_936])
def test_top_p_ties_across_the_first_sorted_head_go_to_the_lowest_ids(n_vocab):
    """200 tokens tied at one value, more than the 64 the cut sorts first: which of them are kept is the
    lowest ids', not whichever a partition happened to pick."""
    rng = np.random.default_rng(1)
    z = np.full(n_vocab, -30.0, np.float32)
    z[rng.choice(n_vocab, 10, replace=False)] = np.log(10.0)
    rest = np.flatnonzero(z == -30.0)
    z[rng.choice(rest, 200, replace=False)] = 0.0
    w = np.exp(z.astype(np.float64))
    params = SamplingParams(1.0, top_p=float((100 + 49.5) / w.sum()))
    _same_law(warp(z, params), _reference(z, params))


@pytest.mark.parametrize("n_vocab", [5_000, 151_936])
def test_top_p_orders_by_the_logits_where_float32_exponentials_tie(n_vocab):
    z = np.full(n_vocab, -40.0, np.float32)
    z[5] = np.float32(0.25)
    z[3] = np.nextafter(np.float32(0.25), np.float32(0))  # one float32 step below: the same float32 weight
    params = SamplingParams(1.0, top_p=0.3)
    got, want = warp(z, params), _reference(z, params)
    assert np.flatnonzero(want).tolist() == [5]
    _same_law(got, want)
