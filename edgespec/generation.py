"""One generation's state, and what it reports: the round functions (`rounds.py`) read and
advance a `Generation`; the engine hands its committed tokens to the request's `Stream`."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np

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
    exact_cuts: int = 0             # rounds whose rows went in a pass apart from other sequences' (exactness)
    accept_histogram: list[int] = field(default_factory=list)  # [n] = rounds that accepted n drafts
    # source -> {"rounds", "drafted", "accepted", "seconds"}: seconds of the rounds it chose (their
    # drafting and pass), so rounds + accepted tokens over seconds is what it gave per second
    by_drafter: dict = field(default_factory=dict)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    stop_sequence: str = ""         # the stop string that ended it (finish_reason "stop"), if one did
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


@dataclass(eq=False)
class Generation:
    """One request from its prompt to its finish: the sequence it runs on, its tokens (the
    prompt, then every committed token), its request, constraint state, randomness, drafter
    lane and stats; the tokens committed but not yet handed to its stream; why it ended."""

    tokens: list
    request: object                 # request.Request
    stats: GenerationStats
    guide: object = None            # constraints.Guide, or None
    rng: Optional[np.random.Generator] = None
    seq: int = -1                   # the sequence of the KV caches it runs on (-1: not started)
    n_ctx: int = 0                  # that sequence's context
    drafter: object = None          # this sequence's drafter lane (None: plain decoding)
    cancel: threading.Event = field(default_factory=threading.Event)
    out: deque = field(default_factory=deque)  # committed (token, from_draft) its stream has not taken
    last_round: int = 0             # how many of those its last round added (engine._wanted reads ahead by one)
    reads_ahead: bool = False       # it runs alone: its reader asks for the round ahead as it takes tokens
    restored: Optional[bool] = None  # its prompt's prefix came back from the prompt cache (None: no sequence
                                     # yet, or its first piece is in and the stats say it)
    sources: object = None          # what its copies may draft from besides its context: the prompt's
                                    # texts as a call's JSON string writes them (ChatPrompt.sources)
    carry: Optional[np.ndarray] = None         # the prompt's last row, for the first round (rounds._feed)
    ahead: Optional[Callable] = None           # under a constraint: what the grammar drafts ahead
    t1: float = 0.0                 # when its prompt was in (decode time counts from here)
    started: bool = False
    finished: bool = False
    error: Optional[BaseException] = None      # raised to its stream once the tokens before it are out
    emitted_all: bool = True        # every committed token was handed out (none cut by max_tokens)
    aside_seconds: float = 0.0      # a long prompt: the turns it stepped aside for other requests
    piece_seconds: float = 0.0      # the turns its prompt's pieces took

    @property
    def room(self) -> int:
        """Drafts this round may carry: the answer's and the context's room, less the target's token."""
        return min(self.request.max_tokens - self.stats.generated - 1,
                   self.n_ctx - len(self.tokens) - 1)
