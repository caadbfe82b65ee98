"""Drafters propose tokens for the target to verify; the engine's loop knows only this protocol.

Lifecycle: `begin(prompt tokens)` once per request; each round `plan(...)` (by default
`propose(...)`) returns a `Draft` (possibly empty), the target verifies it, and `observe(Round)`
tells the drafter what was committed, how much of its draft was accepted and what the passes
cost. `end(tokens)` says the generation is over (what was committed); `reset()` forgets everything a
drafter learnt or cached, a draft memory's answers included; `close()` frees what it holds.
`Drafter` is the whole interface, with the defaults of a drafter that drafts nothing: a new
drafter subclasses it and overrides `propose` (and what else it needs).

Several sequences: `fork(seq)` makes the drafter's lane for another sequence (its own state,
the same models and device costs; `forks` says a drafter can); `plan(...)` may answer with a
`model.ModelWant` instead of a draft, so that the round drafts for every sequence that wants the
draft model in one batch (`model.draft_many`). Cost reporting: `policy` (the `policy.Policy`
that decides by cost, auto's) and `describe_costs()` (the stats' `costs`); `draft_backend` is
the draft model's backend (the engine counts its sequences), `n_vocab` the width of its q rows.

A draft carries the q rows its tokens were sampled from, or None for point-mass drafts
(n-gram lookup, argmax drafting): verification is exact either way. Under a constraint,
`propose` gets the request's `constraints.Guide` at the committed position: a drafter that
samples (the draft model) samples under its masks and leaves it where it found it; point-mass
drafts are cut by the engine at the first forbidden token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    q: Optional[np.ndarray] = None   # (len(tokens), n_vocab) or None for point masses
    source: str = "none"             # which drafter made it: "model", "ngram", "copy", ...


NO_DRAFT = Draft([])


@dataclass(frozen=True)
class Round:
    """One finished round, as the drafters learn from it."""

    tokens: list[int]        # every committed token, prompt included, after this round
    draft: Draft
    accepted: int            # drafts the target accepted (then one token of its own)
    verify_rows: int         # rows of logits the target pass computed (0: no pass this round)
    verify_seconds: float    # wall time of that pass
    draft_seconds: float     # wall time of `propose`
    fed: int = -1            # tokens that pass evaluated when more than its rows (forced tokens, rows
                             # a constraint decided): its time is then no sample of a k-row pass
    timed_pass: bool = True  # the pass's time is this drafter's to learn from (a pass shared by several
                             # sequences is learnt from once, by the first; verify_rows are then all of its rows)
    timed_draft: bool = True  # draft_seconds is this sequence's own drafting (not a batch of several)


class Drafter:
    """What the round and the engine ask of a drafter, with the defaults of one that drafts nothing."""

    name: str = "none"
    forks: bool = False      # `fork` makes lanes for other sequences (parallel generations)
    policy = None            # the policy.Policy deciding by cost (auto), or None
    n_vocab: int = 0         # the width of its q rows (0: it has no rows of its own)

    @property
    def draft_backend(self):
        """The draft model's backend (all its sequences), or None: no draft model."""
        return None

    def begin(self, tokens: list[int]) -> None:
        """A new request: `tokens` is its prompt."""

    def propose(self, tokens: list[int], room: int, params: SamplingParams,
                rng: np.random.Generator, guide=None) -> Draft:
        """At most `room` tokens to follow `tokens` (a guide: the constraint at that position)."""
        return NO_DRAFT

    def plan(self, tokens: list[int], room: int, params: SamplingParams, rng: np.random.Generator,
             guide=None, share=None):
        """`propose`, or a `model.ModelWant` to be drafted in one batch with the other sequences';
        `share`: the pass this sequence shares (costs.Share), for a drafter that prices it."""
        return self.propose(tokens, room, params, rng, guide)

    def observe(self, round: Round) -> None:
        """What the round committed and cost."""

    def end(self, tokens: list[int]) -> None:
        """The generation ended with `tokens` committed (prompt included): a drafter with a
        draft memory (recall.py) remembers its answer for later requests."""

    def use_memory(self, memory) -> None:
        """Draw on a draft memory shared by the engine's lanes (recall.DraftMemory); a drafter
        without lookups ignores it."""

    def use_sources(self, sources) -> None:
        """For this generation (after `begin`): what its copies may draft from besides the context
        (ChatPrompt.sources, a recall.DraftMemory of the prompt's quoted texts); a drafter
        without copies ignores it."""

    def fork(self, seq: int) -> "Drafter":
        from ..errors import UsageError
        raise UsageError(f"the {self.name} drafter cannot draft for several sequences: use parallel=1")

    def describe_costs(self) -> Optional[dict]:
        """Where its cost figures came from (GenerationStats.costs), None if it decides without any."""
        return None

    def reset(self) -> None:
        """Forget what was learnt or cached."""

    def close(self) -> None:
        """Free what it holds."""
