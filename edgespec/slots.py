"""The live sequences: which conversation each sequence of the KV caches holds, and where a new
prompt's prefix comes from.

The target (and the draft model) hold `n` sequences in one context. A prompt starts on a free
sequence, the one whose tokens it continues best (else an empty one, else the one unused the
longest). Its prefix then comes from the cheapest place that has it: that sequence itself,
another sequence (a shared system prompt or tool definitions: llama_memory_seq_cp copies the
cells, nothing is evaluated again), or the prompt cache (promptcache.py: a saved
conversation, restored byte for byte). A conversation about to be thrown away is saved to
the prompt cache first. With one sequence this is the one live slot and its prompt cache.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from .errors import BackendError, check_finite
from .promptcache import MIN_TOKENS, Slot, common_prefix

log = logging.getLogger("edgespec")
# A prefix is copied from another sequence when it holds at least this many more tokens:
# llama.cpp copies the whole stream of cells (Qwen 1.5B at 4096 tokens: 112 MiB, tens of ms),
# about what a prefill of a dozen tokens costs on a CPU.
MIN_COPY = 16
# The canonical shape of a prompt's computation. A token's KV depends, in its last bits, on the pass it
# was computed in (how many rows, how the kernels group them), so a prefix is reused (kept, copied from
# another sequence, restored) only as far as it was computed in the canonical shape: the rest of the
# prompt is then computed as a fresh prefill computes it, and the answer is the answer alone. Two shapes:
# - tiles, on llama.cpp's CPU kernels with the settings docs/exactness.md's table proves (`tile_of`):
#   flash attention's CPU kernel computes a whole pass by its tiled path from TILE (64) query rows on,
#   by another below; the repacked weights' gemm takes rows in fours (GROUP), the rest by a gemv. A row
#   computed in a pass of at least TILE rows, in its whole groups, has the same KV however the prompt
#   was split. So a prompt longer than a piece is computed in pieces of PIECE from wherever its kept
#   prefix ends, the last pass brought to at least TILE rows and a multiple of GROUP (dummy rows after
#   it, cut from the cache after the pass; where the context has no room for them, the pass begins a
#   few rows earlier): every position is kept for a later turn, which computes only its new tokens.
#   A prompt of one piece is computed whole, as llama.cpp computes it in one batch.
# - the grid, elsewhere (a GPU, unproven settings): pieces of PIECE tokens at absolute positions
#   (0..127, 128..255, ...; the last piece what is left); a prefix reused only as far as whole pieces
#   of the grid. On a GPU the piece is the batch (n_batch).
# 128 rows cost no more than 512 a token on a CPU (Qwen 1.5B, 2 threads: 89 tok/s against 82-87).
PIECE = 128
TILE = 64
GROUP = 4


class Sequences:
    def __init__(self, target, draft=None, cache=None, n: int = 1):
        """`target`, `draft`: backends (the draft model's, or None); `cache`: a
        promptcache.PromptCache or None; `n`: the sequences both hold."""
        self.target, self.draft, self.cache, self.n = target, draft, cache, n
        # per sequence, the last prompt's logits row: an exact repeat of the prompt reuses it,
        # so it takes the same path as the first time (its last token evaluated again, alone,
        # would round differently)
        self.prompt_row: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self.piece = piece_of(target)
        self.tile = tile_of(target)  # 0: the grid
        self._used: dict[int, int] = {}
        self._tick = 0

    @property
    def canon(self) -> dict[int, int]:
        """Per sequence: its leading positions computed in the canonical shape (whole tiles, or whole
        pieces of the grid), as the target's backend keeps them (LlamaBackend.canon: lowered wherever
        its cache is cut, carried by copy_prefix)."""
        return {s: self.target.canon(s) for s in range(self.n)}

    def canonical(self, seq: int, n: int, source: Optional[int] = None) -> int:
        """How much of an `n`-token prefix held by sequence `source` (default `seq`) may be reused:
        what it computed in the canonical shape (on the grid: cut to a multiple of the piece)."""
        src = seq if source is None else source
        if not getattr(self.target, "can_truncate", True):  # a recurrent model: its state is not cut back
            return min(n, len(self.target.held(src)))
        n = min(n, self.target.canon(src))
        return self._whole(n)

    @property
    def caching(self) -> bool:
        cache = self.cache
        return cache is not None and (cache.capacity > 0 or cache.disk is not None) and \
            hasattr(self.target, "save_state")

    def claim(self, tokens: list[int], busy=()) -> tuple[int, bool]:
        """A sequence not in `busy` for a prompt, its KV prepared (the prefix kept, copied or
        restored); returns (the sequence, whether a saved conversation was restored into it)."""
        head = tokens[:-1]  # the last prompt token is always evaluated (its row is needed)
        held = self.target.held
        free = [s for s in range(self.n) if s not in busy]
        if not free:
            raise RuntimeError("no free sequence: the engine admitted more generations than it has sequences")
        # first a sequence that keeps the running ones' ids consecutive: llama.cpp computes a pass
        # in one go only over consecutive sequences (a gap costs a second computation every
        # round); the prompt's prefix comes by copy from whichever sequence holds it (_prepare)
        seq = max(free, key=lambda s: (-_runs(set(busy) | {s}), common_prefix(held(s), head), not held(s),
                                       -self._used.get(s, -1)))
        self._tick += 1
        self._used[seq] = self._tick
        return seq, self._prepare(seq, tokens)

    def _prepare(self, seq: int, tokens: list[int]) -> bool:
        target, cache = self.target, self.cache
        head = tokens[:-1]
        live = common_prefix(target.held(seq), head)
        repeat = self.prompt_row.get(seq)
        if not (repeat is not None and repeat[0] == tuple(tokens)):  # an exact repeat keeps all (prefill)
            live = self.canonical(seq, live)
        donor, shared = None, live
        for s in range(self.n):  # another sequence holding more of the prompt
            n = self.canonical(seq, common_prefix(target.held(s), head), s) if s != seq else 0
            if n > shared:
                donor, shared = s, n
        slot, saved = (None, 0)
        if self.caching:
            slot, saved = cache.best(head)
            if slot is not None:
                saved = self._usable(slot, saved)
            if cache.disk is not None:
                path, on_disk = cache.disk.best(head)
                if on_disk > max(saved, shared):
                    loaded = cache.disk.load(path)  # None when damaged or foreign: refused, not loaded
                    if loaded is not None and self._usable(loaded, on_disk) > max(saved, shared):
                        slot, saved = loaded, self._usable(loaded, on_disk)
                        slot.path = path
        if donor is not None and shared - live < MIN_COPY:
            donor, shared = None, live
        restore = slot is not None and saved > shared
        if restore:
            cache.take(slot)  # before saving the live slot could evict it
        n_past = len(target.held(seq))
        # saved only where it holds more whole pieces than are kept (the rest could not be reused)
        worth = self.canonical(seq, n_past)
        if self.caching and (worth - live >= MIN_TOKENS or ((restore or donor is not None) and worth >= MIN_TOKENS)):
            self.stash(seq)
        if restore:
            try:
                self._load(seq, slot)
                target.mark_canon(saved, seq)
                if not target.truncate(saved, seq):
                    target.reset(seq)
                    return False
                return True
            except BackendError:
                if getattr(slot, "path", None) is None:
                    raise
                cache.disk._refuse(slot.path)  # llama.cpp would not take it: never again
                target.reset(seq)
                return False
        if donor is not None:
            row = self.prompt_row.get(donor)
            if row is not None and row[0] == tuple(tokens) \
                    and target.held(donor)[:len(tokens)] == list(tokens):
                shared = len(tokens)  # an exact repeat: its last row too, so it is not evaluated again
            target.copy_prefix(donor, seq, shared)  # its canonical prefix goes with it
            if row is not None:
                self.prompt_row[seq] = row
            d = self.draft
            if d is not None:  # as far as the draft computed it in the canonical shape too
                n = min(common_prefix(d.held(donor), head), d.canon(donor))
                n = self._whole(n)
                if n > common_prefix(d.held(seq), head):
                    d.copy_prefix(donor, seq, n)  # its canonical prefix goes with it
        return False

    def _whole(self, n: int) -> int:
        """A canonical prefix of `n` positions as it may be reused: all of it in tiles, its whole
        pieces on the grid."""
        return n if self.tile else n - n % self.piece

    def _usable(self, slot: Slot, n: int) -> int:
        """How much of a saved slot's `n`-token prefix may be restored (its canonical shape)."""
        n = min(n, slot.canon)
        return self._whole(n)

    def prefill(self, seq: int, tokens: list[int], limit: Optional[int] = None
                ) -> tuple[Optional[np.ndarray], int]:
        """Put the prompt in sequence `seq`; return its last row of logits and how many prompt
        positions were already there. With `limit`, at most that many tokens are evaluated now
        (other sequences' rounds go on between the pieces): the row is None until the last
        piece; a `limit` of n_batch cuts the prompt where llama.cpp's own batches would."""
        target = self.target
        saved = self.prompt_row.get(seq)
        held = target.held(seq)
        if (saved is not None and saved[0] == tuple(tokens) and len(held) >= len(tokens)
                and held[:len(tokens)] == tokens and target.truncate(len(tokens), seq)):
            return saved[1], len(tokens)
        self.prompt_row.pop(seq, None)
        # what is kept is cut back to the canonical shape; the rest is computed in it
        kept, p, n = target.keep_prefix(tokens, seq), self.piece, len(tokens)
        keep = self.canonical(seq, kept) if not (self.tile and n <= p) else 0  # one piece: whole
        if keep < kept and not target.truncate(keep, seq):
            target.reset(seq)
            keep = 0
        kept = keep
        target.mark_canon(kept, seq)
        at = kept
        # with `limit`, whole pieces up to it (at least one) now, the rest in later calls; on the grid
        # the pieces lie at multiples of `p`, in tiles from where the kept prefix ends
        base = at if self.tile else at - at % p
        stop = n if limit is None else min(n, base + max(p, (at + limit - base) - (at + limit - base) % p))
        while at < n:
            end = min(n, base + ((at - base) // p + 1) * p)
            if end > stop:
                return None, kept
            if end == n:
                if self.tile and n > p:
                    # always in tiles here: a prompt longer than a piece has room to begin a tile earlier
                    row, _, began = last_pass(target.sequence(seq) if seq else target, tokens, at, self.tile)
                    kept = min(kept, began)  # a pass begun earlier computed those again
                else:
                    row = target.eval(tokens[at:], [n - at - 1], seq)
                break
            target.eval(tokens[at:end], [], seq)
            at = end
            target.mark_canon(at, seq)
        check_finite(target, row)
        if self.tile:  # one piece: its rows in whole groups of a pass of at least a tile
            target.mark_canon(n if n > p else n - n % GROUP if n >= self.tile else 0, seq)
        else:
            target.mark_canon(n - n % p, seq)
        self.prompt_row[seq] = (tuple(tokens), row)
        return row, kept

    # -- the prompt cache -----------------------------------------------------------------
    def stash(self, seq: int) -> None:
        """Save sequence `seq`'s conversation to the prompt cache (and its disk)."""
        slot = self.save(seq)
        self.cache.put(slot)
        if self.cache.disk is not None:
            try:
                self.cache.disk.put(slot)
            except OSError as exc:  # a full disk costs the restart's prefill, not this request
                log.warning("prompt cache: could not write to %s: %s", self.cache.disk.dir, exc)

    def save(self, seq: int) -> Slot:
        toks, data = self.target.save_state(seq)
        d = self.draft
        # auto's draft model may hold another conversation (it catches up only when it drafts)
        dstate = (d.save_state(seq) if d is not None
                  and common_prefix(d.held(seq), toks) >= min(MIN_TOKENS, len(d.held(seq))) > 0 else None)
        return Slot(toks, data, dstate, self.prompt_row.get(seq), min(self.target.canon(seq), len(toks)),
                    d.canon(seq) if dstate is not None else 0)

    def _load(self, seq: int, slot: Slot) -> None:
        self.target.load_state(slot.tokens, slot.target, seq)
        d = self.draft
        if d is not None:
            try:
                if slot.draft is not None:
                    d.load_state(*slot.draft, seq)
                    d.mark_canon(slot.draft_canon, seq)
                else:
                    d.reset(seq)
            except BackendError:  # a saved draft state of another draft model: it catches up instead
                d.reset(seq)
        if slot.prompt_row is not None:
            self.prompt_row[seq] = slot.prompt_row
        else:
            self.prompt_row.pop(seq, None)

    def save_for_restart(self) -> None:
        """At close: every conversation the sequences hold, to the prompt cache's disk."""
        cache = self.cache
        if cache is None or cache.disk is None or not hasattr(self.target, "save_state"):
            return
        for seq in range(self.n):
            if len(self.target.held(seq)) >= 32:
                try:
                    cache.disk.put(self.save(seq))
                except Exception as exc:
                    log.warning("prompt cache: could not save a conversation: %s", exc)

    def reset(self) -> None:
        self.target.reset()
        self.prompt_row.clear()
        if self.cache is not None:
            self.cache.clear()


def piece_of(backend) -> int:
    """The canonical piece (PIECE) for a backend: its batch where it runs on a GPU."""
    root = getattr(backend, "backend", backend)  # a SequenceView: its backend's
    given = getattr(root, "canonical_piece", None)  # a backend that says its own (the test fakes)
    if isinstance(given, int) and given > 0:
        return given
    settings = getattr(root, "settings", {}) or {}
    on_gpu = bool(settings.get("gpu_offload")) and settings.get("n_gpu_layers", 0) != 0
    batch = getattr(root, "n_batch", 512)
    return batch if on_gpu else min(PIECE, batch)


# The settings docs/exactness.md's table proves the tile rule for (llama.cpp's CPU kernels, 1 and 2
# threads, Q4_1 and Q4_K_M weights, flash attention on, auto or off): an f16 or q8_0 KV cache.
_TILE_KV = {"f16", "q8_0"}


def tile_of(backend) -> int:
    """TILE where the tile rule is proven for a backend (llama.cpp on this machine's CPU, the
    settings of _TILE_KV, each pass one batch; over an rpc-server, its CPU kernels are taken to be
    the same): its prompts are computed in tiles; 0 where they keep the grid (a GPU build, a
    recurrent model, other settings)."""
    root = getattr(backend, "backend", backend)  # a SequenceView: its backend's
    given = getattr(root, "canonical_tile", None)  # a backend that says its own (the test fakes)
    if isinstance(given, int) and given >= 0:
        return given
    settings = getattr(root, "settings", None)
    if not isinstance(settings, dict) or not getattr(root, "repack", False) \
            or getattr(root, "n_batch", 0) < PIECE:  # a pass is one batch
        return 0
    # a GPU build, even with no layers offloaded (llama.cpp may still send a batch's matmuls to the
    # device), and a recurrent model (its state cannot drop the dummy rows) keep the grid
    if settings.get("gpu_offload") or not getattr(root, "can_truncate", True):
        return 0
    return TILE if {getattr(root, "type_k", None), getattr(root, "type_v", None)} <= _TILE_KV else 0


def last_pass(be, tokens: list[int], at: int, tile: int) -> tuple[np.ndarray, bool, int]:
    """The last pass of a prompt longer than a piece, in tiles, on a one-sequence backend (a
    SequenceView, or sequence 0) holding tokens[:at]: tokens[at:] brought to at least `tile` and a
    multiple of GROUP rows, by dummy rows after them (the causal mask hides them from the prompt's rows;
    cut from the cache after the pass) or, where the context has no room for them, by beginning the
    pass earlier (rows computed again as they were: in whole groups of passes of a tile or more).
    Returns the last token's row, whether the pass was in tiles (not where neither could be), and
    where it began."""
    n = len(tokens)
    rows = n - at
    want = max(tile, rows + -rows % GROUP)
    if want == rows:
        return be.eval(tokens[at:], [rows - 1]), True, at
    if at + want <= be.n_ctx:
        out = be.eval(list(tokens[at:]) + [tokens[-1]] * (want - rows), [rows - 1])
        if not be.truncate(n):
            raise BackendError(f"{be.path.name}: the KV cache could not cut a prompt's padding back")
        return out, True, at
    start = n - want  # > 0 for a prompt longer than a piece
    if start < 0:
        return be.eval(tokens[at:], [rows - 1]), False, at
    if not be.truncate(start):
        raise BackendError(f"{be.path.name}: the KV cache could not be cut back")
    return be.eval(tokens[start:], [want - 1]), True, start


def _runs(seqs: set) -> int:
    """How many runs of consecutive ids `seqs` makes ({0, 1, 3}: 2)."""
    return sum(1 for s in seqs if s - 1 not in seqs)
