"""The threads that load, run and close the engine, and the request queue.

llama.cpp calls block for milliseconds to seconds and hold the GIL only in between, so they never
run on the event loop. One thread loads the engine and, at the very end, closes it. In between, a
fixed pool of `engine.parallel` generation threads takes jobs from one FIFO in arrival order,
each thread running one generation at a time: a Stream is iterated by the thread that opened it,
and the engine batches the rounds of the streams that run at once. Exactly `parallel` threads,
never more: the engine's `stream_prompt` blocks while all its sequences are busy, and a request
cancelled while it waits must leave the queue without ever touching the engine. A waiting job is
a Future in the FIFO; cancelling it is enough (the thread that reaches it skips it), whereas a
thread blocked inside `stream_prompt` could not be called back.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("edgespec.server")


class Threads:
    """`n` threads running submitted callables, each taken in submission order by the first
    thread that is free."""

    def __init__(self, n: int, name: str) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # daemons: a model still downloading or loading when the server is stopped must not keep
        # the process alive (nothing is written by these threads that an abrupt end could
        # corrupt: hub downloads land in a temporary file first)
        self._threads = [threading.Thread(target=self._main, name=name if n == 1 else f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        """Finish what was submitted (skipping what was cancelled), then end the threads."""
        for _ in self._threads:
            self._inbox.put(None)

    def join(self) -> None:
        """Wait for the threads to end (after stop())."""
        for t in self._threads:
            t.join()

    def _main(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever awaits the future
                fut.set_exception(exc)


class NotReady(Exception):
    """The engine is still loading (or failed to load)."""


class QueueFull(Exception):
    """As many requests wait as the queue holds."""


# what a job reports to the event loop, in order: START (the stream opened: the request is
# valid), TEXT* and then END; or ERROR at any point; or CANCELLED if it never started
START, TEXT, END, ERROR, CANCELLED = "start", "text", "end", "error", "cancelled"


class Job:
    """One request's generation. `opener(engine)` returns the engine's Stream; it runs on a
    generation thread and its events come back to the event loop through an asyncio queue.

    Waking the event loop costs CPU time, and on a machine with as many cores as llama.cpp has
    threads that time comes out of the next pass (its threads wait for each other at every
    operation). So text is handed over only as often as someone reads it: a streamed answer's
    text as it comes, in one wake-up for whatever arrived since the last one the loop took; an
    answer returned whole, once, before its end (`streamed` False)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, opener: Callable[[Any], Any], streamed: bool = True):
        self._loop = loop
        self._open = opener
        self._streamed = streamed
        self._events: asyncio.Queue = asyncio.Queue()
        self._text: list[str] = []        # text not yet handed to the loop (generation thread side)
        self._text_lock = threading.Lock()
        self._flush_pending = False       # a hand-over is scheduled on the loop and has not run yet
        self._cancel = threading.Event()
        self._stream = None
        self._ended = False  # its last event was handed out: nothing left to cancel
        self.future: Optional[concurrent.futures.Future] = None

    # -- event loop side --------------------------------------------------------------------
    async def next(self) -> tuple[str, Any]:
        event = await self._events.get()
        if event[0] in (END, ERROR, CANCELLED):
            self._ended = True
        return event

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def cancel(self) -> None:
        """Stop this request: dropped from the queue if it has not started, ended within a
        round if it runs. Idempotent; nothing happens once it has finished."""
        if self._ended or self.done:
            return
        self._cancel.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()  # ends the engine's loop at its next round, even in a long prompt+round
        if self.future is not None and self.future.cancel():
            self._events.put_nowait((CANCELLED, None))

    # -- generation thread side ---------------------------------------------------------------
    def run(self, engine) -> None:
        if self._cancel.is_set():  # the client left while this waited
            self._emit(CANCELLED, None)
            return
        try:
            stream = self._open(engine)
        except Exception as exc:  # bad parameters (UsageError) or an engine failure
            self._emit(ERROR, exc)
            return
        try:
            with stream:
                self._stream = stream
                if self._cancel.is_set():  # cancel() may have run before _stream was set
                    stream.cancel()
                self._emit(START, None)
                for ev in stream:
                    if ev.text:
                        self._add_text(ev.text)
                    if self._cancel.is_set():  # do not finish a round's accepted tokens for nobody
                        break
        except Exception as exc:
            log.exception("generation failed: %s: %s", type(exc).__name__, exc)
            self._emit(ERROR, exc)
            return
        finally:
            self._stream = None
        reason = "cancelled" if self._cancel.is_set() else (stream.finish_reason or "cancelled")
        self._emit(END, (stream.stats, reason, list(getattr(stream, "tool_calls", []))))

    def _add_text(self, text: str) -> None:
        with self._text_lock:
            self._text.append(text)
            if not self._streamed or self._flush_pending:
                return
            self._flush_pending = True
        self._call(self._flush)

    def _take(self) -> str:
        """The text gathered since the last hand-over (either thread)."""
        with self._text_lock:
            text, self._text, self._flush_pending = "".join(self._text), [], False
        return text

    def _flush(self) -> None:  # event loop side
        text = self._take()
        if text:
            self._events.put_nowait((TEXT, text))

    def _emit(self, kind: str, value) -> None:
        # the text gathered so far is taken here, on the generation thread, so that it goes
        # before this event and nothing added later can
        text = self._take()

        def put() -> None:
            if text:
                self._events.put_nowait((TEXT, text))
            self._events.put_nowait((kind, value))
        self._call(put)

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the event loop is gone (server shut down): nobody listens
            self._cancel.set()


class Scheduler:
    """Admission and order: up to `parallel` requests generate at once (the engine's number of
    sequences, known once it has loaded), up to `queue_size` more wait in arrival order, further
    ones are refused (QueueFull) rather than left to time out. Event-loop side only, except for
    the work it hands to its threads."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.thread = Threads(1, "edgespec-engine")  # loads the engine, and closes it
        self.engine = None
        self.parallel: Optional[int] = None  # generations at once, once loaded
        self._generators: Optional[Threads] = None
        self.state = "loading"          # loading -> ready | failed; ready -> closed
        self.error: Optional[BaseException] = None
        self._jobs: set[Job] = set()    # admitted and not yet finished: running or waiting
        self.served = 0                 # requests that ran to their end
        self.cancelled = 0              # requests whose client left (queued or running)
        # a target on rpc-servers (edgespec/rpc.py): "remote_down" while they are lost, then loaded again
        self._unwatch: Optional[Callable[[], None]] = None
        self._reconnect: Optional[asyncio.Future] = None
        self.lost_engines: list = []    # engines whose server was lost: never used, never freed (rpc.py)
        self.reconnects = 0

    async def load(self, loader: Callable[[], Any]) -> None:
        try:
            self.engine = await asyncio.wrap_future(self.thread.submit(loader))
        except BaseException as exc:
            self.state, self.error = "failed", exc
            raise
        # an engine without `parallel` serves one generation at a time
        self.parallel = max(1, int(getattr(self.engine, "parallel", 1)))
        self._generators = Threads(self.parallel, "edgespec-generate")
        self.state = "ready"
        self._watch_remote(loader)

    # -- a target on rpc-servers ------------------------------------------------------------------
    def _watch_remote(self, loader: Callable[[], Any]) -> None:
        remote = list(getattr(getattr(self.engine, "target", None), "remote", None) or [])
        if not remote:
            return
        from .. import rpc
        loop = asyncio.get_running_loop()

        def lost(error):  # on llama.cpp's thread that met the loss
            try:
                loop.call_soon_threadsafe(self._remote_lost, error, loader, remote)
            except RuntimeError:  # the event loop is gone: the server is stopping
                pass
        self._unwatch = rpc.on_lost(lost)

    def _remote_lost(self, error: BaseException, loader: Callable[[], Any], remote: list[str]) -> None:
        """The requests in flight end with `error` (the engine fails them: a 503 each); new ones are
        refused with it while the servers are away; once they answer, the engine is loaded again with
        the prompt cache it had."""
        if self.state != "ready":
            return
        log.error("%s", error)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self.state, self.error = "remote_down", error
        self.lost_engines.append(self.engine)
        self._reconnect = asyncio.ensure_future(self._come_back(loader, remote))

    async def _come_back(self, loader: Callable[[], Any], remote: list[str], every: float = 2.0) -> None:
        from .. import rpc
        old = self.lost_engines[-1]
        while self.state == "remote_down":
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(rpc.check_servers, remote, 3.0)
            except rpc.RemoteError as exc:
                log.debug("rpc-server still away: %s", exc)
                continue
            rpc.reconnected()
            log.warning("the rpc-server at %s answers again: loading the target there", ", ".join(remote))
            try:
                engine = await asyncio.wrap_future(self.thread.submit(loader))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # lost again while loading, or refused: wait for it once more
                log.error("loading the target again failed: %s", exc)
                continue
            if self.state != "remote_down":  # closed meanwhile
                await asyncio.wrap_future(self.thread.submit(engine.close))
                return
            engine.adopt_cache(old)
            if self._generators is not None:
                self._generators.stop()  # their last jobs ended with the loss
            self.engine = engine
            self.parallel = max(1, int(getattr(engine, "parallel", 1)))
            self._generators = Threads(self.parallel, "edgespec-generate")
            self.state, self.error = "ready", None
            self.reconnects += 1
            self._watch_remote(loader)
            log.warning("serving again")

    @property
    def running(self) -> int:
        return sum(1 for job in self._jobs if job.future.running())

    @property
    def waiting(self) -> int:
        return sum(1 for job in self._jobs if not (job.future.running() or job.future.done()))

    def submit(self, opener: Callable[[Any], Any], streamed: bool = True) -> Job:
        if self.state != "ready":
            raise NotReady(self.state)
        # counted on this side, not by the threads: a job that just ended frees its place at once,
        # and one that is admitted while a thread is free is about to run, not to wait
        if len(self._jobs) >= self.parallel + self.queue_size:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        job = Job(loop, opener, streamed)
        self._jobs.add(job)
        job.future = self._generators.submit(job.run, self.engine)
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, job))
        return job

    def _finished(self, job: Job) -> None:
        self._jobs.discard(job)
        if job.cancelled:
            self.cancelled += 1
        else:
            self.served += 1

    async def close(self) -> None:
        """Cancel everything, wait for the running generations to end (within a round of their
        cancel), then close the engine on the thread that loaded it."""
        ready = self.state == "ready"
        if self._reconnect is not None:
            self._reconnect.cancel()
        if self._unwatch is not None:
            self._unwatch()
        if self.state == "remote_down":
            self.state = "closed"
        if ready:
            self.state = "closed"  # nothing more is admitted
        for job in list(self._jobs):
            job.cancel()
        if ready:
            self._generators.stop()
            try:
                await asyncio.wrap_future(self.thread.submit(self._close_engine))
            except Exception:
                log.exception("closing the engine failed")
        self.thread.stop()

    def _close_engine(self) -> None:  # the loading thread
        self._generators.join()
        self.engine.close()
