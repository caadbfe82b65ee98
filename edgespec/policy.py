"""Which drafter and how many drafts, per round, from measured costs and online acceptance.

Expected tokens per second of a round with gamma drafts, each accepted with probability
alpha until the first miss (Leviathan et al. 2023, eq. 1):

    E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha)
    time      = gamma * T_draft + T_verify(gamma + 1)

T_verify(k) is the calibrated cost of a target pass that returns logits for k rows; it is
not monotonic on every device, which the search over gamma uses as it is.

A model draft's acceptance is one rate per token (a Beta estimate). An n-gram draft is a
copy, and copies are not geometric: the longer a passage has been copied, the likelier its
next token is copied too (measured on this project's workloads: about 0.2 of single-token
matches continue, 0.85 after 8 agreeing tokens, 0.97 after 16, alike for every kind of
prompt). So n-gram acceptance is estimated per run-length bucket, and a draft of gamma
tokens starting at run r is scored with the survival product of the buckets of r, r+1, ...
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

MIN_OBSERVATIONS = 4  # rounds scored before a drafter is trusted: no speculation on nothing
CAUTION = 0.25        # acceptance is taken a quarter standard deviation below its estimate
MARGIN = 1.0          # how much better than plain decoding a round must be expected to be

# Run-length buckets (lower edges) and the prior per-token acceptance of each: below what
# the workloads showed for every kind (about 0.2 0.45 0.6 0.75 0.8 0.85 0.95 0.98 ...), and
# worth PRIOR_WEIGHT observations, so that what a generation observes soon outweighs them.
RUN_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
RUN_PRIOR = (0.15, 0.35, 0.5, 0.6, 0.7, 0.75, 0.85, 0.93, 0.95, 0.95, 0.95)
PRIOR_WEIGHT = 4.0


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
    """N-gram draft acceptance per token, by the length of the copy run it continues."""

    def __init__(self, decay: float = 0.98):
        self.buckets = [Acceptance(prior=p, weight=PRIOR_WEIGHT, decay=decay) for p in RUN_PRIOR]
        self.rounds = 0

    @staticmethod
    def bucket(run: int) -> int:
        return max(0, bisect.bisect_right(RUN_EDGES, run) - 1)

    def update(self, run: int, matched: int, compared: int) -> None:
        """A proposal made at `run` matched `matched` of the `compared` tokens committed since:
        token i was drafted at run + i; tokens after the first miss were never at stake."""
        self.rounds += 1
        for i in range(min(compared, matched + 1)):
            self.buckets[self.bucket(run + i)].observe(i < matched)

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


@dataclass(frozen=True)
class Costs:
    """Seconds: verify[k - 1] is a target pass with logits on k rows (k = 1..len(verify));
    draft_step a draft model's single-token step (None without a draft model)."""

    verify: tuple[float, ...]
    draft_step: float | None = None

    @property
    def max_rows(self) -> int:
        return len(self.verify)

    def verify_cost(self, k: int) -> float:
        return self.verify[min(k, self.max_rows) - 1]


@dataclass(frozen=True)
class Choice:
    drafter: str       # "none", "ngram" or "model"
    gamma: int
    tokens_per_second: float


def best_length(costs: Costs, survival: list[float], draft_step: float = 0.0) -> tuple[int, float]:
    """The draft length (0 allowed) with the highest expected tokens per second, where
    survival[j - 1] is the probability that the first j drafts are all accepted."""
    best = (0, 1.0 / costs.verify_cost(1))
    tokens = 1.0  # the target's own token comes with every pass
    for g, s in enumerate(survival[:costs.max_rows - 1], 1):
        tokens += s
        tps = tokens / (g * draft_step + costs.verify_cost(g + 1))
        if tps > best[1]:
            best = (g, tps)
    return best


def best_gamma(costs: Costs, alpha: float, draft_step: float, max_gamma: int) -> tuple[int, float]:
    """best_length for a constant per-token acceptance alpha."""
    return best_length(costs, [alpha ** j for j in range(1, max_gamma + 1)], draft_step)


@dataclass
class Policy:
    costs: Costs
    max_gamma: int = 32
    model_prior: float = 0.6
    ngram: CopyAcceptance = field(default_factory=CopyAcceptance)
    model: Acceptance | None = None
    decisions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.model is None:
            self.model = Acceptance(prior=self.model_prior)

    def reset(self) -> None:
        """Forget what was learnt (the benchmark starts every run from the priors)."""
        self.ngram = CopyAcceptance()
        self.model = Acceptance(prior=self.model_prior)

    def choose(self, ngram_match: tuple[int, int] | None, has_model: bool, room: int) -> Choice:
        """ngram_match: (run length, continuation tokens available) or None; room: most
        drafts that fit (context and max_tokens)."""
        plain = 1.0 / self.costs.verify_cost(1)
        choice = Choice("none", 0, plain)
        bar = plain * MARGIN  # the cost model is an estimate: a marginal bet is not worth taking
        if ngram_match and room > 0:
            run, available = ngram_match
            if self.ngram.rounds >= MIN_OBSERVATIONS:
                n = min(available, room, self.max_gamma)
                g, tps = best_length(self.costs, self.ngram.survival(run, n, CAUTION))
                if g and tps > max(bar, choice.tokens_per_second):
                    choice = Choice("ngram", g, tps)
        if has_model and room > 0 and self.costs.draft_step is not None:
            g, tps = best_gamma(self.costs, self.model.lower(CAUTION), self.costs.draft_step,
                                min(room, self.max_gamma))
            if g and tps > max(bar, choice.tokens_per_second):
                choice = Choice("model", g, tps)
        self.decisions[choice.drafter] = self.decisions.get(choice.drafter, 0) + 1
        return choice
