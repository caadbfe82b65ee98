"""Structured output: JSON Schema, regular expressions and grammars, through llguidance.

A `Constraint` is what a request asks for, compiled to llguidance's grammar text (no tokenizer
needed, so a bad schema is refused before anything waits for the engine). A `Guide` follows
one generation: an `LLMatcher` over the target's vocabulary that says, at the committed
position, which tokens are legal (`allowed`), which the grammar forces (`forced`), and how
much of a draft is legal (`legal_prefix`); it looks ahead along a draft and rolls back.

The law (docs/structured-output.md): the target's logits with every forbidden token at -inf
first, then the request's filters (top-k, top-p, min-p, temperature); the same mask on the
draft's rows. A position where exactly one token is legal is decided: no logits are needed.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import UsageError

# Compact JSON: keys, quotes, colons and commas are then forced, drafts the grammar makes
# (docs/structured-output.md: the layout choice and its measurements).
JSON_OPTIONS = {"whitespace_flexible": False}
KINDS = ("json_schema", "regex", "grammar")
NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}


def _llg():
    try:
        import llguidance
    except ImportError:  # a dependency; only an install without it gets here
        raise UsageError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    kind: str      # json_schema | regex | grammar
    source: str    # what the user gave (schema as JSON text, the regex, the grammar)
    grammar: str   # llguidance's grammar text

    @classmethod
    def build(cls, json_schema=None, regex=None, grammar=None) -> Optional["Constraint"]:
        """At most one of the three; None when none is given. Errors are UsageErrors."""
        given = [(k, v) for k, v in zip(KINDS, (json_schema, regex, grammar)) if v is not None]
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(k for k, _ in given)
            raise UsageError(f"give at most one of json_schema, regex and grammar, got {names}")
        kind, value = given[0]
        try:
            return cls._build(kind, value)
        except RecursionError:  # json, llguidance's Python side: a schema nested ~1000 levels deep
            raise UsageError(f"the {NAMES[kind]} nests too deeply to compile (hundreds of levels): "
                             "flatten it, or use $defs and $ref for recursive structures") from None

    @classmethod
    def _build(cls, kind: str, value) -> "Constraint":
        M = _llg().LLMatcher
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"the JSON schema is not valid JSON ({exc.msg} at line {exc.lineno} "
                                     f"column {exc.colno})") from None
            if not isinstance(value, dict):
                raise UsageError(f"a JSON schema is an object, got {type(value).__name__}")
            try:  # a dict from Python may hold what JSON cannot (sets, int keys, lone surrogates)
                source = json.dumps(value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"the JSON schema is not JSON data: {_first_line(exc)}") from None
            try:
                text = M.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as exc:
                raise UsageError(f"the JSON schema was refused: {_first_line(exc)}") from None
        elif kind == "regex":
            if not isinstance(value, str) or not value:
                raise UsageError("regex must be a non-empty string")
            _utf8(value, "regex")
            source, text = value, M.grammar_from_regex(value)
        else:
            if not isinstance(value, str) or not value.strip():
                raise UsageError("grammar must be non-empty text (Lark, llguidance's syntax, or GBNF)")
            _utf8(value, "grammar")
            source, text = value, M.grammar_from_lark(_to_lark(value))
        error = M.validate_grammar(text)
        if error:
            raise UsageError(f"the {NAMES[kind]} was refused: {_first_line(error)}")
        return cls(kind, source, text)

    def describe(self) -> str:
        return NAMES[self.kind]


def _utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"the {what} is not valid text: {exc.reason} at character {exc.start}") from None


def _first_line(exc) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:300] if lines else type(exc).__name__


def _to_lark(text: str) -> str:
    """GBNF (llama.cpp's grammars: `root ::= ...`) is converted; anything else is taken as Lark."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            return gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions for bad GBNF
            raise UsageError(f"the GBNF grammar was refused: {_first_line(exc)}") from None
    return text


def json_object_schema() -> dict:
    """OpenAI's response_format {"type": "json_object"}: any JSON object."""
    return {"type": "object"}


# -- tokenizers -------------------------------------------------------------------------------
_tok_lock = threading.Lock()


def tokenizer_for(backend):
    """llguidance's tokenizer of a loaded backend, built once (about a second for 150k tokens)
    and kept on the backend. Every end-of-generation token ends a constrained answer."""
    tok = getattr(backend, "_llg_tokenizer", None)
    if tok is not None:
        return tok
    with _tok_lock:
        tok = getattr(backend, "_llg_tokenizer", None)
        if tok is None:
            tok = backend.guidance_tokenizer()
            backend._llg_tokenizer = tok
    return tok


class Guide:
    """One generation's matcher. Positions: `advance` what is committed; `lookahead` steps along
    a draft and returns the masks of each row, then rolls back."""

    def __init__(self, constraint: Constraint, tokenizer, n_vocab: int):
        llg = _llg()
        self.constraint = constraint
        self.n_vocab = n_vocab
        self._tok = tokenizer
        self._m = llg.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self._words = (tokenizer.vocab_size + 31) // 32
        self._pieces: dict[int, str] = {}
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise UsageError(f"the {self.constraint.describe()} was refused: {_first_line(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """No token but end-of-generation may follow: the answer is complete."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    def allowed(self) -> np.ndarray:
        """Bool mask over the (padded) vocabulary of the tokens legal next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").view(bool)  # 0 and 1 bytes: a bool array as they are
        if mask.size >= self.n_vocab:
            return mask[: self.n_vocab]
        out = np.zeros(self.n_vocab, dtype=bool)
        out[: mask.size] = mask
        return out

    def forced(self) -> list[int]:
        """Tokens the grammar allows in exactly one way from here (possibly none)."""
        return list(self._m.compute_ff_tokens())

    def likely(self) -> list[int]:
        """`forced`, then the usual tokenization of the rest of the forced bytes (the closing
        quote and colon after a key, say): bytes are forced there but not yet their tokens
        (`":` or `"` then `:`), and the model mostly writes them the usual way. Drafts only: the
        target verifies them."""
        forced = self.forced()
        try:
            done = self._tok.decode_bytes(forced)
            rest = bytes(self._m.compute_ff_bytes())
        except Exception:  # an older llguidance without these: the forced tokens alone
            return forced
        if not rest.startswith(done) or len(rest) == len(done):
            return forced
        extra = self._tok.tokenize_bytes(rest[len(done):])
        if not extra:
            return forced
        self.advance(forced)
        try:
            n = self.legal_prefix(extra)
        finally:
            self.rollback(len(forced))
        return forced + list(extra[:n])

    def piece(self, token: int) -> str:
        """A token's text (what a drafter reads to guess where a quoted value ends)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self._tok.decode_bytes([int(token)]).decode("utf-8", "replace")
        return text

    def legal_prefix(self, tokens: list[int]) -> int:
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def advance(self, tokens: list[int]) -> None:
        for t in tokens:
            if not self._m.consume_token(int(t)):
                self._check()
                raise UsageError(f"token {t} is not allowed by the {self.constraint.describe()}")

    def rollback(self, n: int) -> None:
        if n > 0:
            self._m.rollback(n)

    def masks(self, drafts: list[int]) -> np.ndarray:
        """(len(drafts) + 1, n_vocab) masks: row i before drafts[i], the last for the bonus
        token. The drafts must be legal; the matcher ends where it began."""
        rows = np.empty((len(drafts) + 1, self.n_vocab), dtype=bool)
        for i, t in enumerate(drafts):
            rows[i] = self.allowed()
            self.advance([t])
        rows[len(drafts)] = self.allowed()
        self.rollback(len(drafts))
        return rows


