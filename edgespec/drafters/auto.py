"""`auto`: every round, the policy picks a copy of the context (an aligned copy or a prompt
lookup hit), the draft model or no draft at all, and the draft length, from what the device's
passes cost now and the acceptance seen so far."""
from __future__ import annotations

from ..costs import Share
from ..policy import Offer
from . import NO_DRAFT, Draft, Drafter, Round
from .copy import CopyDrafter
from .model import ModelWant, draft_many
from .ngram import NgramDrafter
from .quote import value_end


class AutoDrafter(Drafter):
    name = "auto"
    forks = True

    def __init__(self, policy, copy: CopyDrafter | NgramDrafter | None = None, model=None):
        """`copy`: the copy drafter (an NgramDrafter is wrapped: its index serves fresh
        lookups); `model`: a ModelDrafter or None."""
        self.policy = policy
        if copy is None or isinstance(copy, NgramDrafter):
            copy = CopyDrafter(ngram=copy)
        self.copy = copy
        self.model = model
        self._lag = 1
        self._drafted = False
        self._committed = 0  # tokens committed at the last observe (begin: the prompt)
        self._constrained = False  # the last proposal was made under a constraint
        self._bound = None  # under a constraint: the continuation's tokens the proposal stood for

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab if self.model is not None else 0

    @property
    def draft_backend(self):
        return self.model.draft_backend if self.model is not None else None

    @property
    def ngram(self) -> NgramDrafter:
        return self.copy.ngram

    def begin(self, tokens: list[int]) -> None:
        # the draft model catches up on the prompt at its first draft, a cost the policy weighs
        self.policy.start()
        self._drafted = False  # the draft model has not drafted in this generation yet
        self.copy.begin(tokens)
        self._committed = len(tokens)
        if self.model is not None:
            self.model.begin(tokens)

    def use_memory(self, memory) -> None:
        """Copies and lookups draw on this draft memory (recall.DraftMemory) too."""
        self.copy.use_memory(memory)

    def use_sources(self, sources) -> None:
        self.copy.use_sources(sources)

    def end(self, tokens: list[int]) -> None:
        self.copy.end(tokens)

    def fork(self, seq: int) -> "AutoDrafter":
        """The lane for sequence `seq`: its own copy drafter, the same draft model (its sequence
        `seq`) and the policy's fork: what passes cost is learnt from every sequence; with
        reproducible decisions (the engine's default) acceptance is each generation's own, else
        it is shared too."""
        return AutoDrafter(self.policy.fork(), self.copy.fork(seq),
                           self.model.fork(seq) if self.model is not None else None)

    def propose(self, tokens, room, params, rng, guide=None) -> Draft:
        d = self.plan(tokens, room, params, rng, guide)
        return d if isinstance(d, Draft) else draft_many([d])[0]

    def plan(self, tokens, room, params, rng, guide=None, share=None):
        """`propose`, but a model draft comes back as a ModelWant (drafted in a batch with the
        other sequences'); `share`: the rest of the pass this round makes (a costs.Share; None:
        this sequence alone): what a draft adds is priced against the whole pass."""
        if room <= 0:
            return NO_DRAFT
        m = self.copy.match(tokens, min(room, self.policy.max_gamma))
        cont = m.continuation
        self._bound = None
        if guide is not None and cont:  # judged as the engine will verify it: cut at its first forbidden token
            cont = cont[:guide.legal_prefix(cont)]
            if m.in_prompt and m.source is None:  # a value quoted from the prompt: up to its phrase's end
                cont = cont[:value_end(cont, guide.piece)]
            self._bound = len(cont)
        self._constrained = guide is not None
        offer = Offer(m.run, len(cont), m.state, m.risk, m.in_prompt, guide is not None) if cont else None
        self._lag = self._model_lag(tokens)
        # tokens past the committed ones are forced by the constraint: they ride in this round's
        # pass (fed, their rows decided by the mask), and a draft adds to that pass
        forced = max(0, len(tokens) - self._committed)
        share = share or Share(-1, ())  # alone: the pass feeds the last committed token
        choice = self.policy.choose(offer, self.model is not None, room, self._lag,
                                    (share.own + forced, int(share.own > 0)), share=share)
        if choice.drafter in ("copy", "ngram"):
            return Draft(cont[:choice.gamma], None, m.source or choice.drafter)
        if choice.drafter == "model":
            return ModelWant(self.model, tokens, choice.gamma, params, rng, guide)
        return NO_DRAFT

    def observe(self, round: Round) -> None:
        policy = self.policy
        self._committed = len(round.tokens)
        if self.model is not None:
            self.model.observe(round)
        self.copy.observe(round)
        seen = self.copy.outcome(round.tokens)
        if seen is not None:  # scored whether or not it drafted this round: proposals cost nothing
            m, matched, compared = seen
            if self._bound is not None:  # scored as far as it was offered
                compared = min(compared, self._bound)
                matched = min(matched, compared)
            if compared:
                policy.copy_outcome(m.state, m.run, matched, compared, m.in_prompt, self._constrained)
        if round.draft.source == "model":
            self._drafted = True
            policy.model_outcome(round.accepted, len(round.draft.tokens))
            if round.timed_draft:
                policy.online.observe_draft(len(round.draft.tokens), round.draft_seconds, self._lag)
        if round.timed_pass and round.fed in (-1, round.verify_rows):
            policy.online.observe_pass(round.verify_rows, round.verify_seconds)

    def _model_lag(self, tokens: list[int]) -> int:
        """Committed tokens the draft model has not evaluated: it skips plain rounds, and must
        catch up on them before its next draft (a cost the policy weighs)."""
        backend = self.model.backend if self.model is not None else None
        if backend is None:  # no draft model (or a stand-in without a cache of its own)
            return 1
        if self.policy.reproducible and not self._drafted:
            # priced as a fresh generation would find it (what the draft model held before, from
            # earlier requests, must not change this one's decisions): the whole context
            return len(tokens)
        return len(tokens) - backend.n_past

    def describe_costs(self) -> dict:
        """Where the cost figures came from and how far the passes have moved them."""
        d = self.policy.online.describe()
        d["decisions"] = dict(self.policy.decisions)
        # the longest pass computed as single-row decodes compute (None: no limit found), whether
        # passes are kept within it, and whether this generation decided on a fixed table
        p = self.policy
        d["exact_rows"] = p.exact_rows
        d["bit_exact"] = p.bit_exact
        d["reproducible"] = p.fixed_costs
        d["law"] = ("plain decoding's tokens at T = 0" if p.bit_exact else
                    "the target's distribution exactly; at T = 0 the target's batched logits")
        return d

    def reset(self) -> None:
        self.copy.reset()
        if self.model is not None:
            self.model.reset()
        self.policy.reset()

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
