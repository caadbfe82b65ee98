"""`auto`: every round, the policy picks n-gram lookup, the draft model or no draft at all,
and the draft length, from the device's measured costs and the acceptance seen so far."""
from __future__ import annotations

from . import NO_DRAFT, Draft, Round
from .ngram import NgramDrafter


class AutoDrafter:
    name = "auto"

    def __init__(self, policy, ngram: NgramDrafter | None = None, model=None):
        self.policy = policy
        self.ngram = ngram if ngram is not None else NgramDrafter()
        self.model = model  # a ModelDrafter or None

    def begin(self, tokens: list[int]) -> None:
        self.ngram.begin(tokens)
        if self.model is not None:
            self.model.begin(tokens)

    def propose(self, tokens, room, params, rng) -> Draft:
        if room <= 0:
            return NO_DRAFT
        run, cont = self.ngram.match(tokens, min(room, self.policy.max_gamma))
        choice = self.policy.choose((run, len(cont)) if cont else None, self.model is not None, room)
        if choice.drafter == "ngram":
            return Draft(cont[:choice.gamma], None, "ngram")
        if choice.drafter == "model":
            return self.model.draft(tokens, choice.gamma, params, rng)
        return NO_DRAFT

    def observe(self, round: Round) -> None:
        if self.model is not None:
            self.model.observe(round)
        seen = self.ngram.outcome(round.tokens)
        if seen is not None:  # scored whether or not it drafted this round: lookups cost nothing
            self.policy.ngram.update(*seen)
        if round.draft.source == "model":
            self.policy.model.update(round.accepted, len(round.draft.tokens))

    def reset(self) -> None:
        self.ngram.reset()
        if self.model is not None:
            self.model.reset()
        self.policy.reset()

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
