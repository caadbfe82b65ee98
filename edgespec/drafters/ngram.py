"""Prompt lookup: continue the most recent earlier occurrence of the context's longest suffix.

The index maps every n-gram (N_MIN <= n <= N_MAX) of the context to the position where it
last ended, updated incrementally as tokens are committed: a lookup costs N_MAX dict probes,
whatever the context length. Drafts are point masses (q is None), verified exactly by
sampling from p and accepting while equal.

Besides the continuation, a lookup reports the *run*: how many tokens before the context's
end agree with the text before the chosen occurrence (the match extended backwards past
N_MAX, up to RUN_MAX). A long run means the output is copying that passage, and copies go
on: it is what the policy predicts acceptance from.

With a draft memory (`recall.DraftMemory`, shared by an Engine's lanes) the lookup also draws on
earlier answers: where the memory's match runs longer than the context's own and says something
else (or the context has none), its continuation is drafted instead (source "memory",
`recall.prefer`). Each lane gives the memory its answer when the generation ends (`end`).
"""
from __future__ import annotations

from typing import NamedTuple

from ..defaults import GAMMA
from . import Draft, Drafter, Round
from .recall import prefer

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

    def __init__(self, gamma: int = GAMMA, n_min: int = N_MIN, n_max: int = N_MAX, memory=None):
        self.gamma = gamma
        self.index = NgramIndex(n_min, n_max)
        self._args = (gamma, n_min, n_max)
        self.memory = memory  # a recall.DraftMemory shared with the other lanes, or None
        self.prompt: list[int] | None = None  # this generation's prompt (begin), until it ends
        self._clear()

    def _clear(self) -> None:
        self.index.reset()
        self.last: tuple[int, int, list[int]] | None = None  # (context length, run, proposal)
        self.recalled = False  # the last match came from the memory

    def use_memory(self, memory) -> None:
        """Draw on (and add to) this draft memory from now on; None: none."""
        self.memory = memory

    def begin(self, tokens: list[int]) -> None:
        self._clear()
        self.prompt = list(tokens)

    def end(self, tokens: list[int]) -> None:
        """The generation ended with these tokens committed: its answer goes into the memory."""
        prompt, self.prompt = self.prompt, None
        if self.memory is not None and prompt is not None and len(tokens) > len(prompt):
            self.memory.add(list(tokens[len(prompt):]), prompt)

    def reset(self) -> None:
        """Forget the request and every earlier answer (Engine.reset)."""
        self._clear()
        self.prompt = None
        if self.memory is not None:
            self.memory.clear()

    def match(self, tokens: list[int], limit: int) -> Match:
        """The run length and up to `limit` continuation tokens; Match(0, []) when the context's
        suffix was not seen before. With a memory whose match runs longer: the memory's."""
        n, i = self.index.find(tokens)
        run, cont = (run_length(tokens, i, n), tokens[i + 1:i + 1 + limit]) if n else (0, [])
        self.recalled = False
        if self.memory is not None:
            r = self.memory.match(tokens, limit)
            if prefer(run, cont, r):
                run, cont, self.recalled = r.run, r.continuation, True
        if not cont:
            self.last = None
            return Match(0, [])
        self.last = (len(tokens), run, cont)
        return Match(run, cont)

    def propose(self, tokens, room, params, rng, guide=None) -> Draft:
        # point masses: the engine cuts them at the first token a constraint forbids
        m = self.match(tokens, min(self.gamma, room))
        return Draft(m.continuation, None, "memory" if self.recalled else self.name)

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
        """A drafter like this one for another sequence (its own index, the same memory)."""
        return NgramDrafter(*self._args, memory=self.memory)

    def close(self) -> None:
        pass
