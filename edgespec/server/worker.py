"""The engine thread and the request queue.

llama.cpp calls block for milliseconds to seconds and hold the GIL only in between, so they never
run on the event loop: one dedicated thread loads the engine, runs every generation in arrival
order and finally closes it. One thread rather than a pool because the engine serves one
generation at a time anyway, and because a queued request that is cancelled must leave the queue
without ever touching the engine — a pool thread blocked inside `Engine.stream()` could not.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("edgespec.server")


class EngineThread:
    """Runs submitted callables one after the other on a single thread."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # daemon: a model still downloading or loading when the server is stopped must not keep
        # the process alive (nothing is written by the thread that an abrupt end could corrupt:
        # hub downloads land in a temporary file first)
        self._thread = threading.Thread(target=self._main, name="edgespec-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fut, fn, args))
        return fut

    def stop(self) -> None:
        """Finish what was submitted, then end the thread."""
        self._inbox.put(None)

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
    """One request's generation. `opener(engine)` returns the engine's Stream; it runs on the
    engine thread and its events come back to the event loop through an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, opener: Callable[[Any], Any]):
        self._loop = loop
        self._open = opener
        self._events: asyncio.Queue = asyncio.Queue()
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

    # -- engine thread side -----------------------------------------------------------------
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
                        self._emit(TEXT, ev.text)
                    if self._cancel.is_set():  # do not finish a round's accepted tokens for nobody
                        break
        except Exception as exc:
            log.exception("generation failed")
            self._emit(ERROR, exc)
            return
        finally:
            self._stream = None
        reason = "cancelled" if self._cancel.is_set() else (stream.finish_reason or "cancelled")
        self._emit(END, (stream.stats, reason, list(getattr(stream, "tool_calls", []))))

    def _emit(self, kind: str, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (server shut down): nobody listens
            self._cancel.set()


class Scheduler:
    """Admission and order: one request generates, up to `queue_size` wait in arrival order,
    further ones are refused (QueueFull) rather than left to time out. Event-loop side only,
    except for the work it hands to the engine thread."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.thread = EngineThread()
        self.engine = None
        self.state = "loading"          # loading -> ready | failed; ready -> closed
        self.error: Optional[BaseException] = None
        self._jobs: set[Job] = set()
        self._running: Optional[Job] = None
        self.served = 0                 # requests that ran to their end
        self.cancelled = 0              # requests whose client left (queued or running)

    async def load(self, loader: Callable[[], Any]) -> None:
        try:
            self.engine = await asyncio.wrap_future(self.thread.submit(loader))
        except BaseException as exc:
            self.state, self.error = "failed", exc
            raise
        self.state = "ready"

    @property
    def running(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def waiting(self) -> int:
        return len(self._jobs) - self.running

    def submit(self, opener: Callable[[Any], Any]) -> Job:
        if self.state != "ready":
            raise NotReady(self.state)
        if len(self._jobs) > self.queue_size:  # one running + queue_size waiting
            raise QueueFull()
        loop = asyncio.get_running_loop()
        job = Job(loop, opener)
        self._jobs.add(job)
        job.future = self.thread.submit(self._run, job)
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, job))
        return job

    def _run(self, job: Job) -> None:  # engine thread
        self._running = job
        try:
            job.run(self.engine)
        finally:
            self._running = None

    def _finished(self, job: Job) -> None:
        self._jobs.discard(job)
        if job.cancelled:
            self.cancelled += 1
        else:
            self.served += 1

    async def close(self) -> None:
        """Cancel everything, then close the engine on its thread."""
        for job in list(self._jobs):
            job.cancel()
        if self.engine is not None and self.state == "ready":
            self.state = "closed"
            try:
                await asyncio.wrap_future(self.thread.submit(self.engine.close))
            except Exception:
                log.exception("closing the engine failed")
        self.thread.stop()
