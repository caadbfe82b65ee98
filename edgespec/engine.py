"""The engine: a target backend and one drafter, the generations they run, and the public calls.

How the models were chosen and loaded is `assemble.py`'s business; prompt building is
`prompts.py`'s, the speculative round `rounds.py`'s, which sequence holds which conversation
`slots.py`'s. The engine keeps the lifecycle and admission: up to `parallel` generations run
at once (threads calling one Engine, each reading its own Stream). One loop runs the rounds of
all of them, batched, on the one thread that owns llama.cpp (backend._Compute, as llama-server's
`update_slots`): while a running generation has no committed token waiting to be read, the engine
posts its next round there (`_loop`); the tokens a round commits wait in each generation's queue,
and the threads that asked for them only read that queue. `cancel()` ends the running
generations within a round and gives their places back, `close()` frees the models.
"""
from __future__ import annotations

import codecs
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from . import rounds
from .backend import _compute
from .errors import EdgespecError, EngineClosedError, UsageError
from .generation import FINISH_REASONS, Generation, GenerationResult, GenerationStats, StreamEvent
from .prompts import ChatPrompt, PromptBuilder
from .request import Request
from .slots import Sequences
from .tools import StreamParser

__all__ = ["Engine", "Stream", "ChatPrompt", "GenerationStats", "GenerationResult", "StreamEvent",
           "FINISH_REASONS"]

# Prompt tokens evaluated a round beside running generations (a multiple of 4, as the repacked
# kernels group rows: the prompt's KV comes out as in whole batches). SmolLM2 on 2 cores: a short
# request beside a 3,000-token prompt took 9.9 s with 512-token pieces, 0.2 s alone.
PIECE = 64
# A prompt with more than LONG_PROMPT tokens to evaluate (beyond a kept or restored prefix) goes in
# one canonical piece a turn of the loop, and steps aside while other requests run, whenever they
# arrive (in the first minute of a 12-minute prefill or in its last): an agent's side request (a
# title, a check: a few hundred tokens in, a few dozen out) answers in seconds alone rather than in
# tens of seconds between the pieces, and the long prompt waits about as long as that request's own
# work either way. So that requests that never stop cannot starve it, it steps aside for at most
# YIELD_SECONDS more than its own pieces have taken, then takes turns with them: at worst it takes
# twice its time alone, plus YIELD_SECONDS. (Until issue 50 it stepped aside for 20 s in all, and
# not at all once fewer than LONG_PROMPT tokens were left: a request arriving in the second half of
# a 4,000-token prompt waited 7-21 s for a piece before each of its rounds.)
LONG_PROMPT = 2048
YIELD_SECONDS = 20.0

_rng = np.random.default_rng  # a generation's source of randomness (tests enumerate every draw through it)


def _long(g: Generation) -> bool:
    """Whether `g`'s prompt is long (LONG_PROMPT): by the tokens it has to evaluate, all of them
    until its first piece says how many its sequence or the prompt cache kept."""
    return len(g.tokens) - g.stats.reused_prompt_tokens > LONG_PROMPT


def _stop_prefix(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string: they are
    held back until the next token says whether the stop string follows."""
    for k in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stop):
            return k
    return 0


class Stream:
    """One request's events, as they are committed. `stats` and `finish_reason` are the
    request's own; `cancel()` ends it within a round and gives its place back, read or not;
    `close()` gives its place back."""

    def __init__(self, engine: "Engine", generation: Generation):
        self._engine = engine
        self.generation = generation
        self._thread = threading.get_ident()
        self._ticket = _Ticket(self)  # what the engine holds of it: a stream its reader drops is freed
        self._gen = engine._events(generation, self._ticket)  # not the stream itself: no cycle to wait for
        self.stats = generation.stats
        self.tokens: list[int] = []
        self._text: list[str] = []
        self._outdated: Optional[EdgespecError] = None  # raised when resumed
        self._tools = None          # a tools.StreamParser when the request had tools
        self.tool_calls: list = []
        self._ended = False         # the closing event was read, or the stream was closed
        self._lock = threading.RLock()  # held while its events are computed

    @property
    def finish_reason(self) -> Optional[str]:
        """Why it ended ("tool_calls" when the answer called tools), None while it runs (its
        generation may have ended while tokens wait to be read). A cancelled stream says why as
        soon as its generation has ended, whether or not its last tokens were read."""
        if self.tool_calls:
            return "tool_calls"
        g = self.generation
        ended = self._ended or (g.finished and g.cancel.is_set())
        return (self.stats.finish_reason or None) if ended else None

    @property
    def text(self) -> str:
        return "".join(self._text)

    def cancel(self) -> None:
        """End the generation within a round (finish reason "cancelled") and give its place back,
        whether or not the stream is read again: the tokens already committed can still be read."""
        self._engine._cancel([self._ticket])

    def __iter__(self):
        return self

    def __next__(self) -> StreamEvent:
        if self._outdated:
            raise self._outdated
        # the stream's own lock, not the engine's: a token already committed (by a round another
        # thread ran) is handed out at once; only a stream with none waits for a round
        with self._lock:
            if self._outdated:
                raise self._outdated
            try:
                ev = next(self._gen)
            except BaseException:
                self._ended = True
                self._release()
                raise
        if ev.token is None:
            self._ended = True
        if ev.token is not None:
            self.tokens.append(ev.token)
        if self._tools is not None:  # markup held back; calls on the closing event
            shown = self._tools.feed(ev.text)
            if ev.token is None:
                rest, self.tool_calls = self._tools.finish()
                shown += rest
                ev = StreamEvent(shown, None, False, "tool_calls" if self.tool_calls else ev.finish_reason,
                                 list(self.tool_calls))
            else:
                ev = StreamEvent(shown, ev.token, ev.from_draft)
        self._text.append(ev.text)
        return ev

    def result(self) -> GenerationResult:
        """Run the request to its end (if it has not ended) and return its result."""
        for _ in self:
            pass
        text = self.text.strip() if self.tool_calls and not self.text.strip() else self.text
        return GenerationResult(text, list(self.tokens), self.stats, list(self.tool_calls))

    def close(self) -> None:
        """Stop here; the engine serves the next request."""
        if self._outdated is None:
            with self._lock:
                self._gen.close()
        self._ended = True
        self._release()

    def _release(self) -> None:
        self._engine._release(self._ticket)

    def _invalidate(self, error: EdgespecError) -> None:
        self._outdated = error
        if self._lock.acquire(blocking=False):  # else its reader is inside: it meets the error next
            try:
                self._gen.close()
            finally:
                self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._engine._release(self._ticket)
        except Exception:
            pass


class _Ticket:
    """An admitted stream's place, as the engine holds it: its generation, and the stream by a weak
    reference. A stream its reader drops unclosed (`for ev in stream: break`) is then freed at once,
    and its __del__ gives the place back; held strongly, it kept the place until the engine closed,
    and a request from another thread waited for it forever."""

    def __init__(self, stream: Stream):
        self.generation = stream.generation
        self._thread = stream._thread
        self._stream = weakref.ref(stream)

    def cancel(self) -> None:
        self.generation.cancel.set()

    def _invalidate(self, error) -> None:
        stream = self._stream()
        if stream is not None:
            stream._invalidate(error)


class _Placeholder:
    """Holds the whole engine for work that is not a stream (reset)."""

    def __init__(self, thread: int):
        self._thread = thread
        self.generation = None

    def cancel(self) -> None:
        pass

    def _invalidate(self, error) -> None:
        pass


class Engine(PromptBuilder):
    """A target model and one drafter. Use `Engine.load` to build one from GGUF files."""

    def __init__(self, target, drafter=None, cache=None, parallel: Optional[int] = None):
        """`target`: a backend (see backend.LlamaBackend); `drafter`: a `Drafter` or None
        for plain decoding; `cache`: a `promptcache.PromptCache` for conversations that come
        back (None: only what the sequences hold is kept); `parallel`: generations run at once
        (default: the sequences the target holds, its `n_seq`)."""
        self.target = target
        self.drafter = drafter
        self.n_vocab = max(target.n_vocab, drafter.n_vocab if drafter is not None else 0)
        if drafter is not None and not target.can_truncate:
            raise UsageError(f"{target.path.name} is a recurrent or hybrid model whose cache cannot be "
                             "cut back after a rejected draft: speculation is impossible, use --drafter none")
        n_seq = getattr(target, "n_seq", 1)
        self.parallel = n_seq if parallel is None else int(parallel)
        # each sequence's rows in passes of their own (Settings.parallel_exact, on through from_settings):
        # a row computed beside another sequence's rows rounds otherwise (SmolLM2 Q4_1, 2 threads)
        self.exact_shared = False
        draft = drafter.draft_backend if drafter is not None else None
        held = min(n_seq, getattr(draft, "n_seq", n_seq)) if draft is not None else n_seq
        if not 1 <= self.parallel <= held:
            raise UsageError(f"parallel must be in 1..{held} (the sequences the models' contexts hold), "
                             f"got {self.parallel}")
        if self.parallel > 1 and drafter is not None and not drafter.forks:
            raise UsageError(f"the {drafter.name} drafter cannot draft for several sequences: use parallel=1")
        self._lanes = {0: drafter}
        self._admission = threading.Condition()   # admission: who may generate now
        self._active: list = []              # admitted streams' _Tickets (or one _Placeholder)
        self._work = threading.RLock()       # held while a backend is in use (a round, reset, close)
        self._round_done = threading.Condition()  # notified after every round: readers waiting for tokens
        self._posted = False                 # a round is posted to the llama.cpp thread (_loop)
        self._closed = False
        self._readers = 0                    # threads tokenizing now (see _reading)
        self._readers_idle = threading.Condition()
        self.cache = cache
        self.sequences = Sequences(target, draft, cache, self.parallel)
        self.lost: Optional[BaseException] = None  # the target's rpc-server was lost (edgespec/rpc.py)
        self._unwatch = None
        if getattr(target, "remote", None):
            from . import rpc
            self._unwatch = rpc.on_lost(self._remote_lost)

    def _remote_lost(self, error: BaseException) -> None:
        """The target's rpc-server is gone (called from the llama.cpp thread that met it): every
        running generation ends with `error` now, and so does everything asked of this engine later.
        Its round is stuck for good inside llama.cpp; nothing here waits for it."""
        if not getattr(self.target, "lost", False):
            return  # another model's server
        self.lost = error
        with self._admission:
            gens = [a.generation for a in self._active if a.generation is not None]
            self._admission.notify_all()
        for g in gens:
            if not g.finished:
                g.error, g.finished = error, True
        with self._round_done:
            self._round_done.notify_all()

    def adopt_cache(self, other: "Engine") -> None:
        """Take over `other`'s prompt cache (an engine loaded again after its rpc-server came back:
        the conversations saved before the loss are still there)."""
        if other.cache is not None:
            self.cache = self.sequences.cache = other.cache

    @property
    def mode(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    @classmethod
    def load(cls, target: Optional[str] = None, draft: Optional[str] = None, drafter: str = "auto", *,
             download: bool = True, calibrate: str = "auto", progress=None, **settings) -> "Engine":
        """Load a target (GGUF path or models.toml pair name; None = the default pair) and its
        drafter. `settings` are `assemble.Settings`' fields (n_ctx=4096, threads, n_gpu_layers=-1,
        draft_n_gpu_layers=-1, gamma=4, parallel, memory_budget, cache_ram, models_file, verbose...).
        `download=False` refuses to fetch missing files; `calibrate` is "auto" (measure this
        device once, then use the cached figures), "now" (measure again) or "never" (cached
        figures or cautious defaults that the engine corrects as it runs); `progress` receives
        `progress.Progress` reports for downloads and calibration."""
        from .assemble import Settings
        known = Settings.__dataclass_fields__
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise UsageError(f"unknown setting {unknown[0]!r}; the settings are {', '.join(known)}")
        return cls.from_settings(Settings(target=target, draft=draft, drafter=drafter, **settings),
                                 download=download, calibrate=calibrate, progress=progress)

    @classmethod
    def from_settings(cls, settings, *, download: bool = True, calibrate: str = "auto", progress=None
                      ) -> "Engine":
        """An Engine for an `assemble.Settings` (the CLI, the server and the benchmarks build one)."""
        from .assemble import load_parts
        from .selftest import ensure
        ensure()  # a build that crashes or computes wrong on this machine: one line, not SIGSEGV
        target, drafter, cache = load_parts(settings, download=download, calibrate=calibrate, progress=progress)
        try:
            engine = cls(target, drafter, cache)
            engine.exact_shared = settings.parallel_exact
            return engine
        except BaseException:
            if drafter is not None:
                drafter.close()
            target.close()
            raise

    def _lane(self, seq: int):
        """The drafter for sequence `seq` (None: plain decoding)."""
        if self.drafter is None:
            return None
        lane = self._lanes.get(seq)
        if lane is None:
            lane = self._lanes[seq] = self.drafter.fork(seq)
        return lane

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.lost is not None:
            raise self.lost
        if self._closed:
            raise EngineClosedError("this engine is closed: load a new one with Engine.load")

    def reset(self) -> None:
        """Start the next generation from nothing: empty KV caches (no reused prompt prefix)
        and drafters that forget what earlier generations taught them."""
        with self._acquire(None):
            with self._work:
                self.sequences.reset()
                for lane in self._lanes.values():
                    if lane is not None:
                        lane.reset()

    def cancel(self) -> None:
        """End the running generations (from any thread) within one round; their finish reason
        is "cancelled", and their places are given back whether or not their streams are read
        again. Does nothing when no generation runs."""
        self._cancel(list(self._active))

    def _cancel(self, holders) -> None:
        """Cancel `holders` (tickets): ended and their places given back now where no round runs
        (a stream nobody reads wants no round, so nothing else would), else by the loop after the
        round that runs (`_loop`, which sees the cancel in `_wanted`). Never waits for a lock that
        a round holds: a Ctrl-C handler calls this."""
        for h in holders:
            h.cancel()
        if self._work.acquire(blocking=False):
            try:
                if not self._closed:
                    self._end_cancelled()
            finally:
                self._work.release()

    def close(self) -> None:
        """Cancel what runs, wait for its round to end, free the models. Idempotent."""
        with self._admission:
            if self._closed:
                return
            self._closed = True
            active = list(self._active)
            for a in active:
                a.cancel()
            self._admission.notify_all()
        if self._unwatch is not None:
            self._unwatch()
        if self.lost is not None:  # its round is stuck in llama.cpp for good, holding _work: nothing waits
            for a in active:       # for it, the remote model is left as it is (backend.close), the local
                a._invalidate(self.lost)  # draft model is freed
            if self.drafter is not None:
                self.drafter.close()
            self.target.close()
            with self._round_done:
                self._round_done.notify_all()
            return
        with self._readers_idle:
            while self._readers:  # a tokenization in progress reads the vocabulary about to be freed
                self._readers_idle.wait()
        with self._work:
            for a in active:
                a._invalidate(EngineClosedError("this engine was closed while the stream was open"))
                self._release(a)
            self.sequences.save_for_restart()
            if self.drafter is not None:
                self.drafter.close()  # the lanes share its models
            self.target.close()
        with self._round_done:
            self._round_done.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextmanager
    def _reading(self):
        """The target's vocabulary, for tokenizing. Not under `_work`: llama.cpp's tokenizer only
        reads the vocabulary, so a long prompt is tokenized on its caller's thread while another
        request generates (a server tokenizes off its engine thread); close() waits for it."""
        with self._readers_idle:  # not the admission condition: a token's text wakes no one waiting there
            self._check_open()
            self._readers += 1
        try:
            yield self.target
        finally:
            with self._readers_idle:
                self._readers -= 1
                if not self._readers and self._closed:
                    self._readers_idle.notify_all()

    # -- admission ------------------------------------------------------------------------
    class _Turn:
        def __init__(self, engine, holder):
            self.engine, self.holder = engine, holder

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.engine._release(self.holder)

    def _acquire(self, stream: Optional[Stream]) -> "_Turn":
        """Wait for a free place (`stream` None: for the whole engine). When this thread's own
        open streams hold the places, its oldest is made outdated (resuming it raises) instead:
        one thread waiting for itself would wait forever."""
        me = threading.get_ident()
        while True:
            with self._admission:
                self._check_open()
                active = self._active
                whole = bool(active) and isinstance(active[0], _Placeholder)
                if not whole and (not active if stream is None else len(active) < self.parallel):
                    holder = stream._ticket if stream is not None else _Placeholder(me)
                    active.append(holder)
                    return self._Turn(self, holder)
                mine = [a for a in active if a._thread == me and not isinstance(a, _Placeholder)]
                if not mine or whole:
                    self._admission.wait()
                    continue
            # outside the admission lock, as every generation's ending (see _release)
            mine[0]._invalidate(UsageError(
                "this stream is outdated: another generation started on the same engine before it "
                "finished; read streams to their end or close() them"))
            self._release(mine[0])

    def _release(self, holder) -> None:
        """Give back the place of `holder` (a stream's _Ticket, or a _Placeholder). Its generation
        is ended after the admission lock is let go: the loop holds rounds' finishing lock while it
        allocates, and a collection then may end a dropped stream here; ending it under the
        admission lock would take the two locks in the other order."""
        with self._admission:
            if holder not in self._active:
                return
            self._active.remove(holder)
            self._admission.notify_all()
        g = holder.generation
        if g is not None and not g.finished:
            rounds.finish(g, None)

    def _end_cancelled(self) -> None:
        """End the cancelled generations and give their places back (under `_work`: no round runs
        now). Their streams keep the tokens already committed, to be read or not."""
        with self._admission:
            cancelled = [a for a in self._active if a.generation is not None and a.generation.cancel.is_set()]
        for a in cancelled:  # outside the admission lock, as every generation's ending (see _release)
            if not a.generation.finished:
                rounds.finish(a.generation, "cancelled")
            self._release(a)
        if cancelled:
            with self._round_done:  # their readers
                self._round_done.notify_all()

    # -- generation -----------------------------------------------------------------------
    # Options (or one `request=Request.build(...)`): max_tokens=128, temperature=0.0, top_k=0,
    # top_p=1.0, min_p=0.0, seed=None, stop=(), and at most one of json_schema (a dict or JSON
    # text), regex, grammar (Lark or GBNF): the answer then follows it (docs/structured-output.md).
    def generate(self, prompt: Union[str, Sequence[int]], request: Optional[Request] = None,
                 **options) -> GenerationResult:
        """Generate from a verbatim prompt (text, or token ids); waits while `parallel` others run."""
        with self.stream(prompt, request, **options) as s:
            return s.result()

    def chat(self, messages, request: Optional[Request] = None, **options) -> GenerationResult:
        """`generate` for a conversation, through the target's chat template. With `tools`
        (OpenAI's list of functions) and `tool_choice` the answer may call them, in the model's
        own format: `result.tool_calls` (id, name, arguments as a dict), `result.text` the rest."""
        with self.stream_chat(messages, request, **options) as s:
            return s.result()

    def stream_chat(self, messages, request: Optional[Request] = None, **options) -> Stream:
        """`stream` for a conversation, through the target's chat template. With tools, call
        markup never reaches the events' text; the closing event carries `tool_calls`."""
        request = Request.of(request, options)
        return self.stream_prompt(self.prepare_chat(messages, request, room=1))

    def stream_prompt(self, prompt: "ChatPrompt") -> Stream:
        """`stream` for a conversation `prepare_chat` made ready (a server does that off its
        engine thread). Waits while `parallel` generations run."""
        stats = GenerationStats(drafter=self.mode, prompt_tokens=len(prompt.tokens))
        # the guide was compiled with the prompt (off the engine thread, in a server); a matcher
        # follows one generation only, so a prepared prompt is streamed once
        guide, prompt.guide = prompt.guide, None
        if guide is None:
            guide = self.guide(prompt.request)
        gen = Generation(list(prompt.tokens), prompt.request, stats, guide, _rng(prompt.request.seed),
                         sources=prompt.sources)
        stream = Stream(self, gen)
        if prompt.format is not None:
            stream._tools = StreamParser(prompt.format, prompt.request.tools)
        self._acquire(stream)
        self._kick()  # its prompt goes in now, before its first token is asked for
        return stream

    def stream(self, prompt: Union[str, Sequence[int]], request: Optional[Request] = None, **options) -> Stream:
        """Yield tokens as they are committed, with the text each makes printable.

        A text prompt is tokenized verbatim (BOS added, special tokens parsed); a list of ints
        is taken as token ids. Generation ends at an end-of-generation token ("eos"), after
        `max_tokens` ("length"), at a stop string, not included ("stop"), when a constraint is
        complete ("stop"), when the context is full ("context") or on `cancel()`
        ("cancelled"). Each token's event comes as soon as it is committed; a closing event
        (token None) carries any text held back (the start of a possible stop string, an
        unfinished character) and the finish reason.
        """
        request = Request.of(request, options)
        return self.stream_prompt(self.prepare_prompt(prompt, request, room=1))

    # -- the loop -------------------------------------------------------------------------
    def _kick(self) -> None:
        """Post the next round to the llama.cpp thread, unless one is posted already."""
        with self._round_done:
            if self._posted or self._closed:
                return
            _compute.post(self._loop)  # posted before it is marked: an interrupt between the two cannot
            self._posted = True        # leave it marked with nothing posted (a second post is harmless)

    def _wanted(self) -> bool:
        """Whether a turn of the loop is wanted: a running generation has no committed token left to
        read, or was cancelled (its place is given back). A generation running alone reads ahead by
        one round: its next round runs while its reader takes the last one's tokens (a GPU's step
        would otherwise wait for the reader's wake-up and detokenizing every round, issue 47), and its
        reader asks for the round ahead again as it takes tokens (`reads_ahead`, `_tokens`); a stream
        nobody reads stops one round later. Beside others a generation takes part in their
        rounds (its queue grows up to its max_tokens, as before the loop), and no round runs ahead of
        the readers, so that the order of rounds and reads does not depend on timing
        (tests/test_parallel_fake.py relies on it)."""
        with self._admission:
            gens = [a.generation for a in self._active if a.generation is not None and not a.generation.finished]
        alone = len(gens) == 1
        for g in gens:
            g.reads_ahead = alone
        return any(not g.out or g.cancel.is_set() or (alone and len(g.out) <= g.last_round) for g in gens)

    def _loop(self) -> None:
        """One turn of the engine's loop, on the llama.cpp thread: a round for every admitted
        generation, then the next turn posted behind whatever else waits for that thread (another
        engine's round, a reset's or close's calls) while a round is still wanted."""
        with self._round_done:
            self._posted = False
        if self._closed:
            return
        if not self._work.acquire(blocking=False):  # reset() or close() holds the engine; their
            time.sleep(0.001)                       # llama.cpp calls come to this thread meanwhile
            self._kick()
            return
        try:
            if not self._closed:
                self._end_cancelled()  # a cancel alone computes nothing
            if not self._closed and self._wanted():
                self._advance()
                self._end_cancelled()  # those the round ended (a prompt stopped inside its pass)
        except BaseException as exc:  # not one generation's failure (those end in rounds): all of them
            with self._admission:
                gens = [a.generation for a in self._active if a.generation is not None]
            for g in gens:
                if not g.finished:
                    g.error, g.finished = exc, True
            with self._round_done:
                self._round_done.notify_all()
        finally:
            self._work.release()
        if not self._closed and self._wanted():
            self._kick()

    def _advance(self) -> None:
        """One round for every admitted generation (under `_work`, on the llama.cpp thread):
        those that just came in first get their prompt in (a long prompt a piece, or none while
        others run: `_steps_aside`), then all of them draft and share one verifying pass."""
        with self._admission:
            gens = [a.generation for a in self._active if a.generation is not None]
        # a prompt goes in by pieces, one a turn, so that a request arriving meanwhile joins: PIECE
        # beside running generations, whose rounds wait for it; alone, n_batch tokens (llama.cpp's own
        # cut), but a long prompt one canonical piece, so that a request arriving waits for one at most
        now = time.perf_counter()
        running = any(g.started and not g.finished for g in gens)
        served = [g for g in gens if not g.finished and not g.cancel.is_set() and (g.started or not _long(g))]
        aside = []
        for g in gens:
            if g.started or g.finished:
                continue
            if _long(g) and self._steps_aside(g, served):
                aside.append(g)
                continue
            piece = PIECE if running else self.sequences.piece if _long(g) else self.target.n_batch
            busy = {o.seq for o in gens if o.seq >= 0 and o is not g}
            t0 = time.perf_counter()
            try:
                rounds.start(g, self.target, self.sequences, self._lane, busy, piece)
            except Exception as exc:  # its prompt failed (a damaged model): its own error
                g.error, g.finished = exc, True
            g.piece_seconds += time.perf_counter() - t0
        try:
            rounds.step(self.target, [g for g in gens if g.started], self.n_vocab, self.exact_shared)
        finally:
            spent = time.perf_counter() - now
            for g in aside:
                g.aside_seconds += spent
            with self._round_done:
                self._round_done.notify_all()

    @staticmethod
    def _steps_aside(g: Generation, served: list) -> bool:
        """Whether long prompt `g` skips this turn: other requests run (or a prompt that is not long
        waits), and `g` has stepped aside for no longer than its own pieces took, plus YIELD_SECONDS."""
        if g.cancel.is_set() or not any(o is not g for o in served):
            return False
        return g.aside_seconds < YIELD_SECONDS + g.piece_seconds

    def _tokens(self, gen: Generation) -> Iterator[tuple[int, bool]]:
        """The generation's committed tokens, as the loop commits them."""
        while True:
            finished = gen.finished  # read before the queue: a round may commit its last tokens and
            if gen.out:              # finish between the two reads, and none of them is lost
                token = gen.out.popleft()
                if gen.reads_ahead and len(gen.out) <= gen.last_round and not finished:
                    self._kick()  # room for the round ahead again (the loop stopped with two queued)
                yield token
            elif finished:
                if gen.error is not None:
                    error, gen.error = gen.error, None
                    raise error
                return
            else:
                self._check_open()  # closed while this waited: the models are gone
                self._kick()
                with self._round_done:  # with a timeout: an interrupt is seen where no signal wakes the wait
                    self._round_done.wait_for(lambda: gen.out or gen.finished or self._closed, timeout=0.25)

    def _events(self, gen: Generation, ticket: _Ticket) -> Iterator[StreamEvent]:
        """Token ids -> events with printable text, each as soon as it is committed; then one
        closing event (token None) with the text held back and the finish reason."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = ""        # decoded, not yet emitted
        stop = gen.request.stop
        read = 0
        try:
            for token, from_draft in self._tokens(gen):
                read += 1
                with self._reading() as t:  # close() waits for it
                    text += decoder.decode(t.token_to_piece(token))
                hit, matched = min(((i, s) for s in stop for i in (text.find(s),) if i >= 0), default=(-1, ""))
                if hit >= 0:
                    rounds.stop_at(gen, matched, read)
                    yield StreamEvent(text[:hit], token, from_draft)
                    text = ""
                    break
                cut = len(text) - _stop_prefix(text, stop)
                yield StreamEvent(text[:cut], token, from_draft)
                text = text[cut:]
            else:
                text += decoder.decode(b"", final=True)
            yield StreamEvent(text, None, False, gen.stats.finish_reason)
        finally:
            rounds.finish(gen, None)
            self._release(ticket)
