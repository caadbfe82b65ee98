"""Passes kept to the rows a build computes exactly (issue 28): with repacked Q4_K weights on an
x86 CPU a pass of 4+ rows rounds every row otherwise than a single-row decode, and a greedy
answer parts from plain decoding's at near-ties. The calibration probes the limit; the policy
keeps passes within it with `bit_exact` (--bit-exact) only: by default (issue 39) it drafts where
the saving is, as llama.cpp and vLLM do, and an exact_rows of 1 (an F16 target, a GPU) no longer
rules out the draft model."""
from __future__ import annotations

import numpy as np

from edgespec.calibrate import exact_rows
from edgespec.costs import Costs
from edgespec.policy import Offer, Policy
from fakes import FakeBackend

GPU = Costs(tuple(0.05 * (1 + 0.02 * (k - 1)) for k in range(1, 33)), draft_step=0.005)


class Rounding(FakeBackend):
    """A fake whose passes of more than `exact` tokens add a small offset to every row."""

    def __init__(self, table, exact: int, **kw):
        super().__init__(table, **kw)
        self.exact = exact

    def eval_batch(self, parts):
        outs = super().eval_batch(parts)
        if sum(len(t) for _, t, _ in parts) > self.exact:
            outs = [o + np.float32(1e-3) for o in outs]
        return outs


def test_the_probe_finds_the_largest_exact_pass():
    table = np.random.default_rng(0).normal(size=(300, 300)).astype(np.float32)
    assert exact_rows(FakeBackend(table, n_ctx=512)) is None  # exact however long: no limit
    for exact in (1, 3, 5):
        b = Rounding(table, exact, n_ctx=512)
        assert exact_rows(b) == exact
        assert b.cache == []  # it leaves the sequence empty


def test_bit_exact_keeps_every_draft_within_the_exact_rows_and_the_default_does_not():
    # a model draft at 60%: on a GPU-like device it drafts long; within 3 rows it drafts 2
    p = Policy(GPU)
    p.exact_rows = 3
    free = p.choose(None, has_model=True, room=16)
    p.bit_exact = True
    kept = p.choose(None, has_model=True, room=16)
    assert free.drafter == kept.drafter == "model" and free.gamma > 2 and kept.gamma == 2
    # an aligned copy 16 tokens into its run: beyond the limit by default, within it with bit_exact
    p = Policy(GPU)
    p.exact_rows = 3
    assert p.choose(Offer(16, 16, "aligned"), room=16).gamma > 2
    p.bit_exact = True
    copy = p.choose(Offer(16, 16, "aligned"), room=16)
    assert copy.drafter == "copy" and copy.gamma == 2
    # exact_rows 1 (an F16 target): the default drafts with the model, bit_exact never drafts
    p = Policy(GPU)
    p.exact_rows = 1
    assert p.choose(None, has_model=True, room=16).drafter == "model"
    p.bit_exact = True
    assert p.choose(None, has_model=True, room=16).drafter == "none"
    assert p.choose(Offer(16, 16, "aligned"), has_model=True, room=16).drafter == "none"
    # a shared pass (several sequences' rows, not cut into exact passes) is beyond the limit anyway
    shared = dict(has_model=True, room=16, base=(4, 4), seqs=4)
    p = Policy(GPU)
    p.exact_rows, p.bit_exact = 3, True
    assert p.choose(None, **shared) == Policy(GPU).choose(None, **shared)
