"""Agent-sized prompts: a request cancelled in the middle of its prompt keeps the pieces already
evaluated, so the client's retry resumes where it stopped (SmolLM2, real llama.cpp)."""
from __future__ import annotations

import threading
import time

import pytest

from edgespec import Engine
from edgespec.request import Request

# about 710 tokens: 5 canonical pieces and a tail
PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(48))
CANCEL_AT = 256  # tokens evaluated (2 pieces) when the request is cancelled


@pytest.mark.slow
def test_a_prompt_cancelled_midway_keeps_its_pieces_and_the_retry_resumes(smol):
    with Engine.load(str(smol), drafter="none", n_ctx=4096, calibrate="never") as eng:
        prompt = eng.prepare_prompt(PROMPT, Request(max_tokens=4))
        n = len(prompt.tokens)
        assert n > 640
        stream = eng.stream_prompt(prompt)
        done = threading.Event()

        def read():
            for _ in stream:
                pass
            done.set()
        t = threading.Thread(target=read)
        t.start()
        seqs = eng.sequences
        deadline = time.monotonic() + 120
        while max(seqs.canon.values(), default=0) < CANCEL_AT and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.005)
        stream.cancel()
        t.join(60)
        assert not t.is_alive()
        assert stream.finish_reason == "cancelled" and not stream.tokens  # no token: inside the prompt
        evaluated = max(seqs.canon.values())
        assert CANCEL_AT <= evaluated < n - 1, evaluated  # stopped in the middle of the prompt
        again = eng.stream_prompt(eng.prepare_prompt(PROMPT, Request(max_tokens=4)))
        with again:
            for _ in again:
                pass
        st = again.stats
        assert st.reused_prompt_tokens >= evaluated - evaluated % seqs.piece > 0
        # and the answer is the one a fresh prompt gives (the pieces are the canonical ones)
        eng.reset()
        assert eng.generate(PROMPT, max_tokens=4).tokens == list(again.tokens)
