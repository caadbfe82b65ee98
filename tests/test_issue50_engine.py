"""Issue 50, the engine's part: a cancelled stream that is still held gives its place back (4);
`bit_exact` with a drafter that cannot keep it is refused (5); a short request arriving at any time
of a long prompt is answered before the prompt goes on, and the prompt is not starved (6). On
SmolLM2 through real llama.cpp; the starvation bound on the fake backend."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import edgespec.engine as engine_mod
from edgespec import Engine
from edgespec.assemble import Settings
from edgespec.errors import UsageError
from edgespec.request import Request

from conftest import ROOT
from fakes import FakeBackend
from test_cli import assert_usage_error, run_cli

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def engine(smol):
    with Engine.load(str(smol), drafter="ngram", n_ctx=1024, parallel=1, calibrate="never") as eng:
        yield eng


# -- 4. a cancelled stream nobody reads ---------------------------------------------------------

@pytest.mark.parametrize("how", ["stream.cancel", "engine.cancel"])
def test_a_cancelled_stream_still_held_gives_its_place_back_at_once(engine, how):
    """A Stop button that keeps the stream (for its text and stats) and reads no more: the
    generation ends with "cancelled" and another thread's request runs. Before, with parallel=1
    that request waited until the stream was closed, and its finish_reason stayed None."""
    s = engine.stream_chat(STORY, max_tokens=300)
    next(s)
    s.cancel() if how == "stream.cancel" else engine.cancel()
    got: list = []
    other = threading.Thread(target=lambda: got.append(engine.chat(HI, max_tokens=8)), daemon=True)
    other.start()
    other.join(120)
    try:
        assert got, "another thread's chat waited for a cancelled stream that nobody reads"
        assert got[0].finish_reason == "length" and len(got[0].tokens) == 8
        assert s.finish_reason == "cancelled"  # said without reading the stream again
        assert s.stats.generated <= 3 * 5  # ended within a round (ngram: gamma + 1 = 5 tokens a round)
        # what was committed before the cancel is still there to read, and the end says why
        rest = list(s)
        assert rest[-1].token is None and rest[-1].finish_reason == "cancelled"
        assert len(s.tokens) == s.stats.generated and s.finish_reason == "cancelled"
    finally:
        s.close()
        other.join(60)


# -- 5. bit_exact and the fixed drafters --------------------------------------------------------

@pytest.mark.parametrize("drafter", ["model", "ngram", "copy"])
def test_bit_exact_with_a_fixed_drafter_is_refused_by_the_library(smol, smol_draft, drafter):
    """The fixed drafters verify --gamma drafts a pass; only auto keeps its passes within the
    exact rows. Before, the combination loaded and bit_exact did nothing."""
    with pytest.raises(UsageError, match=f"bit_exact .*needs drafter auto.*the {drafter} drafter"):
        Engine.load(str(smol), draft=str(smol_draft), drafter=drafter, bit_exact=True, n_ctx=512,
                    parallel=1, calibrate="never")
    for kept in ("auto", "none"):
        Settings(drafter=kept, bit_exact=True, parallel=1).validate()


def test_bit_exact_with_a_fixed_drafter_is_one_line_and_exit_2_for_run_and_serve(smol, capsys):
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "ngram", "--gamma", "8", "--bit-exact",
                              "--prompt", "hi", "--max-tokens", "2"], capsys)
    assert_usage_error(code, err, "--bit-exact", "ngram", "--drafter auto")
    assert out == ""
    try:
        proc = subprocess.run([sys.executable, "-m", "edgespec", "serve", "--target", str(smol), "--drafter", "copy",
                               "--bit-exact", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("serve --drafter copy --bit-exact started instead of refusing")
    assert_usage_error(proc.returncode, proc.stderr, "--bit-exact", "copy")
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "none", "--bit-exact", "--prompt", "hi",
                              "--max-tokens", "2"], capsys)
    assert code == 0, err  # plain decoding is exact anyway


# -- 6. a short request beside a long prompt ----------------------------------------------------

LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(46))  # ~700 tokens


@pytest.mark.slow
def test_a_short_request_goes_before_a_long_prompt_whenever_it_arrives(smol, monkeypatch):
    """A short request arriving early in a long prompt, and one arriving when the prompt has less
    than LONG_PROMPT tokens left: each is answered while the prompt waits (it evaluates at most
    the piece in progress), and the prompt's answer is its answer alone. Before, the prompt went on
    by n_batch tokens while nothing else had started (4 pieces before the short prompt went in), and
    with fewer than LONG_PROMPT tokens left it no longer stepped aside: a piece before each round of
    the short request (a 4,000-token prompt's second half: 7-21 s for a short answer)."""
    monkeypatch.setattr(engine_mod, "LONG_PROMPT", 256)  # ~700 tokens count as long, as 20,000 do
    # credit to spare: on a loaded machine the short requests' own work can take tens of seconds (the
    # bound on stepping aside is test_a_stream_of_short_requests_does_not_starve_a_long_prompt's)
    monkeypatch.setattr(engine_mod, "YIELD_SECONDS", 600.0)
    with Engine.load(str(smol), drafter="none", n_ctx=2048, parallel=2, calibrate="never") as eng:
        piece = eng.sequences.piece
        long = eng.stream_prompt(eng.prepare_prompt(LONG, Request(max_tokens=4)))
        n = len(long.generation.tokens)
        assert n > 4 * piece
        reader = threading.Thread(target=long.result, daemon=True)
        reader.start()
        g = long.generation

        def evaluated():
            return eng.sequences.canon.get(g.seq, 0) if g.seq >= 0 else 0

        def short_request_at(tokens_in):
            deadline = time.monotonic() + 300
            while evaluated() < tokens_in and not g.started and time.monotonic() < deadline:
                time.sleep(0.005)
            assert tokens_in <= evaluated() and not g.started, (tokens_in, evaluated(), g.started)
            before = evaluated()
            short = eng.generate("The capital of France is", max_tokens=8)
            assert len(short.tokens) == 8
            assert not g.started, f"the long prompt went in before the short request arriving at {before} was answered"
            assert evaluated() - before <= 2 * piece, (before, evaluated())  # the piece in progress, one to spare
        try:
            short_request_at(piece)
            short_request_at(n - n % piece - piece)  # fewer than LONG_PROMPT tokens left
        finally:
            reader.join(300)
        assert long.finish_reason == "length"
        eng.reset()
        assert eng.generate(LONG, max_tokens=4).tokens == long.tokens  # its answer alone


class SlowBackend(FakeBackend):
    """The fake with a pass that takes time, as a real one does: 1 ms a token."""

    def eval_batch(self, parts):
        time.sleep(0.001 * sum(len(t) for _, t, _ in parts))
        return super().eval_batch(parts)


def test_a_stream_of_short_requests_does_not_starve_a_long_prompt(monkeypatch):
    """Short requests one after another, each in its first YIELD_SECONDS: the long prompt steps
    aside for them no longer than its own pieces took plus YIELD_SECONDS, then goes on between
    their rounds, and its answer is its answer alone."""
    monkeypatch.setattr(engine_mod, "LONG_PROMPT", 16)
    monkeypatch.setattr(engine_mod, "YIELD_SECONDS", 0.2)
    rng = np.random.default_rng(5)
    p = rng.normal(0, 1.5, (8, 8)).astype(np.float32)
    long_prompt = [1, 2, 3, 4, 5, 6, 7] * 40  # 280 tokens: 70 pieces of 4
    alone = Engine(FakeBackend(p)).generate(long_prompt, max_tokens=5).tokens
    engine = Engine(SlowBackend(p, n_seq=2, n_batch=8), None)
    stop = threading.Event()
    shorts = []

    def side_requests():
        while not stop.is_set():
            shorts.append(engine.generate([0, 1], max_tokens=6).tokens)
    t = threading.Thread(target=side_requests, daemon=True)
    t.start()
    while not shorts:
        time.sleep(0.001)
    long = engine.stream(long_prompt, max_tokens=5)
    got = long.result()
    busy = t.is_alive() and not stop.is_set()
    stop.set()
    t.join(30)
    assert busy and len(shorts) > 3  # requests came one after another while it went in
    assert got.tokens == alone
    g = long.generation
    assert 0 < g.aside_seconds <= engine_mod.YIELD_SECONDS + g.piece_seconds + 0.5  # a turn at most beyond
