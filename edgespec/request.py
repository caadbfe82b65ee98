"""One request's settings, built and checked once: sampling, length, seed, stop strings and the
output constraint. The CLI, the server and the library build a `Request`; the engine's loop,
`warp` (for p and q) and the drafters read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from .constraints import Constraint
from .errors import UsageError
from .sampling import SamplingParams
from .tools import ToolSpec

OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "json_schema", "regex",
           "grammar", "tools", "tool_choice", "parallel_tool_calls")


def check_seed(seed) -> None:
    if seed is not None and not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)
                                 and 0 <= seed < 2**64):
        raise UsageError(f"seed must be an integer in 0..2**64-1 (leave it out for a random seed), got {seed!r}")


def check_text(what: str, text) -> str:
    if not isinstance(text, str):
        raise UsageError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} is not valid UTF-8 text (it holds undecodable bytes): "
                         "pass text in UTF-8") from None
    return text


def check_stop(stop) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise UsageError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    return tuple(s for s in (check_text("each stop string", s) for s in stop) if s)


def check_max_tokens(max_tokens) -> int:
    if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
        raise UsageError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    return max_tokens


@dataclass(frozen=True)
class Request:
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    constraint: Optional[Constraint] = None
    tools: Optional[ToolSpec] = None  # chat only: the functions the answer may call

    @classmethod
    def build(cls, *, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, seed: Optional[int] = None, stop: Union[str, Sequence[str]] = (),
              json_schema: Union[dict, str, None] = None, regex: Optional[str] = None,
              grammar: Optional[str] = None, tools=None, tool_choice=None,
              parallel_tool_calls: Optional[bool] = None) -> "Request":
        """Every option checked (UsageError naming it). `json_schema` (a dict or JSON text),
        `regex` or `grammar` (Lark, llguidance's syntax, or llama.cpp GBNF): at most one.
        `tools`, `tool_choice` ("auto", "none", "required" or {"type": "function", "function":
        {"name"}}), `parallel_tool_calls`: as OpenAI's; not with another constraint."""
        params = SamplingParams(temperature, top_k, top_p, min_p)
        check_seed(seed)
        spec = tools if isinstance(tools, ToolSpec) else ToolSpec.build(tools, tool_choice, parallel_tool_calls)
        constraint = Constraint.build(json_schema, regex, grammar)
        if spec is not None and constraint is not None:
            raise UsageError("give tools or a json_schema/regex/grammar, not both")
        return cls(params, check_max_tokens(max_tokens), None if seed is None else int(seed), check_stop(stop),
                   constraint, spec)

    @classmethod
    def of(cls, request: Optional["Request"], options: dict) -> "Request":
        """The request an Engine method was given: `request`, or one built from keyword options."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise UsageError(f"unknown option {unknown[0]!r}; the options are {', '.join(OPTIONS)}")
        if request is None:
            return cls.build(**options)
        if not isinstance(request, Request):
            raise UsageError(f"request must be an edgespec Request, got {type(request).__name__}")
        if options:
            raise UsageError("give either a Request or keyword options, not both")
        return request
