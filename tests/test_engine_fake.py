"""Engine behaviour on the fake backend: streaming text, stop strings, EOS, limits, and the
request-scoped results (stats and finish reason on the stream, the last event, the result)."""
import threading

import numpy as np
import pytest

from edgespec import rounds
from edgespec.drafters.model import ModelDrafter
from edgespec.engine import Engine
from edgespec.errors import UsageError

from fakes import FakeBackend

V = 6
# greedy chain 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 0 ...
CHAIN = np.full((V, V), -5.0, np.float32)
for i in range(V):
    CHAIN[i, (i + 1) % V] = 5.0
# pieces that split multi-byte characters across tokens: "hé 😀! ok." and so on
PIECES = {0: b".", 1: b"h\xc3", 2: b"\xa9 \xf0\x9f", 3: b"\x98", 4: b"\x80!", 5: b" ok"}


class PieceBackend(FakeBackend):
    def token_to_piece(self, token, special=False):
        return PIECES[token]


def engine(gamma=3, draft=True, **kw):
    target = PieceBackend(CHAIN, **kw)
    drafter = ModelDrafter(PieceBackend(CHAIN + np.float32(0.3), name="draft"), V, gamma) if draft else None
    return Engine(target, drafter)


def test_stream_splits_no_character_and_joins_to_the_full_text():
    events = list(engine().stream("0", max_tokens=12))
    texts = [e.text for e in events]
    assert all("\ufffd" not in t for t in texts)
    full = b"".join(PIECES[e.token] for e in events[:-1]).decode()
    assert "".join(texts) == full == "hé 😀! ok.hé 😀! ok."
    # one event per token as soon as it is committed, then a closing event saying why it ended
    assert [e.token for e in events] == [1, 2, 3, 4, 5, 0] * 2 + [None]
    assert any(e.from_draft for e in events)
    assert [e.finish_reason for e in events] == [None] * 12 + ["length"]


@pytest.mark.parametrize("stop, expect", [("😀!", "hé "), ("ok.h", "hé 😀! "), ("é 😀", "h")])
def test_stop_string_across_tokens_ends_generation_before_it(stop, expect):
    result = engine().generate("0", max_tokens=50, stop=[stop])
    assert result.text == expect
    assert result.stats.finish_reason == result.finish_reason == "stop"
    events = list(engine().stream("0", max_tokens=50, stop=[stop]))
    assert "".join(e.text for e in events) == expect and events[-1].finish_reason == "stop"


def test_text_is_held_back_only_while_it_may_start_a_stop_string():
    events = list(engine().stream("0", max_tokens=6, stop=["ok!"]))
    # "ok" of token 5 could start "ok!": held until token 0 (".") says it does not
    assert [e.text for e in events] == ["h", "é ", "", "😀!", " ", "ok.", ""]
    assert events[-1].finish_reason == "length"


def test_eos_stops_and_is_not_emitted():
    eng = engine(eos=4)
    stream = eng.stream("0", max_tokens=50)
    events = list(stream)
    assert [e.token for e in events] == [1, 2, 3, None]
    assert stream.finish_reason == "eos" and events[-1].finish_reason == "eos"
    assert stream.tokens == [1, 2, 3] and stream.text == "hé \ufffd"  # an unfinished character


def test_a_request_that_generates_nothing_still_ends_with_the_closing_event():
    eng = engine(eos=1)
    events = list(eng.stream("0", max_tokens=5))
    assert [(e.token, e.text, e.finish_reason) for e in events] == [(None, "", "eos")]
    assert eng.generate("0", max_tokens=5).tokens == []


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_max_tokens_is_exact_with_any_draft_length(gamma):
    eng = engine(gamma=gamma)
    for n in (1, 2, 5, 7):
        r = eng.generate("0", max_tokens=n)
        assert len(r.tokens) == n and r.finish_reason == "length"


def test_generation_stops_when_the_context_is_full():
    result = engine(n_ctx=10).generate("0 1", max_tokens=100)
    assert len(result.tokens) == 10 - 3
    assert result.finish_reason == "context"


def test_prompt_longer_than_context_is_a_usage_error():
    with pytest.raises(UsageError, match="context holds 8"):
        engine(n_ctx=8).generate(" ".join(["1"] * 20))


def test_model_that_cannot_cut_its_cache_refuses_speculation_but_decodes_plainly():
    target = PieceBackend(CHAIN)
    target.can_truncate = False
    with pytest.raises(UsageError, match="--drafter none"):
        Engine(target, ModelDrafter(PieceBackend(CHAIN, name="draft"), V))
    assert Engine(target, None).generate("0", max_tokens=3).tokens == [1, 2, 3]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(max_tokens=True), "max_tokens must be"),
    (dict(seed=-1), "seed must be an integer in 0..2**64-1"),
    (dict(seed=1.5), "seed must be"),
    (dict(temperature=1e-46), "temperature must be 0 (greedy) or a number >= 1e-06"),
    (dict(stop=5), "stop must be a string or a list"),
    (dict(stop=["ok", 3]), "each stop string must be a string"),
    (dict(stop="\udcff"), "not valid UTF-8"),
])
def test_bad_arguments_are_usage_errors(kwargs, fragment):
    with pytest.raises(UsageError) as e:
        engine().generate("0", **kwargs)
    assert fragment in str(e.value)


@pytest.mark.parametrize("prompt, fragment", [
    (5, "prompt must be a string or a list of token ids"),
    (b"0 1", "prompt must be a string"),
    ("\udcff", "not valid UTF-8"),
    ([0, 99], "token ids must be in 0..5"),
    ([], "prompt is empty"),
])
def test_bad_prompts_are_usage_errors(prompt, fragment):
    with pytest.raises(UsageError) as e:
        engine().generate(prompt)
    assert fragment in str(e.value)


def test_token_id_prompts_equal_text_prompts():
    eng = engine()
    assert eng.generate([0, 0], max_tokens=6).tokens == eng.generate("0", max_tokens=6).tokens


def test_nan_logits_are_a_backend_error_naming_the_file():
    from edgespec.errors import BackendError
    bad = CHAIN.copy()
    bad[2] = np.nan
    eng = Engine(PieceBackend(bad, name="broken"), None)
    for temperature in (0.0, 1.0):
        with pytest.raises(BackendError, match="broken.gguf produced non-finite logits"):
            eng.generate("0", max_tokens=5, temperature=temperature)
        # the engine stays usable for a prompt that avoids the damaged row
        assert eng.generate("4", max_tokens=1).tokens == [5]


def test_reused_prompt_tokens_counts_the_prefix_really_kept():
    eng = engine()
    assert eng.generate("0 1 2 3", max_tokens=3).stats.reused_prompt_tokens == 0
    assert eng.generate("0 1 2 5", max_tokens=3).stats.reused_prompt_tokens == 4   # BOS 0 1 2
    # BOS only in common: cut back to the canonical pieces (the fake's: 4), as a fresh prefill computes them
    assert eng.generate("4 4", max_tokens=3).stats.reused_prompt_tokens == 0
    assert eng.generate("4 4", max_tokens=3).stats.reused_prompt_tokens == 3        # an exact repeat


def test_each_drafter_says_what_its_rounds_cost():
    """by_drafter carries the seconds of the rounds each drafter chose (drafting and pass): they
    add up to no more than the decode phase, and (no constraint here) every round is counted once."""
    eng = engine(gamma=3)
    r = eng.generate("abcabcabc", max_tokens=24)
    parts = r.stats.by_drafter
    assert parts and all(v["seconds"] >= 0 for v in parts.values())
    assert sum(v["seconds"] for v in parts.values()) <= r.stats.decode_seconds + 1e-6
    assert sum(v["rounds"] for v in parts.values()) == r.stats.rounds


def test_the_fakes_implement_the_written_interfaces():
    """The test stand-ins are what the engine is written against: backend.Backend, drafters.Drafter."""
    from edgespec.backend import Backend, LlamaBackend
    from edgespec.drafters import Drafter
    from edgespec.drafters.auto import AutoDrafter
    from edgespec.drafters.copy import CopyDrafter
    from edgespec.drafters.model import ModelDrafter
    from edgespec.drafters.ngram import NgramDrafter
    fake = FakeBackend(np.zeros((4, 4), dtype=np.float32))
    assert isinstance(fake, Backend)
    missing = [m for m in ("eval_batch", "abort_when", "truncate", "keep_prefix", "copy_prefix", "held",
                           "sequence", "tokenize", "token_to_piece", "is_eog", "pos_max", "reset", "close")
               if not callable(getattr(LlamaBackend, m, None))]
    assert missing == []
    for cls in (ModelDrafter, NgramDrafter, CopyDrafter, AutoDrafter):
        assert issubclass(cls, Drafter) and cls.forks
    assert Drafter().plan([1], 4, None, None).tokens == []  # the default drafts nothing


def test_a_stream_dropped_unclosed_ends_on_any_thread_without_a_deadlock():
    """A stream dropped unclosed inside a reference cycle (until f5ec0ac every stream was one, with
    its generator; still one held by an exception's traceback or an app's own objects) is ended by
    the collector on whatever thread allocates then. Once in the suite that was the loop thread
    inside `rounds.finish`, which holds its lock while it allocates; the stream's ending (its
    generator's `finally`) then waited for that lock forever. Closing the generator is what the
    collector does."""
    eng = engine()
    s = eng.stream("0", max_tokens=12)
    next(s)  # suspended inside its generator
    done = threading.Event()

    def inside_finish_the_collector_ends_the_stream():
        with rounds._finishing:  # as the loop holds it inside finish()
            s._gen.close()
        done.set()
    threading.Thread(target=inside_finish_the_collector_ends_the_stream, daemon=True).start()
    assert done.wait(10), "the stream's ending waited for a lock its own thread held"
    assert s.generation.finished
    assert eng.generate("0", max_tokens=4).tokens == [1, 2, 3, 4]  # the engine goes on
    eng.close()


def test_a_stream_left_by_a_break_gives_its_place_back_to_another_thread():
    """`for ev in eng.stream(...): break` drops the stream unclosed. The engine holds its place by
    a ticket with a weak reference, so the stream is freed at once and gives the place back: before,
    the engine held the stream itself, and with parallel=1 a request from another thread waited
    until the engine closed (a request from the same thread made it outdated instead)."""
    eng = Engine(PieceBackend(CHAIN), None, parallel=1)

    def read_one_event():
        for _ in eng.stream("0", max_tokens=12):
            break
    read_one_event()
    got = []
    t = threading.Thread(target=lambda: got.append(eng.generate("0", max_tokens=3).tokens), daemon=True)
    t.start()
    t.join(10)
    assert got == [[1, 2, 3]], "a request from another thread waited for a stream nobody holds"
    eng.close()


def _settled(stats, at_least=0, timeout=10.0):
    """stats.generated once it has reached `at_least` and stopped growing for 0.3 s (the loop is idle; a
    slow machine only makes this wait longer)."""
    import time
    last, since, end = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        n = stats.generated
        if n != last:
            last, since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - since > 0.3:
            return n
        time.sleep(0.01)
    return last


def test_a_stream_alone_reads_one_round_ahead_and_no_further():
    """Alone, a generation's next round runs while its reader takes the last one's tokens (issue 47), but no
    round runs while its queue holds more than the last round's tokens: a stream nobody reads stops with at
    most two rounds unread (one before the read-ahead)."""
    eng = engine(draft=False)  # plain decoding: a round commits one token
    s = eng.stream("0", max_tokens=40)
    it = iter(s)
    next(it)
    assert 2 <= _settled(s.stats, at_least=2) <= 3  # the token read, then one or two rounds (reader and loop race)
    assert 1 <= len(s.generation.out) <= 2
    for _ in range(5):
        next(it)
    assert 7 <= _settled(s.stats, at_least=7) <= 8
    assert 1 <= len(s.generation.out) <= 2
    s.close()


def test_beside_another_no_round_runs_ahead_of_a_reader():
    eng = Engine(PieceBackend(CHAIN, n_seq=2), None, parallel=2)
    a, b = eng.stream("0", max_tokens=40), eng.stream("1", max_tokens=40)
    next(iter(a))
    next(iter(b))
    na, nb = _settled(a.stats), _settled(b.stats)
    # each took part in the rounds the other's reads asked for, but none ran for a queue already holding tokens
    assert max(len(a.generation.out), len(b.generation.out)) <= 2 and na <= 3 and nb <= 3
    a.close()
    b.close()
