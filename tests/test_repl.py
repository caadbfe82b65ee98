"""The interactive chat (edgespec.cli.repl), driven in-process with scripted lines: /commands never
reach the model, /clear and /system start a new conversation, Ctrl-C during an answer stops that
answer only, Ctrl-D and /exit end the chat with status 0; and the progress a first run shows
before the banner (a fixed total that reaches 100%, a line that is always ended)."""
import copy
import io
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgespec import calibrate
from edgespec.frontend import ProgressBar
from edgespec.progress import Progress
from edgespec.cli.repl import chat

from fakes import FakeBackend


class Tty(io.StringIO):
    def isatty(self):
        return True


class FakeStream:
    """Stream's surface: events, cancel(), close() through `with`, text, stats, finish_reason.
    `during(i)` runs before the i-th piece (to raise KeyboardInterrupt or SIGINT there)."""

    def __init__(self, pieces, during=None):
        self.pieces, self.during = list(pieces), during
        self.cancelled = self.closed = False
        self.finish_reason = None
        self._text = []
        self.stats = SimpleNamespace(summary=lambda: "fake stats line")

    @property
    def text(self):
        return "".join(self._text)

    def cancel(self):
        self.cancelled = True

    def __iter__(self):
        for i, piece in enumerate(self.pieces):
            if self.during:
                self.during(i)
            if self.cancelled:  # the engine checks at the start of each round
                self.finish_reason = "cancelled"
                break
            self._text.append(piece)
            yield SimpleNamespace(text=piece, token=i, from_draft=False)
        else:
            self.finish_reason = "eos"
        yield SimpleNamespace(text="", token=None, from_draft=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


class FakeEngine:
    """Records the messages of every stream_chat; answers "answer N" (or what `script` gives)."""

    def __init__(self, script=None):
        self.calls, self.streams, self.script = [], [], script or {}
        self.target, self.mode = SimpleNamespace(path=Path("fake-model.gguf")), "none"

    def stream_chat(self, messages, request=None):
        self.calls.append(copy.deepcopy(messages))
        n = len(self.calls)
        pieces, during = self.script.get(n, ([f"answer {n}"], None))
        self.streams.append(FakeStream(pieces, during))
        return self.streams[-1]


def lines(*items):
    """read() for chat(): each item is a line, or an exception class to raise (EOFError: Ctrl-D,
    KeyboardInterrupt: Ctrl-C); reading past the script fails the test."""
    items = list(items)
    prompts = []

    def read(prompt):
        prompts.append(prompt)
        if not items:
            raise AssertionError("the chat read past the end of the script")
        item = items.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item
    read.left, read.prompts = items, prompts
    return read


def run(engine, read, **kw):
    out, err = io.StringIO(), io.StringIO()
    code = chat(engine, read=read, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def users(call):
    return [m["content"] for m in call if m["role"] == "user"]


# -- commands ---------------------------------------------------------------------------------
def test_help_and_unknown_commands_never_reach_the_model_and_exit_ends_with_status_0():
    eng = FakeEngine()
    read = lines("/help", "/?", "/frobnicate now", "hello", "/exit", "never read")
    code, out, err = run(eng, read)
    assert code == 0
    assert eng.calls == [[{"role": "user", "content": "hello"}]]
    assert read.left == ["never read"]
    assert err.count("/clear") == 2 and "/bye" in err and "Ctrl-C" in err  # /help and /? both listed them
    assert "unknown command /frobnicate" in err
    assert "answer 1" in out and "fake stats line" in err
    assert "fake-model.gguf" in err.splitlines()[0] and "/help" in err.splitlines()[0]


@pytest.mark.parametrize("word", ["/bye", "/quit", "/EXIT"])
def test_every_exit_word_ends_the_chat(word):
    eng = FakeEngine()
    read = lines(word, "never read")
    assert run(eng, read)[0] == 0
    assert eng.calls == [] and read.left == ["never read"]


def test_clear_starts_a_new_conversation_that_keeps_the_system_message():
    eng = FakeEngine()
    code, _, err = run(eng, lines("one", "two", "/clear", "three", EOFError), system="Be brief.")
    sys_msg = {"role": "system", "content": "Be brief."}
    assert code == 0
    assert eng.calls == [
        [sys_msg, {"role": "user", "content": "one"}],
        [sys_msg, {"role": "user", "content": "one"}, {"role": "assistant", "content": "answer 1"},
         {"role": "user", "content": "two"}],
        [sys_msg, {"role": "user", "content": "three"}],
    ]


def test_system_sets_the_message_and_clears_undo_forgets_the_last_turn_stats_toggles():
    eng = FakeEngine()
    code, _, err = run(eng, lines("one", "/system You are a pirate.", "two", "three", "/undo", "/stats",
                                  "four", "/system", EOFError))
    assert code == 0
    pirate = {"role": "system", "content": "You are a pirate."}
    assert eng.calls[1] == [pirate, {"role": "user", "content": "two"}]
    assert eng.calls[3][0] == pirate and users(eng.calls[3]) == ["two", "four"]  # "three" forgotten
    assert err.count("fake stats line") == 3  # not after "four": /stats turned it off
    assert "system message: You are a pirate." in err


def test_a_doubled_slash_sends_a_line_starting_with_a_slash_and_slash_space_is_sent_as_is():
    eng = FakeEngine()
    run(eng, lines("//etc/hosts is what?", "/ is the root", EOFError))
    assert [users(c)[-1] for c in eng.calls] == ["/etc/hosts is what?", "/ is the root"]


def test_triple_quotes_send_several_lines_as_one_message():
    eng = FakeEngine()
    read = lines('"""first line', "second line", 'third"""', EOFError)
    run(eng, read)
    assert users(eng.calls[0]) == ["first line\nsecond line\nthird"]
    assert read.prompts[1] == "... "


# -- keys -------------------------------------------------------------------------------------
def test_ctrl_d_at_the_prompt_exits_0():
    eng = FakeEngine()
    code, out, err = run(eng, lines(EOFError))
    assert (code, out, eng.calls) == (0, "\n", [])


def test_ctrl_c_at_an_empty_prompt_quits_and_on_a_typed_line_discards_it():
    eng = FakeEngine()
    typed = iter(["half a que", ""])
    read = lines(KeyboardInterrupt, "hello", KeyboardInterrupt, "never read")
    code, _, _ = run(eng, read, typed=lambda: next(typed))
    assert code == 0
    assert [users(c) for c in eng.calls] == [["hello"]]
    assert read.left == ["never read"]


def _interrupt(at):
    def during(i):
        if i == at:
            raise KeyboardInterrupt
    return during


def test_a_keyboard_interrupt_while_streaming_stops_the_answer_and_the_next_message_is_answered():
    eng = FakeEngine({1: (["Once ", "upon ", "a ", "time"], _interrupt(2))})
    read = lines("tell a story", "say hi", EOFError)
    code, out, err = run(eng, read)
    assert code == 0 and read.left == []
    assert "Once upon " in out and "time" not in out and "(stopped)" in err
    assert eng.streams[0].closed  # the stream was closed: the engine is free for the next request
    # the stopped turn is left out of the conversation; the next question is answered
    assert eng.calls[1] == [{"role": "user", "content": "say hi"}]
    assert out.rstrip().endswith("answer 2")


def test_ctrl_c_while_streaming_cancels_the_stream_and_the_handler_is_put_back():
    """A real SIGINT during the answer: the chat's handler cancels the stream (the engine then
    ends it within a round) instead of raising in the middle of the engine's work."""
    before = signal.getsignal(signal.SIGINT)
    eng = FakeEngine({1: (["a ", "b ", "c ", "d "], lambda i: i == 1 and signal.raise_signal(signal.SIGINT))})
    code, out, err = run(eng, lines("go", "again", EOFError))
    assert code == 0
    assert eng.streams[0].cancelled and eng.streams[0].finish_reason == "cancelled"
    assert "a " in out and "c " not in out and "(stopped)" in err
    assert users(eng.calls[1]) == ["again"]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_library_error_in_one_turn_is_reported_and_the_chat_goes_on():
    from edgespec.errors import ContextLengthError

    class Full(FakeEngine):
        def stream_chat(self, messages, request=None):
            if len(self.calls) == 0:
                self.calls.append(copy.deepcopy(messages))
                raise ContextLengthError("the prompt is too long", prompt_tokens=9, n_ctx=8)
            return super().stream_chat(messages, request)
    eng = Full()
    code, out, err = run(eng, lines("too long", "short", EOFError))
    assert code == 0 and "/clear" in err and "too long" in err
    assert eng.calls[1] == [{"role": "user", "content": "short"}]


# -- the real model ---------------------------------------------------------------------------
class SigintAfter(io.StringIO):
    """stdout that presses Ctrl-C (a real SIGINT) after `n` pieces of the first answer."""

    def __init__(self, n):
        super().__init__()
        self.n, self.pieces = n, 0

    def write(self, s):
        self.pieces += 1
        if self.pieces == self.n:
            signal.raise_signal(signal.SIGINT)
        return super().write(s)


def test_real_model_ctrl_c_stops_the_answer_and_the_next_message_is_answered(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    from edgespec import Engine
    from edgespec.request import Request
    with Engine.load(str(smol), drafter="ngram", n_ctx=1024) as eng:
        seen = []
        real = eng.stream_chat

        def recording(messages, request=None):
            seen.append(copy.deepcopy(messages))
            stream = real(messages, request)
            seen[-1] = (seen[-1], stream)
            return stream
        eng.stream_chat = recording
        out, err = SigintAfter(4), io.StringIO()
        code = chat(eng, Request.build(max_tokens=48), read=lines("Write a long story about a fox.",
                                                                  "/help", "Say hello.", EOFError),
                    out=out, err=err)
        assert code == 0, err.getvalue()
        (first, s1), (second, s2) = seen
        assert s1.finish_reason == "cancelled" and 0 < s1.stats.generated < 48
        assert "(stopped)" in err.getvalue()
        assert second == [{"role": "user", "content": "Say hello."}]
        assert s2.finish_reason in ("eos", "length") and s2.text.strip()
        assert s2.text in out.getvalue() and "tok/s" in err.getvalue()


# -- progress before the banner ---------------------------------------------------------------
class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class Timed(FakeBackend):
    """Each eval advances the fake clock; `slow(n, rows)` multiplies the n-th one."""

    def __init__(self, clock, slow):
        super().__init__(np.zeros((8, 8), np.float32), n_ctx=512)
        self.clock, self.slow, self.threads, self.n = clock, slow, 2, 0

    def eval(self, tokens, rows):
        rows = list(rows)
        self.n += 1
        self.clock.t += 0.06 * (1 + 0.75 * (len(rows) - 1)) * self.slow(self.n, len(rows))
        return super().eval(tokens, rows)


class Meter:
    """Other processes' load as scripted: one reading after the warm-up, then one per sweep."""

    def __init__(self, readings=()):
        self.readings = list(readings)

    def reset(self):
        pass

    def others(self):
        return self.readings.pop(0) if self.readings else 0.0


def _reports(slow=lambda n, rows: 1.0, readings=(), **kw):
    clock, seen = Clock(), []
    calibrate.measure(Timed(clock, slow), clock=clock, meter=Meter(readings), sleep=lambda s: None,
                      progress=lambda d, t, detail: seen.append((d, t, detail)), **kw)
    return seen


@pytest.mark.parametrize("case", ["quiet", "sweeps measured again", "time budget cuts it short"])
def test_calibration_progress_has_its_total_from_the_first_report_and_ends_at_100_percent(case):
    if case == "quiet":
        seen = _reports()
    elif case == "sweeps measured again":  # two sweeps disturbed by other processes: two more
        seen = _reports(readings=[0.0, 1e3, 1e3, 0.0, 0.0])
    else:
        seen = _reports(time_budget=0.5)
    total = seen[0][1]
    assert all(t == total for _, t, _ in seen), "the total changed after the first report"
    done = [d for d, _, _ in seen]
    assert done == sorted(done)
    assert done[-1] == total and all(d < total for d in done[:-1])
    if case == "sweeps measured again":
        assert len(seen) > total  # more passes than planned, and still no report beyond 100%
    if case == "time budget cuts it short":
        assert len(seen) < total  # stopped early, and still a last report at 100%


def test_a_progress_line_is_ended_before_the_banner_and_a_finished_one_is_not_ended_twice():
    err = Tty()
    bar = ProgressBar(err)
    bar(Progress("calibrate", 5, 37, "steps", "warming up"))
    assert not err.getvalue().endswith("\n")
    chat(FakeEngine(), read=lines(EOFError), out=io.StringIO(), err=err)
    text = err.getvalue()
    assert "\nedgespec chat with fake-model.gguf" in text and "5/37\n" in text.replace(" ", "")

    err = Tty()
    bar = ProgressBar(err)
    bar(Progress("calibrate", 37, 37, "steps", "done"))
    assert err.getvalue().endswith("\n")
    ProgressBar.finish_open()
    assert err.getvalue().count("\n") == 1


def test_another_task_ends_the_open_line_first():
    err = Tty()
    bar = ProgressBar(err)
    bar(Progress("download", 2**20, None, "bytes", "x.gguf"))
    bar(Progress("verify", 0, 2**20, "bytes", "x.gguf"))
    first, second = err.getvalue().split("\n")
    assert "downloading" in first and "checking sha256" in second
