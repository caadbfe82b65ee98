"""The interactive chat of `python -m edgespec run` on a terminal, as `ollama run` and
`llama-cli` behave: line editing and history (the standard library's readline, where there is
one), /commands that never reach the model, Ctrl-C that stops an answer and not the chat.

Keys: Ctrl-C while an answer streams stops it (the engine cancels it within a round, so its
caches stay consistent) and the prompt comes back; the stopped turn, question and partial
answer, is left out of the conversation (ollama leaves the partial answer out too; the question
goes with it so that user and assistant still alternate, as strict chat templates demand: Up
recalls it). Ctrl-C while typing discards the line, as a shell (and ollama) do; Ctrl-C at an
empty prompt, Ctrl-D, /exit, /bye or /quit end the chat with exit status 0. (Without readline,
on Windows, what was typed is unknown: Ctrl-C at the prompt always ends the chat.)
"""
from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

try:  # line editing and history; missing on Windows without pyreadline
    import readline
except ImportError:  # pragma: no cover
    readline = None

from ..errors import ContextLengthError, EdgespecError, UsageError
from ..frontend import PROG, ProgressBar, _check_arg_text

__all__ = ["chat", "COMMANDS"]

HISTORY_LINES = 1000  # lines kept in the history file
PROMPT, MORE = "> ", "... "

COMMANDS = {  # name: (usage, what it does); aliases share an entry's text
    "/help": ("/help, /?", "this list"),
    "/exit": ("/exit, /bye, /quit", "end the chat (so do Ctrl-D and Ctrl-C at an empty prompt)"),
    "/clear": ("/clear", "start a new conversation (the system message stays)"),
    "/undo": ("/undo", "forget the last question and its answer"),
    "/system": ("/system [TEXT]", "set the system message and start a new conversation; alone: show it"),
    "/stats": ("/stats", "turn the statistics line after each answer off or on"),
}
ALIASES = {"/?": "/help", "/bye": "/exit", "/quit": "/exit"}

HELP_TAIL = """\
Ctrl-C stops an answer; the stopped turn is left out of the conversation (Up recalls it).
Up and Down walk the history, Tab completes a /command.
\"\"\" starts a message of several lines, ended by a line that ends with \"\"\".
A line starting with // sends the rest with one slash (//etc/hosts sends /etc/hosts);
"/ " (slash, space) is sent as it is. Any other line starting with / is a command."""


def _help() -> str:
    width = max(len(u) for u, _ in COMMANDS.values())
    return "\n".join([f"  {u:<{width}}  {what}" for u, what in COMMANDS.values()] + [HELP_TAIL])


def _history_path() -> Path:
    from ..registry import cache_dir
    return cache_dir() / "chat_history"


@contextmanager
def _line_editing(history: Optional[Path]):
    """readline for the session: completion of /commands and a bounded history file, read at
    the start and written at the end (a file that cannot be read or written is ignored)."""
    if readline is None:
        yield
        return
    old_completer = readline.get_completer()
    old_delims = readline.get_completer_delims()
    names = sorted(set(COMMANDS) | set(ALIASES))

    def complete(text, state):
        hits = [n for n in names if n.startswith(text)] if text.startswith("/") else []
        return hits[state] if state < len(hits) else None
    try:
        readline.set_completer(complete)
        readline.set_completer_delims(" \t\n")
        if "libedit" in (readline.__doc__ or ""):  # macOS's readline is libedit
            readline.parse_and_bind("bind ^I rl_complete")
        else:
            readline.parse_and_bind("tab: complete")
        readline.set_history_length(HISTORY_LINES)
        if history is not None:
            try:  # a regular file only: a FIFO there would hang the start
                if stat.S_ISREG(os.stat(history).st_mode):
                    readline.read_history_file(str(history))
            except (OSError, ValueError):
                pass
    except Exception:  # a readline that refuses a setting still edits lines
        pass
    try:
        yield
    finally:
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(str(history))
            except (OSError, ValueError):
                pass
        try:
            readline.set_completer(old_completer)
            readline.set_completer_delims(old_delims)
        except Exception:
            pass


def _typed() -> str:
    """What the line held when Ctrl-C came ('' when unknown, or without readline)."""
    if readline is None:
        return ""
    try:
        return readline.get_line_buffer()
    except Exception:
        return ""


@contextmanager
def _ctrl_c_cancels(stream):
    """While an answer streams, the first Ctrl-C cancels it (the engine ends the generation at
    the next round, with finish reason "cancelled" and its caches consistent); another one
    raises KeyboardInterrupt as usual. Outside the main thread signals cannot be caught: there
    a KeyboardInterrupt stops the answer (the caller catches it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []

    def handler(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(1)
        stream.cancel()
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except (ValueError, OSError):  # pragma: no cover
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _Quit(Exception):
    pass


class _Chat:
    def __init__(self, engine, request, system, show_drafts, read, typed, out, err):
        self.engine, self.request, self.show_drafts = engine, request, show_drafts
        self.read, self.typed, self.out, self.err = read, typed, out, err
        self.system = system
        self.messages: list[dict] = []
        self.stats = True
        self.clear()

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    # -- reading ----------------------------------------------------------------------------
    def line(self) -> Optional[str]:
        """The next message or command; None for a line to ignore. Raises _Quit."""
        try:
            text = self.read(PROMPT)
        except EOFError:  # Ctrl-D
            self.out.write("\n")
            raise _Quit from None
        except KeyboardInterrupt:
            if self.typed().strip():  # a shell's Ctrl-C: the line is dropped, a new prompt comes
                self.out.write("\n")
                return None
            self.out.write("\n")
            raise _Quit from None
        if text.lstrip().startswith('"""'):
            return self.more(text.lstrip()[3:])
        return text

    def more(self, first: str) -> Optional[str]:
        """A message of several lines between triple quotes (as ollama reads them)."""
        lines, text = [], first
        while True:
            end = text.rstrip()
            if end.endswith('"""'):
                lines.append(end[:-3])
                return "\n".join(lines)
            lines.append(text)
            try:
                text = self.read(MORE)
            except EOFError:
                self.out.write("\n")
                raise _Quit from None
            except KeyboardInterrupt:  # the whole message is dropped
                self.out.write("\n")
                return None

    # -- commands ---------------------------------------------------------------------------
    def command(self, text: str) -> None:
        name, _, rest = text.strip().partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        rest = rest.strip()
        if name == "/help":
            self.say(_help())
        elif name == "/exit":
            raise _Quit
        elif name == "/clear":
            self.clear()
            self.say("(new conversation)")
        elif name == "/undo":
            for i in range(len(self.messages) - 1, -1, -1):
                if self.messages[i]["role"] == "user":
                    del self.messages[i:]
                    self.say("(the last question and its answer are forgotten)")
                    return
            self.say("(nothing to undo)")
        elif name == "/system":
            if not rest:
                self.say(f"system message: {self.system}" if self.system else "(no system message)")
                return
            try:
                _check_arg_text("the system message", rest)
            except UsageError as exc:
                self.say(f"{PROG}: {exc}")
                return
            self.system = rest
            self.clear()
            self.say("(system message set, new conversation)")
        elif name == "/stats":
            self.stats = not self.stats
            self.say(f"(statistics {'on' if self.stats else 'off'})")
        else:
            self.say(f"unknown command {name}: /help lists the commands; start a line with // "
                     "to send one beginning with /")

    # -- answering --------------------------------------------------------------------------
    def echo(self, ev) -> None:
        text = ev.text
        if self.show_drafts and ev.from_draft and text:
            text = f"\033[32m{text}\033[0m"
        self.out.write(text)
        self.out.flush()

    def answer(self, user: str) -> None:
        turn = self.messages + [{"role": "user", "content": user}]
        try:
            stream = self.engine.stream_chat(turn, self.request)
        except ContextLengthError as exc:
            self.say(f"{PROG}: {exc} (/clear starts a new conversation, /undo forgets the last turn)")
            return
        except EdgespecError as exc:
            self.say(f"{PROG}: error: {exc}")
            return
        stopped = False
        try:
            with stream, _ctrl_c_cancels(stream):
                try:
                    for ev in stream:
                        self.echo(ev)
                except KeyboardInterrupt:
                    stopped = True
        except EdgespecError as exc:
            self.out.write("\n")
            self.out.flush()
            self.say(f"{PROG}: error: {exc}")
            return
        stopped = stopped or stream.finish_reason == "cancelled"
        self.out.write("\n")
        self.out.flush()
        if stopped:
            self.say("(stopped)")
            return
        if self.stats:
            self.say(stream.stats.summary())
        self.messages = turn + [{"role": "assistant", "content": stream.text}]

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        while True:
            try:
                text = self.line()
                if text is None or not text.strip():
                    continue
                if text.startswith("//"):
                    text = text[1:]
                elif text.startswith("/") and not text.startswith("/ ") and text.strip() != "/":
                    self.command(text)
                    continue
                try:
                    _check_arg_text("the message", text)
                except UsageError as exc:
                    self.say(f"{PROG}: {exc}")
                    continue
                self.answer(text)
            except _Quit:
                return 0


def chat(engine, request=None, *, system: Optional[str] = None, show_drafts: bool = False,
         read: Optional[Callable[[str], str]] = None, typed: Optional[Callable[[], str]] = None,
         history: Optional[Path] = None, out=None, err=None) -> int:
    """Chat with `engine` until the user quits; returns the exit status (0).

    `read(prompt)` reads a line (default: input(), with readline's editing and a history kept
    in ~/.cache/edgespec/chat_history unless `history` names another file); `typed()` says
    what the line held when Ctrl-C came (default: readline's buffer). Answers go to `out`
    (stdout), notices, statistics and the banner to `err` (stderr)."""
    out = out or sys.stdout
    err = err or sys.stderr
    ProgressBar.finish_open()  # a progress line left open must not swallow the banner
    name = getattr(getattr(engine.target, "path", None), "name", None) or "the model"
    print(f"{PROG} chat with {name} (drafter {engine.mode}): type /help for commands, Ctrl-D to quit",
          file=err, flush=True)
    session = _Chat(engine, request, system, show_drafts, read or input, typed or _typed, out, err)
    if read is not None:  # a caller's reader: no terminal, no history file
        return session.run()
    with _line_editing(history or _history_path()):
        return session.run()
