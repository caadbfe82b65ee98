"""Acceptance: how likely a drafted token is to be accepted, learnt as the engine runs.

A model draft's acceptance is one rate per token (a Beta estimate, `Acceptance`). A copy (prompt
lookup or an aligned copy) is not geometric: the longer a passage has been copied, the likelier
its next token is copied too (measured on this project's workloads: about 0.2 of single-token
matches continue, 0.85 after 8 agreeing tokens, 0.97 after 16). So copy acceptance is estimated
per run-length bucket, separately for a fresh lookup hit and for an established alignment (where
even the first token after an edit's resync is usually right), and a draft of gamma tokens
starting at run r is scored with the survival product of the buckets of r, r+1, ...
(`CopyAcceptance`). The priors below are where every generation starts.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# Run-length buckets (lower edges) and the prior per-token acceptance of each. Fresh lookup
# hits: below what the workloads showed for every kind (about 0.2 0.45 0.6 0.75 0.8 0.85 0.95
# 0.98 ...). Aligned copies: the continuation of an established copy after an edit.
RUN_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
RUN_PRIOR = (0.15, 0.35, 0.5, 0.6, 0.7, 0.75, 0.85, 0.93, 0.95, 0.95, 0.95)
ALIGNED_PRIOR = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.95, 0.95)
# Copies whose source is text this answer generated (a repeated structure: rows of a table,
# similar functions) break far sooner than copies of a prompt passage: measured on the
# workloads, after 2 agreeing tokens 4 more agree 0.1 of the time there, 0.5 in the prompt.
GENERATED_PRIOR = (0.1, 0.25, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.93, 0.95, 0.95)
# Fresh prompt-lookup hits under a constraint, cut at their first forbidden token and where the
# quoted phrase ends (drafters/quote.py): inside a JSON string an extraction quotes its prompt,
# and such hits continue far more often (measured on the structured workloads, Qwen 1.5B, per
# token: 0.77 at run 1, 0.95 at 2, 0.94 at 3 and after); set below that.
QUOTED_PRIOR = (0.65, 0.8, 0.85, 0.85, 0.9, 0.9, 0.9, 0.93, 0.95, 0.95, 0.95)
PRIOR_WEIGHT = 4.0
ALIGNED_SHIFT = 0.3   # how fast the aligned priors follow the evidence together (CopyAcceptance)
SHIFT_MAX = 3.0


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass
class Acceptance:
    """Per-token acceptance as a Beta posterior with forgetting (recent rounds weigh more)."""

    prior: float = 0.5
    weight: float = 2.0        # prior strength, in pseudo-trials
    decay: float = 0.97        # per update: about the last 30 rounds matter
    hits: float = 0.0
    trials: float = 0.0
    seen: int = 0

    def observe(self, hit: bool) -> None:
        self.hits = self.hits * self.decay + hit
        self.trials = self.trials * self.decay + 1
        self.seen += 1

    def update(self, matched: int, compared: int) -> None:
        # geometric model: `matched` successes, then one failure unless everything matched
        trials = matched + (1 if matched < compared else 0)
        if trials == 0:
            return
        self.hits = self.hits * self.decay + matched
        self.trials = self.trials * self.decay + trials
        self.seen += trials

    @property
    def mean(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.trials + self.weight)

    def lower(self, z: float = 1.0) -> float:
        """A pessimistic estimate: the posterior mean less z standard deviations."""
        m, n = self.mean, self.trials + self.weight
        return max(0.0, m - z * math.sqrt(m * (1.0 - m) / (n + 1.0)))


class CopyAcceptance:
    """Copy draft acceptance per token, by the length of the copy run it continues.

    With `shift_rate`, the priors of all buckets also move together (a shift in log-odds,
    learnt from every scored token), so that an answer that keeps resuming its copies (an
    edit) is trusted at short runs after a few rounds, before each bucket has evidence."""

    def __init__(self, decay: float = 0.98, prior: tuple[float, ...] = RUN_PRIOR, shift_rate: float = 0.0):
        self.base = tuple(prior)
        self.buckets = [Acceptance(prior=p, weight=PRIOR_WEIGHT, decay=decay) for p in prior]
        self.rounds = 0
        self.shift_rate = shift_rate
        self.shift = 0.0

    def _learn_shift(self, b: int, hit: bool) -> None:
        p = _sigmoid(_logit(self.base[b]) + self.shift)
        self.shift = min(SHIFT_MAX, max(-SHIFT_MAX, self.shift + self.shift_rate * (hit - p)))
        for bucket, base in zip(self.buckets, self.base):
            bucket.prior = _sigmoid(_logit(base) + self.shift)

    @staticmethod
    def bucket(run: int) -> int:
        return max(0, bisect.bisect_right(RUN_EDGES, run) - 1)

    def update(self, run: int, matched: int, compared: int) -> None:
        """A proposal made at `run` matched `matched` of the `compared` tokens committed since:
        token i was drafted at run + i; tokens after the first miss were never at stake."""
        self.rounds += 1
        for i in range(min(compared, matched + 1)):
            b = self.bucket(run + i)
            if self.shift_rate:
                self._learn_shift(b, i < matched)
            self.buckets[b].observe(i < matched)

    def survival(self, run: int, n: int, z: float = 0.0) -> list[float]:
        """P(the first j drafts are all accepted) for j = 1..n, each rate z deviations low.
        A longer run is taken to be at least as reliable as a shorter one, so a bucket with
        little evidence of its own inherits what the shorter runs showed."""
        rates, best = [], 0.0
        for b in self.buckets:
            best = max(best, b.lower(z))
            rates.append(best)
        out, s = [], 1.0
        for i in range(n):
            s *= rates[self.bucket(run + i)]
            out.append(s)
        return out


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)

