"""`serve --parallel N`: several requests generate at once, the rest wait in arrival order.

First the Scheduler alone, on a fake engine whose streams the test steps by hand (which job
opens a stream when, what the queue holds, what close() does); then real `edgespec serve`
processes on SmolLM2 with --parallel 2. Nothing here times anything: the assertions are on the
order of events (a first chunk before an end, a request admitted while another still runs).

The real-server tests that need two generations at once fail while the engine serves one at a
time (no `Engine.parallel` yet): their first assertion reads /health's `parallel` and says so.
"""
from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import openai
import pytest

from edgespec.server import worker
from serverproc import ServerProcess

WAIT = 30  # seconds before a test that hangs gives up: a guard, not a measurement


# -- the Scheduler on a fake engine ------------------------------------------------------------
class FakeStream:
    """A Stream that yields a token, or ends, when the test says so (step / end), or when it is
    cancelled."""

    def __init__(self, engine: "FakeEngine", name: str):
        self.engine, self.name = engine, name
        self._orders: queue.SimpleQueue = queue.SimpleQueue()
        self.finish_reason = None
        self.stats = SimpleNamespace(generated=0)
        self.cancelled = False

    def step(self) -> None:
        self._orders.put("token")

    def end(self) -> None:
        self._orders.put("end")

    def cancel(self) -> None:
        self.cancelled = True
        self._orders.put("cancel")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with self.engine.lock:
            self.engine.active -= 1

    def __iter__(self):
        while True:
            order = self._orders.get(timeout=WAIT)
            if order == "cancel":
                return
            if order == "end":
                self.finish_reason = "length"
                return
            self.stats.generated += 1
            yield SimpleNamespace(text=f"{self.name}{self.stats.generated}")


class FakeEngine:
    def __init__(self, parallel=None):
        if parallel is not None:
            self.parallel = parallel
        self.lock = threading.Lock()
        self.streams: dict[str, FakeStream] = {}
        self.opened: list[str] = []   # in the order stream_prompt was called
        self.active = 0               # streams open now
        self.most = 0                 # the most that were ever open at once
        self.closed_on = None         # the thread that closed the engine, and how many streams were open then

    def stream_prompt(self, prepared: str) -> FakeStream:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.opened.append(prepared)
            self.streams[prepared] = FakeStream(self, prepared)
            return self.streams[prepared]

    def close(self) -> None:
        self.closed_on = (threading.current_thread().name, self.active)


def _opener(name):
    return lambda engine: engine.stream_prompt(name)


async def _next(job):
    return await asyncio.wait_for(job.next(), WAIT)


async def _loaded(engine, queue_size):
    sched = worker.Scheduler(queue_size)
    loaded_on = []

    def load():
        loaded_on.append(threading.current_thread().name)
        return engine
    await sched.load(load)
    return sched, loaded_on[0]


async def _counts(sched, want: tuple) -> None:
    """Until (running, waiting, served, cancelled) are `want`: a job's end reaches the event loop
    from its thread a moment after its last event."""
    deadline = time.monotonic() + WAIT
    while (got := (sched.running, sched.waiting, sched.served, sched.cancelled)) != want:
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.01)


def _run(coro):
    asyncio.run(asyncio.wait_for(coro, 2 * WAIT))


def test_the_scheduler_runs_parallel_jobs_at_once_and_queues_the_rest_in_order():
    async def main():
        eng = FakeEngine(parallel=2)
        sched, _ = await _loaded(eng, queue_size=2)
        assert sched.parallel == 2
        a, b, c, d = (sched.submit(_opener(n)) for n in "abcd")
        with pytest.raises(worker.QueueFull):  # 2 generate, 2 wait: the fifth is refused
            sched.submit(_opener("e"))
        assert await _next(a) == (worker.START, None)
        assert await _next(b) == (worker.START, None)
        assert (sched.running, sched.waiting) == (2, 2)
        assert eng.opened == ["a", "b"] and eng.active == 2  # both open, neither ended
        eng.streams["b"].step()
        assert await _next(b) == (worker.TEXT, "b1")
        eng.streams["a"].step()
        assert await _next(a) == (worker.TEXT, "a1")

        eng.streams["b"].end()  # b's place goes to c, the first that waited
        kind, (stats, reason, calls) = await _next(b)
        assert (kind, reason, stats.generated, calls) == (worker.END, "length", 1, [])
        assert await _next(c) == (worker.START, None)
        assert eng.opened == ["a", "b", "c"]
        assert (sched.running, sched.waiting, sched.served) == (2, 1, 1)
        e = sched.submit(_opener("e"))  # b's end made room in the queue
        with pytest.raises(worker.QueueFull):
            sched.submit(_opener("f"))

        for name, job, following in (("a", a, d), ("c", c, e)):
            eng.streams[name].end()
            assert (await _next(job))[0] == worker.END
            assert await _next(following) == (worker.START, None)
        assert eng.opened == ["a", "b", "c", "d", "e"] and eng.most == 2
        for name, job in (("d", d), ("e", e)):
            eng.streams[name].end()
            assert (await _next(job))[0] == worker.END
        await _counts(sched, (0, 0, 5, 0))
        await sched.close()
    _run(main())


def test_a_job_cancelled_while_it_waits_never_reaches_the_engine():
    async def main():
        eng = FakeEngine(parallel=2)
        sched, _ = await _loaded(eng, queue_size=2)
        a, b, c, d = (sched.submit(_opener(n)) for n in "abcd")
        await _next(a), await _next(b)
        c.cancel()  # its client left: out of the queue at once, no thread involved
        assert await _next(c) == (worker.CANCELLED, None)
        await _counts(sched, (2, 1, 0, 1))
        eng.streams["a"].end()
        await _next(a)
        assert await _next(d) == (worker.START, None)  # d took a's place, c was skipped
        assert eng.opened == ["a", "b", "d"]

        d.cancel()  # a running one: its stream is cancelled and ends within a round
        assert eng.streams["d"].cancelled
        kind, (_, reason, _) = await _next(d)
        assert (kind, reason) == (worker.END, "cancelled")
        eng.streams["b"].end()
        await _next(b)
        await _counts(sched, (0, 0, 2, 2))
        await sched.close()
    _run(main())


def test_an_engine_without_parallel_runs_one_job_at_a_time_in_arrival_order():
    async def main():
        eng = FakeEngine()  # no `parallel` attribute: one at a time
        sched, _ = await _loaded(eng, queue_size=1)
        assert sched.parallel == 1
        a, b = sched.submit(_opener("a")), sched.submit(_opener("b"))
        with pytest.raises(worker.QueueFull):
            sched.submit(_opener("c"))
        assert await _next(a) == (worker.START, None)
        assert sched.waiting == 1 and eng.opened == ["a"]
        eng.streams["a"].end()
        await _next(a)
        assert await _next(b) == (worker.START, None)
        eng.streams["b"].end()
        await _next(b)
        assert eng.opened == ["a", "b"] and eng.most == 1
        await sched.close()
    _run(main())


def test_close_cancels_everything_waits_for_the_running_and_closes_the_engine_on_the_loading_thread():
    async def main():
        eng = FakeEngine(parallel=2)
        sched, loaded_on = await _loaded(eng, queue_size=4)
        a, b, c = (sched.submit(_opener(n)) for n in "abc")
        await _next(a), await _next(b)
        await sched.close()
        # the engine closed only once both running streams had ended, on the thread that loaded it
        assert eng.closed_on == (loaded_on, 0)
        assert eng.streams["a"].cancelled and eng.streams["b"].cancelled
        assert eng.opened == ["a", "b"]  # c never started
        assert await _next(c) == (worker.CANCELLED, None)
        for job in (a, b):
            kind, (_, reason, _) = await _next(job)
            assert (kind, reason) == (worker.END, "cancelled")
        assert sched.state == "closed"
        with pytest.raises(worker.NotReady):
            sched.submit(_opener("d"))
    _run(main())


# -- the flag ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "x", "65"])
def test_a_bad_parallel_is_a_one_line_error(smol, value):
    r = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--target", str(smol), "--port", "0",
                        "--parallel", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--parallel" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "listening" not in r.stderr  # refused before anything binds


def test_help_says_what_parallel_does_and_its_default():
    r = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--help"], capture_output=True, text=True,
                       timeout=120)
    text = " ".join(r.stdout.split())
    start = text.index("--parallel N, -np N")
    entry = text[start:text.index("--queue-size N", start)]  # up to the next option
    assert "at once" in entry and "Default" in entry and "at most 4" in entry, entry


# -- a real server with --parallel 2 --------------------------------------------------------------
N_CTX = 2048  # room for two sequences even if the engine splits the context between them
FLAGS = ["--ctx", str(N_CTX), "--drafter", "ngram", "--parallel", "2"]
COUNT = "1, 2, 3, 4, 5, 6, 7, 8,"   # SmolLM2 keeps counting: an answer as long as max_tokens
TENS = "10, 20, 30, 40, 50,"
HOLD_TOKENS = 900                   # a stream that runs until the test closes it
LONG_WAIT = 300                     # what a test waits for the server before it fails: a hang guard


def _serve(smol, tmp_path_factory, *flags):
    srv = ServerProcess(["--target", str(smol), *FLAGS, *flags], tmp_path_factory.mktemp("parallel"))
    srv.wait_ready()
    return srv


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=LONG_WAIT)


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    """No queue: a request beyond the two that generate is refused at once."""
    srv = _serve(smol, tmp_path_factory, "--queue-size", "0")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    with _client(server) as c:
        yield c


@pytest.fixture
def roomy(smol, tmp_path_factory):
    """Room in the queue: with one generation at a time, the second request waits (and the test
    fails on the order of events, not on a 503)."""
    srv = _serve(smol, tmp_path_factory, "--queue-size", "2")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def _idle(server) -> dict:
    """/health once nothing runs or waits (an earlier test's cancelled streams end within a round)."""
    deadline = time.monotonic() + LONG_WAIT
    while True:
        h = server.health().json()
        if h["running"] == h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def _until(server, check) -> dict:
    deadline = time.monotonic() + LONG_WAIT
    while True:
        h = server.health().json()
        if check(h):
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def _two_at_once(server) -> None:
    parallel = server.health().json()["parallel"]
    assert parallel == 2, (f"asked --parallel 2, the engine generates {parallel} at a time (it has no "
                           "Engine.parallel yet?)")


def _hold(client):
    """A streamed answer that is generating once this returns: its iterator, past the first chunk."""
    stream = client.completions.create(model="x", prompt=COUNT, max_tokens=HOLD_TOKENS, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].text and not first.choices[0].finish_reason
    return stream, chunks


def test_health_and_the_ready_line_show_parallel(server):
    h = _idle(server)
    assert {"parallel", "running", "waiting", "served", "cancelled"} <= set(h)
    assert h["parallel"] >= 1 and "at once" in server.log.read_text()


@pytest.mark.slow
def test_two_streams_sent_at_once_both_start_before_either_ends_with_their_solo_answers(roomy):
    prompts, max_tokens = [COUNT, TENS], 96
    client = _client(roomy)
    alone = []
    for p in prompts:  # one after the other: each generates alone
        r = client.completions.create(model="x", prompt=p, max_tokens=max_tokens, temperature=0)
        assert r.choices[0].finish_reason == "length"  # so that neither ends early below
        alone.append(r.choices[0].text)

    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    texts: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def ask(i):
        try:
            start.wait()
            parts = []
            for chunk in client.completions.create(model="x", prompt=prompts[i], max_tokens=max_tokens,
                                                   temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].text:
                    if not parts:
                        with lock:
                            events.append(("first", i))
                    parts.append(chunk.choices[0].text)
            with lock:
                events.append(("end", i))
            texts[i] = "".join(parts)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LONG_WAIT)
    client.close()
    assert not errors, errors
    assert [texts.get(i) for i in range(len(prompts))] == alone
    # both were being answered at the same time: neither waited for the other to end
    assert sorted(events[:2]) == [("first", 0), ("first", 1)], (events, roomy.health().json())


def test_a_request_beyond_parallel_with_no_queue_gets_queue_full_while_two_run(client, server):
    _two_at_once(server)
    before = _idle(server)
    holds = [_hold(client), _hold(client)]  # both generating at once
    try:
        h = server.health().json()
        assert (h["parallel"], h["running"], h["waiting"]) == (2, 2, 0)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="x", prompt=TENS, max_tokens=4, temperature=0)
        assert err.value.status_code == 503
        assert err.value.response.json()["error"]["code"] == "queue_full"
        assert err.value.response.headers["retry-after"]
    finally:
        for stream, _ in holds:
            stream.close()
    after = _idle(server)
    assert (after["cancelled"], after["served"]) == (before["cancelled"] + 2, before["served"])


def test_a_dropped_stream_frees_its_place_for_the_next_request(client, server):
    _two_at_once(server)
    before = _idle(server)
    (dropped, _), (kept, kept_chunks) = _hold(client), _hold(client)
    try:
        dropped.close()  # that client goes away mid-answer
        _until(server, lambda h: h["cancelled"] == before["cancelled"] + 1 and h["running"] == 1)
        # the freed place serves a new request while the other stream still runs (the queue holds
        # none: without the freed place this would be a 503)
        r = client.completions.create(model="x", prompt=TENS, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason == "length"
        more = next(kept_chunks)
        assert more.choices[0].text and not more.choices[0].finish_reason  # still generating
        h = server.health().json()
        assert (h["running"], h["served"]) == (1, before["served"] + 1)
    finally:
        kept.close()
    after = _idle(server)
    assert (after["cancelled"], after["served"]) == (before["cancelled"] + 2, before["served"] + 1)
