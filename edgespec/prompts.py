"""Prompt building: text and conversations into checked prompt tokens, tool formats and
compiled constraints. The Engine is a PromptBuilder; everything here only reads the target's
vocabulary (under `_reading`, never the engine's KV work), so a server prepares a request off
its engine thread while other requests generate."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import numpy as np

from .chat import render, render_segments, validate_messages
from .constraints import Constraint, Guide, tokenizer_for
from .drafters.recall import DraftMemory
from .errors import ConstraintError, ContextLengthError, UsageError
from .request import Request, check_text
from .tools import detect


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


def _only_eog(guide: Guide, target) -> bool:
    """The constraint allows nothing but end-of-generation next (and is not complete)."""
    return all(target.is_eog(int(t)) for t in np.flatnonzero(guide.allowed())[:64])


QUOTED_MIN = 64        # characters: a text shorter than this is not worth a source of its own
QUOTED_MAX = 32768     # tokens of quoted sources a request keeps (the latest texts first)
_NUMBERED = re.compile(r"^ *\d+(?:\t|\u2192)", re.M)  # "7<tab>code"; earlier Claude Codes wrote "7→code"


def _without_line_numbers(text: str) -> str:
    """`text` without `cat -n` line numbers ("     7\tcode", Claude Code's Read) where most
    lines have one (a note may follow the listing); else as it is."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if len(lines) >= 2 and sum(bool(_NUMBERED.match(ln)) for ln in lines) * 4 >= len(lines) * 3:
        return _NUMBERED.sub("", text)
    return text


@dataclass
class ChatPrompt:
    """A request ready to stream: its prompt tokens, checked, and its compiled constraint."""
    tokens: list[int]
    request: "Request"
    format: object = None      # tools.Format when the request had tools
    dropped: int = 0           # messages left out (overflow="drop-oldest")
    guide: Optional[Guide] = None
    sources: object = None     # quoted_sources, indexed (recall.DraftMemory): what a call may copy


class PromptBuilder:
    """What the Engine does with text before it generates; needs `target`, `n_vocab` and a
    `_reading()` context (the vocabulary, guarded against close())."""

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` with BOS (when the model uses one); `special=False` reads
        control-token text like "<|im_end|>" as plain text."""
        check_text("the prompt", text)
        with self._reading() as t:
            return t.tokenize(text, add_bos=True, special=special)

    def format_chat(self, messages) -> str:
        """The target's chat template applied to `messages` (list of {'role', 'content'})."""
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
        messages = validate_messages(messages)
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
                # a call goes with the results that answer it (and a result never stays without
                # its call: the conversation would be refused)
                while first + gone < len(messages) and messages[first + gone].get("role") == "tool":
                    gone += 1
                if first + gone >= len(messages):  # that would take the last message too
                    raise
                # a new list, checked again (a result left without its call is refused)
                messages = validate_messages(messages[:first] + messages[first + gone:])
                dropped += gone

    def prepare_chat(self, messages, request: Optional[Request] = None, *, room: Optional[int] = None,
                     overflow: str = "error") -> "ChatPrompt":
        """Everything a chat request needs before it waits for the engine: the prompt tokens
        (checked against the context with `room` tokens for the answer, default max_tokens; with
        overflow="drop-oldest" the oldest turns go), and with tools the request constrained to the
        model's own call format. Safe from any thread, as `prompt_tokens`."""
        request = request or Request()
        messages = validate_messages(messages)  # before a format rewrites tool turns
        given, fmt = messages, None
        if request.tools is not None or any(m.get("tool_calls") or m.get("role") == "tool"
                                            for m in messages if isinstance(m, dict)):
            with self._reading() as t:
                fmt = detect(t.chat_template())
                if fmt.name == "mistral":  # its marker is a control token: the grammar names it by id
                    ids = t.tokenize(fmt.TAG, add_bos=False, special=True)
                    fmt.marker_id = ids[0] if len(ids) == 1 else None
            # the format's rewrite is checked again (what the template sees)
            messages, extra = fmt.render_messages(list(messages), request.tools)
            if request.tools is not None:
                grammar = fmt.grammar(request.tools)
                if grammar is not None:
                    request = replace(request, constraint=Constraint.build(grammar=grammar))
        else:
            extra = {}
        tokens, dropped = self.conversation_tokens(messages, room=request.max_tokens if room is None else room,
                                                   overflow=overflow, **extra)
        calls = request.tools is not None and request.tools.choice != "none"  # none: text only, never parsed
        sources = DraftMemory.of_sources(self.quoted_sources(given)) if calls else None
        return ChatPrompt(tokens, request, fmt if calls else None, dropped, self.guide(request), sources)

    def quoted_sources(self, messages) -> tuple:
        """What a call's arguments may copy from the conversation, tokenized as they write it, the
        latest first: each tool result and user turn given (those `drop-oldest` left out of the
        prompt too) of QUOTED_MIN characters or more, as the inside of a JSON string
        (newlines as \\n, quotes as \\"), line numbers of a `cat -n` listing left out (Claude Code's
        Read). An agent rewriting a file it has read writes it this way in a Write or Edit call, which
        prompt lookup cannot follow: the prompt holds the file's lines, not their escaped text. Drafts
        from these are verified as any other (they change what is drafted, never the law)."""
        out, total = [], 0
        with self._reading() as t:
            for m in reversed(messages):  # the latest first, up to QUOTED_MAX tokens in all
                text = m.get("content") if m.get("role") in ("tool", "user") else None
                if not isinstance(text, str) or len(text) < QUOTED_MIN:
                    continue
                quoted = json.dumps(_without_line_numbers(text), ensure_ascii=False)[1:-1]
                if quoted == text:  # nothing escaped: prompt lookup finds it as it is
                    continue
                # cut before tokenizing (a token holds far fewer than 16 characters): a tool result
                # of megabytes is not tokenized whole for a bounded source
                quoted = quoted[:16 * (QUOTED_MAX - total)]
                toks = t.tokenize(quoted, add_bos=False, special=False)[:QUOTED_MAX - total]
                out.append(toks)
                total += len(toks)
                if total >= QUOTED_MAX:
                    break
        return tuple(out)

    def chat_tokens(self, messages, **extra) -> list[int]:
        """The prompt tokens for a conversation, checked against the context (UsageError).
        Message contents are tokenized as text: a message holding "<|im_end|>" cannot close
        its turn; only the template's own markers are control tokens. Roles must be system,
        user, assistant or tool. Safe to call from any thread, as `prompt_tokens`."""
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

