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

from typing import NamedTuple

from ..defaults import GAMMA
from . import Draft, Drafter, Round

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

    def continuation(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier match of the context's suffix."""
        n, i = self.find(tokens)
        return tokens[i + 1:i + 1 + limit] if n else []


def run_length(tokens: list[int], end: int, n: int, cap: int = RUN_MAX) -> int:
    """How far the n tokens known to agree before `end` and the context's end extend backwards."""
    last = len(tokens) - 1
    while n < cap and end - n >= 0 and tokens[end - n] == tokens[last - n]:
        n += 1
    return n


class Match(NamedTuple):
    run: int                 # how long the copy this continuation extends has been (0: no match)
    continuation: list[int]


def agreed(proposal: list[int], tokens: list[int], start: int) -> tuple[int, int]:
    """(tokens of `proposal` matched before the first miss, tokens compared) against what was
    committed from position `start` on."""
    compared = min(len(proposal), len(tokens) - start)
    matched = 0
    while matched < compared and proposal[matched] == tokens[start + matched]:
        matched += 1
    return matched, compared


class NgramDrafter(Drafter):
    """Prompt lookup as a drafter: `gamma` tokens of the continuation each round (fixed length).
    The auto drafter uses `match` and `outcome` to learn how far copies can be trusted."""

    name = "ngram"
    forks = True

    def __init__(self, gamma: int = GAMMA, n_min: int = N_MIN, n_max: int = N_MAX):
        self.gamma = gamma
        self.index = NgramIndex(n_min, n_max)
        self._args = (gamma, n_min, n_max)
        self.last: tuple[int, int, list[int]] | None = None  # (context length, run, proposal)

    def begin(self, tokens: list[int]) -> None:
        self.reset()

    def reset(self) -> None:
        self.index.reset()
        self.last = None

    def match(self, tokens: list[int], limit: int) -> Match:
        """The run length and up to `limit` continuation tokens; Match(0, []) when the context's
        suffix was not seen before."""
        n, i = self.index.find(tokens)
        if not n:
            self.last = None
            return Match(0, [])
        run, cont = run_length(tokens, i, n), tokens[i + 1:i + 1 + limit]
        self.last = (len(tokens), run, cont)
        return Match(run, cont)

    def propose(self, tokens, room, params, rng, guide=None) -> Draft:
        # point masses: the engine cuts them at the first token a constraint forbids
        return Draft(self.match(tokens, min(self.gamma, room)).continuation, None, self.name)

    def outcome(self, tokens: list[int]) -> tuple[int, int, int] | None:
        """How the last match fared against what was committed since:
        (run length, tokens matched before the first miss, tokens compared)."""
        if self.last is None:
            return None
        start, n, cont = self.last
        self.last = None
        return (n, *agreed(cont, tokens, start))

    def observe(self, round: Round) -> None:
        pass

    def fork(self, seq: int) -> "NgramDrafter":
        """A drafter like this one for another sequence (its own index)."""
        return NgramDrafter(*self._args)

    def close(self) -> None:
        pass
