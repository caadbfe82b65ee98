"""backend._Compute: every llama.cpp computation on one thread (libgomp throttles its teams once
more threads have started parallel regions than there are CPUs: a decode from a second thread was
35% slower), and an interrupted caller waits for llama.cpp before it raises."""
import threading
import time

import pytest

from edgespec.backend import _Compute


def test_calls_from_any_thread_run_on_one_thread_and_return_or_raise_there():
    c = _Compute()
    seen = []

    def where(x):
        seen.append(threading.get_ident())
        if x < 0:
            raise ValueError("negative")
        return x * 2
    out = []
    threads = [threading.Thread(target=lambda i=i: out.append(c.call(where, i))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [0, 2, 4, 6, 8, 10]
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    with pytest.raises(ValueError, match="negative"):
        c.call(where, -1)
    assert c.call(lambda: c.call(where, 3)) == 6  # a call made on the compute thread runs in place


def test_an_interrupted_caller_stops_the_pass_and_raises_only_after_it_returned(monkeypatch):
    """Ctrl-C reaches the caller while it waits for the pass (as KeyboardInterrupt out of its
    wait: simulated there, since a real signal's delivery time varies with the load)."""
    import edgespec.backend as backend
    c = _Compute()
    stop = threading.Event()
    ended = []

    class Interrupted(threading.Event):  # the caller's wait is interrupted once, 0.1 s in
        fired = False

        def wait(self, timeout=None):
            if not Interrupted.fired:
                Interrupted.fired = True
                time.sleep(0.1)
                raise KeyboardInterrupt
            return super().wait(timeout)

    def pass_(seconds):  # a pass that an abort callback would stop early
        stop.wait(seconds)
        ended.append(time.perf_counter())
        return "done"
    c.call(pass_, 0.0)  # the compute thread started before the Event is replaced
    ended.clear()
    monkeypatch.setattr(backend.threading, "Event", Interrupted)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        c.call(pass_, 5.0, interrupt=stop.set)
    raised = time.perf_counter()
    monkeypatch.undo()
    assert ended and ended[0] <= raised  # llama.cpp had returned before the caller raised
    assert raised - t0 < 2.0  # the interrupt hook stopped the pass (5 s otherwise)
    assert c.call(pass_, 0.0) == "done"  # and the thread serves the next call
