"""Prompt lookup: continue the most recent earlier occurrence of the context's longest suffix.

The index maps every n-gram (N_MIN <= n <= N_MAX) of the context to the position where it
last ended, updated incrementally as tokens are committed: a lookup costs N_MAX dict probes,
whatever the context length. Drafts are point masses (q is None), verified exactly by
sampling from p and accepting while equal.

Besides the continuation, a lookup reports the *run*: how many tokens before the context's
end agree with the text before the chosen occurrence (the match extended backwards past
N_MAX, up to RUN_MAX). A long run means the output is copying that passage, and copies go
on: it is what the policy predicts acceptance from.
"""
from __future__ import annotations

N_MIN = 1
N_MAX = 8
RUN_MAX = 64


class NgramIndex:
    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        self.n_min, self.n_max = n_min, n_max
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def reset(self) -> None:
        self.last_end.clear()
        self.indexed = 0

    def update(self, tokens: list[int]) -> None:
        # an n-gram ending at i is indexed once token i + 1 exists, so every hit has a continuation
        for i in range(self.indexed, len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, i + 1) + 1):
                self.last_end[tuple(tokens[i - n + 1:i + 1])] = i
        self.indexed = max(self.indexed, len(tokens) - 1)

    def find(self, tokens: list[int]) -> tuple[int, int]:
        """(length n of the longest suffix seen before, position where it last ended); (0, -1) if none."""
        self.update(tokens)
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            i = self.last_end.get(tuple(tokens[-n:]))
            if i is not None:
                return n, i
        return 0, -1

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """(length of the longest matching suffix, up to `limit` continuation tokens); (0, []) if none."""
        n, i = self.find(tokens)
        return (n, tokens[i + 1:i + 1 + limit]) if n else (0, [])


def run_length(tokens: list[int], end: int, n: int, cap: int = RUN_MAX) -> int:
    """How far the n tokens known to agree before `end` and the context's end extend backwards."""
    last = len(tokens) - 1
    while n < cap and end - n >= 0 and tokens[end - n] == tokens[last - n]:
        n += 1
    return n


class NgramDrafter:
    name = "ngram"

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        self.index = NgramIndex(n_min, n_max)
        self.last: tuple[int, int, list[int]] | None = None  # (context length, run, proposal)

    def begin(self, tokens: list[int]) -> None:
        self.index.reset()
        self.last = None

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, list[int]]:
        """(run length, up to `limit` continuation tokens); (0, []) when no suffix was seen before."""
        n, i = self.index.find(tokens)
        if not n:
            self.last = None
            return 0, []
        run, cont = run_length(tokens, i, n), tokens[i + 1:i + 1 + limit]
        self.last = (len(tokens), run, cont)
        return run, cont

    def propose(self, tokens, gamma, params, rng):
        _, cont = self.lookup(tokens, gamma)
        return cont, None

    def outcome(self, tokens: list[int]) -> tuple[int, int, int] | None:
        """How the last lookup fared against what was committed since:
        (run length, tokens matched before the first miss, tokens compared)."""
        if self.last is None:
            return None
        start, n, cont = self.last
        compared = min(len(cont), len(tokens) - start)
        matched = 0
        while matched < compared and cont[matched] == tokens[start + matched]:
            matched += 1
        self.last = None
        return n, matched, compared

    def accept(self, tokens: list[int]) -> None:
        pass

    def close(self) -> None:
        pass
