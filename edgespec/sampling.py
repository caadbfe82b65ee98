"""Sampling math, numpy only.

`warp` turns float32 logits into the distribution the target would sample from, with the
filters in llama.cpp's sampler order (top-k, top-p, min-p on the raw logits, then
temperature). The same function is applied to target rows (p) and draft rows (q), which is
what makes speculative output distributed exactly as the target's own sampling.

`verify` is the rejection sampler of Leviathan et al. (2023) / Chen et al. (2023); variable
names follow the papers: p is the target, q the draft, gamma the number of drafted tokens.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import UsageError


# Below this, float32 logits divided by the temperature overflow or the temperature itself
# rounds to zero; anything that small is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t, k, tp, mp = self.temperature, self.top_k, self.top_p, self.min_p
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                and (t == 0 or t >= MIN_TEMPERATURE)):
            raise UsageError(f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE:g}, got {t!r}")
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            raise UsageError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not (isinstance(tp, (int, float)) and not isinstance(tp, bool) and 0 < tp <= 1):
            raise UsageError(f"top_p must be in (0, 1] (1 = off), got {tp!r}")
        if not (isinstance(mp, (int, float)) and not isinstance(mp, bool) and 0 <= mp <= 1):
            raise UsageError(f"min_p must be in [0, 1] (0 = off), got {mp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# The windows under a row's maximum in which top-k looks for its candidates first (widened until one
# holds them); comparisons find a window, exponentials are taken on it only.
_TOP_K_WINDOWS = (9.0, 12.0, 16.0, 20.0, 24.0, 32.0, np.inf)
# Top-p first exponentiates only the tokens within 16 of the row's maximum (a few hundred at 152k): every
# token below weighs less than e^-16 against the maximum's 1, and less than e^-20 below 20, so with the
# count of tokens within 20 (a comparison, no exponential) the row's normalising sum lies within a bracket
# above the window's (about 5e-4 at 152k tokens); the cut is kept where both ends of it give the same
# one. Else the window of 20 (the bracket under 3e-4), else the whole row; a window holding more than a
# quarter of the row is skipped. Only the narrowest of _TOP_P_SORTED that reaches the mass is sorted.
_TOP_P_HEADS = (16.0, 20.0)
_TOP_P_SORTED = (4.0, 8.0, 16.0, np.inf)
# Below this many candidates the top-p mass is computed on all of them at once, in float64.
_SMALL = 4096
# numpy's float32 exp is within a few ulp of the exact value (summed in float64): a window's sum and
# its running sums are known to 4e-6, and a cut that error could move is decided on a wider window, or
# in float64 on the whole row.
_EXP32_ERROR = 4e-6
# exp((z - max) / T) of a float32 lies below the smallest float32 (1.4e-45 = e^-103.3) beyond this:
# those tokens are zero in the law whether or not they are computed.
_UNDERFLOW = 104.0


# Per thread, a row-sized boolean and float32 array that the whole-row comparisons and exponentials
# write into: a new temporary of a 152k-token row (152 kB, 608 kB) costs more than the pass itself
# where malloc hands it back to the kernel between two rows (measured: a float32 exp of a row 70 us into
# a kept array, 540 us into a new one, heap-state dependent).
_scratch = threading.local()


def _scratch_of(name: str, n: int, dtype) -> np.ndarray:
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:n]


def _at_least(z: np.ndarray, floor) -> np.ndarray:
    """np.flatnonzero(z >= floor) (ascending indices), without a row-sized temporary."""
    return np.flatnonzero(np.greater_equal(z, floor, out=_scratch_of("mask", z.size, bool)))


class Law:
    """The law of one row on its support: `idx` token ids in ascending order (int64), `p` their
    float32 probabilities (summing to 1). The same numbers a dense row would hold, without the
    zeros: a 152k-token row filtered by top-p holds a few hundred."""

    __slots__ = ("idx", "p")

    def __init__(self, idx: np.ndarray, p: np.ndarray):
        self.idx, self.p = idx, p

    @classmethod
    def point(cls, token: int) -> "Law":
        return cls(np.array([token], dtype=np.int64), np.ones(1, dtype=np.float32))

    def prob(self, x: int) -> float:
        j = int(np.searchsorted(self.idx, x))
        return float(self.p[j]) if j < self.idx.size and self.idx[j] == x else 0.0

    def sample(self, rng) -> int:
        return int(self.idx[sample(self.p, rng)])

    def dense(self, width: int) -> np.ndarray:
        out = np.zeros(width, dtype=np.float32)
        out[self.idx] = self.p
        return out

    def __len__(self) -> int:
        return self.idx.size


def _top_k(z: np.ndarray, m: float, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest entries of z (max m); ties at the k-th value go to the
    lowest ids. The narrowest window under the maximum that holds k (counted by comparisons alone,
    `_TOP_K_WINDOWS`), then `_k_of` it."""
    mask = _scratch_of("mask", z.size, bool)
    for d in _TOP_K_WINDOWS:
        if d == np.inf or np.count_nonzero(np.greater_equal(z, m - np.float32(d), out=mask)) >= k:
            break
    return _k_of(z, np.flatnonzero(mask) if d != np.inf else np.arange(z.size), k)


def _k_of(z: np.ndarray, sel: np.ndarray, k: int) -> np.ndarray:
    """The k largest of z among `sel` (ascending indices holding them), ascending; ties to the lowest ids."""
    if k < sel.size <= 512:  # a small window: sorted (stable: ties to the lowest ids)
        return np.sort(sel[np.argsort(-z[sel], kind="stable")[:k]])
    if sel.size > k:
        v = z[sel]
        kth = np.partition(v, v.size - k)[v.size - k]
        above = sel[v > kth]
        sel = np.sort(np.concatenate([above, sel[v == kth][:k - above.size]]))
    return sel


def _columns(z: np.ndarray, k: int) -> Optional[tuple]:
    """(the row's maximum, a floor at least k of its tokens reach), from one pass: the row read as
    64 or 128 interleaved columns, the k-th largest of their maxima (k disjoint columns reach it). None
    where the row has too few columns for that to be a narrow floor."""
    step = 64 if z.size < 131072 else 128
    body = z.size - z.size % step
    if body // step < 4 * k:
        return None
    cols = z[:body].reshape(step, -1).max(axis=0)
    m = cols.max() if body == z.size else np.maximum(cols.max(), z[body:].max())  # a NaN carried through
    return m, np.partition(cols, cols.size - k)[cols.size - k]


def _cut(w: np.ndarray, lo: float, hi: float, z: np.ndarray) -> Optional[np.ndarray]:
    """Positions in w of its largest entries, in descending order of their logits `z` (float32
    exponentials can tie where the logits do not; ties: the lower position first), up to the first whose
    running sum reaches `lo`; None when the cut for `hi` would be another one (or w does not reach hi);
    hi <= lo: w is the whole row, the cut is lo's. Only the head is sorted, grown by 8x until its sum
    reaches hi; a head takes every token tied with its last."""
    count = min(64, w.size)
    while True:
        if count < w.size:  # the count largest, and all tied with the last of them, in ascending positions
            top = np.flatnonzero(z >= np.partition(z, z.size - count)[z.size - count])
        else:
            top = np.arange(w.size)
        top = top[np.argsort(-z[top], kind="stable")]  # stable: ties to the lowest id
        cum = np.cumsum(w[top])
        if cum[-1] >= hi or top.size == w.size:
            break
        count = min(max(count * 8, top.size + 1), w.size)
    j = int(np.searchsorted(cum, lo))
    if hi <= lo:  # exact: the whole row's sum (its rounding may leave the last token just short)
        return top[:min(j, cum.size - 1) + 1]
    if j >= cum.size or j != int(np.searchsorted(cum, hi)):
        return None
    return top[:j + 1]


def _top_p_cut(e: np.ndarray, z: np.ndarray, outside: float, top_p: float) -> Optional[np.ndarray]:
    """Positions in `e` (float32 weights exp(z - max) of logits `z`, by ascending token id, the maximum's
    among them) of top-p's cut, the rest of the row weighing between 0 and `outside`; None when the
    bracket or the rounding could move it."""
    inside = float(e.sum(dtype=np.float64))
    err = 2 * (inside + outside) * _EXP32_ERROR  # float32 exponentials, within a few ulp
    lo, hi = top_p * (inside - err), top_p * (inside + outside + err)
    for d in _TOP_P_SORTED:  # the cut lies in the narrowest top of the row that weighs more than hi
        sub = np.flatnonzero(e >= np.float32(math.exp(-d))) if d != np.inf else None
        if sub is None or float(e[sub].sum(dtype=np.float64)) > hi:
            break
    if sub is None:
        return _cut(e.astype(np.float64), lo, hi, z)
    got = _cut(e[sub].astype(np.float64), lo, hi, z[sub])
    return None if got is None else sub[got]


def _top_p(z: np.ndarray, m: float, top_p: float) -> np.ndarray:
    """Indices into z of the smallest set of highest-probability tokens (probabilities at
    temperature 1 over all of z, in float64) whose mass reaches top_p; ties go to the lowest ids.

    On a large row the weights are float32 exponentials, of a window under the maximum where the
    rest is bounded (`_TOP_P_HEADS`), else of the whole row; only the top that holds the mass is sorted,
    and the cut is kept where neither the bound nor the rounding can move it; otherwise (rarely) it is
    decided in float64 on the whole row."""
    if z.size > _SMALL:
        n, (near, far) = z.size, _TOP_P_HEADS
        within = np.count_nonzero(np.greater_equal(z, m - np.float32(far), out=_scratch_of("mask", n, bool)))
        for d in _TOP_P_HEADS:
            if 4 * within > n:
                break
            head = _at_least(z, m - np.float32(d))
            if 4 * head.size > n:
                break
            outside = (n - within) * math.exp(-far) + (within - head.size) * math.exp(-near) * (d < far)
            zh = z[head]
            got = _top_p_cut(np.exp(zh - m), zh, outside, top_p)
            if got is not None:
                return head[got]
        e = np.subtract(z, m, out=_scratch_of("exp", n, np.float32))
        got = _top_p_cut(np.exp(e, out=e), z, 0.0, top_p)
        if got is not None:
            return got
    w = np.exp(z.astype(np.float64) - np.float64(m))
    mass = top_p * float(w.sum())
    return _cut(w, mass, mass, z)


def row_law(row: np.ndarray, params: "SamplingParams", width: Optional[int] = None,
            allowed: Optional[np.ndarray] = None) -> Law:
    """The law of one float32 logits row (T > 0): `width` columns (the row cut, or zero beyond
    it), the tokens `allowed` (a boolean mask) forbids at zero; then top-k, top-p and min-p on the
    raw logits and the temperature, in llama.cpp's order, on the candidates only. Raises
    FloatingPointError on a row whose allowed maximum is not finite (a damaged model)."""
    z = row if width is None or row.shape[-1] <= width else row[:width]
    if allowed is not None:
        cand = np.flatnonzero(allowed[:z.size])
        z = z[cand]
    else:
        cand = None
    if z.size == 0:
        raise FloatingPointError("no token is allowed in this row")
    k = params.top_k if 0 < params.top_k < z.size else 0
    cols = _columns(z, k) if k and z.size > _SMALL else None
    m = z.max() if cols is None else cols[0]
    if not np.isfinite(m):
        raise FloatingPointError("non-finite logits")
    # the filters, each on the tokens the one before kept; every set is the top of the row by value
    if k:
        keep = _top_k(z, m, k) if cols is None else _k_of(z, _at_least(z, cols[1]), k)
        cand = keep if cand is None else cand[keep]
        z = z[keep]
    keep = None
    if params.top_p < 1.0:
        keep = np.sort(_top_p(z, m, params.top_p))
    if params.min_p > 0.0:
        # p(x) >= min_p * p_max  <=>  logit(x) >= max_logit + log(min_p)
        floor = m + np.float32(math.log(params.min_p))
        keep = _at_least(z, floor) if keep is None else keep[z[keep] >= floor]
    if keep is None:  # temperature alone: every token that does not underflow
        keep = _at_least(z, m - np.float32(_UNDERFLOW * params.temperature))
    p = np.exp((z[keep] - m) / np.float32(params.temperature))
    p /= p.sum()
    idx = keep if cand is None else cand[keep]
    return Law(idx.astype(np.int64, copy=False), p.astype(np.float32, copy=False))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float32 logits, shape (V,) or (rows, V) -> float32 probabilities of the same shape (dense
    rows of `row_law`; a one-hot argmax when greedy)."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim == 2:
        return np.stack([warp(row, params) for row in logits]) if len(logits) else logits.copy()
    if params.greedy:
        out = np.zeros_like(logits)
        out[int(np.argmax(logits))] = 1.0
        return out
    return row_law(logits, params).dense(logits.size)


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Forbidden tokens at -inf (a copy)."""
    width = min(logits.shape[-1], allowed.shape[-1])
    out = np.full(logits.shape, -np.inf, dtype=np.float32)
    out[..., :width] = np.where(allowed[..., :width], logits[..., :width], -np.inf)
    return out


def fit(logits: np.ndarray, width: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """Logits rows as both sides compare them: cut or padded (-inf) to `width` tokens (the larger
    vocabulary of target and draft), the tokens a constraint's `allowed` mask forbids at -inf.
    The rows themselves when nothing changes."""
    if logits.shape[-1] != width:
        rows = np.full(logits.shape[:-1] + (width,), -np.inf, dtype=np.float32)
        n = min(width, logits.shape[-1])
        rows[..., :n] = logits[..., :n]
        logits = rows
    return logits if allowed is None else mask_logits(logits, allowed)


class LawRows(list):
    """A list of `Law` (the draft's q rows) that also answers q[i, x], as a dense array would."""

    def __getitem__(self, key):
        if isinstance(key, tuple):
            i, x = key
            return super().__getitem__(i).prob(x)
        got = super().__getitem__(key)
        return LawRows(got) if isinstance(key, slice) else got


class Laws:
    """The laws of a round's rows, each computed when the verifier first reads it (a rejection
    at row i leaves the rows after it unread). Indexing gives a `Law`; numpy sees the dense
    (rows, width) array."""

    def __init__(self, rows, params: SamplingParams, width: int, masks=None):
        self.rows, self.params, self.width, self.masks = rows, params, width, masks
        self._done: dict[int, Law] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i) -> Law:
        if isinstance(i, tuple):  # p[i, x], as a dense array answers it
            return self[i[0]].prob(i[1])
        got = self._done.get(i)
        if got is None:
            if i < 0:
                return self[len(self) + i]
            row = self.rows[i]
            if isinstance(row, Law):  # a row decided without logits (a mask's one legal token)
                got = self._done[i] = row
            else:
                allowed = None if self.masks is None else self.masks[i]
                got = self._done[i] = row_law(np.asarray(row, dtype=np.float32), self.params, self.width, allowed)
        return got

    def __array__(self, dtype=None, copy=None):
        out = np.stack([self[i].dense(self.width) for i in range(len(self))]) if len(self) else \
            np.zeros((0, self.width), np.float32)
        return out if dtype is None else out.astype(dtype)


def law(logits, params: SamplingParams, width: int, allowed: np.ndarray | None = None) -> Laws:
    """The distribution each row of logits stands for, the same function for the target's rows (p)
    and the draft's (q): the width and the constraint mask first, then the filters and temperature
    (`row_law`), row by row as they are read. `logits`: a (rows, V) array or a list of rows. A new
    logits processor (a bias, a penalty) belongs in `row_law`, so that both sides get it."""
    return Laws(logits, params, width, allowed)


def sample(probs: np.ndarray, rng) -> int:
    """One draw from a (possibly unnormalised) non-negative vector, or a `Law`; zero entries never
    come out.

    `rng` is a numpy Generator, or any object with `categorical(weights) -> index`: the tests
    pass one that walks every outcome, to compute `verify`'s output law exactly."""
    if isinstance(probs, Law):
        return probs.sample(rng)
    categorical = getattr(rng, "categorical", None)
    if categorical is not None:
        return int(categorical(np.asarray(probs, dtype=np.float64)))
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    return int(np.searchsorted(cdf, rng.random() * total, side="right"))


def _prob(row, x: int) -> float:
    return row.prob(x) if isinstance(row, Law) else float(row[x])


def _draw(row, rng) -> int:
    return row.sample(rng) if isinstance(row, Law) else sample(row, rng)


def _residual(p_row, q_row):
    """norm(max(0, p - q)) as (ids or None, weights): on the union of the supports when both are
    Laws (the same numbers, in the same order, as the dense rows without their zeros)."""
    if isinstance(p_row, Law) and isinstance(q_row, Law):
        ids = np.concatenate((p_row.idx, q_row.idx))
        ids.sort()
        ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]  # np.union1d, without its overhead
        pv = np.zeros(ids.size, dtype=np.float32)
        qv = np.zeros(ids.size, dtype=np.float32)
        pv[np.searchsorted(ids, p_row.idx)] = p_row.p
        qv[np.searchsorted(ids, q_row.idx)] = q_row.p
    else:  # a dense row on either side: both dense, as wide as it
        width = len(q_row) if isinstance(p_row, Law) else len(p_row)
        ids = None
        pv = p_row.dense(width) if isinstance(p_row, Law) else p_row
        qv = q_row.dense(width) if isinstance(q_row, Law) else q_row
    residual = np.maximum(pv - qv, 0.0)
    if not residual.sum() > 0:
        # p <= q everywhere means p == q as distributions (up to rounding): rejection had
        # probability ~0; fall back to p itself, which is then the same distribution.
        residual = pv
    return ids, residual


def _accept(p_x: float, q_x: float, rng) -> bool:
    """True with probability min(1, p_x / q_x)."""
    if getattr(rng, "categorical", None) is not None:
        keep = min(p_x, q_x)
        return sample(np.array([q_x - keep, keep]), rng) == 1
    return rng.random() * q_x < p_x


def verify(draft: list[int], p, q, rng: np.random.Generator) -> tuple[int, int]:
    """Speculative rejection sampling.

    draft: gamma drafted tokens x_1..x_gamma.
    p: the gamma + 1 target laws (`Laws`, or a (gamma + 1, V) array of probabilities); row i is
       the target's distribution for x_{i+1}, row gamma the one for the bonus token. A row is
       read only when the verifier gets to it.
    q: the gamma draft laws the drafts were sampled from (a list of `Law`, or a (gamma, V)
       array), or None when the drafts are point masses (n-gram lookup): then sampling from p
       and accepting while equal is exact.
    Returns (n accepted, the next token): the corrected token on the first rejection,
    otherwise the bonus token sampled from p[gamma].
    """
    for i, x in enumerate(draft):
        if q is None:
            y = _draw(p[i], rng)
            if y != x:
                return i, y
            continue
        # accept with probability min(1, p/q), written without dividing by a tiny q
        p_row, q_row = p[i], q[i]
        if _accept(_prob(p_row, x), _prob(q_row, x), rng):
            continue
        ids, residual = _residual(p_row, q_row)
        y = sample(residual, rng)
        return i, (y if ids is None else int(ids[y]))
    return len(draft), _draw(p[len(draft)], rng)


def greedy_token(row: np.ndarray, allowed: Optional[np.ndarray] = None) -> int:
    """The argmax of a logits row among the tokens `allowed` (a boolean mask) permits; the first
    of equal maxima, as np.argmax of the masked row. Raises FloatingPointError where that maximum
    is not finite (a NaN wins np.argmax: a damaged model). A `Law` row is a point mass: its token."""
    if isinstance(row, Law):
        return int(row.idx[np.argmax(row.p)])
    x = int(np.argmax(row))
    if allowed is not None and not (x < allowed.shape[-1] and allowed[x]):
        # the row's own argmax is forbidden: the first maximum among the allowed (the usual case,
        # the model following the grammar, needs no mask pass)
        cand = np.flatnonzero(allowed[:row.shape[-1]])
        if cand.size == 0:
            raise FloatingPointError("no token is allowed in this row")
        x = int(cand[np.argmax(row[cand])])
    if not np.isfinite(row[x]):
        raise FloatingPointError("non-finite logits")
    return x


def verify_greedy(draft: list[int], logits, masks: Optional[np.ndarray] = None) -> tuple[int, int]:
    """`verify` at temperature 0, on raw logits rows (a (k + 1, V) array or a list of rows): accept
    while each draft is the row's argmax (under `masks`). The same result as warping to one-hot rows
    and verifying, without building them; the rows after the first rejection are not read."""
    n = 0
    while True:
        best = greedy_token(logits[n], None if masks is None else masks[n])
        if n == len(draft) or draft[n] != best:
            return n, best
        n += 1
