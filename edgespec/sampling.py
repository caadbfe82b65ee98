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
from dataclasses import dataclass

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


def _top_p_mask(z: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of highest-probability tokens whose mass reaches top_p.

    Only the head of the distribution is sorted: candidates are grown by 8x until their mass
    reaches top_p, which on a 152k vocabulary is a few hundred tokens, not a full sort.
    """
    probs = np.exp(z - z.max(), dtype=np.float64)
    probs /= probs.sum()
    n = probs.size
    m = min(64, n)
    while True:
        head = np.argpartition(-probs, m - 1)[:m] if m < n else np.arange(n)
        head = head[np.argsort(-probs[head], kind="stable")]
        cum = np.cumsum(probs[head])
        if cum[-1] >= top_p or m == n:
            keep = head[: int(np.searchsorted(cum, top_p)) + 1]
            mask = np.zeros(n, dtype=bool)
            mask[keep] = True
            return mask
        m = min(m * 8, n)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float32 logits, shape (V,) or (rows, V) -> float32 probabilities of the same shape."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim == 2:
        return np.stack([warp(row, params) for row in logits]) if len(logits) else logits.copy()
    out = np.zeros_like(logits)
    if params.greedy:
        out[int(np.argmax(logits))] = 1.0
        return out
    # Work on the candidates only: after top-k that is k tokens, not the whole vocabulary.
    if 0 < params.top_k < logits.size:
        cand = np.argpartition(logits, logits.size - params.top_k)[logits.size - params.top_k:]
        z = logits[cand]
    else:
        cand, z = None, logits.copy()
    keep = np.isfinite(z)
    if params.top_p < 1.0:
        keep &= _top_p_mask(z, params.top_p)
    if params.min_p > 0.0:
        # p(x) >= min_p * p_max  <=>  logit(x) >= max_logit + log(min_p)
        keep &= z >= z.max() + np.float32(math.log(params.min_p))
    z = np.where(keep, (z - z.max()) / np.float32(params.temperature), -np.inf)
    probs = np.exp(z)
    probs /= probs.sum()
    if cand is None:
        return probs.astype(np.float32, copy=False)
    out[cand] = probs
    return out


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


def law(logits: np.ndarray, params: SamplingParams, width: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """The distribution a row of logits stands for, the same function for the target's rows (p)
    and the draft's (q): `fit` (width, constraint mask) first, then the filters and temperature
    (`warp`). A new logits processor (a bias, a penalty) belongs here, so that both sides get it."""
    return warp(fit(logits, width, allowed), params)


def sample(probs: np.ndarray, rng) -> int:
    """One draw from a (possibly unnormalised) non-negative vector; zero entries never come out.

    `rng` is a numpy Generator, or any object with `categorical(weights) -> index`: the tests
    pass one that walks every outcome, to compute `verify`'s output law exactly."""
    categorical = getattr(rng, "categorical", None)
    if categorical is not None:
        return int(categorical(np.asarray(probs, dtype=np.float64)))
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    return int(np.searchsorted(cdf, rng.random() * total, side="right"))


def _accept(p_x: float, q_x: float, rng) -> bool:
    """True with probability min(1, p_x / q_x)."""
    if getattr(rng, "categorical", None) is not None:
        keep = min(p_x, q_x)
        return sample(np.array([q_x - keep, keep]), rng) == 1
    return rng.random() * q_x < p_x


def verify(draft: list[int], p: np.ndarray, q: np.ndarray | None,
           rng: np.random.Generator) -> tuple[int, int]:
    """Speculative rejection sampling.

    draft: gamma drafted tokens x_1..x_gamma.
    p: (gamma + 1, V) target probabilities; row i is the target's distribution for x_{i+1},
       row gamma the one for the bonus token.
    q: (gamma, V) draft probabilities the drafts were sampled from, or None when the drafts
       are point masses (n-gram lookup): then sampling from p and accepting while equal is exact.
    Returns (n accepted, the next token): the corrected token on the first rejection,
    otherwise the bonus token sampled from p[gamma].
    """
    for i, x in enumerate(draft):
        if q is None:
            y = sample(p[i], rng)
            if y != x:
                return i, y
            continue
        # accept with probability min(1, p/q), written without dividing by a tiny q
        if _accept(float(p[i, x]), float(q[i, x]), rng):
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if not residual.sum() > 0:
            # p <= q everywhere means p == q as distributions (up to rounding): rejection had
            # probability ~0; fall back to p itself, which is then the same distribution.
            residual = p[i]
        return i, sample(residual, rng)
    return len(draft), sample(p[len(draft)], rng)


def verify_greedy(draft: list[int], logits: np.ndarray) -> tuple[int, int]:
    """`verify` at temperature 0, on raw logits: accept while each draft is the row's argmax.
    The same result as warping to one-hot rows and verifying, without building them."""
    best = np.argmax(logits, axis=1)
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, int(best[n])
