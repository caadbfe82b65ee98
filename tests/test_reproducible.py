"""Issue 35: the same request gives the same answer however its prompt's KV was reached. At T = 0
under parallel=4 with another request in flight: a prompt that joins through the shared-prefix copy
(on SmolLM2 a 2,100-token one, and its repeat), and the prompt restored from the disk tier of an engine
that ran with another `parallel`, each equal the same request alone, token for token (the canonical
pieces of slots.PIECE, each sequence's rows in passes of its own: Settings.parallel_exact)."""
from __future__ import annotations

import json

import pytest

from edgespec import Engine
from edgespec.registry import workloads_path
from edgespec.slots import PIECE
from tables import one_table


N = 24  # tokens an answer: enough to part where a near-tie flips (the probe's parted at 13)


def _text() -> str:
    prompts = [json.loads(line)["prompt"] for line in workloads_path().read_text().splitlines() if line.strip()]
    return "\n\n".join(prompts)


def _beside(running, stream):
    """Read the two streams in turn, a token each, until `stream` has ended (their rounds
    interleave); `running` only had to be in flight meanwhile, and is closed then."""
    while True:
        next(running, None)
        try:
            next(stream)
        except StopIteration:
            assert running.finish_reason is None  # it was still running
            running.close()
            return stream.result()


def _prompts(eng, short: bool = False):
    """The running request's prompt, and the one that joins beside it: 2,100 tokens, or (`short`)
    550, which still spans four pieces, three of them shared with the running one's 414."""
    toks = eng.target.tokenize(_text(), add_bos=True)
    tail = lambda text: eng.target.tokenize(text, add_bos=False)  # noqa: E731
    if short:
        return toks[:414] + tail(" Summarize this."), toks[:546] + tail(" Which word is used most?")
    long = (toks + eng.target.tokenize("\n\n" + _text(), add_bos=False))[:2100] + tail(" Summarize.")
    return toks[:700] + tail(" Summarize this."), long


def _load(model, **kw):
    """An engine whose cost table stays the one on disk: a correction adopted mid-test would change
    later decisions, as docs/exactness.md says (every engine here then decides on one table)."""
    return one_table(Engine.load(str(model), **kw))


def _check(model, draft, tmp_path, long: bool = True):
    """One prompt by every path: joining through the copy of the running request's pieces, its
    repeat (`long`), and its head restored into a parallel = 1 engine from the entry the parallel = 4 engine
    wrote at close; then alone, on a fresh engine with no cache. `long`: the 2,100-token prompt
    (the pieces' bookkeeping is the engine's, whatever the model: the Qwen pair's prefill is the
    suite's most expensive, so it takes the 550-token one)."""
    kw = dict(n_ctx=4096, draft=str(draft) if draft else None)
    got = {}
    with _load(model, parallel=4, cache_dir=str(tmp_path), **kw) as eng:
        first, prompt = _prompts(eng, short=not long)
        running = eng.stream(first, max_tokens=3 * N)
        next(running)  # it holds its prompt's pieces now
        got["copy"] = _beside(running, eng.stream(prompt, max_tokens=N))
        if long:
            got["repeat"] = eng.generate(prompt, max_tokens=N)
            assert got["repeat"].stats.reused_prompt_tokens >= len(prompt) - PIECE
    assert got["copy"].stats.reused_prompt_tokens >= 3 * PIECE  # it did come through the copy,
    assert got["copy"].stats.restored_prompt_tokens == 0  # from the running sequence, not the cache
    with _load(model, parallel=1, cache_dir=str(tmp_path), **kw) as eng:
        got["disk"] = eng.generate(prompt, max_tokens=N)  # its head from the other engine's disk entry
    assert got["disk"].stats.restored_prompt_tokens >= 4 * PIECE
    with _load(model, parallel=1, cache_ram=0, **kw) as eng:
        alone = eng.generate(prompt, max_tokens=N).tokens
    for name, result in got.items():
        assert result.tokens == alone, name


@pytest.mark.slow
def test_every_path_to_a_prompt_gives_its_answer_alone_smollm2(smol, tmp_path, own_tables):
    _check(smol, None, tmp_path)


@pytest.mark.qwen
def test_every_path_to_a_prompt_gives_its_answer_alone_qwen_pair(qwen_pair, tmp_path, own_tables):
    _check(*qwen_pair, tmp_path, long=False)


def test_a_saved_state_is_laid_out_for_the_context_it_is_restored_into():
    """llama.cpp refuses a sequence state saved in a context of another number of KV streams
    (--parallel 2 saved, --parallel 1 restores); backend.restream rewrites its stream sections:
    the one holding cells first, then empty ones, the header before the stream count kept."""
    from edgespec.backend import restream
    head = bytes([216, 60, 20, 175, 1, 0, 0, 0])
    cells = (5).to_bytes(4, "little") + bytes(range(1, 40))
    two = head + (2).to_bytes(4, "little") + bytes(4) + cells  # sequence 1 of a 2-stream context
    one = restream(bytearray(two), 1)
    assert bytes(one) == head + (1).to_bytes(4, "little") + cells
    four = restream(bytearray(two), 4)
    assert bytes(four) == head + (4).to_bytes(4, "little") + cells + bytes(12)
    assert bytes(restream(bytearray(four), 2)) == head + (2).to_bytes(4, "little") + cells + bytes(4)
    assert restream(bytearray(two), 2) == bytearray(two)  # the same layout: as it is
    assert restream(b"junk", 1) == b"junk"
