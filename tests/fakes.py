"""A numpy stand-in for LlamaBackend: next-token logits from a table indexed by the previous
token (an order-1 Markov model). It checks the engine's KV bookkeeping on every call."""
from __future__ import annotations

from pathlib import Path

import numpy as np


class FakeBackend:
    def __init__(self, table: np.ndarray, *, n_ctx: int = 4096, eos: int = -1, name: str = "fake",
                 vocab_bytes=None):
        self.table = np.asarray(table, dtype=np.float32)  # (V, V): row = previous token
        self.vocab_bytes = vocab_bytes  # each token's bytes, for constraints (llguidance's tokenizer)
        self.n_vocab = self.table.shape[1]
        self.n_ctx = n_ctx
        self.eos = eos
        self.bos = 0
        self.path = Path(name + ".gguf")
        self.can_truncate = True
        self.cache: list[int] = []  # what a KV cache would hold, position by position
        self.evals = 0
        self.closed = False
        self.settings = {"n_ctx": n_ctx}

    @property
    def n_past(self) -> int:
        return len(self.cache)

    @property
    def tokens(self) -> list[int]:
        return self.cache

    def tokenize(self, text, add_bos=True, special=True):
        # digits are token ids; other words map to a stable id
        ids = [int(w) if w.isdigit() else sum(map(ord, w)) for w in text.split()]
        return ([self.bos] if add_bos else []) + [i % self.n_vocab for i in ids]

    def token_to_piece(self, token, special=False):
        return f"<{token}>".encode()

    def token_text(self, token):
        return f"<{token}>"

    def chat_template(self):
        return None

    def guidance_tokenizer(self):
        """llguidance's tokenizer over `vocab_bytes` (it needs every single byte as a token)."""
        from llguidance import LLTokenizer, TokenizerWrapper
        assert self.vocab_bytes is not None, "FakeBackend(vocab_bytes=...) for constrained generation"
        backend = self

        class Wrapped:
            eos_token_id, bos_token_id = self.eos, None
            tokens = [b"\xff" + t if i == self.eos else t for i, t in enumerate(self.vocab_bytes)]
            special_token_ids = [self.eos]

            def __call__(self, data: bytes):  # longest match first, as BPE would mostly give
                out, i = [], 0
                while i < len(data):
                    fits = [t for t, b in enumerate(backend.vocab_bytes) if t != backend.eos and data.startswith(b, i)]
                    best = max(fits, key=lambda t: len(backend.vocab_bytes[t]))
                    out.append(best)
                    i += len(backend.vocab_bytes[best])
                return out
        return LLTokenizer(TokenizerWrapper(Wrapped()))

    def is_eog(self, token):
        return token == self.eos

    def eval(self, tokens, rows):
        assert not self.closed, "eval after close"
        assert len(self.cache) + len(tokens) <= self.n_ctx, "context overflow"
        self.cache.extend(int(t) for t in tokens)
        self.evals += 1
        return np.stack([self.table[tokens[r]] for r in rows]) if len(rows) else np.zeros((0, self.n_vocab), np.float32)

    def truncate(self, pos):
        del self.cache[pos:]
        return True

    def pos_max(self):
        return len(self.cache) - 1

    def reset(self):
        self.cache.clear()

    def keep_prefix(self, tokens):
        n = 0
        for a, b in zip(self.cache, tokens[:-1]):
            if a != b:
                break
            n += 1
        del self.cache[n:]
        return n

    def close(self):
        self.closed = True
