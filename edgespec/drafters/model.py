"""A smaller model with the target's tokenizer drafts by sampling from its own warped logits.

Each sequence the engine runs has its own lane (`fork`): the same draft model, its own
sequence of the draft model's KV cache. `draft_many` drafts for several lanes at once, step by
step, each step of every lane in one llama_decode of the draft model.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..backend import lent
from ..errors import BackendError, DamagedModelError
from ..sampling import LawRows, SamplingParams, greedy_token, row_law
from ..slots import last_pass, piece_of, tile_of
from ..defaults import GAMMA
from . import NO_DRAFT, Draft, Drafter, Round


class ModelWant(NamedTuple):
    """A draft the model is to make (`draft_many` makes several in lockstep)."""
    drafter: "ModelDrafter"
    tokens: list
    n: int
    params: SamplingParams
    rng: np.random.Generator
    guide: object = None


class ModelDrafter(Drafter):
    name = "model"
    forks = True

    def __init__(self, backend, n_vocab: int, gamma: int = GAMMA):
        # n_vocab: the width of the target's rows; q is zero beyond the draft's own vocabulary.
        # backend: a LlamaBackend (sequence 0) or one sequence of it (backend.SequenceView)
        self.backend = backend
        self.n_vocab = n_vocab
        self.gamma = gamma

    def begin(self, tokens: list[int]) -> None:
        """Keep the cached prefix shared with the prompt; the rest is evaluated at the first
        draft, in one batch (`draft` feeds whatever the model has not seen). Under `auto` the
        first draft may never come: the prompt is then not evaluated twice. What is kept is cut
        to what was computed in the canonical shape (slots.py), as the target's prefix is."""
        be = self.backend
        kept = be.keep_prefix(tokens)
        keep = min(kept, be.canon())
        keep -= 0 if tile_of(be) else keep % piece_of(be)
        if keep < kept:
            be.truncate(keep)

    @property
    def draft_backend(self):
        return getattr(self.backend, "backend", self.backend)  # a SequenceView's backend, or itself

    def fork(self, seq: int) -> "ModelDrafter":
        """A lane of the same draft model for sequence `seq`."""
        root = self.draft_backend
        return ModelDrafter(root.sequence(seq) if seq else root, self.n_vocab, self.gamma)

    def propose(self, tokens, room, params: SamplingParams, rng, guide=None) -> Draft:
        return self.draft(tokens, min(self.gamma, room), params, rng, guide)

    def plan(self, tokens, room, params: SamplingParams, rng, guide=None, share=None):
        return ModelWant(self, tokens, min(self.gamma, room), params, rng, guide)

    def draft(self, tokens, n: int, params: SamplingParams, rng, guide=None) -> Draft:
        """`n` tokens sampled one by one from the draft model (its argmax at T = 0), under the
        constraint's masks when there is one (q is then the masked law, as p will be)."""
        return _lockstep([ModelWant(self, tokens, n, params, rng, guide)])[0]

    def observe(self, round: Round) -> None:
        # keep the committed prefix the draft has evaluated; the newest token is fed next round
        be = self.backend
        if not be.truncate(min(be.n_past, len(round.tokens) - 1)):
            raise BackendError(f"draft model {be.path.name} cannot cut its KV cache")

    def reset(self) -> None:
        self.backend.reset()

    def close(self) -> None:
        self.backend.close()


class _Lane:
    """One sequence's draft in progress."""

    def __init__(self, want: ModelWant):
        d = want.drafter
        self.be, self.want, self.guide = d.backend, want, want.guide
        be, tokens = self.be, want.tokens
        # the draft model holds a prefix of the committed tokens (an interrupted round may have
        # left drafts or a stale tail in it: cut back to what agrees)
        held = be.tokens
        if be.n_past >= len(tokens) or (held and held[-1] != tokens[len(held) - 1]):
            be.keep_prefix(tokens)
        # the committed tokens the draft has not seen yet (the last one or two after a round); a
        # catch-up is computed in the canonical shape first (slots.py: the same KV whatever the draft
        # model held before), the rest fed with the first draft step
        _catch_up(be, tokens)
        self.pending = tokens[be.n_past:]
        self.drafts: list[int] = []
        # at T = 0 the verifier compares argmaxes and needs no q rows; at T > 0 each step's law
        # on its support (sampling.Law), the row the verifier reads as q
        self.q: LawRows | None = None if want.params.greedy else LawRows()

    @property
    def open(self) -> bool:
        return len(self.drafts) < self.want.n and not (self.guide is not None and self.guide.done)

    def feed(self) -> list[int]:
        return self.pending if not self.drafts else [self.drafts[-1]]

    def take(self, logits: np.ndarray) -> None:
        be, want = self.be, self.want
        allowed = self.guide.allowed() if self.guide is not None else None
        try:
            if self.q is None:
                self.drafts.append(greedy_token(logits, allowed))
            else:
                self.q.append(row_law(logits, want.params, want.drafter.n_vocab, allowed))
                self.drafts.append(self.q[-1].sample(want.rng))
        except FloatingPointError:
            if np.isfinite(logits.max()):
                raise
            raise DamagedModelError(f"draft model {be.path.name} produced non-finite logits: the file is "
                                    "damaged; download it again") from None
        if self.guide is not None:
            self.guide.advance(self.drafts[-1:])

    def finish(self) -> Draft:
        if self.guide is not None:
            self.guide.rollback(len(self.drafts))
            self.guide = None
        return Draft(self.drafts, self.q, ModelDrafter.name)


def _catch_up(be, tokens: list[int]) -> None:
    """Feed the draft model the committed `tokens` it lacks but the last, where it lacks more than a
    round's few (the rest goes with the first draft step), as the target's prompt is computed
    (slots.py); marks what is canonical. In tiles: from its canonical prefix (a short tail beyond it
    computed again), pieces of PIECE, the last brought to a tile. On the grid: its whole pieces."""
    p, tile, end = piece_of(be), tile_of(be), len(tokens) - 1
    if tile:
        # the first catch-up of a request starts where its canonical prefix ends (begin): it computes
        # all of it, however short, so that the draft's KV does not depend on what it held before
        canonical = be.n_past == be.canon()
        if end <= be.n_past or not canonical and end - be.n_past < tile:
            return  # a round's lag: fed with the draft step
        if not canonical and be.n_past - be.canon() <= tile:
            be.truncate(be.canon())  # a short stray tail: computed again, in tiles
            canonical = True
        while end - be.n_past > p:
            be.eval(tokens[be.n_past:be.n_past + p], [])
        _, whole, _ = last_pass(be, tokens[:end], be.n_past, tile)
        if whole and canonical:
            be.mark_canon(end)
        return
    while end - (be.n_past - be.n_past % p + p) >= 0:
        at = be.n_past
        be.eval(tokens[at:at - at % p + p], [])
        if at % p == 0 and at == be.canon():  # a whole piece of the grid after canonical ones
            be.mark_canon(be.n_past)


def draft_many(wants: list[ModelWant], separate: bool = False) -> list[Draft]:
    """The drafts `wants` ask for: a ModelDrafter's lanes in lockstep (`separate`: each lane's
    steps in passes of its own), any other model drafter (a stand-in of the tests, a benchmark's)
    by its own `draft`."""
    out: list = [None] * len(wants)
    mine = [i for i, w in enumerate(wants) if isinstance(w.drafter, ModelDrafter)]
    for i, w in enumerate(wants):
        if i not in mine:
            out[i] = w.drafter.draft(w.tokens, w.n, w.params, w.rng, w.guide)
    groups = [[wants[i]] for i in mine] if separate else ([[wants[i] for i in mine]] if mine else [])
    for i, d in zip(mine, [d for group in groups for d in _lockstep(group)]):
        out[i] = d
    return out


def _lockstep(wants: list[ModelWant]) -> list[Draft]:
    """One draft-model step of every open lane per llama_decode (lanes of one draft model; a
    lane alone is the plain step-by-step draft)."""
    lanes = [_Lane(w) if w.n > 0 else None for w in wants]
    try:
        while True:
            open_ = [lane for lane in lanes if lane is not None and lane.open]
            if not open_:
                break
            root = getattr(open_[0].be, "backend", open_[0].be)
            parts = [(getattr(lane.be, "seq", 0), lane.feed(), [len(lane.feed()) - 1]) for lane in open_]
            rows = lent(root, parts)  # each lane's row read (take) before the next step
            for lane, got in zip(open_, rows):
                lane.take(got[0])
    finally:
        drafts = [lane.finish() if lane is not None else NO_DRAFT for lane in lanes]
    return drafts

