"""The exact law of constrained generation through the whole engine loop, by enumeration.

The constrained law (docs/structured-output.md): the target's logits with every token the
constraint forbids at -inf, then the filters (here top-p 0.9 at T = 1). It is computed here
independently of the engine, with llguidance's matcher and `warp`, over every token path.

The engine is then run once per path of its random draws (`test_verify_exact.Enumerator`
through the loop's `_rng` seam), with the draft model, with point drafts and with auto: the law
of its answers must equal the constrained law up to float32 rounding. The constraint is a regex
with free choices inside a forced frame, over a byte vocabulary with multi-byte tokens, so that:
- the frame's forced tokens are drafts ('{"' as one token; llguidance's mask allows only that
  tokenization of forced bytes, so their rows need no logits), as is the '}' that a lone '"'
  forces; the choices inside ('ab' or 'a' then 'b', '"}' or '"' then '}') are open rows;
- the draft model samples under the masks, n-gram drafts are cut at forbidden tokens, and
  drafts past a choice are rejected where the target chose otherwise.
Two wrong engines (the mask applied after top-p; no mask on the bonus row) miss the law by far.
"""
from __future__ import annotations

import numpy as np
import pytest

import edgespec.engine as engine_mod
import edgespec.rounds as rounds
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.copy import CopyDrafter
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.errors import UsageError
from edgespec.costs import Costs
from edgespec.policy import Policy
from edgespec.sampling import SamplingParams, warp

from fakes import FakeBackend
from test_verify_exact import enumerate_paths, law, max_diff

VOCAB = [bytes([i]) for i in range(256)] + [b"ab", b'{"', b'"}', b"<eos>"]
V, EOS = len(VOCAB), len(VOCAB) - 1
REGEX = r'\{"[ab]{1,2}"\}'
PROMPT = [257, 97, 98, 258, 10]  # an earlier answer: n-gram lookups find it
M = 6                      # the longest answer: { " a b " }
PARAMS = SamplingParams(1.0, top_p=0.9)
TOL = 1e-6
WRONG_GAP = 0.01
LIKELY = [ord(c) for c in '{"ab}'] + [256, 257, 258]


def _table(seed: int, bias: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    t[:, LIKELY] += bias  # the constraint's tokens likely, the forbidden ones still in top-p's way
    return t


TARGET = _table(0, 4.0)
DRAFT = _table(1, 4.0) * 0.5 + TARGET * 0.5


def _matcher():
    from llguidance import LLMatcher
    tok = FakeBackend(TARGET, eos=EOS, vocab_bytes=VOCAB).guidance_tokenizer()
    return LLMatcher(tok, LLMatcher.grammar_from_regex(REGEX), log_level=0)


def _allowed(m) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little").astype(bool)
    return bits[:V]


def constrained_law() -> dict:
    """Answers (token tuples, EOS left out) and their probabilities under the masked target."""
    out: dict = {}

    def walk(m, prefix: tuple, prob: float):
        if m.is_stopped() or len(prefix) == M:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        prev = prefix[-1] if prefix else PROMPT[-1]
        logits = np.where(_allowed(m), TARGET[prev], -np.inf).astype(np.float32)
        p = warp(logits, PARAMS).astype(np.float64)
        for x in map(int, np.flatnonzero(p)):
            if x == EOS:
                out[prefix] = out.get(prefix, 0.0) + prob * p[x]
                continue
            child = m.deep_copy()
            assert child.consume_token(x)
            walk(child, prefix + (x,), prob * p[x])
    walk(_matcher(), (), 1.0)
    return out


class _Clock:
    """A perf_counter that ticks evenly: auto's online costs then decide the same way on
    every replay (the enumeration needs a run that is a function of its draws alone)."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self):
        self.t += 0.001
        return self.t


def _engine(kind: str, cls=Engine, gamma: int = 3) -> Engine:
    target = FakeBackend(TARGET, eos=EOS, vocab_bytes=VOCAB)
    if kind == "model":
        drafter = ModelDrafter(FakeBackend(DRAFT, eos=EOS), V, gamma=gamma)
    elif kind == "ngram":
        drafter = NgramDrafter(gamma)
    else:  # rows nearly free: auto drafts with the model and copies
        costs = Costs(tuple(0.01 * (1 + 0.02 * k) for k in range(32)), draft_step=0.001)
        drafter = AutoDrafter(Policy(costs), CopyDrafter(), ModelDrafter(FakeBackend(DRAFT, eos=EOS), V, gamma=3))
    return cls(target, drafter)


def engine_law(engine: Engine, monkeypatch) -> tuple[dict, dict]:
    """(law of the answers, the stats summed over the paths) of engine.generate under REGEX."""
    monkeypatch.setattr(rounds, "time", _Clock())
    seen = {"drafted": 0, "grammar": 0, "rejected": 0, "rows_skipped": 0}
    calls = []
    real_eval = engine.target.eval_batch

    def counting_eval(parts):
        calls.extend((len(tokens), len(rows)) for _, tokens, rows in parts)
        return real_eval(parts)
    monkeypatch.setattr(engine.target, "eval_batch", counting_eval)

    def run(rng):
        monkeypatch.setattr(engine_mod, "_rng", lambda seed: rng)
        engine.reset()
        try:
            r = engine.generate(PROMPT, max_tokens=M, temperature=PARAMS.temperature, top_p=PARAMS.top_p,
                                regex=REGEX)
        except UsageError:  # a wrong engine committed a forbidden token
            return ("ILLEGAL",)
        g = r.stats.by_drafter.get("grammar", {"drafted": 0, "accepted": 0})
        seen["drafted"] += r.stats.drafted
        seen["grammar"] += g["drafted"]
        seen["rejected"] += r.stats.drafted - r.stats.accepted
        return tuple(r.tokens)
    got = law(enumerate_paths(run))
    seen["rows_skipped"] = sum(1 for fed, rows in calls if fed > rows)
    return got, seen


@pytest.fixture(scope="module")
def exact():
    want = constrained_law()
    assert sum(want.values()) == pytest.approx(1.0, abs=TOL)
    # the case is what the docstring says: choices between tokenizations inside the frame
    assert all(k[0] == 257 for k in want)
    assert any(k[-1] == 258 for k in want) and any(k[-2:] == (34, 125) for k in want)
    return want


@pytest.mark.parametrize("kind", ["model", "ngram", "auto"])
def test_constrained_speculation_has_exactly_the_masked_law(kind, exact, monkeypatch):
    got, seen = engine_law(_engine(kind), monkeypatch)
    assert max_diff(got, exact) < TOL
    assert "ILLEGAL" not in {k[0] for k in got}
    # forced drafts were made, some drafts were rejected, and passes left out rows the mask decided
    assert seen["grammar"] > 0 and seen["rejected"] > 0
    assert seen["rows_skipped"] > 0


def test_plain_constrained_decoding_has_the_masked_law(exact, monkeypatch):
    got, seen = engine_law(Engine(FakeBackend(TARGET, eos=EOS, vocab_bytes=VOCAB)), monkeypatch)
    assert max_diff(got, exact) < TOL
    assert seen["grammar"] == 0  # no drafter: no drafts, forced or not


right_law = rounds.law  # sampling.law: the target's rows as the verifier samples them


def mask_after_top_p(logits, params, width, masks):
    """Wrong: the filters on the raw logits, the mask after (then renormalised)."""
    p = right_law(logits, params, width, None)
    if masks is not None:
        p = np.where(masks, p, 0.0).astype(np.float32)
        s = p.sum(axis=1, keepdims=True)
        p = np.where(s > 0, p / np.where(s > 0, s, 1), masks / masks.sum(axis=1, keepdims=True))
    return p.astype(np.float32)


def no_mask_on_bonus(logits, params, width, masks):
    """Wrong: every row masked but the last (the bonus token's)."""
    if masks is not None:
        masks = masks.copy()
        masks[-1] = True
    return right_law(logits, params, width, masks)


@pytest.mark.parametrize("wrong", [mask_after_top_p, no_mask_on_bonus])
@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_wrong_constrained_verifiers_miss_the_law(wrong, kind, exact, monkeypatch):
    # one draft a round: the bonus row is then often an open choice (with three, the drafts
    # mostly reach the end of the answer, where the mask decides the bonus row alone)
    with monkeypatch.context() as m:
        m.setattr(rounds, "law", wrong)
        got, _ = engine_law(_engine(kind, gamma=1), m)
    assert max_diff(got, exact) > WRONG_GAP
    # and the right verifier, one draft a round, is exact
    assert max_diff(engine_law(_engine(kind, gamma=1), monkeypatch)[0], exact) < TOL


def test_greedy_constrained_decoding_is_the_masked_argmax_chain():
    m, prev, chain = _matcher(), PROMPT[-1], []
    while not m.is_stopped() and len(chain) < M:
        x = int(np.argmax(np.where(_allowed(m), TARGET[prev], -np.inf)))
        if x == EOS:
            break
        assert m.consume_token(x)
        chain.append(x)
        prev = x
    for kind in ("model", "ngram", "auto"):
        eng = _engine(kind)
        r = eng.generate(PROMPT, max_tokens=M, regex=REGEX)
        assert r.tokens == chain and r.finish_reason == "stop"
