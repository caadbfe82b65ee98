"""Draft memory: earlier answers of the served model, for drafting the next time they come again.

Agents repeat themselves across requests: the same tool call, a file read and then written back,
the same boilerplate every session. Prompt lookup sees only the request's own context; this
memory keeps the committed tokens of finished generations (each after the last `LEAD` tokens of
its prompt, the chat template's turn header and the end of the user's words, so that an answer's
first tokens can be found too) and answers lookups over all of them, for every sequence of an
Engine (its drafter's lanes share one `DraftMemory`).

Bounded in tokens: every stored token counts (its lead and one separator included); beyond the
bound the oldest answers are evicted whole (an answer longer than the bound keeps its last part).
The index maps a hash of each n-gram (n in `KEYS`) to an absolute position where it ended: in the
newest answer that has it, its first occurrence there. Positions only grow, so an evicted answer's
n-grams are removed from the index exactly where the index still points into it (an occurrence in
a later answer stays), and a lookup never returns evicted text. A hit is checked against the
stored tokens (a hash collision drafts nothing). Thread-safe: one lock around every call.

What it changes is only what is drafted: drafts from memory are point masses, verified exactly
like prompt lookup's (docs/exactness.md).
"""
from __future__ import annotations

import threading
from array import array
from collections import deque
from typing import NamedTuple, Optional

DEFAULT_TOKENS = 256 * 1024
KEYS = (12, 4)   # n-gram lengths indexed, longest first: a lookup wants a long agreement or none
LEAD = 8         # prompt tokens stored before each answer (the turn header: an answer's start is found)
RUN_MAX = 64     # how far a match is extended backwards to measure it (ngram.RUN_MAX)
SEP = -1         # between stored answers: no n-gram and no continuation crosses it


class Recall(NamedTuple):
    run: int                 # context tokens agreeing with the memory before the continuation (0: no hit)
    continuation: list[int]  # what followed there, up to the limit, never past that answer's end


NO_RECALL = Recall(0, [])


def prefer(run: int, cont: list[int], recall: Recall) -> bool:
    """Draft the memory's continuation rather than the context's (`run`, `cont`): the context has
    none, or the memory agrees with the context over more tokens and says something else next (or
    the same, further). Where both say the same, the context's match stays: what is drafted then
    does not change with the memory."""
    if not recall.continuation:
        return False
    if not cont:
        return True
    if recall.run <= run:
        return False
    k = min(len(cont), len(recall.continuation))
    return cont[:k] != recall.continuation[:k] or len(recall.continuation) > len(cont)


class DraftMemory:
    """Earlier answers, at most `capacity` tokens, oldest evicted first; n-gram lookups over them."""

    def __init__(self, capacity: int = DEFAULT_TOKENS, keys: tuple[int, ...] = KEYS, lead: int = LEAD):
        if capacity < 1:
            raise ValueError(f"a draft memory holds at least one token, got {capacity}")
        self.capacity = int(capacity)
        self.keys = tuple(sorted(keys, reverse=True))
        self.lead = lead
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self._tokens = array("q")    # stored tokens, answers separated by SEP
        self._base = 0               # absolute position of _tokens[0]
        self._entries: deque = deque()  # (start, end) absolute positions of each stored answer (end: its SEP)
        self._index: dict[int, int] = {}  # hash of an n-gram -> absolute position of its last token
        self.answers = 0             # answers stored since the last clear (evicted ones included)
        self.evicted = 0             # answers evicted

    # -- what it holds ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Stored tokens (leads and separators included): at most `capacity`."""
        return len(self._tokens)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def describe(self) -> dict:
        with self._lock:
            return {"tokens": len(self._tokens), "capacity": self.capacity, "answers": len(self._entries),
                    "stored": self.answers, "evicted": self.evicted, "keys": len(self._index)}

    # -- storing ------------------------------------------------------------------------------
    def add(self, answer: list[int], prompt: Optional[list[int]] = None) -> None:
        """Remember one finished answer (its committed tokens), after the last `lead` tokens of
        its prompt. An answer shorter than the shortest key is not worth an entry."""
        answer = [int(t) for t in answer if t >= 0]
        if len(answer) < 2:
            return
        lead = [int(t) for t in (prompt or [])[-self.lead:] if t >= 0] if self.lead else []
        seq = (lead + answer)[-(self.capacity - 1):]  # one answer never holds more than the bound
        if len(seq) < min(self.keys) + 1:
            return
        with self._lock:
            self._evict(len(seq) + 1)
            start = self._base + len(self._tokens)
            self._tokens.extend(seq)
            self._tokens.append(SEP)
            end = start + len(seq)
            self._entries.append((start, end))
            self.answers += 1
            # an n-gram ending at i is indexed when i + 1 is in the same answer: every hit continues.
            # The newest answer wins; inside it, an n-gram's first occurrence (the longest continuation:
            # an answer that loops is found at its start, not at its last turn)
            seen = set()
            for i in range(start, end - 1):
                for n in self.keys:
                    if i - n + 1 >= start:
                        k = self._key(i, n)
                        if k not in seen:
                            seen.add(k)
                            self._index[k] = i

    def _key(self, i: int, n: int) -> int:
        """The hash of the n stored tokens ending at absolute position i."""
        j = i - self._base + 1
        return hash(tuple(self._tokens[j - n:j]))

    def _evict(self, room: int) -> None:
        """Drop the oldest answers until `room` more tokens fit within the capacity."""
        drop = 0
        while self._entries and len(self._tokens) - drop + room > self.capacity:
            start, end = self._entries.popleft()
            self.evicted += 1
            for i in range(start, end - 1):
                for n in self.keys:
                    if i - n + 1 >= start:
                        k = self._key(i, n)
                        if self._index.get(k) == i:  # the index points here: no later occurrence
                            del self._index[k]
            drop = end + 1 - self._base
        if drop:
            del self._tokens[:drop]
            self._base += drop

    # -- looking up ---------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> Recall:
        """The stored continuation of the context's longest suffix found (a key length), with how
        far back the context agrees with the memory there (up to RUN_MAX, within that answer)."""
        if limit <= 0 or not self._entries:
            return NO_RECALL
        with self._lock:
            stored, base = self._tokens, self._base
            for n in self.keys:
                if len(tokens) < n:
                    continue
                i = self._index.get(hash(tuple(tokens[-n:])))
                if i is None or i < base:
                    continue
                j = i - base
                run = 0  # checked against the stored tokens: a hash collision is no hit
                while (run < RUN_MAX and run < len(tokens) and j - run >= 0 and stored[j - run] != SEP
                       and stored[j - run] == tokens[-1 - run]):
                    run += 1
                if run < n:
                    continue
                cont = []
                for t in stored[j + 1:j + 1 + limit]:
                    if t == SEP:
                        break
                    cont.append(t)
                if cont:
                    return Recall(run, cont)
        return NO_RECALL

    @classmethod
    def of_sources(cls, sources) -> Optional["DraftMemory"]:
        """A memory holding `sources` (token sequences, the most recent first), for one generation's
        lookups (prompts.quoted_sources); None when none is long enough to index. Where two share
        an n-gram the first given (the most recent) is found: they are added oldest first."""
        sources = [[int(t) for t in s] for s in sources if len(s) > min(KEYS)]
        if not sources:
            return None
        memory = cls(sum(len(s) + 1 for s in sources) + 1, lead=0)
        for s in reversed(sources):
            memory.add(s)
        return memory

    def index_size(self) -> int:
        """Keys in the index (tests: nothing of an evicted answer is left behind)."""
        return len(self._index)
