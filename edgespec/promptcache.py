"""Conversations that come back: their KV caches kept in host RAM, LRU, bounded in bytes.

On an edge CPU the time to the first token is prefill (about a third of a decode step per
token), so an app that switches between three chats, or an agent whose planner and coder share
a model, would otherwise prefill each conversation again at every turn. The engine keeps one
conversation in llama.cpp's context (its live slot); when a request is about to throw most of
it away, the slot is saved here (llama.cpp's per-sequence state: the target's and the draft
model's, byte for byte), and a later request whose tokens extend a saved conversation's
restores it and evaluates only the rest. A restore is byte-exact: the conversation continues
exactly as if it had never left.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

MIN_TOKENS = 32          # shorter prefixes are cheaper to evaluate again than to keep
ENTRY_OVERHEAD = 512     # bytes of bookkeeping per entry beyond its states


@dataclass
class Slot:
    """One conversation's state as the engine holds it: what the target's KV cache holds (and
    its bytes), the draft model's (when there is one), and the last prompt's logits row (an exact
    repeat of the prompt reuses it rather than evaluate its last token again)."""

    tokens: tuple[int, ...]
    target: bytes
    draft: Optional[tuple[tuple[int, ...], bytes]] = None
    prompt_row: Optional[tuple] = None
    nbytes: int = field(init=False, default=0)

    def __post_init__(self):
        row = self.prompt_row[1].nbytes if self.prompt_row is not None else 0
        self.nbytes = (len(self.target) + (len(self.draft[1]) if self.draft else 0) + row
                       + 8 * len(self.tokens) + ENTRY_OVERHEAD)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """Slots by the tokens they hold, least recently used first out, at most `capacity` bytes.
    Thread-safe (the engine uses it under its own lock; stats are read from anywhere)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._slots: "OrderedDict[tuple[int, ...], Slot]" = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.stores = self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def best(self, tokens) -> tuple[Optional[Slot], int]:
        """The slot sharing the longest prefix with `tokens` (at least MIN_TOKENS), and its length."""
        with self._lock:
            best, n = None, 0
            for slot in self._slots.values():
                k = common_prefix(slot.tokens, tokens)
                if k > n:
                    best, n = slot, k
            if best is None or n < MIN_TOKENS:
                return None, 0
            return best, n

    def take(self, slot: Slot) -> None:
        """`slot` goes back into the engine's context: it leaves the cache (it comes back, grown,
        when it is saved again)."""
        with self._lock:
            if self._slots.pop(slot.tokens, None) is not None:
                self.bytes -= slot.nbytes
                self.hits += 1

    def put(self, slot: Slot) -> bool:
        """Keep `slot`, dropping the slots it extends (they hold nothing it lacks) and then the
        least recently used until it fits; False when it is larger than the whole cache."""
        if len(slot.tokens) < MIN_TOKENS or slot.nbytes > self.capacity:
            return False
        with self._lock:
            for key in [k for k in self._slots if common_prefix(k, slot.tokens) == len(k)]:
                self.bytes -= self._slots.pop(key).nbytes
            while self._slots and self.bytes + slot.nbytes > self.capacity:
                _, old = self._slots.popitem(last=False)
                self.bytes -= old.nbytes
                self.evictions += 1
            self._slots[slot.tokens] = slot
            self.bytes += slot.nbytes
            self.stores += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self.bytes = 0

    def describe(self) -> dict:
        return {"capacity_bytes": self.capacity, "bytes": self.bytes, "entries": len(self._slots),
                "hits": self.hits, "stores": self.stores, "evictions": self.evictions}
