"""A smaller model with the target's tokenizer drafts by sampling from its own warped logits."""
from __future__ import annotations

import numpy as np

from ..errors import BackendError, DamagedModelError
from ..constraints import mask_logits
from ..sampling import SamplingParams, sample, warp
from . import NO_DRAFT, Draft, Round


class ModelDrafter:
    name = "model"

    def __init__(self, backend, n_vocab: int, gamma: int = 4):
        # n_vocab: the width of the target's rows; q is zero beyond the draft's own vocabulary.
        self.backend = backend
        self.n_vocab = n_vocab
        self.gamma = gamma

    def begin(self, tokens: list[int]) -> None:
        """Keep the cached prefix shared with the prompt; the rest is evaluated at the first
        draft, in one batch (`draft` feeds whatever the model has not seen). Under `auto` the
        first draft may never come: the prompt is then not evaluated twice."""
        self.backend.keep_prefix(tokens)

    def propose(self, tokens, room, params: SamplingParams, rng, guide=None) -> Draft:
        return self.draft(tokens, min(self.gamma, room), params, rng, guide)

    def draft(self, tokens, n: int, params: SamplingParams, rng, guide=None) -> Draft:
        """`n` tokens sampled one by one from the draft model (its argmax at T = 0), under the
        constraint's masks when there is one (q is then the masked law, as p will be)."""
        be = self.backend
        if n <= 0:
            return NO_DRAFT
        # the committed tokens the draft has not seen yet (the last one or two after a round)
        pending = tokens[be.n_past:]
        drafts: list[int] = []
        # at T = 0 the verifier compares argmaxes and needs no q rows
        q = None if params.greedy else np.zeros((n, self.n_vocab), dtype=np.float32)
        w = min(be.n_vocab, self.n_vocab)
        try:
            for i in range(n):
                if guide is not None and guide.done:  # the answer is complete: nothing to draft
                    break
                feed = pending if i == 0 else [drafts[-1]]
                logits = be.eval(feed, [len(feed) - 1])[0]
                if not np.isfinite(logits.max()):
                    raise DamagedModelError(f"draft model {be.path.name} produced non-finite logits: the file is "
                                            "damaged; download it again")
                row = np.full(self.n_vocab, -np.inf, dtype=np.float32)
                row[:w] = logits[:w]
                if guide is not None:
                    row = mask_logits(row, guide.allowed())
                if q is None:
                    drafts.append(int(np.argmax(row)))
                else:
                    q[i] = warp(row, params)
                    drafts.append(sample(q[i], rng))
                if guide is not None:
                    guide.advance(drafts[-1:])
        finally:
            if guide is not None:
                guide.rollback(len(drafts))
        if q is not None and len(drafts) < n:
            q = q[:len(drafts)]
        return Draft(drafts, q, self.name)

    def observe(self, round: Round) -> None:
        # keep the committed prefix the draft has evaluated; the newest token is fed next round
        be = self.backend
        if not be.truncate(min(be.n_past, len(round.tokens) - 1)):
            raise BackendError(f"draft model {be.path.name} cannot cut its KV cache")

    def reset(self) -> None:
        self.backend.reset()

    def close(self) -> None:
        self.backend.close()
