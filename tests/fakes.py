"""A numpy stand-in for LlamaBackend: next-token logits from a table indexed by the previous
token (an order-1 Markov model), with `n_seq` sequences. It checks the engine's KV bookkeeping
on every call."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from edgespec.backend import CanonMarks


class FakeBackend(CanonMarks):
    def __init__(self, table: np.ndarray, *, n_ctx: int = 4096, eos: int = -1, name: str = "fake",
                 vocab_bytes=None, n_seq: int = 1, n_batch: int = 512):
        self.table = np.asarray(table, dtype=np.float32)  # (V, V): row = previous token
        self.vocab_bytes = vocab_bytes  # each token's bytes, for constraints (llguidance's tokenizer)
        self.n_vocab = self.table.shape[1]
        self.n_ctx = n_ctx
        self.eos = eos
        self.bos = 0
        self.path = Path(name + ".gguf")
        self.can_truncate = True
        self.n_seq = n_seq
        self.n_batch = n_batch
        # slots.piece_of: the canonical piece of a prompt's computation (4: tiny prompts still reuse)
        self.canonical_piece = 4
        self.canonical_tile = 0  # slots.tile_of: the grid (a test sets tiles of its own)
        self.caches: list[list[int]] = [[] for _ in range(n_seq)]  # what each sequence's KV cache holds
        self._canon = [0] * n_seq  # backend.CanonMarks
        self.evals = 0
        self.batches: list[list[tuple[int, int, int]]] = []  # per eval_batch: (seq, tokens, rows) of each part
        self.closed = False
        self.settings = {"n_ctx": n_ctx}

    @property
    def cache(self) -> list[int]:
        return self.caches[0]

    @property
    def n_past(self) -> int:
        return len(self.caches[0])

    @property
    def tokens(self) -> list[int]:
        return self.caches[0]

    def held(self, seq=0):
        return self.caches[seq]

    def sequence(self, seq):
        from edgespec.backend import SequenceView
        return SequenceView(self, seq)

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

    def eval(self, tokens, rows, seq=0):
        return self.eval_batch([(seq, tokens, rows)])[0]

    def eval_batch(self, parts):
        assert not self.closed, "eval after close"
        assert len({seq for seq, _, _ in parts}) == len(parts), "a sequence twice in one batch"
        out = []
        for seq, tokens, rows in parts:
            cache = self.caches[seq]
            assert len(cache) + len(tokens) <= self.n_ctx, "context overflow"
            cache.extend(int(t) for t in tokens)
            out.append(np.stack([self.table[tokens[r]] for r in rows]) if len(rows)
                       else np.zeros((0, self.n_vocab), np.float32))
        self.evals += 1
        self.batches.append([(seq, len(tokens), len(rows)) for seq, tokens, rows in parts])
        return out

    def abort_when(self, stop):
        """Passes here never take long enough to be stopped inside (backend.LlamaBackend's can)."""
        return contextlib.nullcontext()

    def truncate(self, pos, seq=0):
        del self.caches[seq][pos:]
        self._cut_canon(seq, pos)
        return True

    def pos_max(self, seq=0):
        return len(self.caches[seq]) - 1

    def reset(self, seq=None):
        for s in (range(self.n_seq) if seq is None else [seq]):
            self.caches[s].clear()
            self._cut_canon(s)

    def keep_prefix(self, tokens, seq=0):
        cache = self.caches[seq]
        n = 0
        for a, b in zip(cache, tokens[:-1]):
            if a != b:
                break
            n += 1
        self.truncate(n, seq)
        return n

    def copy_prefix(self, src, dst, n):
        n = min(n, len(self.caches[src]))
        self.caches[dst][:] = self.caches[src][:n]
        self._copy_canon(src, dst)
        return n

    def close(self):
        self.closed = True
