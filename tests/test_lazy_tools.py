"""Calls written without the template's markup (issue 50, item 10): Qwen2.5-Coder, not forced to
call, writes a call as a fenced or bare JSON object. Once an answer opens one, the rest is
constrained to one call of an offered function (a lazy grammar, tools.LAZY_*), and the answer ends
with it; prose never meets the constraint.

- on fixed strings, with the tools of Claude Code's and Codex's recorded first requests: the
  answers issue 50 saw (a fenced call to a tool Claude Code does not offer; Codex's call followed
  by invented output) are cut where they leave the grammar, and prose, code and JSON in prose pass;
- parsed and streamed: the text before the call is content, the call never is;
- the law under the lazy constraint, enumerated through the engine loop with fakes, is the masked
  law exactly (as test_constrained_exact.py does for a regex);
- SmolLM2 (any vocabulary serves the lazy rules): prose is the unconstrained answer byte for byte,
  an opened call becomes a call of an offered function;
- the Qwen pair behind the qwen marker: Claude Code's Write and Codex's exec_command called.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import edgespec.engine as engine_mod
import edgespec.rounds as rounds
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.errors import UsageError
from edgespec.request import Request
from edgespec.sampling import SamplingParams, warp
from edgespec.server import anthropic, responses
from edgespec.tools import Hermes, StreamParser, ToolSpec, lazy_call_grammar

from fakes import FakeBackend
from test_verify_exact import enumerate_paths, law, max_diff

DATA = Path(__file__).parent / "data"
CLAUDE = json.loads((DATA / "claude-code-2.1.197-first-request.json").read_text())["body"]
CODEX = json.loads((DATA / "codex-0.171.0-first-request.json").read_text())["body"]
# what the default pair wrote in issue 50's hold-out run (abridged)
CLAUDE_SAW = ('I will create the file.\n```json\n{"name": "GenerateCodebaseDocumentation", "arguments": '
              '{"content": "hi", "file_path": "hello.txt"}}\n```')
CODEX_SAW = ('```json\n{"name": "exec_command", "arguments": {"cmd": "echo hi > hello.txt"}}\n```\n'
             'The output of this command would be: hi')
# what real Codex 0.171.0 got through `serve` (the default pair, T = 1): a call keyed "function", and
# a tool definition invented in a tag, then a call in doubled braces on the next line
CODEX_GOT = ['```json\n{\n  "function": "write_stdin",\n  "arguments": {\n    "chars": "hi",\n'
             '    "session_id": 0\n  }\n}\n```',
             '<tools>\n  {"function": {"name": "create_file", "parameters": {"type": "object"}}}\n</tools>\n'
             '{{"name": "create_file", "arguments": {"file_name": "hello.txt"}}}']
PROSE = ["Hello! How can I help you today?",
         "Use a dict:\n```python\nuser = {\"name\": \"Ada\"}\nrows = [\n    {\"name\": \"x\"},\n]\n```\nDone.",
         'Settings:\n```json\n{\n  "version": "1.0.0",\n  "name": "my-app"\n}\n```\n',
         'The key {"name": "x"} in a sentence, and `{"name": 1}` in code.',
         "Call it with <tool_call> markup, or ```json blocks."]


def _spec(body_kind: str) -> ToolSpec:
    if body_kind == "claude":
        return anthropic.MessagesRequest.model_validate(CLAUDE).chat().engine_request(32768).tools
    return responses.ResponsesRequest.model_validate(CODEX).chat().engine_request(32768).tools


# -- fixed strings -------------------------------------------------------------------------------
SPECIAL = [b"<tool_call>", b"</tool_call>", b"<eos>"]


class _Vocab(FakeBackend):
    """FakeBackend whose llguidance tokenizer knows Qwen's call markers as special tokens."""

    def guidance_tokenizer(self):
        from llguidance import LLTokenizer, TokenizerWrapper
        vocab, special = self.vocab_bytes, {i for i, t in enumerate(self.vocab_bytes) if t in SPECIAL}

        class Wrapped:
            eos_token_id, bos_token_id = self.eos, None
            tokens = [b"\xff" + t if i in special else t for i, t in enumerate(vocab)]
            special_token_ids = sorted(special)

            def __call__(self, data: bytes):  # longest match first
                out, i = [], 0
                while i < len(data):
                    best = max((t for t, b in enumerate(vocab) if t not in special and data.startswith(b, i)),
                               key=lambda t: len(vocab[t]))
                    out.append(best)
                    i += len(vocab[best])
                return out
        return LLTokenizer(TokenizerWrapper(Wrapped()))


BYTES = [bytes([i]) for i in range(256)] + SPECIAL


def _matcher(grammar: str):
    from llguidance import LLMatcher
    tok = _Vocab(np.zeros((len(BYTES), len(BYTES)), np.float32), eos=len(BYTES) - 1,
                 vocab_bytes=BYTES).guidance_tokenizer()
    m = LLMatcher(tok, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _legal(grammar: str, text: str) -> tuple[str, bool]:
    """(the longest legal prefix of `text`, whether the answer must end there)."""
    m = _matcher(grammar)
    data = text.encode()
    n = m.try_consume_tokens(list(data))
    return data[:n].decode(), m.is_stopped()


@pytest.mark.parametrize("agent", ["claude", "codex"])
def test_an_opened_call_is_held_to_an_offered_tool_and_ends_the_answer(agent):
    spec = _spec(agent)
    grammar = Hermes().grammar(spec)
    names = {t.name for t in spec.tools}
    assert ("Write" if agent == "claude" else "exec_command") in names
    # Claude Code's answer: the invented name is refused at its first letter, after the opening
    legal, _ = _legal(grammar, CLAUDE_SAW)
    assert legal == 'I will create the file.\n```json\n{"name": "'
    # Codex's answer: its call is legal to its closing fence (for Codex); the invented output is not
    legal, stopped = _legal(grammar, CODEX_SAW)
    if agent == "codex":
        assert legal == CODEX_SAW.split("\nThe output")[0] and stopped
    else:  # Claude Code offers no exec_command
        assert legal == '```json\n{"name": "'
    # the same call bare, in doubled braces, or in a tag (llama.cpp's list): ends where it closes
    call = '{"name": "exec_command", "arguments": {"cmd": "ls"}}'
    for opened in (call, "{" + call + "}", f"<tools>\n  {call}\n</tools>", f"<function_call>{call}</function_call>"):
        end = _legal(grammar, opened + "\nThe output")
        assert end == ((opened, True) if agent == "codex" else (opened[:opened.index('"exec') + 1], False))
    # arguments follow the tool's schema: Write's file_path is a string, unknown keys refused
    call = 'Sure.\n```json\n{"name": "Write", "arguments": {"file_path": 7'
    if agent == "claude":
        assert _legal(grammar, call)[0] == call[:-1]
        ok = '```\n{"name": "Write", "arguments": {"file_path": "/tmp/a.txt", "content": "hi"}}\n```'
        assert _legal(grammar, ok) == (ok, True)
    # prose, code and JSON in prose are no call: legal whole, and the answer may go on
    for text in PROSE:
        assert _legal(grammar, text) == (text, False), text
    # real Codex's answers: a call (write_stdin is Codex's), and a call held to an offered name
    if agent == "codex":
        assert _legal(grammar, CODEX_GOT[0]) == (CODEX_GOT[0], True)
        assert _legal(grammar, CODEX_GOT[1])[0].endswith('{{"name": "create_')  # create_goal is offered
    # the model's own layout after the opening; a call after a preamble laid out over lines
    # (the default pair's answer to Codex at T = 1) is one, with no argument its schema lacks
    pretty = ('To create it, run:\n\n```json\n{\n  "name": "exec_command",\n  "arguments": {\n'
              '    "cmd": "echo hi > hello.txt",\n    "perfect_score": 100\n  }\n}\n```')
    if agent == "codex":
        assert _legal(grammar, pretty)[0] == pretty[:pretty.index('erfect_score')]  # "p...: prefix_rule
        fixed = pretty.replace(',\n    "perfect_score": 100', "")
        assert _legal(grammar, fixed) == (fixed, True)
    # what it costs: a JSON block in prose whose first key is "name" is taken for a call
    assert _legal(grammar, 'A package.json:\n```json\n{\n  "name": "my-app"')[0].endswith('"name": "')


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "lazy"])
def test_an_empty_answer_is_legal_where_a_call_is_not_required(fmt):
    """tool_choice auto: the model may end its answer at once (after a tool's result it often does).
    The grammars' free text was one or more characters: on the shipped Claude Code session the end
    of the turn was masked after Write's result, and Qwen2.5-Coder-1.5B wrote 593 tokens where
    llama-server, with the same prompt, ended at once."""
    from edgespec.tools import Llama3, Mistral, lazy_call_grammar
    spec = _spec("claude")
    grammar = {"hermes": lambda: Hermes().grammar(spec), "llama3": lambda: Llama3().grammar(spec),
               "mistral": lambda: Mistral().grammar(spec), "lazy": lambda: lazy_call_grammar(spec)}[fmt]()
    assert _matcher(grammar).is_accepting()
    assert _legal(grammar, "Done.") == ("Done.", False)


def test_the_space_between_a_calls_tokens_is_bounded():
    """Qwen2.5-Coder-1.5B closed Write's content string too early (at T = 0, on the shipped Claude
    Code session) and, with any amount of space allowed before the `}` it did not want, wrote spaces
    to max_tokens. The space between tokens is bounded (16, a line break, 64): then only what closes
    the call is legal."""
    grammar = Hermes().grammar(_spec("claude"))
    call = '{"name": "Write", "arguments": {"file_path": "a.py", "content": "x = \\"low stock: "'
    legal, _ = _legal(grammar, call + " " * 200)
    assert legal == call + " " * 16
    legal, _ = _legal(grammar, call + " " * 3 + "\n" + " " * 200)
    assert legal == call + " " * 3 + "\n" + " " * 64
    laid_out = call + "\n  }\n}"  # the model's own layout still closes the call
    assert _legal(grammar, laid_out) == (laid_out, True)


def test_the_lazy_openings_leave_required_and_none_as_they_were():
    spec = _spec("codex")
    for choice in ("required", {"type": "function", "function": {"name": "exec_command"}}):
        forced = ToolSpec.build([t.openai() for t in spec.tools], choice)
        g = Hermes().grammar(forced)
        assert "fenced" not in g  # the call is forced from the first token, in the template's markup
        assert _legal(g, "Hello")[0] == ""
        tc = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
        m = _matcher(g)
        ids = [256] + list(tc[len("<tool_call>"):-len("</tool_call>")].encode()) + [257]
        assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    assert Hermes().grammar(ToolSpec.build([t.openai() for t in spec.tools], "none")) is None


# -- parsed and streamed -------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = ToolSpec.build([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}])
CALLED = 'Let me look.\n\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'


def _streamed(text: str, cut: int, spec=TOOLS) -> tuple[str, str, list]:
    p = StreamParser(Hermes(), spec)
    shown = "".join(p.feed(text[i:i + cut]) for i in range(0, len(text), cut))
    rest, calls = p.finish()
    return shown, rest, calls


@pytest.mark.parametrize("cut", [1, 2, 5, 200])
def test_text_before_a_fenced_call_is_content_and_the_call_never_is(cut):
    content, calls = Hermes().parse(CALLED, TOOLS)
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    shown, rest, calls = _streamed(CALLED, cut)
    assert shown + rest == "Let me look." and calls[0].arguments == {"city": "Oslo"} and calls[0].error is None
    later = "Sure.\n{{" + CALLED[CALLED.index('"name"'):-len("\n```")] + "}"  # doubled braces on a later line
    assert _streamed(later, cut)[0] + _streamed(later, cut)[1] == "Sure."
    assert Hermes().parse(later, TOOLS)[1][0].arguments == {"city": "Oslo"}
    # cut off inside the call (max_tokens): the text before it, no markup, no call
    cut_off = CALLED[:CALLED.index('"city"')]
    assert Hermes().parse(cut_off, TOOLS) == ("Let me look.", [])
    shown, rest, calls = _streamed(cut_off, cut)
    assert shown + rest == "Let me look." and calls == []
    # opening the answer: fenced, bare, doubled, tagged
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    keyed = bare.replace('"name"', '"function"')
    for text in (CALLED[len("Let me look.\n\n"):], bare, "{" + bare + "}", f"<tools>\n{bare}\n</tools>", keyed):
        shown, rest, calls = _streamed(text, cut)
        assert shown + rest == "" and calls[0].name == "get_weather"
    # prose, code blocks and JSON in prose stream whole and are no call
    for text in PROSE:
        shown, rest, calls = _streamed(text, cut)
        assert shown + rest == text and calls == [], text
        assert Hermes().parse(text, TOOLS) == (text, [])


def test_a_code_block_is_shown_once_its_first_line_rules_out_a_call():
    p = StreamParser(Hermes(), TOOLS)
    assert p.feed("Here:\n```") == "Here:"    # may open a call: held, with the line break before it
    assert p.feed("json\n{") == ""
    assert p.feed('\n  "a": 1') == '\n```json\n{\n  "a": 1'  # its first key is not "name": no call
    p = StreamParser(Hermes(), TOOLS)
    assert p.feed("Here:\n```py") == "Here:\n```py"  # another language: shown at once


# -- the law under the lazy constraint, enumerated -------------------------------------------------
# tokens: the bytes, then words, the call markers and EOS
WORDS = [b"hi", b"\n```json\n", b'{"name": "', b'", "arguments": {"v": ', b"}}\n```", b"\nThe output", b"}}",
         b"\n```"]
VOCAB = BYTES[:256] + WORDS + SPECIAL
V, EOS = len(VOCAB), len(VOCAB) - 1
HI, FENCE, HEAD, ARGS, CLOSE, OUT, BRACES, TICKS = range(256, 264)
F, G, Z, X = (ord(c) for c in "fgzx")
ONE, TWO, THREE = (ord(c) for c in "123")
PROMPT = [ord("?"), FENCE, HEAD, F, ARGS, ONE, CLOSE, ord("?")]  # an earlier call: n-gram drafts find it
M = 8
PARAMS = SamplingParams(1.0, top_p=0.9)
TOL = 1e-6
ARGS_SCHEMA = {"type": "object", "properties": {"v": {"enum": [1, 2]}}, "required": ["v"],
               "additionalProperties": False}
SPEC = ToolSpec.build([{"type": "function", "function": {"name": n, "parameters": ARGS_SCHEMA}} for n in "fg"])
# the model's wishes: prose, or a call opened at once or in a fence; a name it was not offered (z);
# an argument out of the enum (3); output it invents after the call
NEXT = {ord("?"): {HI: 2.0, HEAD: 1.0, FENCE: 0.5}, HI: {FENCE: 1.5, EOS: 1.0},
        FENCE: {HEAD: 1.5, X: 0.5}, HEAD: {Z: 3.0, F: 1.0, G: 0.5}, F: {ARGS: 3.0}, G: {ARGS: 3.0},
        Z: {EOS: 3.0}, ARGS: {ONE: 1.0, TWO: 0.5, THREE: 2.0}, ONE: {CLOSE: 3.0, BRACES: -1.0},
        TWO: {CLOSE: 3.0, BRACES: -1.0}, THREE: {CLOSE: 3.0}, CLOSE: {OUT: 3.0, EOS: 0.0},
        BRACES: {TICKS: 3.0, OUT: 1.0}, TICKS: {OUT: 3.0, EOS: 0.0}, OUT: {EOS: 3.0}, X: {EOS: 2.0}}


def _table() -> np.ndarray:
    t = np.full((V, V), -14.0, np.float32)  # the rest: cut by top-p
    for prev, nxt in NEXT.items():
        for tok, logit in nxt.items():
            t[prev, tok] = logit
    return t


TARGET = _table()
# the draft differs where the answer chooses how to open and which function to call: drafts are
# rejected there; elsewhere it is the target's choices alone (q has no tail: the enumeration
# follows every draw q could make: exp(-1e4) is 0)
DRAFT = np.where(TARGET > -14.0, TARGET, -1e4).astype(np.float32)  # exp underflows to 0
DRAFT[:, EOS] = np.maximum(DRAFT[:, EOS], -8.0)
DRAFT[ord("?"), [HI, HEAD, FENCE]] = (0.5, 2.0, 1.0)
DRAFT[HEAD, [Z, F, G]] = (1.0, 0.0, 1.5)


def _law(grammar) -> dict:
    """Answers (token tuples) and their probabilities under the target, masked by `grammar` (None:
    unconstrained), computed apart from the engine."""
    out: dict = {}

    def walk(m, prefix: tuple, prob: float):
        if (m is not None and m.is_stopped()) or len(prefix) == M:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        prev = prefix[-1] if prefix else PROMPT[-1]
        logits = TARGET[prev]
        if m is not None:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:V].astype(bool)
            logits = np.where(bits, logits, -np.inf).astype(np.float32)
        p = warp(logits, PARAMS).astype(np.float64)
        for x in map(int, np.flatnonzero(p)):
            if x == EOS:
                out[prefix] = out.get(prefix, 0.0) + prob * p[x]
                continue
            child = None
            if m is not None:
                child = m.deep_copy()
                assert child.consume_token(x)
            walk(child, prefix + (x,), prob * p[x])
    from llguidance import LLMatcher
    tok = _Vocab(TARGET, eos=EOS, vocab_bytes=VOCAB).guidance_tokenizer()
    walk(LLMatcher(tok, LLMatcher.grammar_from_lark(grammar), log_level=0) if grammar else None, (), 1.0)
    return out


def _engine_law(engine: Engine, grammar: str, monkeypatch) -> dict:
    clock = iter(np.arange(1, 10**7) * 0.001)  # auto's online costs: the same on every replay
    monkeypatch.setattr(rounds, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))

    def run(rng):
        monkeypatch.setattr(engine_mod, "_rng", lambda seed: rng)
        engine.reset()
        try:
            r = engine.generate(PROMPT, max_tokens=M, temperature=PARAMS.temperature, top_p=PARAMS.top_p,
                                grammar=grammar)
        except UsageError:  # a wrong engine committed a token the grammar forbids
            return ("ILLEGAL",)
        return tuple(r.tokens)
    return law(enumerate_paths(run))


@pytest.fixture(scope="module")
def lazy_law():
    grammar = Hermes().grammar(SPEC)
    want, free = _law(grammar), _law(None)
    assert sum(want.values()) == pytest.approx(1.0, abs=TOL)
    # the case is what it says: prose and calls opened both ways; unconstrained, the model names
    # z, picks 3 and invents output; constrained, never
    assert (HI,) in want and any(k[:2] == (FENCE, HEAD) for k in want) and any(k[:1] == (HEAD,) for k in want)
    bad = lambda k: Z in k or THREE in k or OUT in k  # noqa: E731
    assert sum(p for k, p in free.items() if bad(k)) > 0.3
    assert not any(bad(k) for k in want)
    assert any(k[-1] == CLOSE for k in want)  # calls end at their fence
    # prose answers keep their unconstrained probability (the tokens before any opening are free)
    assert want[(HI,)] == pytest.approx(free[(HI,)], rel=1e-6)
    return grammar, want


@pytest.mark.parametrize("kind", ["none", "model", "ngram"])
def test_speculation_under_the_lazy_constraint_has_exactly_the_masked_law(kind, lazy_law, monkeypatch):
    grammar, want = lazy_law
    target = _Vocab(TARGET, eos=EOS, vocab_bytes=VOCAB)
    # (the model drafts one token a round: with more, the paths of its draws run to hundreds)
    drafter = {"none": None, "model": lambda: ModelDrafter(_Vocab(DRAFT, eos=EOS), V, gamma=1),
               "ngram": lambda: NgramDrafter(3)}[kind]
    got = _engine_law(Engine(target, drafter() if drafter else None), grammar, monkeypatch)
    assert max_diff(got, want) < TOL


# -- SmolLM2 ---------------------------------------------------------------------------------------
SHELL = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
         "additionalProperties": False}
WRITE = {"type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
         "required": ["file_path", "content"], "additionalProperties": False}
AGENT = ToolSpec.build([{"type": "function", "function": {"name": "Write", "parameters": WRITE}},
                        {"type": "function", "function": {"name": "exec_command", "parameters": SHELL}}])
FEW_SHOT = ("Tools: Write, exec_command. Answer with a call as a JSON block.\n\n"
            "Task: list the files\nAnswer: ```json\n{\"name\": \"ls_files\", \"arguments\": {\"dir\": \".\"}}\n```\n\n"
            "Task: save hi to hello.txt\nAnswer:")


@pytest.fixture(scope="module")
def smol_engine(smol):
    with Engine.load(str(smol), drafter="ngram", n_ctx=512) as eng:
        yield eng


def test_smollm2_prose_is_untouched_and_an_opened_call_is_a_call(smol_engine):
    eng, grammar = smol_engine, lazy_call_grammar(AGENT)
    for prompt, seed in (("The capital of France is", None), ("Write a haiku about the sea:\n", 3)):
        kw = dict(max_tokens=24, temperature=0.0 if seed is None else 0.8, seed=seed)
        free = eng.generate(prompt, **kw)
        held = eng.generate(prompt, grammar=grammar, **kw)
        assert held.text == free.text and held.tokens == free.tokens
    # unconstrained, the model calls a function it was not offered and goes on; held, it calls one
    # of the two with valid arguments, and the answer ends with the call's fence
    free = eng.generate(FEW_SHOT, max_tokens=48)
    assert "```json" in free.text[:12] and Hermes().parse(free.text, AGENT)[1] == []
    held = eng.generate(FEW_SHOT, max_tokens=48, grammar=grammar)
    content, calls = Hermes().parse(held.text, AGENT)
    assert held.finish_reason == "stop" and held.text.endswith("\n```") and content == ""
    assert len(calls) == 1 and calls[0].name in ("Write", "exec_command")
    jsonschema.validate(calls[0].arguments, WRITE if calls[0].name == "Write" else SHELL)


def test_a_verifier_that_leaves_the_bonus_row_unmasked_misses_the_lazy_law(lazy_law, monkeypatch):
    from test_constrained_exact import no_mask_on_bonus
    grammar, want = lazy_law
    monkeypatch.setattr(rounds, "law", no_mask_on_bonus)
    engine = Engine(_Vocab(TARGET, eos=EOS, vocab_bytes=VOCAB), ModelDrafter(_Vocab(DRAFT, eos=EOS), V, gamma=1))
    got = _engine_law(engine, grammar, monkeypatch)
    assert got.get(("ILLEGAL",), 0.0) > 0.01  # it names z after the opening


# -- the default pair ------------------------------------------------------------------------------
@pytest.mark.qwen
@pytest.mark.slow
def test_claude_codes_write_and_codexs_exec_command_are_called_on_qwen(qwen_pair):
    """Qwen2.5-Coder-1.5B at T = 0, offered the tools as Claude Code's and Codex's recorded requests
    define them, with short prompts (the recorded ones are 23,000 and 8,600 tokens: minutes of
    prefill on this CPU; their runs are in docs/structured-output.md). Offered Write, it writes the
    call as a ```json block laid out over lines; offered exec_command and asked to list files, it
    names a tool it was not offered ("ls" when the template's tojson sorted the schema's keys,
    "list_files" since it writes them in order; unconstrained: text, no call) and is held to
    exec_command, whose optional arguments it now fills in too (160 tokens, not 64).
    (The target alone: the format and the law are the target's.)"""
    write = next(t for t in CLAUDE["tools"] if t["name"] == "Write")
    shell = next(t for t in CODEX["tools"] if t.get("name") == "exec_command")
    claude = [{"type": "function", "function": {"name": "Write", "description": write["description"],
                                                "parameters": write["input_schema"]}}]
    codex = [{"type": "function", "function": {k: shell[k] for k in ("name", "description", "parameters")}}]
    target, _ = qwen_pair
    with Engine.load(str(target), drafter="ngram", n_ctx=1024) as eng:
        def raw(r):
            return b"".join(eng.target.token_to_piece(t, special=True) for t in r.tokens).decode()
        r = eng.chat([{"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude."},
                      {"role": "user", "content": "Create a file hello.txt containing the word hi."}],
                     max_tokens=64, tools=claude)
        assert raw(r).startswith("```json\n{\n") and "<tool_call>" not in raw(r)  # no markup: the lazy opening
        assert r.finish_reason == "tool_calls" and r.text == "" and [c.name for c in r.tool_calls] == ["Write"]
        jsonschema.validate(r.tool_calls[0].arguments, write["input_schema"])
        assert r.tool_calls[0].arguments["content"] == "hi"
        ask = [{"role": "system", "content": "You are Codex, a coding agent in a terminal."},
               {"role": "user", "content": "List the files, please."}]
        r = eng.chat(ask, max_tokens=160, tools=codex)
        assert r.finish_reason == "tool_calls" and r.text == "" and [c.name for c in r.tool_calls] == ["exec_command"]
        jsonschema.validate(r.tool_calls[0].arguments, shell["parameters"])
        assert r.tool_calls[0].arguments["cmd"].startswith("ls")
        prompt = eng.prepare_chat(ask, Request.build(max_tokens=64, tools=codex)).tokens
        free = eng.generate(prompt, max_tokens=12).text  # what it writes unconstrained: a name not offered
        assert '"name": "' in free and '"name": "exec_command"' not in free, free


def test_codexs_goal_objective_without_a_call_id_is_taken_as_context():
    """Answered create_goal (a call the lazy grammar let through), Codex 0.171.0 sends the call's
    output, then the goal's objective as a function_call_output with no call_id (recorded through
    `serve`): context, not a 400 that ends its run."""
    import copy
    body = copy.deepcopy(CODEX)
    body["input"] += [
        {"type": "function_call", "name": "create_goal", "call_id": "call_1",
         "arguments": '{"objective": "Create hello.txt", "token_budget": 20000}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"goal": {"status": "active"}}'},
        {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
         "output": "Create hello.txt"}]
    msgs = responses.ResponsesRequest.model_validate(body).chat().engine_messages()
    assert [m["role"] for m in msgs[-3:]] == ["assistant", "tool", "system"]
    assert msgs[-1]["content"] == "goal_objective: Create hello.txt"
    body["input"][-1] = {"type": "function_call_output", "output": "x"}  # neither a call nor a name: refused
    with pytest.raises(Exception, match="names its call in call_id"):
        responses.ResponsesRequest.model_validate(body).chat()
