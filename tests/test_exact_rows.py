"""Passes kept to the rows a build computes exactly (issue 28): with repacked Q4_K weights on an
x86 CPU a pass of 4+ rows rounds every row otherwise than a single-row decode, and a greedy
answer parts from plain decoding's at near-ties. The calibration probes the limit; the policy
keeps passes within it unless going beyond saves INEXACT_MARGIN steps."""
from __future__ import annotations

import numpy as np

from edgespec.calibrate import exact_rows
from edgespec.policy import INEXACT_MARGIN, Costs, Offer, Policy
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


def test_a_marginal_draft_stays_within_the_exact_rows_and_a_long_copy_goes_beyond():
    # a model draft at 60%: on a GPU-like device it would draft long; within 3 rows it drafts 2
    p = Policy(GPU)
    free = p.choose(None, has_model=True, room=16)
    p.exact_rows = 3
    kept = p.choose(None, has_model=True, room=16)
    assert free.drafter == kept.drafter == "model" and free.gamma > 2 and kept.gamma == 2
    # an aligned copy 16 tokens into its run saves far more than INEXACT_MARGIN steps beyond it
    p = Policy(GPU)
    p.exact_rows = 3
    copy = p.choose(Offer(16, 16, "aligned"), room=16)
    assert copy.drafter == "copy" and copy.gamma > 2 and p.inexact == 1
    # a shared pass (several sequences' rows) is beyond the limit anyway: no rule there
    shared = dict(has_model=True, room=16, base=(4, 4), seqs=4)
    p = Policy(GPU)
    p.exact_rows = 3
    assert p.choose(None, **shared) == Policy(GPU).choose(None, **shared)
    assert INEXACT_MARGIN >= 1.0
