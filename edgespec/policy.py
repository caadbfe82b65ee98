"""Which drafter and how many drafts, per round, from measured costs and online acceptance.

Expected tokens per second of a round with gamma drafts, each accepted with probability
alpha until the first miss (Leviathan et al. 2023, eq. 1):

    E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha)
    time      = gamma * T_draft + T_verify(gamma + 1)

T_verify(k) is the calibrated cost of a target pass that returns logits for k rows; it is
not monotonic on every device, which the search over gamma uses as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_OBSERVATIONS = 4  # trials before an estimate is trusted: no speculation on nothing
CAUTION = 0.5         # acceptance is taken half a standard deviation below its estimate
MARGIN = 1.0          # how much better than plain decoding a round must be expected to be


@dataclass
class Acceptance:
    """Per-token acceptance as a Beta posterior with forgetting (recent rounds weigh more)."""

    prior: float = 0.5
    weight: float = 2.0        # prior strength, in pseudo-trials
    decay: float = 0.97        # per update: about the last 30 rounds matter
    hits: float = 0.0
    trials: float = 0.0
    seen: int = 0

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


def best_gamma(costs: Costs, alpha: float, draft_step: float, max_gamma: int) -> tuple[int, float]:
    """The draft length (0 allowed) with the highest expected tokens per second."""
    best = (0, 1.0 / costs.verify_cost(1))
    for g in range(1, min(max_gamma, costs.max_rows - 1) + 1):
        tps = expected_tokens(alpha, g) / (g * draft_step + costs.verify_cost(g + 1))
        if tps > best[1]:
            best = (g, tps)
    return best


@dataclass
class Policy:
    costs: Costs
    max_gamma: int = 32
    model_prior: float = 0.6
    ngram: dict[int, Acceptance] = field(default_factory=dict)   # by match length
    model: Acceptance | None = None
    decisions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.model is None:
            self.model = Acceptance(prior=self.model_prior)

    def ngram_estimate(self, n: int) -> Acceptance:
        return self.ngram.setdefault(n, Acceptance(prior=0.3))

    def choose(self, ngram_match: tuple[int, int] | None, has_model: bool, room: int) -> Choice:
        """ngram_match: (match length, continuation tokens available) or None; room: most
        drafts that fit (context and max_tokens)."""
        plain = 1.0 / self.costs.verify_cost(1)
        choice = Choice("none", 0, plain)
        bar = plain * MARGIN  # the cost model is an estimate: a marginal bet is not worth taking
        if ngram_match and room > 0:
            n, available = ngram_match
            est = self.ngram_estimate(n)
            if est.seen >= MIN_OBSERVATIONS:
                g, tps = best_gamma(self.costs, est.lower(CAUTION), 0.0, min(available, room, self.max_gamma))
                if g and tps > max(bar, choice.tokens_per_second):
                    choice = Choice("ngram", g, tps)
        if has_model and room > 0 and self.costs.draft_step is not None:
            g, tps = best_gamma(self.costs, self.model.lower(CAUTION), self.costs.draft_step,
                                min(room, self.max_gamma))
            if g and tps > max(bar, choice.tokens_per_second):
                choice = Choice("model", g, tps)
        self.decisions[choice.drafter] = self.decisions.get(choice.drafter, 0) + 1
        return choice
