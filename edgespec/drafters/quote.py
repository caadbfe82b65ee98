"""Where a value quoted from the prompt probably ends.

Under a constraint (a JSON answer), most of a copy drafter's hits are values an extraction
quotes from its prompt: a name, an address, a subject line. The source goes on after the value
("Dana Whitfield <dana@...>", "...moved to Thursday\\n\\nHi Marcus"), and a copy that runs past
the value's end wastes a verified row per token. Values end where the source's phrase ends: at
a line break, a bracket, a comma or semicolon, a double quote, a spaced dash, or a full stop, colon or
question mark followed by a space. A copy cut there is accepted far more often: measured on the
structured workloads (Qwen 1.5B, T = 0), per-token acceptance of fresh in-prompt copies rose
from 0.68 / 0.87 / 0.88 (run 1 / 2 / 3+, the whole legal continuation) to 0.77 / 0.95 / 0.94,
and whole drafts accepted from about 40% to 75%.

Only a guess about where drafting should stop: the target verifies every token, so a value
that goes on past a boundary is still written, one pass later.
"""
from __future__ import annotations

from typing import Callable, Sequence

CLOSERS = set('<>()[]{}|;,"')     # a token starting with one of these (after spaces) ends a phrase
BREAKS = set("\n\r\t")             # ... or with a line break or tab
STOPS = set(".:!?")                # ... or with one of these, when a space or line break follows
DASHES = {" -", " –", " —"}        # a spaced dash
SPACES = set(" \n\t\r")


def value_end(cont: Sequence[int], piece: Callable[[int], str]) -> int:
    """How many tokens of `cont` (a copy's continuation) to draft: up to, not including, the
    first token where the quoted phrase may end (len(cont) when none does)."""
    for j, tok in enumerate(cont):
        text = piece(tok)
        if not text:
            continue
        if text[0] in BREAKS or text in DASHES:
            return j
        rest = text.lstrip(" ")
        if not rest:
            continue
        if rest[0] in CLOSERS:
            return j
        if rest[0] in STOPS:  # "." ". " ".\n" (not ".com"), followed by a space or by nothing
            after = rest[1:2] or (piece(cont[j + 1])[:1] if j + 1 < len(cont) else " ")
            if after in SPACES:
                return j
    return len(cont)
