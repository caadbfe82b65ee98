"""Drafters propose tokens for the target to verify; the engine's loop knows only this protocol.

Lifecycle: `begin(prompt tokens)` once per request; each round `propose(...)` returns a
`Draft` (possibly empty), the target verifies it, and `observe(Round)` tells the drafter what
was committed, how much of its draft was accepted and what the passes cost. `reset()` forgets
everything a drafter learnt or cached; `close()` frees what it holds.

Several sequences: `fork(seq)` makes the drafter's lane for another sequence (its own state,
the same models and device costs); `plan(...)`, where a drafter has it, is `propose` that may
answer with a `model.ModelWant` instead of a draft, so that the engine drafts for every
sequence that wants the draft model in one batch (`model.draft_many`).

A draft carries the q rows its tokens were sampled from, or None for point-mass drafts
(n-gram lookup, argmax drafting): verification is exact either way. Under a constraint,
`propose` gets the request's `constraints.Guide` at the committed position: a drafter that
samples (the draft model) samples under its masks and leaves it where it found it; point-mass
drafts are cut by the engine at the first forbidden token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

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


class Drafter(Protocol):
    name: str

    def begin(self, tokens: list[int]) -> None: ...

    def propose(self, tokens: list[int], room: int, params: SamplingParams,
                rng: np.random.Generator, guide=None) -> Draft: ...

    def observe(self, round: Round) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...
