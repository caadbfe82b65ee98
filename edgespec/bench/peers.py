"""What edgespec is measured against and beside: llama-cpp-python's own prompt lookup, and
argmax drafting (the scheme of llama.cpp's server) for the acceptance comparison."""
from __future__ import annotations

import time

from ..drafters import Draft, Drafter
from ..sampling import SamplingParams


class ArgmaxDrafts(Drafter):
    """Wraps a model drafter so it proposes its argmax and hands no q to the verifier: the
    target then samples from p and accepts while equal (llama.cpp server's scheme). Exact, but
    accepts less than min(1, p/q) sampling at T > 0."""

    name = "model-argmax"

    def __init__(self, inner):
        self.inner = inner

    def begin(self, tokens):
        self.inner.begin(tokens)

    @property
    def n_vocab(self) -> int:
        return self.inner.n_vocab

    @property
    def draft_backend(self):
        return self.inner.draft_backend

    def propose(self, tokens, room, params, rng, guide=None):
        d = self.inner.propose(tokens, room, SamplingParams(0.0), rng, guide)
        return Draft(d.tokens, None, self.name)

    def observe(self, round):
        self.inner.observe(round)

    def reset(self):
        self.inner.reset()

    def close(self):
        pass  # the wrapped drafter's backend belongs to the benchmark's main engine


class LookupPeer:
    """llama-cpp-python's Llama with its LlamaPromptLookupDecoding draft model, greedy."""

    def __init__(self, path, n_ctx, threads):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   draft_model=LlamaPromptLookupDecoding(), verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.is_eog = llama_cpp.llama_vocab_is_eog

    def run(self, prompt_tokens, n):
        self.llm.reset()
        out, t_first = [], None
        for tok in self.llm.generate(prompt_tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if self.is_eog(self.vocab, tok):
                break
            if t_first is None:
                t_first = time.perf_counter()  # decode phase: after the first token
            out.append(tok)
            if len(out) >= n:
                break
        dt = time.perf_counter() - t_first if t_first else 0.0
        return out, (len(out) - 1) / dt if dt > 0 else 0.0

    def close(self):
        self.llm.close()


