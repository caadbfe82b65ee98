"""Conversations that come back: their KV caches kept in host RAM, LRU, bounded in bytes.

On an edge CPU the time to the first token is prefill (about a third of a decode step per
token), so an app that switches between three chats, or an agent whose planner and coder share
a model, would otherwise prefill each conversation again at every turn. The engine keeps a
conversation in each of llama.cpp's sequences (slots.py); when a request is about to throw most
of one away, it is saved here (llama.cpp's per-sequence state: the target's and the draft
model's, byte for byte), and a later request whose tokens extend a saved conversation's
restores it and evaluates only the rest. A restore is byte-exact: the conversation continues
exactly as if it had never left.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass, field
from typing import Optional

from .cachefile import open_regular

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

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
    # the leading positions whose KV was computed in the canonical shape (slots.py): only those are
    # restored for another prompt (a restored prefix is cut back to them)
    canon: int = 0
    draft_canon: int = 0  # the same for the draft model's state
    nbytes: int = field(init=False, default=0)
    path: Optional[Path] = field(default=None, compare=False)  # where a slot read from disk came from

    def __post_init__(self):
        row = self.prompt_row[1].nbytes if self.prompt_row is not None else 0
        self.nbytes = (len(self.target) + (len(self.draft[1]) if self.draft else 0) + row
                       + 8 * len(self.tokens) + ENTRY_OVERHEAD)


def _count(v) -> int:
    """A header's count (a non-negative int), 0 where it is missing or anything else."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


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

    def __init__(self, capacity: int, disk: Optional["DiskCache"] = None):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.disk = disk  # slots are also written there, and looked up there when RAM has none
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
        out = {"capacity_bytes": self.capacity, "bytes": self.bytes, "entries": len(self._slots),
               "hits": self.hits, "stores": self.stores, "evictions": self.evictions}
        if self.disk is not None:
            out["disk"] = {"dir": str(self.disk.dir), "entries": len(self.disk._index), "refused": self.disk.refused}
        return out


# -- on disk ----------------------------------------------------------------------------------
MAGIC = "edgespec-slot-1"


class DiskCache:
    """Slots in files under `directory`, for an app that restarts with the same long system
    prompt. Each file holds one slot: a JSON header line (the model's identity, the tokens, the
    payload's size and sha256) and the states. An entry is used only when its identity matches
    this model file, llama.cpp build and context settings and its payload hashes right; anything
    else is refused (and removed), never loaded. At most `capacity` bytes, oldest out."""

    def __init__(self, directory, identity: str, capacity: int = 4 * 2**30, draft_identity: Optional[str] = None,
                 facts: Optional[dict] = None):
        """`facts`: what `identity` hashes (`facts_of`), kept in each header so that an entry of
        another setup is named by what differs (it is kept for that setup, never removed)."""
        self.dir = Path(directory)
        self.identity = identity
        self.facts = facts or {}
        self.draft_identity = draft_identity  # a saved draft state is used only with the same draft model
        self.capacity = capacity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.refused = 0
        self.removed_parts = clean_parts(self.dir)  # what saves cut off (a process killed) left behind
        self._index: dict[tuple[int, ...], Path] = {}
        foreign: dict[str, int] = {}
        for f in sorted(self.dir.glob("*.slot"), key=_mtime):
            head = self._header(f)
            if head is not None and head.get("identity") == identity:
                try:
                    self._index[tuple(int(t) for t in head["tokens"])] = f
                except (TypeError, ValueError):
                    continue
            elif head is not None:  # another model, build or setting: kept for it, not used here
                theirs = head.get("facts") if isinstance(head.get("facts"), dict) else {}
                why = ", ".join(sorted(k for k in set(theirs) | set(self.facts) if theirs.get(k) != self.facts.get(k)))
                key = why or "written before entries named their setup"
                foreign[key] = foreign.get(key, 0) + 1
        for why, n in foreign.items():
            logging.getLogger("edgespec").info("prompt cache: %d entr%s in %s %s for another setup (%s): kept, "
                                               "not used", n, "y" if n == 1 else "ies", self.dir,
                                               "was written" if n == 1 else "were written", why)

    @staticmethod
    def facts_of(backend) -> dict:
        """What a saved state depends on: the model file, the llama.cpp build and the settings of
        the context that change a token's KV (not how many sequences it holds: a sequence's state
        is its own stream, restored into any sequence of any context of the same setup)."""
        import llama_cpp
        st = backend.path.stat()
        facts = {"file": str(backend.path.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns,
                 "llama_cpp": getattr(llama_cpp, "__version__", "?"),
                 "system": llama_cpp.llama_print_system_info().decode("utf-8", "replace")}
        facts.update({k: v for k, v in backend.settings.items()})
        return json.loads(json.dumps(facts, sort_keys=True, default=str))

    @staticmethod
    def identity_of(backend) -> str:
        return hashlib.sha256(json.dumps(DiskCache.facts_of(backend), sort_keys=True).encode()).hexdigest()

    def _header(self, path) -> Optional[dict]:
        fh = open_regular(path)  # a FIFO or a device named *.slot must not hang the start
        if fh is None:
            return None
        try:
            with fh:
                line = fh.readline(1 << 22)
            head = json.loads(line)
        except (OSError, ValueError):
            return None
        if not isinstance(head, dict) or head.get("magic") != MAGIC or not isinstance(head.get("tokens"), list):
            return None
        return head

    def best(self, tokens) -> tuple[Optional[Path], int]:
        best, n = None, 0
        for toks, path in self._index.items():
            k = common_prefix(toks, tokens)
            if k > n:
                best, n = path, k
        return (best, n) if n >= MIN_TOKENS else (None, 0)

    def load(self, path) -> Optional[Slot]:
        """The slot in `path`, or None (and the file removed) when it is damaged or foreign."""
        fh = open_regular(path)
        try:
            if fh is None:
                raise OSError("not a regular file")
            with fh:
                head = json.loads(fh.readline(1 << 22))
                size = head.get("size") if isinstance(head, dict) else None
                payload = fh.read(size + 1) if isinstance(size, int) and size >= 0 else b""
            ok = (isinstance(head, dict) and head.get("magic") == MAGIC and head.get("identity") == self.identity
                  and len(payload) == head.get("size") and hashlib.sha256(payload).hexdigest() == head.get("sha256"))
        except (OSError, ValueError):
            ok = False
        if not ok:
            self._refuse(path)
            return None
        try:
            t_len, d_len = int(head["target_bytes"]), int(head.get("draft_bytes", 0))
            tokens = tuple(int(t) for t in head["tokens"])
            same_draft = d_len and head.get("draft_identity") == self.draft_identity is not None
            draft = (tuple(int(t) for t in head["draft_tokens"]), payload[t_len:t_len + d_len]) if same_draft else None
        except (KeyError, TypeError, ValueError):
            self._refuse(path)
            return None
        canon, draft_canon = (_count(head.get(k)) for k in ("canon", "draft_canon"))
        return Slot(tokens, bytearray(payload[:t_len]), draft, None, canon, draft_canon if draft else 0)

    def _refuse(self, path) -> None:
        logging.getLogger("edgespec").warning("prompt cache: %s is damaged (or llama.cpp would not take it); "
                                              "not used (removed)", path.name)
        self.refused += 1
        self._index = {k: v for k, v in self._index.items() if v != path}
        try:
            path.unlink()
        except OSError:
            pass

    def put(self, slot: Slot) -> None:
        if len(slot.tokens) < MIN_TOKENS:
            return
        payload = bytes(slot.target) + (bytes(slot.draft[1]) if slot.draft else b"")
        head = {"magic": MAGIC, "identity": self.identity, "facts": self.facts, "tokens": list(slot.tokens),
                "target_bytes": len(slot.target), "size": len(payload), "canon": int(slot.canon),
                "sha256": hashlib.sha256(payload).hexdigest()}
        if slot.draft and self.draft_identity is not None:
            head.update(draft_tokens=list(slot.draft[0]), draft_bytes=len(slot.draft[1]),
                        draft_identity=self.draft_identity, draft_canon=int(slot.draft_canon))
        else:
            payload = bytes(slot.target)
            head.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        # named by the setup too: another setup's entry of the same conversation is kept for it
        name = hashlib.sha256(json.dumps([self.identity, head["tokens"]]).encode()).hexdigest()[:32] + ".slot"
        fd, tmp = _new_part(self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(json.dumps(head).encode() + b"\n")
                fh.write(payload)
                if fcntl is not None:  # renamed while locked: clean_parts never takes a finished file
                    fh.flush()
                    os.replace(tmp, self.dir / name)  # never half-written under its own name
            if fcntl is None:  # Windows: an open file cannot be renamed
                os.replace(tmp, self.dir / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        for key in [k for k in self._index if common_prefix(k, slot.tokens) == len(k)]:
            old = self._index.pop(key)
            if old.name != name:
                try:
                    old.unlink()
                except OSError:
                    pass
        self._index[slot.tokens] = self.dir / name
        self._trim()

    def _trim(self) -> None:
        files = sorted(self.dir.glob("*.slot"), key=_mtime)
        total = sum(_size(f) for f in files)
        while files and total > self.capacity:
            f = files.pop(0)
            total -= _size(f)
            self._index = {k: v for k, v in self._index.items() if v != f}
            try:
                f.unlink()
            except OSError:
                pass


# -- what a killed save leaves ------------------------------------------------------------------------
# A save writes "<random>.part" and renames it to its entry when whole; a process killed meanwhile
# (SIGKILL, a power cut) leaves the .part, up to an agent's prefix of a gigabyte, that nothing
# would remove or count. Two servers may share the folder, so only a .part nobody writes goes:
# its writer holds an exclusive flock on it from creation to rename (flock is per open file, works
# across processes, containers and, on Linux, NFS clients; it dies with its holder), and a start
# removes the .part files whose lock it gets. Where there is no flock (Windows), a .part goes
# when it has not been written to for PART_AGE_S.
PART_AGE_S = 3600


def _new_part(directory: Path) -> tuple[int, str]:
    """A new .part file in `directory`, open and (with flock) locked: (fd, path)."""
    while True:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".part")
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a start that took it first removes it
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        os.close(fd)  # removed by clean_parts between its creation and the lock: another name


def clean_parts(directory: Path) -> int:
    """Remove the .part files in `directory` that no save is writing (see above); their bytes."""
    removed = 0
    for f in Path(directory).glob("*.part"):
        try:
            size = _remove_if_stale(f)
        except OSError:  # a save holds it, it went meanwhile (renamed into its entry), or it is not ours
            continue
        if size is not None:
            removed += size
            logging.getLogger("edgespec").info("prompt cache: removed %s (%d bytes), left by a save that was cut "
                                               "off", f, size)
    return removed


def _remove_if_stale(f: Path) -> Optional[int]:
    """Remove `f` when no save writes it: its size; None when it is kept."""
    if fcntl is None:
        st = os.lstat(f)
        if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < PART_AGE_S:
            return None
        os.unlink(f)
        return st.st_size
    # read-write: an exclusive lock needs it where flock is a POSIX lock (NFS); O_NONBLOCK and
    # O_NOFOLLOW: a FIFO or a link named *.part is neither waited on nor followed
    fd = os.open(f, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError): a save writes it
        if os.lstat(f).st_ino != st.st_ino:  # the name is another file's now
            return None
        os.unlink(f)
        return st.st_size
    finally:
        os.close(fd)


def _mtime(f: Path) -> float:
    try:
        return f.stat().st_mtime
    except OSError:  # another process removed it meanwhile
        return 0.0


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0
