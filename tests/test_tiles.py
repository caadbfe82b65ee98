"""Issue 49: prompts computed in tiles (slots.py, docs/exactness.md). Where the table proves it, a row
computed in a pass of at least 64 rows, in its whole groups of 4, has the same KV however the prompt was
split: a prompt longer than a piece is computed from wherever its kept prefix ends, its last pass brought
to a tile by dummy rows, and a later turn keeps every token of the previous prompt and computes only its
new ones. A prompt of one piece is computed whole, as llama.cpp computes it. Elsewhere, the grid."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.backend import LlamaBackend
from edgespec.drafters.model import ModelDrafter, ModelWant, _Lane
from edgespec.sampling import SamplingParams
from edgespec.slots import TILE, Sequences, tile_of
from fakes import FakeBackend

TEXT = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n"
        "The harbour was quiet all winter. The nets were mended twice, the boats were painted, and the "
        "children counted the days until spring on the wall of the school. ") * 6


def _fake(tile: int, n_ctx: int = 64) -> FakeBackend:
    be = FakeBackend(np.zeros((32, 32), np.float32), n_ctx=n_ctx, n_seq=2)
    be.canonical_piece, be.canonical_tile = 8, tile  # pieces of 8, passes of at least 4 (a fake's tile)
    return be


def _passes(be) -> list[int]:
    out = [b[0][1] for b in be.batches]
    be.batches.clear()
    return out


def test_in_tiles_a_later_prompt_keeps_every_token_of_the_earlier_one():
    be = _fake(4)
    seqs = Sequences(be, n=2)
    first = list(range(1, 14))  # 13 tokens: a piece of 8, then 5 brought to 8 by dummy rows
    row, kept = seqs.prefill(0, first)
    assert kept == 0 and row.shape == (1, 32) and _passes(be) == [8, 8]
    assert be.held(0) == first and seqs.canon[0] == 13  # the dummies are gone, every position canonical
    row, kept = seqs.prefill(0, first + [20, 21, 22, 23, 24, 25])
    assert kept == 13 and _passes(be) == [8]  # 6 new tokens and 2 dummies; the grid: 11 from position 8
    assert seqs.canon[0] == 19


def test_a_prompt_of_one_piece_is_computed_whole_as_llama_cpp_computes_it():
    be = _fake(4)
    seqs = Sequences(be, n=2)
    seqs.prefill(0, [1, 2, 3, 4, 5, 6, 7])
    assert _passes(be) == [7] and seqs.canon[0] == 4  # its whole groups of 4, in a pass of a tile or more
    _, kept = seqs.prefill(0, [1, 2, 3, 4, 5, 9])
    assert kept == 0 and _passes(be) == [6]  # not from a kept prefix: as a fresh prompt of one piece is
    _, kept = seqs.prefill(0, [1, 2, 3, 4, 5, 9, 10, 11, 12])  # longer than a piece: from what was kept
    assert kept == 4 and _passes(be) == [8]


def test_without_room_for_the_dummies_the_last_pass_begins_earlier():
    be = _fake(4, n_ctx=62)
    seqs = Sequences(be, n=1)
    prompt = list(range(1, 31)) + list(range(1, 32))  # 61 tokens in a 62-token context
    _, kept = seqs.prefill(0, prompt)
    assert _passes(be) == [8] * 7 + [8]  # 56, then 53..61: 3 dummies would pass position 61
    assert be.held(0) == prompt and seqs.canon[0] == 61


def test_on_the_grid_a_later_prompt_keeps_whole_pieces_only():
    be = _fake(0)
    seqs = Sequences(be, n=2)
    first = list(range(1, 14))
    seqs.prefill(0, first)
    assert [b[0][1] for b in be.batches] == [8, 5] and seqs.canon[0] == 8
    be.batches.clear()
    _, kept = seqs.prefill(0, first + [20, 21, 22])
    assert kept == 8 and [b[0][1] for b in be.batches] == [8]


def test_the_tile_rule_is_taken_only_where_it_is_proven():
    class B:
        repack, flash_attn, type_k, type_v, n_batch = True, "auto", "f16", "f16", 512
        settings = {"n_gpu_layers": 0}
    assert tile_of(B()) == TILE
    for change, want in [(dict(type_k="q8_0", type_v="q8_0"), TILE), (dict(flash_attn="off"), TILE),
                         (dict(flash_attn="off", type_k="q8_0"), TILE), (dict(type_k="q4_0"), 0),
                         (dict(repack=False), 0), (dict(n_batch=64), 0),
                         (dict(settings={"gpu_offload": True, "n_gpu_layers": -1}), 0)]:
        b = B()
        for k, v in change.items():
            setattr(b, k, v)
        assert tile_of(b) == want, change


# -- real llama.cpp: the same KV, bit for bit, whatever the path ----------------------------------------
def _any_path(model, fa: str, kv: str) -> None:
    be = LlamaBackend(model, n_ctx=512, threads=2, flash_attn=fa, type_k=kv, type_v=kv if fa == "on" else "f16")
    try:
        assert tile_of(be) == TILE
        toks = be.tokenize(TEXT)
        prompt = toks[:300]
        seqs = Sequences(be)
        row, _ = seqs.prefill(0, prompt)  # fresh: pieces of PIECE from 0
        want = be.save_state(0)[1], row.copy()
        # earlier prompts that part from this one after n tokens (n + 1 long), then this one; what it keeps:
        # all of a prompt longer than a piece, the whole groups of 4 of a prompt of one piece
        for path, keeps in (([37, 201], 201), ([130, 131], 131), ([70], 68), ([101], 100)):
            seqs.reset()
            for n in path:
                other = next(t for t in range(100, 200) if t != prompt[n])
                seqs.prefill(0, prompt[:n] + [other])
            row, kept = seqs.prefill(0, prompt)
            assert kept == keeps, path
            assert be.save_state(0)[1] == want[0], path
            assert np.array_equal(row, want[1]), path
    finally:
        be.close()


@pytest.mark.parametrize("fa,kv", [("on", "f16"), ("on", "q8_0"), ("off", "f16")])
def test_a_prompt_reached_by_any_path_has_the_kv_of_a_fresh_prefill_smollm2(smol, fa, kv):
    """(Without the padding the first setting parts: docs/exactness.md's `irregular`.)"""
    _any_path(smol, fa, kv)


@pytest.mark.qwen
def test_a_prompt_reached_by_any_path_has_the_kv_of_a_fresh_prefill_qwen_05b(qwen_pair):
    """Qwen's repacked Q4_K kernels take rows in fours: unpadded pieces part in every setting."""
    _any_path(qwen_pair[1], "on", "f16")


def test_the_draft_models_catch_up_is_canonical_too_smollm2(smol_draft):
    """The draft model keeps what it computed in tiles and catches up in them: its KV for a prompt is
    the same after an earlier prompt and a tail fed as draft steps feed it, as from nothing."""
    be = LlamaBackend(smol_draft, n_ctx=1024, threads=2, flash_attn="on")  # where other passes part
    try:
        toks = be.tokenize(TEXT)
        prompt = toks[:333]
        d = ModelDrafter(be, be.n_vocab)
        params = SamplingParams(temperature=0.0)

        def catch_up(tokens):
            d.begin(tokens)
            _Lane(ModelWant(d, tokens, 1, params, np.random.default_rng(0), None))

        catch_up(prompt)
        assert be.canon() == be.n_past == len(prompt) - 1  # all but the last, which a draft step feeds
        want = be.save_state(0)[1]
        be.reset()
        catch_up(prompt[:150])
        assert be.canon() == be.n_past == 149
        be.eval(prompt[149:170], [])  # as draft steps feed them: passes of fewer rows than a tile
        be.eval(prompt[170:200], [])
        catch_up(prompt)  # keeps 149, not 200
        assert be.save_state(0)[1] == want
        be.reset()
        catch_up(prompt[:300])
        catch_up(prompt)  # a tail of 33 after its canonical prefix: computed as from nothing
        assert be.save_state(0)[1] == want
    finally:
        be.close()
