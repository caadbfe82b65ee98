"""How a generation's text reaches the event loop (server/worker.Job): in order whatever the
timing, and without a wake-up of the loop per token where nobody reads tokens one by one."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from edgespec.server import worker


class _Stream:
    def __init__(self, texts):
        self.texts, self.finish_reason, self.stats, self.tool_calls = texts, "length", SimpleNamespace(), []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        return iter(SimpleNamespace(text=t) for t in self.texts)

    def cancel(self):
        pass


async def _drain(job) -> list:
    out = []
    while True:
        kind, value = await asyncio.wait_for(job.next(), 5)
        out.append((kind, value if kind == worker.TEXT else None))
        if kind in (worker.END, worker.ERROR, worker.CANCELLED):
            return out


@pytest.mark.parametrize("streamed", [False, True])
def test_events_keep_their_order_when_the_loop_is_slower_than_the_tokens(streamed):
    """The whole generation runs before the loop takes any callback (a busy loop): START still
    comes first, the text whole and before END. (Gathering the text once made the text overtake
    START, and a non-streamed answer came back as a 500.)"""
    async def main():
        loop = asyncio.get_running_loop()
        job = worker.Job(loop, lambda engine: _Stream(["a", "b", "c"]), streamed=streamed)
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: (calls.append(fn), real(fn, *a))[1]
        try:
            job.run(engine=None)  # on the loop's own thread: no callback runs until it returns
        finally:
            del loop.call_soon_threadsafe
        events = await _drain(job)
        assert events == [(worker.START, None), (worker.TEXT, "abc"), (worker.END, None)]
        # non-streamed: START and END wake the loop, no token does; streamed: the first token's
        # wake-up takes the tokens that come while it waits
        assert len(calls) == (2 if not streamed else 3)
    asyncio.run(main())


def test_a_streamed_answer_hands_over_each_token_when_the_loop_keeps_up():
    async def main():
        loop = asyncio.get_running_loop()
        job = worker.Job(loop, lambda engine: _Stream(["x", "y"]), streamed=True)
        seen = []

        class Paced(_Stream):  # the loop takes every hand-over before the next token comes
            def __iter__(self):
                for t in self.texts:
                    yield SimpleNamespace(text=t)
                    fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop)
                    fut.result(5)
        job._open = lambda engine: Paced(["x", "y"])
        task = loop.run_in_executor(None, job.run, None)
        while not seen or seen[-1][0] != worker.END:
            kind, value = await asyncio.wait_for(job.next(), 5)
            seen.append((kind, value))
        await task
        assert [e for e in seen if e[0] == worker.TEXT] == [(worker.TEXT, "x"), (worker.TEXT, "y")]
    asyncio.run(main())
