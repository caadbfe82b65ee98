"""A smaller model with the target's tokenizer drafts by sampling from its own warped logits."""
from __future__ import annotations

import numpy as np

from ..errors import BackendError
from ..sampling import SamplingParams, sample, warp


class ModelDrafter:
    name = "model"

    def __init__(self, backend, n_vocab: int):
        # n_vocab: the width of the target's rows; q is zero beyond the draft's own vocabulary.
        self.backend = backend
        self.n_vocab = n_vocab

    def begin(self, tokens: list[int]) -> None:
        be = self.backend
        kept = be.keep_prefix(tokens)
        if kept < len(tokens) - 1:  # prefill now, so drafting time is decode time
            be.eval(tokens[kept:-1], [])

    def propose(self, tokens, gamma, params: SamplingParams, rng):
        be = self.backend
        if gamma <= 0:
            return [], None
        # the committed tokens the draft has not seen yet (the last one or two after a round)
        pending = tokens[be.n_past:]
        drafts: list[int] = []
        # at T = 0 the verifier compares argmaxes and needs no q rows
        q = None if params.greedy else np.zeros((gamma, self.n_vocab), dtype=np.float32)
        w = min(be.n_vocab, self.n_vocab)
        for i in range(gamma):
            feed = pending if i == 0 else [drafts[-1]]
            logits = be.eval(feed, [len(feed) - 1])[0]
            if q is None:
                drafts.append(int(np.argmax(logits[:w])))
                continue
            row = np.full(self.n_vocab, -np.inf, dtype=np.float32)
            row[:w] = logits[:w]
            q[i] = warp(row, params)
            drafts.append(sample(q[i], rng))
        return drafts, q

    def accept(self, tokens: list[int]) -> None:
        # keep the committed prefix the draft has evaluated; the newest token is fed next round
        if not self.backend.truncate(min(self.backend.n_past, len(tokens) - 1)):
            raise BackendError(f"draft model {self.backend.path.name} cannot cut its KV cache")

    def close(self) -> None:
        self.backend.close()
