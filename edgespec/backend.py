"""llama.cpp adapter over llama-cpp-python's low-level API.

One model, one context, `n_seq` sequences, each in its own stream of n_ctx KV cells. Every
KV method takes a sequence id (default 0); `eval_batch` evaluates several sequences' tokens
in one llama_decode (llama.cpp cuts it into micro-batches of equal tokens per sequence);
`copy_prefix` gives one sequence another's prefix without evaluating it; `sequence(seq)` is a
view with the one-sequence interface, for code that follows one sequence (a drafter's lane).
Logits are requested only for the rows that will be verified and read with
llama_get_logits_ith: never `logits_all`, never the n_ctx x n_vocab `Llama.scores` buffer.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from .defaults import ALL_LAYERS, N_CTX, cpu_count
from .errors import Aborted, BackendError, ModelFileError, UsageError

log = logging.getLogger("edgespec")

_log_callback = None  # keep the ctypes callback alive for the life of the process
_backend_ready = False


def _llama():
    import llama_cpp
    return llama_cpp


def set_verbose(verbose: bool) -> None:
    """Route llama.cpp's logging to stderr when verbose, nowhere otherwise."""
    global _log_callback, _backend_ready
    L = _llama()

    @L.llama_log_callback
    def _cb(level, text, user_data):
        if verbose:
            os.write(2, text)

    _log_callback = _cb
    L.llama_log_set(_log_callback, ctypes.c_void_p(0))
    if not _backend_ready:
        L.llama_backend_init()
        _backend_ready = True


class _Compute:
    """One thread for every llama.cpp graph computation of the process (decodes, model loads),
    and the thread that runs every engine's rounds (`post`: engine.Engine's loop).

    llama-cpp-python's builds run ggml's CPU graphs on OpenMP, and libgomp keeps a team of
    worker threads per thread that started a parallel region. Once there are more of them
    than CPUs (a server's request threads each decoding in turn, a library called from a new
    thread), libgomp throttles every team's spinning between the graph's operations, and each
    operation waits for a sleeping worker to wake: measured on 2 cores, Qwen 1.5B, the same
    decode step took 35-41 ms from the thread that ran the first one and 48-55 ms from any other,
    and `serve --parallel 4` answered one request at a time in 7.5-9.3 s against 5.1-5.6 s with
    --parallel 1. Computing on one thread keeps one team. A caller interrupted while it waits
    (KeyboardInterrupt) stops a pass that can be stopped (`interrupt`), waits for llama.cpp to
    return, and then raises: llama.cpp is never used by two threads at once. (A stream's reader
    waits on its queue, not here: its interrupt ends its generation, and the round stops that
    generation's prompt pass inside, rounds.start.)"""

    def __init__(self):
        self._start_lock = threading.Lock()
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._abandoned: dict[int, tuple] = {}  # id(queue) -> (queue, why its thread will never run again)

    def abandon(self, error: BaseException) -> None:
        """The thread is stuck for good inside llama.cpp (an rpc-server lost mid-pass, edgespec/rpc.py):
        the jobs queued for it fail with `error`, and the next job starts a new thread and queue."""
        with self._start_lock:
            self._abandoned[id(self._jobs)] = (self._jobs, error)
            self._jobs = queue.SimpleQueue()
            self._thread = None

    def _main(self, jobs) -> None:
        while id(jobs) not in self._abandoned:  # an abandoned thread that came back takes no more jobs
            fn, args, box, done = jobs.get()
            if box is None:  # posted: nobody waits for it (an engine's round, engine.Engine._loop)
                try:
                    fn(*args)
                except BaseException:
                    log.exception("a job posted to the llama.cpp thread failed")
                continue
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            finally:
                done.set()

    def _ensure(self) -> None:
        """(under _start_lock)"""
        if self._thread is None or not self._thread.is_alive():  # first use, a forked child, or abandoned
            self._thread = threading.Thread(target=self._main, args=(self._jobs,), name="edgespec-llama",
                                            daemon=True)
            self._thread.start()

    def post(self, fn, *args) -> None:
        """Run `fn(*args)` on this thread in its turn, without waiting for it (its errors are logged)."""
        with self._start_lock:
            self._ensure()
            self._jobs.put((fn, args, None, None))

    def call(self, fn, *args, interrupt: Optional[Callable[[], None]] = None):
        t = self._thread
        if t is not None and threading.current_thread() is t:
            return fn(*args)
        box: list = []
        done = threading.Event()
        with self._start_lock:
            self._ensure()
            jobs = self._jobs
            jobs.put((fn, args, box, done))
        pending: Optional[BaseException] = None
        while not done.is_set():
            lost = self._abandoned.get(id(jobs))
            if lost is not None:
                raise lost[1]
            try:
                done.wait(0.25)  # with a timeout: an interrupt is seen even where no signal wakes the wait
            except BaseException as exc:  # an interrupt while llama.cpp computes: stop it if it can be
                if pending is None:
                    pending = exc
                    if interrupt is not None:
                        interrupt()
        if pending is not None:
            raise pending
        ok, value = box[0]
        if ok:
            return value
        raise value


_compute = _Compute()


THREADS_ENV = "EDGESPEC_THREADS"  # like llama-server's LLAMA_ARG_THREADS: the default for --threads


def default_threads() -> int:
    """$EDGESPEC_THREADS where set (a test runner's workers share the cores that way), else the
    physical cores."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        cpus = cpu_count()
        if not 1 <= n <= cpus:
            raise UsageError(f"{THREADS_ENV}={env!r} is not a thread count for this machine: set a whole number "
                             f"from 1 to its {cpus} CPUs, or unset it (the default is the physical cores)")
        return n
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
    except Exception:
        n = None
    return max(1, n or os.cpu_count() or 1)


# llama.cpp's llama_flash_attn_type: auto lets it decide per device (on for CPUs)
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}
ALL_GPU_LAYERS = 2**31 - 1
REMOTE_FREE_SECONDS = 10  # a remote model's close waits this long for its servers (rpc.py)
# KV cache element types llama-server takes for -ctk/-ctv (ggml_type ids); a quantized V needs
# flash attention (llama.cpp refuses the context otherwise)
KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # what n_gpu_layers = -1 means: llama.cpp caps it at the model's layers


def gpu_offload_supported() -> bool:
    """Whether this machine has a GPU llama.cpp can offload to. Not llama_supports_gpu_offload: it also
    says yes for a build with the RPC client (every edgespec wheel), where no layer leaves the CPU
    unless --rpc names a server."""
    try:
        from .rpc import local_devices
        return bool(local_devices())
    except Exception:  # the ggml bindings could not be read: llama.cpp's own answer
        return bool(_llama().llama_supports_gpu_offload())


@runtime_checkable
class Backend(Protocol):
    """What the engine, the round, the sequences and the drafters use of a model: LlamaBackend
    over llama.cpp, tests/fakes.FakeBackend over a numpy table. Sequences are ids 0..n_seq-1,
    each its own KV stream of n_ctx cells; `held(seq)` is what that cache holds, token for token."""

    path: Path
    n_vocab: int
    n_ctx: int
    n_seq: int
    n_batch: int
    can_truncate: bool           # a rejected draft can be cut back (not a recurrent model)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]: ...
    def token_to_piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def chat_template(self) -> Optional[str]: ...
    def held(self, seq: int = 0) -> list[int]: ...
    def sequence(self, seq: int): ...      # a view with the one-sequence calls (a drafter's lane)

    def eval_batch(self, parts) -> list[np.ndarray]:
        """[(seq, tokens, rows)] appended to their sequences in one pass; each part's rows' logits."""
    def abort_when(self, stop: Callable[[], bool]):
        """A context in which a pass stops (Aborted) as soon as `stop()` says so."""
    def truncate(self, pos: int, seq: int = 0) -> bool: ...
    def keep_prefix(self, tokens: Sequence[int], seq: int = 0) -> int: ...
    def copy_prefix(self, src: int, dst: int, n: int) -> int: ...
    def canon(self, seq: int = 0) -> int: ...  # leading positions computed in the canonical shape (slots.py)
    def mark_canon(self, n: int, seq: int = 0) -> None: ...
    def pos_max(self, seq: int = 0) -> int: ...
    def reset(self, seq: Optional[int] = None) -> None: ...
    def close(self) -> None: ...


def lent(backend, parts) -> list:
    """`backend.eval_batch(parts)`, the rows lent where the backend can (views of its output, valid
    until its next pass: a round and a draft step read them before that), copied otherwise."""
    if getattr(backend, "lends_rows", False):
        return backend.eval_batch(parts, copy=False)
    return backend.eval_batch(parts)


class CanonMarks:
    """Each sequence's leading positions computed in the canonical shape (slots.py), as the caller
    marks them, for a backend whose `held(seq)` lists what its cache holds: a cut of the cache lowers
    them (`_cut_canon`: truncate, reset, load_state), a copied prefix carries them (`_copy_canon`).
    LlamaBackend and the stand-ins (bench/hostcost.SimBackend, the tests' FakeBackend) keep them alike."""

    _canon: list[int]

    def canon(self, seq: int = 0) -> int:
        """How many leading positions of sequence `seq` were computed in the canonical shape."""
        return min(self._canon[seq], len(self.held(seq)))

    def mark_canon(self, n: int, seq: int = 0) -> None:
        """Say that sequence `seq`'s first `n` positions were computed in the canonical shape."""
        self._canon[seq] = max(0, min(int(n), len(self.held(seq))))

    def _cut_canon(self, seq: int, pos: int = 0) -> None:
        self._canon[seq] = min(self._canon[seq], pos)

    def _copy_canon(self, src: int, dst: int) -> None:
        self.mark_canon(self.canon(src), dst)  # as far as dst now holds


class LlamaBackend(CanonMarks):
    """A loaded GGUF model with its own context, KV cache and batch."""

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = N_CTX, n_gpu_layers: int = ALL_LAYERS,
                 threads: int | None = None, n_batch: int = 512, flash_attn: str | bool = "off",
                 verbose: bool = False, n_seq: int = 1, repack: bool = True, type_k: str = "f16",
                 type_v: str = "f16", rpc: Optional[Sequence[str]] = None, rpc_output: str = "remote"):
        """`repack=False`: llama.cpp keeps no repacked copy of the weights (CPU: less memory, the
        plain kernels); `type_k`, `type_v`: the KV cache's element types (KV_TYPES); `rpc`: rpc-servers
        ("host:port") that hold the layers (edgespec/rpc.py), with the output layer there or here
        (`rpc_output` "remote" | "local")."""
        flash_attn = {True: "on", False: "off"}.get(flash_attn, flash_attn)
        if flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_TYPES)}, got {flash_attn!r}")
        for name, t in (("type_k", type_k), ("type_v", type_v)):
            if t not in KV_TYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {t!r}")
        if type_v != "f16" and flash_attn == "off":
            raise ValueError(f"a {type_v} V cache needs flash attention: flash_attn 'on' or 'auto'")
        threads = threads or default_threads()  # before anything is loaded: $EDGESPEC_THREADS may be wrong
        L = _llama()
        set_verbose(verbose)
        self.path = Path(path)
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = ALL_GPU_LAYERS if n_gpu_layers < 0 else n_gpu_layers
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = bool(repack)
        self.remote: list[str] = list(rpc or [])
        self.remote_devices: list[dict] = []
        if self.remote:
            self._remote_setup(mparams, rpc_output)
        self._model = _compute.call(L.llama_model_load_from_file, str(self.path).encode(), mparams)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not load {self.path}: the file is damaged or "
                                 "of an unsupported architecture (run with --verbose for details)")
        cparams = L.llama_context_default_params()
        n_seq = max(1, int(n_seq))
        cparams.n_ctx = n_ctx * n_seq
        cparams.n_batch = cparams.n_ubatch = min(n_batch, n_ctx)
        cparams.n_seq_max = n_seq
        self._n_stream = n_seq if hasattr(cparams, "kv_unified") else 1  # KV streams (restream)
        if hasattr(cparams, "kv_unified"):
            # a stream of cells per sequence, in position order as when it runs alone: a
            # sequence's logits are then bit for bit its logits alone (in one pool, its cells
            # interleave with the others' and its attention sums in another order: measured on
            # SmolLM2, logits 0.9 apart after a few rounds of rejected drafts)
            cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.type_k, cparams.type_v = KV_TYPES[type_k], KV_TYPES[type_v]
        if hasattr(cparams, "flash_attn_type"):
            cparams.flash_attn_type = FLASH_ATTN_TYPES[flash_attn]
        elif hasattr(cparams, "flash_attn"):  # llama.cpp before the auto setting: a bool
            cparams.flash_attn = flash_attn == "on"
        self._ctx = _compute.call(L.llama_init_from_model, self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            self._model = None
            what = f"{n_seq} sequences of {n_ctx} tokens" if n_seq > 1 else f"{n_ctx} tokens"
            raise BackendError(f"llama.cpp could not create a context of {what} for "
                               f"{self.path.name}: lower --ctx{' or --parallel' if n_seq > 1 else ''} or free memory")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        # llama.cpp may round the context up (to 256 at least); the caller's limit still holds
        self.n_ctx = min(n_ctx, int(L.llama_n_ctx(self._ctx)) // n_seq)  # per sequence
        self.n_seq = n_seq
        self.n_batch = int(L.llama_n_batch(self._ctx))
        self.threads = threads
        # what changes this backend's speed: the key of its calibration
        # (flash attention off stays False, as in calibrations cached before it was a setting)
        self.settings = {"n_gpu_layers": n_gpu_layers, "n_ctx": self.n_ctx, "threads": threads,
                         "flash_attn": {"on": True, "off": False}.get(flash_attn, flash_attn),
                         "gpu_offload": gpu_offload_supported()}
        # the memory modes, when not the default (calibrations and saved states made before them
        # keep their keys): they change the speed, and a saved state of one KV type fits no other
        if not repack:
            self.settings["repack"] = False
        if self.remote:  # a pass over the network costs what it costs there: its own calibration
            self.settings["rpc"] = ",".join(self.remote)
            self.settings["rpc_output"] = rpc_output
        if (type_k, type_v) != ("f16", "f16"):
            self.settings["kv_types"] = f"{type_k}/{type_v}"
        self.repack, self.type_k, self.type_v = bool(repack), type_k, type_v
        self.flash_attn = flash_attn
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._mem = L.llama_get_memory(self._ctx)
        recurrent = L.llama_model_is_recurrent(self._model)
        hybrid = getattr(L, "llama_model_is_hybrid", lambda m: False)(self._model)
        # Recurrent/hybrid state cannot be cut back to an earlier position.
        self.can_truncate = not (recurrent or hybrid)
        # per sequence: the KV cache holds these, at positions 0..len-1
        self._held: list[list[int]] = [[] for _ in range(n_seq)]
        # per sequence: its leading positions computed in the canonical shape (slots.py), as the
        # caller marks them; lowered wherever the cache is cut below, emptied with it
        self._canon: list[int] = [0] * n_seq
        self._stray: set[int] = set()
        self._abort_fn = None  # the ctypes callback while abort_when() is in force
        self._interrupted = False  # the caller of the pass under way was interrupted (_Compute)
        self._piece_buf = threading.local()
        self._longest = None
        self._specials = None

    def _remote_setup(self, mparams, output: str) -> None:
        """The model's layers on the rpc-servers' devices (greeted first: one line, not llama.cpp's
        abort, for a server that is not there); the output layer there or here."""
        from . import rpc
        if output not in ("remote", "local"):
            raise UsageError(f"rpc_output must be remote or local, got {output!r}")
        rpc.check_servers(self.remote)
        rpc.watch(self.remote, park=_compute.abandon)
        self.remote_devices = rpc.devices(self.remote)
        self._devices = rpc.device_list([d["handle"] for d in self.remote_devices])  # kept alive with the model
        mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        mparams.n_gpu_layers = ALL_GPU_LAYERS
        if output == "local":  # every repeating layer remote, the output layer here (rpc.output_here)
            self._overrides = rpc.output_here()
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.rpc_output = output

    @property
    def lost(self) -> bool:
        """Its rpc-server was lost: the model is gone and is never used (nor freed) again."""
        if not self.remote:
            return False
        from . import rpc
        return rpc.lost() is not None and self.remote[0] in (rpc.lost().endpoint or "")

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        L = _llama()
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:
            n_max = -n
            buf = (L.llama_token * n_max)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The token's bytes. Thread-safe: several streams detokenize at once (a buffer per thread)."""
        L = _llama()
        buf = getattr(self._piece_buf, "buf", None)
        if buf is None:
            buf = self._piece_buf.buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = self._piece_buf.buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def longest_piece(self) -> int:
        """Bytes of the longest token text in the vocabulary (control tokens as written), the most
        input one token can cover; computed once, on first use."""
        if self._longest is None:
            L = _llama()
            buf = ctypes.create_string_buffer(1024)
            longest = 1
            for token in range(self.n_vocab):
                n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
                longest = max(longest, abs(n))
            self._longest = longest
        return self._longest

    def special_texts(self) -> tuple[str, ...]:
        """The text of every control and user-defined token ("<|im_end|>", "<tool_call>"): what
        tokenizing with special=True reads differently from plain text. Computed once."""
        if self._specials is None:
            L = _llama()
            wanted = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
            found = set()
            for t in range(self.n_vocab):
                if L.llama_vocab_get_attr(self._vocab, t) & wanted:
                    text = self.token_to_piece(t, special=True).decode("utf-8", "replace")
                    if text:
                        found.add(text)
            self._specials = tuple(sorted(found))
        return self._specials

    def guidance_tokenizer(self):
        """llguidance's tokenizer over this vocabulary; every end-of-generation token counts as
        the end of a constrained answer (callers cache it: constraints.tokenizer_for)."""
        import warnings

        from llguidance.llamacpp import lltokenizer_from_vocab
        eog = [t for t in range(self.n_vocab) if self.is_eog(t)]
        with warnings.catch_warnings():  # it calls a binding llama-cpp-python marks deprecated, per token
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._vocab, eos_token=eog or None)

    def is_eog(self, token: int) -> bool:
        return bool(_llama().llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        return _llama().llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def chat_template(self) -> str | None:
        ptr = _llama().llama_model_chat_template(self._model, None)
        return ptr.decode("utf-8") if ptr else None

    @property
    def bos(self) -> int:
        return int(_llama().llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(_llama().llama_vocab_eos(self._vocab))

    # -- evaluation -----------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """What sequence 0's KV cache holds."""
        return self._held[0]

    @property
    def n_past(self) -> int:
        return len(self._held[0])

    def held(self, seq: int = 0) -> list[int]:
        """The tokens sequence `seq`'s KV cache holds, position by position (do not modify)."""
        return self._held[seq]

    def sequence(self, seq: int) -> "SequenceView":
        return SequenceView(self, seq)

    def eval(self, tokens: Sequence[int], rows: Sequence[int], seq: int = 0) -> np.ndarray:
        """Append `tokens` to sequence `seq` at positions n_past.. and return float32 logits for
        `rows` (indices into `tokens`), shape (len(rows), n_vocab)."""
        return self.eval_batch([(seq, tokens, rows)])[0]

    # eval_batch(parts, copy=False) lends the rows (views of llama.cpp's output, no copy)
    lends_rows = True

    def eval_batch(self, parts, copy: bool = True) -> list:
        """Several sequences' tokens in one llama_decode (more when they exceed n_batch):
        `parts` is [(seq, tokens, rows)], each as `eval` takes them; returns each part's rows.
        `copy=False`: each part's rows as a list of views of llama.cpp's logits buffer, not copied:
        valid until this context's next pass (a round reads them before it; what is kept is copied)."""
        if self.remote:  # reading the rows waits for the servers: on the llama.cpp thread, which a loss
            return _compute.call(self._eval_batch, parts, copy, interrupt=self._interrupt)  # may park
        return self._eval_batch(parts, copy)

    def _eval_batch(self, parts, copy: bool = True) -> list:
        L = _llama()
        for seq, tokens, _ in parts:
            if len(self._held[seq]) + len(tokens) > self.n_ctx:
                raise BackendError(f"context of {self.n_ctx} tokens is full: raise --ctx or lower --max-tokens")
        if len({seq for seq, _, _ in parts}) != len(parts):
            raise ValueError("eval_batch takes each sequence once")
        self._drop_stray()
        self._interrupted = False
        outs = [np.empty((len(rows), self.n_vocab), dtype=np.float32) if copy else [None] * len(rows)
                for _, _, rows in parts]
        # every token to feed: (part, its index in the part, the output row it fills or -1)
        flat = []
        # in sequence order: llama.cpp puts consecutive sequences' tokens in one micro-batch
        for p, (seq, tokens, rows) in sorted(enumerate(parts), key=lambda e: e[1][0]):
            where = {r: i for i, r in enumerate(rows)}
            flat.extend((p, j, where.get(j, -1)) for j in range(len(tokens)))
        base = [len(self._held[seq]) for seq, _, _ in parts]  # token i of part p goes at base[p] + i
        batch = self._batch
        for start in range(0, len(flat), self.n_batch):
            chunk = flat[start:start + self.n_batch]
            for j, (p, i, _) in enumerate(chunk):
                seq, tokens, _ = parts[p]
                batch.token[j] = tokens[i]
                batch.pos[j] = base[p] + i
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = chunk[j][2] >= 0
            batch.n_tokens = len(chunk)
            seqs = {parts[p][0] for p, _, _ in chunk}
            self._stray |= seqs  # until the bookkeeping below has caught up with llama.cpp
            rc = _compute.call(L.llama_decode, self._ctx, batch, interrupt=self._interrupt)
            if rc != 0:
                # a failed decode may leave part of the batch in the cache: drop it
                for seq in seqs:
                    L.llama_memory_seq_rm(self._mem, seq, len(self._held[seq]), -1)
                self._stray -= seqs
                if rc == 2 and self._abort_fn is not None:
                    raise Aborted(f"the pass on {self.path.name} was stopped (cancelled)")
                raise BackendError(f"llama_decode failed with code {rc} on {self.path.name}")
            for p, i, _ in chunk:
                seq, tokens, _ = parts[p]
                self._held[seq].append(int(tokens[i]))
            self._stray -= seqs
            if copy or start + self.n_batch < len(flat):  # a later micro-batch overwrites this one's rows
                for j, (p, _, r) in enumerate(chunk):
                    if r >= 0:
                        ptr = L.llama_get_logits_ith(self._ctx, j)
                        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                        outs[p][r] = row if copy else row.copy()
            else:
                for j, (p, _, r) in enumerate(chunk):
                    if r >= 0:
                        outs[p][r] = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, j), shape=(self.n_vocab,))
        return outs

    @contextlib.contextmanager
    def abort_when(self, stop: Callable[[], bool]):
        """Passes inside stop as soon as `stop()` says so (llama.cpp asks between the graph's
        nodes, so within milliseconds of a cancel), raising Aborted; for a prompt evaluated alone,
        whose pass may take seconds. Not for shared passes: all their rows would be lost."""
        L = _llama()

        def check(_data) -> bool:
            try:
                return self._interrupted or bool(stop())
            except BaseException:  # never raise into C
                return False
        self._abort_fn = L.ggml_abort_callback(check)  # kept alive while llama.cpp may call it
        L.llama_set_abort_callback(self._ctx, self._abort_fn, None)
        try:
            yield
        finally:
            L.llama_set_abort_callback(self._ctx, L.ggml_abort_callback(), None)
            self._abort_fn = None

    def _interrupt(self) -> None:
        """The caller of a pass was interrupted: a pass under `abort_when` stops now."""
        self._interrupted = True

    def _drop_stray(self) -> None:
        """An interrupt (KeyboardInterrupt, an exception in a callback) between llama_decode and
        the bookkeeping leaves positions in the cache that the token lists do not hold: drop them."""
        L = _llama()
        while self._stray:
            seq = self._stray.pop()
            n = len(self._held[seq])
            if self.pos_max(seq) >= n and not L.llama_memory_seq_rm(self._mem, seq, n, -1):
                self.reset(seq)

    def truncate(self, pos: int, seq: int = 0) -> bool:
        """Drop positions >= pos from sequence `seq`. False when the model cannot do that."""
        self._drop_stray()
        held = self._held[seq]
        if pos >= len(held):
            return True
        if not _llama().llama_memory_seq_rm(self._mem, seq, pos, -1):
            return False
        del held[pos:]
        self._cut_canon(seq, pos)
        return True

    def keep_prefix(self, tokens: Sequence[int], seq: int = 0) -> int:
        """Reuse the cached prefix shared with `tokens` (all but its last token, which the
        caller feeds to get logits); drop the rest. Returns how many positions were kept."""
        self._drop_stray()
        n = 0
        for a, b in zip(self._held[seq], tokens[:-1]):
            if a != b:
                break
            n += 1
        if not self.truncate(n, seq):
            self.reset(seq)
            return 0
        return n

    def copy_prefix(self, src: int, dst: int, n: int) -> int:
        """Make sequence `dst` hold the first `n` positions of sequence `src` (llama.cpp copies
        the whole stream, before the next decode; `dst` then drops the rest): nothing is
        evaluated again. Returns the positions copied."""
        L = _llama()
        self._drop_stray()
        n = min(n, len(self._held[src]))
        if src == dst:
            return n if self.truncate(n, dst) else 0
        self.reset(dst)
        if n <= 0:
            return 0
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._held[dst].extend(self._held[src])
        if not self.truncate(n, dst):
            self.reset(dst)
            return 0
        self._copy_canon(src, dst)
        return n

    def save_state(self, seq: int = 0) -> tuple[tuple[int, ...], bytes]:
        """(the tokens sequence `seq` holds, its bytes): llama.cpp's state of the sequence, to be
        put back, byte for byte, by `load_state`."""
        if self.remote:  # read from the servers: see eval_batch
            return _compute.call(self._save_state, seq)
        return self._save_state(seq)

    def _save_state(self, seq: int = 0) -> tuple[tuple[int, ...], bytes]:
        L = _llama()
        self._drop_stray()
        size = int(L.llama_state_seq_get_size(self._ctx, seq))
        data = bytearray(size)
        n = int(L.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq))
        if n <= 0:
            raise BackendError(f"llama.cpp could not save the KV cache of {self.path.name}")
        del data[n:]
        return tuple(self._held[seq]), data

    def load_state(self, tokens, data: bytes, seq: int = 0) -> None:
        """Replace sequence `seq`'s KV cache with a state `save_state` returned (of this model)."""
        if self.remote:  # written to the servers: see eval_batch
            return _compute.call(self._load_state, tokens, data, seq)
        return self._load_state(tokens, data, seq)

    def _load_state(self, tokens, data: bytes, seq: int = 0) -> None:
        L = _llama()
        self._drop_stray()
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._held[seq].clear()
        self._cut_canon(seq)
        data = restream(data, self._n_stream)
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data) if isinstance(data, bytearray) else \
            (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(L.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) != len(data):
            self.reset(seq)
            raise BackendError(f"llama.cpp could not restore a saved KV cache of {self.path.name}")
        self._held[seq].extend(tokens)

    def pos_max(self, seq: int = 0) -> int:
        """The highest position llama.cpp holds for the sequence (-1 when empty)."""
        return int(_llama().llama_memory_seq_pos_max(self._mem, seq))

    def reset(self, seq: Optional[int] = None) -> None:
        """Empty sequence `seq`'s KV cache (None: every sequence's)."""
        L = _llama()
        if seq is None:
            L.llama_memory_clear(self._mem, True)
            for held in self._held:
                held.clear()
            self._canon = [0] * len(self._held)
            self._stray.clear()
        else:
            if not L.llama_memory_seq_rm(self._mem, seq, -1, -1):
                raise BackendError(f"llama.cpp could not clear sequence {seq} of {self.path.name}")
            self._held[seq].clear()
            self._cut_canon(seq)
            self._stray.discard(seq)

    def close(self) -> None:
        if getattr(self, "remote", None):
            if self.lost:  # freeing would send to the lost server and wait for good: its memory here is left
                self._ctx = self._model = None
                return
            # freeing sends to the servers: one that went away unnoticed (nothing was computed since) is
            # met here, and the thread that meets it never returns (rpc.py): not the caller's
            t = threading.Thread(target=self._free, name="edgespec-rpc-free", daemon=True)
            t.start()
            t.join(REMOTE_FREE_SECONDS)
            if t.is_alive():
                log.warning("freeing %s on %s did not finish within %d s; left as it is", self.path.name,
                            ", ".join(self.remote), REMOTE_FREE_SECONDS)
            return
        self._free()

    def _free(self) -> None:
        L = _llama()
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class SequenceView:
    """One sequence of a backend with the one-sequence interface (tokens, n_past, eval,
    truncate, keep_prefix, save_state, load_state, reset): a drafter follows its own sequence
    through it. Everything else (the vocabulary, n_ctx, path) is the backend's."""

    def __init__(self, backend, seq: int):
        self.backend, self.seq = backend, seq

    def __getattr__(self, name):
        return getattr(self.backend, name)

    @property
    def tokens(self) -> list[int]:
        return self.backend.held(self.seq)

    @property
    def n_past(self) -> int:
        return len(self.backend.held(self.seq))

    def eval(self, tokens, rows):
        return self.backend.eval(tokens, rows, seq=self.seq)

    def truncate(self, pos: int) -> bool:
        return self.backend.truncate(pos, seq=self.seq)

    def keep_prefix(self, tokens) -> int:
        return self.backend.keep_prefix(tokens, seq=self.seq)

    def canon(self) -> int:
        return self.backend.canon(self.seq)

    def mark_canon(self, n: int) -> None:
        self.backend.mark_canon(n, self.seq)

    def save_state(self):
        return self.backend.save_state(seq=self.seq)

    def load_state(self, tokens, data) -> None:
        self.backend.load_state(tokens, data, seq=self.seq)

    def pos_max(self) -> int:
        return self.backend.pos_max(seq=self.seq)

    def reset(self) -> None:
        self.backend.reset(self.seq)

    def close(self) -> None:
        """The backend belongs to whoever made it: a view closes nothing."""


def restream(data, n_stream: int):
    """A sequence's saved state laid out for a context of `n_stream` KV streams. llama.cpp writes a
    sequence's state as a short header, the count of the context's streams, then one section per
    stream (a cell count, and the cells where it is not 0), and refuses a state of another count
    ("n_stream mismatch"): a state saved under --parallel 2 would never be restored under
    --parallel 1. Only the sequence's own stream holds cells, and it is read into the sequence's
    stream wherever its section stands, so the sections are rewritten: the one that holds cells,
    then empty ones. A state of another form is returned as it is (llama.cpp says if it takes it)."""
    for at in (8, 0, 4, 12):  # where the stream count stands (8 in llama.cpp 0.3.36's states)
        if len(data) >= at + 8:
            out = _restream_at(data, n_stream, at)
            if out is not None:
                return out
    return data


def _restream_at(data, n_stream: int, at: int):
    saved = int.from_bytes(data[at:at + 4], "little")
    if not 1 <= saved <= 256:
        return None
    if saved == n_stream:
        return data
    empty = bytes(4)
    pos, before = at + 4, 0
    while before < saved and data[pos:pos + 4] == empty:
        pos, before = pos + 4, before + 1
    if before == saved:  # no cells at all
        return bytearray(bytes(data[:at]) + n_stream.to_bytes(4, "little") + empty * n_stream)
    after = 4 * (saved - 1 - before)
    if pos + 4 > len(data) - after or (after and bytes(data[len(data) - after:]) != bytes(after)):
        return None
    section = bytes(data[pos:len(data) - after])
    return bytearray(bytes(data[:at]) + n_stream.to_bytes(4, "little") + section + empty * (n_stream - 1))
