"""The speculative loop: draft, verify in one target pass, commit, cut the KV cache back.

The engine knows a target backend and one drafter (see `drafters`); how the two were chosen
and loaded is `assemble.py`'s business. One generation runs at a time: concurrent requests
wait their turn, `cancel()` ends the running one within a round, `close()` frees the models.
"""
from __future__ import annotations

import codecs
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .drafters import NO_DRAFT, Draft, Round
from .errors import (BackendError, ConstraintError, ContextLengthError, DamagedModelError, EdgespecError,
                     EngineClosedError, UsageError)
from .constraints import Guide, mask_logits, tokenizer_for
from .request import Request, check_text
from .sampling import verify, verify_greedy, warp
from .tools import StreamParser

FINISH_REASONS = ("eos", "length", "stop", "context", "cancelled")


@dataclass
class GenerationStats:
    drafter: str
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0   # prompt positions found in the KV cache from an earlier request
    restored_prompt_tokens: int = 0  # ... of which came back from the prompt cache (an earlier conversation)
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0                 # accepted tokens a constraint forced (drafts of source "grammar")
    rounds: int = 0
    target_forwards: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # [n] = rounds that accepted n drafts
    by_drafter: dict = field(default_factory=dict)  # source -> {"rounds", "drafted", "accepted"}
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    costs: dict = field(default_factory=dict)  # auto: where its cost figures came from

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode phase only: the tokens after the first (which the prompt's own pass yields) over
        the time after the prompt was processed; 0 when there is no such token."""
        return (self.generated - 1) / self.decode_seconds if self.generated > 1 and self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["tokens_per_second"] = round(self.tokens_per_second, 2)
        return d

    def summary(self) -> str:
        rate = f"{self.tokens_per_second:.1f} tok/s" if self.generated > 1 else "no decode rate from one token"
        s = (f"{self.generated} token{'s' if self.generated != 1 else ''}, {rate}, "
             f"prompt {self.prompt_tokens} tok in {self.prompt_seconds:.2f}s, "
             f"{self.target_forwards} target passes, drafter {self.drafter}")
        if self.drafted:
            s += f", accepted {self.accepted}/{self.drafted} ({100 * self.acceptance_rate:.0f}%)"
        if self.drafter == "auto":
            parts = (f"{k}: {v['rounds']} rounds" + (f" {v['accepted']}/{v['drafted']}" if v["drafted"] else "")
                     for k, v in sorted(self.by_drafter.items()))
            s += " [" + ", ".join(parts) + "]"
        if self.finish_reason == "cancelled":
            s += ", cancelled"
        return s


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats
    tool_calls: list = field(default_factory=list)  # tools.ToolCall: id, name, arguments (a dict)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.stats.finish_reason


@dataclass(frozen=True)
class StreamEvent:
    text: str                     # text that became printable with this token (may be empty)
    token: Optional[int]          # None in the closing event
    from_draft: bool              # the token was a draft the target accepted
    finish_reason: Optional[str] = None  # set on the closing event only: why generation ended
    tool_calls: Optional[list] = None    # the closing event of a request with tools: its calls


_rng = np.random.default_rng  # the loop's source of randomness (tests enumerate every draw through it)


def _stop_prefix(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string: they are
    held back until the next token says whether the stop string follows."""
    for k in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stop):
            return k
    return 0


def _no_control_text(messages, specials) -> None:
    """Tool-call names, ids and arguments reach the template outside the message contents (which
    are tokenized as plain text): control-token text there would open turns of its own."""
    import json
    for i, m in enumerate(messages):
        fields = [str(m.get("tool_call_id") or "")]
        for c in m.get("tool_calls") or ():
            fields.append(json.dumps(c, ensure_ascii=False))
        for text in fields:
            hit = next((sp for sp in specials if sp in text), None)
            if hit is not None:
                raise UsageError(f"message {i} has the control token {hit!r} in a tool call's name, id or arguments: "
                                 "remove it")


def _legal(draft: Draft, guide: Guide) -> Draft:
    """The draft cut at its first token the constraint forbids."""
    n = guide.legal_prefix(draft.tokens)
    if n == len(draft.tokens):
        return draft
    return Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n], draft.source)


def _only_eog(guide: Guide, target) -> bool:
    """The constraint allows nothing but end-of-generation next (and is not complete)."""
    return all(target.is_eog(int(t)) for t in np.flatnonzero(guide.allowed())[:64])


def _pad(rows: np.ndarray, width: int) -> np.ndarray:
    if rows.shape[1] == width:
        return rows
    out = np.full((rows.shape[0], width), -np.inf, dtype=np.float32)
    out[:, : rows.shape[1]] = rows[:, :width]
    return out


@dataclass
class ChatPrompt:
    """A request ready to stream: its prompt tokens, checked, and its compiled constraint."""
    tokens: list[int]
    request: "Request"
    format: object = None      # tools.Format when the request had tools
    dropped: int = 0           # messages left out (overflow="drop-oldest")
    guide: Optional[Guide] = None


class Stream:
    """One request's events, as they are committed. `stats` and `finish_reason` are the
    request's own; `cancel()` ends it within a round; `close()` gives the engine back."""

    def __init__(self, engine: "Engine", gen: Iterator[StreamEvent], stats: GenerationStats):
        self._engine = engine
        self._gen = gen
        self.stats = stats
        self.tokens: list[int] = []
        self._text: list[str] = []
        self._cancel = threading.Event()
        self._outdated: Optional[EdgespecError] = None  # raised when resumed
        self._thread = threading.get_ident()
        self._tools = None          # a tools.StreamParser when the request had tools
        self.tool_calls: list = []

    @property
    def finish_reason(self) -> Optional[str]:
        """Why it ended ("tool_calls" when the answer called tools), None while it runs."""
        if self.tool_calls:
            return "tool_calls"
        return self.stats.finish_reason or None

    @property
    def text(self) -> str:
        return "".join(self._text)

    def cancel(self) -> None:
        self._cancel.set()

    def __iter__(self):
        return self

    def __next__(self) -> StreamEvent:
        if self._outdated:
            raise self._outdated
        with self._engine._work:
            if self._outdated:
                raise self._outdated
            try:
                ev = next(self._gen)
            except BaseException:
                self._release()
                raise
        if ev.token is not None:
            self.tokens.append(ev.token)
        if self._tools is not None:  # markup held back; calls on the closing event
            shown = self._tools.feed(ev.text)
            if ev.token is None:
                rest, self.tool_calls = self._tools.finish()
                shown += rest
                ev = StreamEvent(shown, None, False, "tool_calls" if self.tool_calls else ev.finish_reason,
                                 list(self.tool_calls))
            else:
                ev = StreamEvent(shown, ev.token, ev.from_draft)
        self._text.append(ev.text)
        return ev

    def result(self) -> GenerationResult:
        """Run the request to its end (if it has not ended) and return its result."""
        for _ in self:
            pass
        text = self.text.strip() if self.tool_calls and not self.text.strip() else self.text
        return GenerationResult(text, list(self.tokens), self.stats, list(self.tool_calls))

    def close(self) -> None:
        """Stop here; the engine serves the next request."""
        if self._outdated is None:
            with self._engine._work:
                self._gen.close()
        self._release()

    def _release(self) -> None:
        self._engine._release(self)

    def _invalidate(self, error: EdgespecError) -> None:
        self._outdated = error
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._engine._release(self)
        except Exception:
            pass


class Engine:
    """A target model and one drafter. Use `Engine.load` to build one from GGUF files."""

    def __init__(self, target, drafter=None, cache=None):
        """`target`: a backend (see backend.LlamaBackend); `drafter`: a `Drafter` or None
        for plain decoding; `cache`: a `promptcache.PromptCache` for conversations that come
        back (None: only the last request's KV cache is kept)."""
        self.target = target
        self.drafter = drafter
        self.n_vocab = max(target.n_vocab, getattr(getattr(drafter, "model", drafter), "n_vocab", 0) or 0)
        if drafter is not None and not target.can_truncate:
            raise UsageError(f"{target.path.name} is a recurrent or hybrid model whose cache cannot be "
                             "cut back after a rejected draft: speculation is impossible, use --drafter none")
        self._slot = threading.Condition()   # who may generate now
        self._active: Optional[Stream] = None
        self._work = threading.RLock()       # held while a backend is in use
        self._closed = False
        self._readers = 0                    # threads tokenizing now (see _reading)
        self._prompt_row: Optional[tuple[tuple[int, ...], np.ndarray]] = None
        self.cache = cache
        self._restored = 0

    @property
    def mode(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    @classmethod
    def load(cls, target: Optional[str] = None, draft: Optional[str] = None, drafter: str = "auto", *,
             download: bool = True, calibrate: str = "auto", progress=None, **settings) -> "Engine":
        """Load a target (GGUF path or models.toml pair name; None = the default pair) and its
        drafter. `settings` are `assemble.Settings`' fields (n_ctx=4096, threads, n_gpu_layers=-1,
        draft_n_gpu_layers=-1, gamma=4, memory_budget, cache_ram, models_file, verbose...).
        `download=False` refuses to fetch missing files; `calibrate` is "auto" (measure this
        device once, then use the cached figures), "now" (measure again) or "never" (cached
        figures or cautious defaults that the engine corrects as it runs); `progress` receives
        `progress.Progress` reports for downloads and calibration."""
        from .assemble import Settings
        known = Settings.__dataclass_fields__
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise UsageError(f"unknown setting {unknown[0]!r}; the settings are {', '.join(known)}")
        return cls.from_settings(Settings(target=target, draft=draft, drafter=drafter, **settings),
                                 download=download, calibrate=calibrate, progress=progress)

    @classmethod
    def from_settings(cls, settings, *, download: bool = True, calibrate: str = "auto", progress=None
                      ) -> "Engine":
        """An Engine for an `assemble.Settings` (the CLI, the server and the benchmarks build one)."""
        from .assemble import load_parts
        from .selftest import ensure
        ensure()  # a build that crashes or computes wrong on this machine: one line, not SIGSEGV
        target, drafter, cache = load_parts(settings, download=download, calibrate=calibrate, progress=progress)
        try:
            return cls(target, drafter, cache)
        except BaseException:
            if drafter is not None:
                drafter.close()
            target.close()
            raise

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine is closed: load a new one with Engine.load")

    def reset(self) -> None:
        """Start the next generation from nothing: empty KV caches (no reused prompt prefix)
        and a drafter that forgets what earlier generations taught it."""
        with self._acquire(None):
            with self._work:
                self.target.reset()
                self._prompt_row = None
                if self.cache is not None:
                    self.cache.clear()
                if self.drafter is not None:
                    self.drafter.reset()

    def cancel(self) -> None:
        """End the running generation (from any thread) within one round; its finish reason
        is "cancelled". Does nothing when no generation runs."""
        active = self._active
        if active is not None:
            active.cancel()

    def close(self) -> None:
        """Cancel what runs, wait for its round to end, free the models. Idempotent."""
        with self._slot:
            if self._closed:
                return
            self._closed = True
            active = self._active
            if active is not None:
                active.cancel()
            self._slot.notify_all()
            while self._readers:  # a tokenization in progress reads the vocabulary about to be freed
                self._slot.wait()
        with self._work:
            if active is not None:
                active._invalidate(EngineClosedError("this engine was closed while the stream was open"))
                self._release(active)
            cache = self.cache
            if cache is not None and cache.disk is not None and getattr(self.target, "n_past", 0) >= 32:
                try:  # the conversation in the context, for the next start
                    cache.disk.put(self._save_slot())
                except Exception as exc:
                    import logging
                    logging.getLogger("edgespec").warning("prompt cache: could not save the last conversation: %s", exc)
            if self.drafter is not None:
                self.drafter.close()
            self.target.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one request at a time ------------------------------------------------------------
    class _Turn:
        def __init__(self, engine, stream):
            self.engine, self.stream = engine, stream

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.engine._release(self.stream)

    def _acquire(self, stream: Optional[Stream]) -> "_Turn":
        """Wait until no other thread's request runs; a request of this thread that is still
        open is made outdated (resuming it raises)."""
        me = threading.get_ident()
        with self._slot:
            while True:
                self._check_open()
                active = self._active
                if active is None:
                    break
                if active._thread == me:
                    active._invalidate(UsageError(
                        "this stream is outdated: another generation started on the same engine before it "
                        "finished; read streams to their end or close() them"))
                    self._active = None
                    break
                self._slot.wait()
            self._active = stream if stream is not None else _Placeholder(me)
        return self._Turn(self, self._active)

    def _release(self, stream) -> None:
        with self._slot:
            if self._active is stream:
                self._active = None
                self._slot.notify_all()

    # -- text in, text out ----------------------------------------------------------------
    @contextmanager
    def _reading(self):
        """The target's vocabulary, for tokenizing. Not under `_work`: llama.cpp's tokenizer only
        reads the vocabulary, so a long prompt is tokenized on its caller's thread while another
        request generates (a server tokenizes off its engine thread); close() waits for it."""
        with self._slot:
            self._check_open()
            self._readers += 1
        try:
            yield self.target
        finally:
            with self._slot:
                self._readers -= 1
                self._slot.notify_all()

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` with BOS (when the model uses one); `special=False` reads
        control-token text like "<|im_end|>" as plain text."""
        check_text("the prompt", text)
        with self._reading() as t:
            return t.tokenize(text, add_bos=True, special=special)

    def format_chat(self, messages) -> str:
        """The target's chat template applied to `messages` (list of {'role', 'content'})."""
        from .chat import render
        with self._reading():
            return render(self.target.chat_template(), messages, **self._template_tokens())

    def _template_tokens(self) -> dict:
        t = self.target
        return dict(bos_token=t.token_text(t.bos) if t.bos >= 0 else "",
                    eos_token=t.token_text(t.eos) if t.eos >= 0 else "")

    def _check_size(self, text: str) -> None:
        """Refuse, without tokenizing it, a text too long for the context whatever its tokens:
        each token covers at most the longest piece of the vocabulary (megabytes of text take
        seconds to tokenize)."""
        n_ctx, n = self.target.n_ctx, len(text)  # characters: at least a byte each
        if n <= n_ctx:
            return
        longest = getattr(self.target, "longest_piece", None)
        nbytes = len(text.encode("utf-8"))
        if longest is None:
            return
        with self._reading():  # it reads the vocabulary (once): close() must wait for it
            most = longest()
        if nbytes > n_ctx * most:
            raise ContextLengthError(f"the prompt is {nbytes:,} bytes, more than {n_ctx} tokens of this model can "
                                     "hold: shorten it or raise --ctx", prompt_tokens=nbytes // most, n_ctx=n_ctx)

    def prompt_tokens(self, prompt: Union[str, Sequence[int]], *, room: int = 1) -> list[int]:
        """The token ids `stream` would generate from, checked against the context with `room`
        tokens left for the answer (ContextLengthError): a text tokenized verbatim (BOS added,
        special tokens parsed), or token ids as they are. Safe to call from any thread, also
        while another request generates."""
        if isinstance(prompt, str):
            check_text("the prompt", prompt)
            self._check_size(prompt)
            tokens = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            tokens = [int(t) for t in prompt]
            if any(not 0 <= t < self.target.n_vocab for t in tokens):
                raise UsageError(f"prompt token ids must be in 0..{self.target.n_vocab - 1}")
        else:
            raise UsageError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return self._fits(tokens, room)

    def _fits(self, tokens: list[int], room: int = 1, what: str = "the prompt") -> list[int]:
        n_ctx = self.target.n_ctx
        if not tokens:
            raise UsageError("the prompt is empty after tokenization")
        room = max(1, room)
        if len(tokens) + room > n_ctx:
            answer = f" and its answer may take {room}" if room > 1 else ""
            raise ContextLengthError(f"{what} is {len(tokens)} tokens{answer}, but the context holds {n_ctx}: "
                                     "raise --ctx or shorten it", prompt_tokens=len(tokens), n_ctx=n_ctx, room=room)
        return tokens

    def conversation_tokens(self, messages, *, room: int = 1, overflow: str = "error", **extra
                            ) -> tuple[list[int], int]:
        """`chat_tokens` with `room` tokens left for the answer; a conversation that does not
        fit raises ContextLengthError, or with overflow="drop-oldest" loses its oldest turns
        (system messages stay, the last message too) until it fits. Returns (tokens, how many
        messages were dropped)."""
        if overflow not in ("error", "drop-oldest"):
            raise UsageError(f"overflow must be 'error' or 'drop-oldest', got {overflow!r}")
        messages = list(messages)
        dropped = 0
        while True:
            try:
                tokens = self.chat_tokens(messages, **extra)
                return self._fits(tokens, room, "the conversation"), dropped
            except ContextLengthError:
                keep = [i for i, m in enumerate(messages) if m.get("role") != "system"]
                if overflow == "error" or len(keep) <= 1:
                    raise
                first = keep[0]
                gone = 1
                if messages[first].get("tool_calls"):  # a call goes with the results that answer it
                    while first + gone < len(messages) - 1 and messages[first + gone].get("role") == "tool":
                        gone += 1
                del messages[first:first + gone]
                dropped += gone

    def prepare_chat(self, messages, request: Optional[Request] = None, *, room: Optional[int] = None,
                     overflow: str = "error") -> "ChatPrompt":
        """Everything a chat request needs before it waits for the engine: the prompt tokens
        (checked against the context with `room` tokens for the answer, default max_tokens; with
        overflow="drop-oldest" the oldest turns go), and with tools the request constrained to the
        model's own call format. Safe from any thread, as `prompt_tokens`."""
        from .chat import validate_messages
        from .tools import detect
        request = request or Request()
        messages = validate_messages(messages)  # before a format rewrites tool turns
        fmt = None
        if request.tools is not None or any(m.get("tool_calls") or m.get("role") == "tool"
                                            for m in messages if isinstance(m, dict)):
            with self._reading() as t:
                fmt = detect(t.chat_template())
                if fmt.name == "mistral":  # its marker is a control token: the grammar names it by id
                    ids = t.tokenize(fmt.TAG, add_bos=False, special=True)
                    fmt.marker_id = ids[0] if len(ids) == 1 else None
            messages, extra = fmt.render_messages(list(messages), request.tools)
            if request.tools is not None:
                grammar = fmt.grammar(request.tools)
                if grammar is not None:
                    from .constraints import Constraint
                    request = replace(request, constraint=Constraint.build(grammar=grammar))
        else:
            extra = {}
        tokens, dropped = self.conversation_tokens(messages, room=request.max_tokens if room is None else room,
                                                   overflow=overflow, **extra)
        calls = request.tools is not None and request.tools.choice != "none"  # none: text only, never parsed
        return ChatPrompt(tokens, request, fmt if calls else None, dropped, self.guide(request))

    def chat_tokens(self, messages, **extra) -> list[int]:
        """The prompt tokens for a conversation, checked against the context (UsageError).
        Message contents are tokenized as text: a message holding "<|im_end|>" cannot close
        its turn; only the template's own markers are control tokens. Roles must be system,
        user, assistant or tool. Safe to call from any thread, as `prompt_tokens`."""
        from .chat import render, render_segments, validate_messages
        messages = validate_messages(messages)
        with self._reading() as t:
            template, kw = t.chat_template(), dict(self._template_tokens(), **extra)
            text = render(template, messages, **kw)
            self._check_size(text)
            # usually no message holds control-token text, and the prompt is tokenized whole
            # (as llama.cpp does); otherwise piece by piece, contents as plain text
            specials = getattr(t, "special_texts", None)
            if specials is not None:
                specials = specials()
                _no_control_text(messages, specials)
                plain = not any(sp in m["content"] for m in messages for sp in specials)
            else:
                plain = all(t.tokenize(m["content"], add_bos=False, special=True)
                            == t.tokenize(m["content"], add_bos=False, special=False) for m in messages)
            if plain:
                tokens = t.tokenize(text, add_bos=True, special=True)
            else:
                tokens = t.tokenize("", add_bos=True, special=False)
                for piece, is_content in render_segments(template, messages, **kw):
                    tokens += t.tokenize(piece, add_bos=False, special=not is_content)
            if len(tokens) > 1 and tokens[0] == tokens[1] == t.bos:
                tokens = tokens[1:]  # the template wrote BOS and the tokenizer added one
        return self._fits(tokens, 1, "the conversation")

    # -- generation -----------------------------------------------------------------------
    # Options (or one `request=Request.build(...)`): max_tokens=128, temperature=0.0, top_k=0,
    # top_p=1.0, min_p=0.0, seed=None, stop=(), and at most one of json_schema (a dict or JSON
    # text), regex, grammar (Lark or GBNF): the answer then follows it (docs/structured-output.md).
    def generate(self, prompt: Union[str, Sequence[int]], request: Optional[Request] = None,
                 **options) -> GenerationResult:
        """Generate from a verbatim prompt (text, or token ids); waits while another request runs."""
        with self.stream(prompt, request, **options) as s:
            return s.result()

    def chat(self, messages, request: Optional[Request] = None, **options) -> GenerationResult:
        """`generate` for a conversation, through the target's chat template. With `tools`
        (OpenAI's list of functions) and `tool_choice` the answer may call them, in the model's
        own format: `result.tool_calls` (id, name, arguments as a dict), `result.text` the rest."""
        with self.stream_chat(messages, request, **options) as s:
            return s.result()

    def stream_chat(self, messages, request: Optional[Request] = None, **options) -> Stream:
        """`stream` for a conversation, through the target's chat template. With tools, call
        markup never reaches the events' text; the closing event carries `tool_calls`."""
        request = Request.of(request, options)
        return self.stream_prompt(self.prepare_chat(messages, request, room=1))

    def stream_prompt(self, prompt: "ChatPrompt") -> Stream:
        """`stream` for a conversation `prepare_chat` made ready (a server does that off its
        engine thread)."""
        stats = GenerationStats(drafter=self.mode, prompt_tokens=len(prompt.tokens))
        holder: list[Stream] = []
        # the guide was compiled with the prompt (off the engine thread, in a server); a matcher
        # follows one generation only, so a prepared prompt is streamed once
        guide, prompt.guide = prompt.guide, None
        if guide is None:
            guide = self.guide(prompt.request)
        stream = Stream(self, self._events(prompt.tokens, prompt.request, guide, stats, holder), stats)
        holder.append(stream)
        if prompt.format is not None:
            stream._tools = StreamParser(prompt.format, prompt.request.tools)
        self._acquire(stream)
        return stream

    def stream(self, prompt: Union[str, Sequence[int]], request: Optional[Request] = None, **options) -> Stream:
        """Yield tokens as they are committed, with the text each makes printable.

        A text prompt is tokenized verbatim (BOS added, special tokens parsed); a list of ints
        is taken as token ids. Generation ends at an end-of-generation token ("eos"), after
        `max_tokens` ("length"), at a stop string, not included ("stop"), when a constraint is
        complete ("stop"), when the context is full ("context") or on `cancel()`
        ("cancelled"). Each token's event comes as soon as it is committed; a closing event
        (token None) carries any text held back (the start of a possible stop string, an
        unfinished character) and the finish reason.
        """
        request = Request.of(request, options)
        return self.stream_prompt(self.prepare_prompt(prompt, request, room=1))

    def prepare_prompt(self, prompt: Union[str, Sequence[int]], request: Optional[Request] = None, *,
                       room: int = 1) -> "ChatPrompt":
        """`prepare_chat` for a verbatim prompt: its tokens checked against the context and the
        request's constraint compiled. Safe from any thread, as `prompt_tokens`."""
        request = request or Request()
        tokens = self.prompt_tokens(prompt, room=room)
        return ChatPrompt(tokens, request, guide=self.guide(request))

    def guide(self, request: Request) -> Optional[Guide]:
        """A fresh matcher for the request's constraint (None without one); UsageError when
        llguidance refuses it for this vocabulary. Safe from any thread, as `prompt_tokens`."""
        if request.constraint is None:
            return None
        with self._reading() as t:
            guide = Guide(request.constraint, tokenizer_for(t), self.n_vocab)
            if not guide.accepting and _only_eog(guide, t):  # llguidance compiles some dead grammars
                raise ConstraintError(f"the {request.constraint.describe()} admits no answer: no text can "
                                      "complete it (an unsatisfiable schema, regex or grammar)")
        return guide

    def _events(self, prompt_tokens, request: Request, guide, stats, holder) -> Iterator[StreamEvent]:
        """Token ids -> events with printable text, each as soon as it is committed; then one
        closing event (token None) with the text held back and the finish reason."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = ""        # decoded, not yet emitted
        stop = request.stop
        gen = self._loop(prompt_tokens, request, guide, stats, holder)
        try:
            for token, from_draft in gen:
                text += decoder.decode(self.target.token_to_piece(token))
                hit = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
                if hit >= 0:
                    stats.finish_reason = "stop"
                    yield StreamEvent(text[:hit], token, from_draft)
                    text = ""
                    break
                cut = len(text) - _stop_prefix(text, stop)
                yield StreamEvent(text[:cut], token, from_draft)
                text = text[cut:]
            else:
                text += decoder.decode(b"", final=True)
            yield StreamEvent(text, None, False, stats.finish_reason)
        finally:
            gen.close()
            if holder:
                self._release(holder[0])

    def _prefill(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Put the prompt in the target's cache; return its last row of logits and how many
        prompt positions were already in the cache. An exact
        repeat of the last prompt reuses that row, so it takes the same path as the first time
        (re-evaluating the last token alone would round differently)."""
        target = self.target
        restored = self._switch_slot(tokens)
        saved = self._prompt_row
        if (saved is not None and saved[0] == tuple(tokens) and target.n_past >= len(tokens)
                and target.tokens[:len(tokens)] == tokens and target.truncate(len(tokens))):
            self._restored = len(tokens) if restored else 0
            return saved[1], len(tokens)
        self._prompt_row = None
        # the whole rest of the prompt in one batch, as plain llama.cpp decoding does (a
        # token's KV depends, in its last bits, on the batch it was computed in)
        kept = target.keep_prefix(tokens)
        row = target.eval(tokens[kept:], [len(tokens) - kept - 1])
        self._check_finite(row)
        self._prompt_row = (tuple(tokens), row)
        self._restored = kept if restored else 0
        return row, kept

    # -- conversations that come back (promptcache.py) -------------------------------------
    def _draft_backend(self):
        d = self.drafter
        model = d if getattr(d, "name", None) == "model" else getattr(d, "model", None)
        return getattr(model, "backend", None)

    def _switch_slot(self, tokens: list[int]) -> bool:
        """Before a prompt is evaluated: keep the conversation in the context if the prompt
        continues it; otherwise save it to the prompt cache (when the prompt would throw much of
        it away) and restore the saved conversation the prompt continues best. True when a
        saved conversation was restored."""
        from .promptcache import MIN_TOKENS, common_prefix
        cache, target = self.cache, self.target
        if cache is None or (cache.capacity <= 0 and cache.disk is None) or not hasattr(target, "save_state"):
            return False
        head = tokens[:-1]  # the last prompt token is always evaluated (its row is needed)
        live = common_prefix(target.tokens, head)
        slot, n = cache.best(head)
        if cache.disk is not None:
            path, on_disk = cache.disk.best(head)
            if on_disk > max(n, live):
                loaded = cache.disk.load(path)  # None when damaged or foreign: refused, not loaded
                if loaded is not None:
                    slot, n = loaded, on_disk
                    slot.path = path
        restore = slot is not None and n > live
        if restore:
            cache.take(slot)  # before saving the live slot could evict it
        if target.n_past - live >= MIN_TOKENS or (restore and target.n_past >= MIN_TOKENS):
            self._stash()
        if restore:
            try:
                self._load_slot(slot)
            except BackendError:
                if getattr(slot, "path", None) is None:
                    raise
                cache.disk._refuse(slot.path)  # llama.cpp would not take it: never again
                target.reset()
                return False
        return restore

    def _stash(self) -> None:
        slot = self._save_slot()
        self.cache.put(slot)
        if self.cache.disk is not None:
            try:
                self.cache.disk.put(slot)
            except OSError as exc:  # a full disk costs the restart's prefill, not this request
                import logging
                logging.getLogger("edgespec").warning("prompt cache: could not write to %s: %s",
                                                      self.cache.disk.dir, exc)

    def _save_slot(self):
        from .promptcache import MIN_TOKENS, Slot, common_prefix
        toks, data = self.target.save_state()
        draft = self._draft_backend()
        # auto's draft model may hold another conversation (it catches up only when it drafts)
        dstate = (draft.save_state() if draft is not None
                  and common_prefix(draft.tokens, toks) >= min(MIN_TOKENS, draft.n_past) > 0 else None)
        return Slot(toks, data, dstate, self._prompt_row)

    def _load_slot(self, slot) -> None:
        self.target.load_state(slot.tokens, slot.target)
        draft = self._draft_backend()
        if draft is not None:
            try:
                if slot.draft is not None:
                    draft.load_state(*slot.draft)
                else:
                    draft.reset()
            except BackendError:  # a saved draft state of another draft model: it catches up instead
                draft.reset()
        self._prompt_row = slot.prompt_row

    def _check_finite(self, logits: np.ndarray) -> None:
        if len(logits) and not np.isfinite(logits.max(axis=1)).all():
            raise DamagedModelError(f"{self.target.path.name} produced non-finite logits (NaN): the file is damaged; "
                                    "download it again")

    def _loop(self, prompt_tokens: list[int], request: Request, guide: Optional[Guide], stats, holder
              ) -> Iterator[tuple[int, bool]]:
        """The speculative loop over token ids: yields (token, from_draft) as they are committed.

        Under a constraint (`guide`), each round drafts the tokens the grammar forces, then the
        drafter's legal continuation, and verifies them on masked rows; rows a mask decides
        alone (one legal token) are not asked of llama.cpp."""
        target, drafter = self.target, self.drafter
        params, max_tokens = request.params, request.max_tokens
        n_ctx = target.n_ctx
        rng = _rng(request.seed)
        tokens = list(prompt_tokens)
        t0 = time.perf_counter()
        self._restored = 0
        carry, stats.reused_prompt_tokens = self._prefill(tokens)
        stats.restored_prompt_tokens = self._restored
        stats.target_forwards += 1
        if drafter is not None:
            drafter.begin(tokens)
        t1 = time.perf_counter()
        stats.prompt_seconds = t1 - t0
        cancelled = holder[0]._cancel
        # what the grammar drafts ahead: decided once a generation, not every round
        ahead = None
        if guide is not None:
            from .policy import drafts_likely
            ahead = guide.likely if drafts_likely(getattr(drafter, "policy", None)) else guide.forced
        emitted_all = True  # every committed token was emitted (not cut by max_tokens)
        try:
            while stats.generated < max_tokens and len(tokens) < n_ctx:
                if cancelled.is_set():
                    stats.finish_reason = "cancelled"
                    return
                if guide is not None and guide.done:  # complete: only end-of-generation could follow
                    stats.finish_reason = "stop"
                    return
                room = min(max_tokens - stats.generated - 1, n_ctx - len(tokens) - 1)
                td = time.perf_counter()
                draft, inner, n_forced = self._draft(tokens, room, params, rng, guide, ahead)
                masks = guide.masks(draft.tokens) if guide is not None else None
                drafts = draft.tokens
                tv = time.perf_counter()
                logits, rows, fed = self._verify_pass(tokens, drafts, carry, masks)
                carry = None
                if rows:
                    stats.target_forwards += 1
                    self._check_finite(logits)
                te = time.perf_counter()
                if params.greedy:
                    n, y = verify_greedy(drafts, logits if masks is None else mask_logits(logits, masks))
                else:
                    n, y = verify(drafts, self._target_law(logits, masks, params), draft.q, rng)
                new = drafts[:n] + [y]
                if not target.truncate(min(target.n_past, len(tokens) + n)):
                    raise BackendError("the target's KV cache could not be cut back")
                tokens.extend(new)
                if guide is not None:
                    guide.advance([t for t in new if not target.is_eog(t)])
                self._count(stats, draft, n, n_forced, inner.source)
                if drafter is not None:
                    drafter.observe(Round(tokens, inner, max(0, n - n_forced), rows, te - tv, tv - td, fed))
                for i, tok in enumerate(new):
                    if target.is_eog(tok):
                        if guide is not None and not guide.accepting:  # the grammar left nothing else
                            raise ConstraintError(f"the {request.constraint.describe()} cannot be "
                                                  "completed from here: it admits no continuation of this answer")
                        stats.finish_reason = "stop" if guide is not None else "eos"
                        return
                    stats.generated += 1
                    stats.decode_seconds = time.perf_counter() - t1
                    yield tok, i < n
                    if stats.generated >= max_tokens:
                        emitted_all = i == len(new) - 1
                        break
            if guide is not None and guide.done and emitted_all:  # complete at exactly max_tokens
                stats.finish_reason = "stop"
            else:
                stats.finish_reason = "length" if stats.generated >= max_tokens else "context"
        finally:
            stats.decode_seconds = time.perf_counter() - t1
            describe = getattr(drafter, "describe_costs", None)
            if describe is not None:
                stats.costs = describe()

    def _verify_pass(self, tokens: list[int], drafts: list[int], carry, masks):
        """One target pass over what the cache lacks and the drafts: (len(drafts) + 1) rows of
        logits (masked under a constraint), the rows computed, the tokens evaluated. Row i is the
        target's logits for drafts[i], the last row the bonus token's; a row a mask leaves one
        token in is that token's point mass, not asked of llama.cpp (nor is a pass without any
        open row made: its tokens stay pending for the next)."""
        target = self.target
        k = len(drafts)
        open_rows = list(range(k + 1)) if masks is None else [i for i in range(k + 1) if masks[i].sum() > 1]
        width = target.n_vocab
        logits = np.empty((k + 1, width), dtype=np.float32)
        if carry is not None:  # first round: the last prompt row is already computed (row 0)
            ask = [i for i in open_rows if i > 0]
            if ask:
                got, fed = target.eval(drafts, [i - 1 for i in ask]), len(drafts)
            else:
                got, fed = np.zeros((0, width), np.float32), 0
            logits[0] = carry[0]
            rows = len(ask)
        else:
            pending = tokens[target.n_past:]
            feed = pending + drafts
            ask = open_rows
            if ask:
                got = target.eval(feed, [len(pending) - 1 + i for i in ask])
                fed = len(feed)
            else:
                got, fed = np.zeros((0, width), np.float32), 0
            rows = len(ask)
        for j, i in enumerate(ask):
            logits[i] = got[j]
        if masks is None:
            return logits, rows, fed
        done = set(ask) | ({0} if carry is not None else set())
        for i in range(k + 1):
            if i not in done:  # decided by the mask: a point mass on its one legal token
                logits[i] = np.where(masks[i][:width], 0.0, -np.inf)
        return logits, rows, fed

    def _target_law(self, logits: np.ndarray, masks: Optional[np.ndarray], params) -> np.ndarray:
        """p: each row's logits with the forbidden tokens at -inf first, then the filters and the
        temperature (`warp`), as the constrained target would sample."""
        rows = _pad(logits, self.n_vocab)
        return warp(rows if masks is None else mask_logits(rows, masks), params)

    def _draft(self, tokens: list[int], room: int, params, rng, guide: Optional[Guide], ahead=None):
        """This round's draft: the tokens the constraint forces from here (point masses, source
        "grammar": verified like any draft, since the law may still prefer another tokenization
        of the same bytes), then the drafter's proposal after them, cut at its first forbidden
        token. Returns (the whole draft, the drafter's part, how many were forced)."""
        drafter = self.drafter
        forced: list[int] = []
        if guide is not None and room > 0 and drafter is not None:  # no drafter: plain decoding
            forced = (ahead or guide.forced)()[:room]
            guide.advance(forced)
        try:
            left = room - len(forced)
            inner = (drafter.propose(tokens + forced, left, params, rng, guide) if drafter is not None and left > 0
                     else NO_DRAFT)
            if guide is not None:
                inner = _legal(inner, guide)
        finally:
            if forced:
                guide.rollback(len(forced))
        if not forced:
            return inner, inner, 0
        q = None
        if inner.q is not None:  # the forced tokens' rows are point masses
            q = np.zeros((len(forced) + len(inner.tokens), inner.q.shape[1]), dtype=np.float32)
            q[np.arange(len(forced)), forced] = 1.0
            q[len(forced):] = inner.q
        return Draft(forced + inner.tokens, q, "grammar"), inner, len(forced)

    @staticmethod
    def _count(stats: GenerationStats, draft, n: int, n_forced: int = 0, source: str = "") -> None:
        """One round in the stats; a constrained draft counts its forced part (source "grammar")
        apart from the drafter's."""
        stats.rounds += 1
        drafts = draft.tokens
        if drafts:
            stats.drafted += len(drafts)
            stats.accepted += n
            stats.forced += min(n, n_forced)
            if len(stats.accept_histogram) <= len(drafts):
                stats.accept_histogram.extend([0] * (len(drafts) + 1 - len(stats.accept_histogram)))
            stats.accept_histogram[n] += 1
        parts = [(draft.source if drafts else "none", len(drafts), n)] if not n_forced else \
            [("grammar", n_forced, min(n, n_forced))] + \
            ([(source, len(drafts) - n_forced, max(0, n - n_forced))] if len(drafts) > n_forced else [])
        for name, k, acc in parts:
            d = stats.by_drafter.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0})
            d["rounds"] += 1
            d["drafted"] += k
            d["accepted"] += acc


class _Placeholder:
    """Holds the engine for work that is not a stream (reset)."""

    def __init__(self, thread: int):
        self._thread = thread

    def cancel(self) -> None:
        pass

    def _invalidate(self, error) -> None:
        pass
