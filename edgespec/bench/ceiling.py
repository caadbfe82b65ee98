"""The prompt-lookup ceiling: what the n-gram drafter would give if every round's draft length
were chosen knowing the output in advance. No causal policy can beat it."""
from __future__ import annotations


def copy_ceiling(costs, prompt: list[int], out: list[int]) -> float:
    """Plain decoding's time over the hindsight-best n-gram schedule's, both in calibrated costs.

    At each position the drafter's proposal and how much of it the output confirms are fixed
    by the output; a dynamic programme over positions picks every round's draft length
    (0 allowed) to minimise the total verification cost."""
    from ..drafters.ngram import NgramIndex, agreed
    idx, toks, n_out = NgramIndex(), list(prompt), len(out)
    if not n_out:
        return 1.0
    offers = []  # (continuation tokens available, how many of them the output confirms)
    for pos in range(n_out):
        cont = idx.continuation(toks, costs.max_rows - 1)
        offers.append((len(cont), agreed(cont, out, pos)[0]))
        toks.append(out[pos])
    best = [0.0] * (n_out + 1)  # best[pos]: least time to produce out[pos:]
    for pos in range(n_out - 1, -1, -1):
        avail, ok = offers[pos]
        best[pos] = min(costs.verify_cost(g + 1) + best[min(n_out, pos + min(g, ok) + 1)]
                        for g in range(avail + 1))
    return n_out * costs.verify_cost(1) / best[0]


def replay(drafter, costs, prompt: list[int], out: list[int], draft_step: float = 0.0,
           clock=None) -> tuple[float, list[tuple[str, int, int]]]:
    """Run `drafter` over a known greedy output as the engine would, with the passes timed
    by `costs` instead of a device (a draft-model step costs `draft_step`): (plain decoding's
    time over the drafter's, and per round (draft source, drafted, accepted)).

    Exact at T = 0, where the committed tokens do not depend on the drafts; no model runs,
    so policies can be compared on the same outputs and costs, deterministically.
    `clock(rows) -> seconds` overrides what a pass is reported to cost (the true costs of a
    device the policy has wrong beliefs about)."""
    import numpy as np

    from ..drafters import Round
    from ..drafters.ngram import agreed
    from ..sampling import SamplingParams
    clock = clock or costs.verify_cost
    tokens, i, spent, rounds = list(prompt), 0, 0.0, []
    drafter.begin(tokens)
    greedy, rng = SamplingParams(0.0), np.random.default_rng(0)
    while i < len(out):
        room = len(out) - i - 1
        d = drafter.propose(tokens, room, greedy, rng) if room > 0 else None
        drafts = d.tokens if d is not None else []
        n = agreed(drafts, out, i)[0]
        rows = len(drafts) + (1 if i else 0)  # the first round's own row came with the prompt
        took = clock(rows) if rows else 0.0
        dt = len(drafts) * draft_step if d is not None and d.source == "model" else 0.0
        spent += took + dt
        tokens.extend(out[i:i + n + 1])
        i += n + 1
        if d is not None:
            drafter.observe(Round(list(tokens), d, n, rows, took, dt))
        rounds.append((d.source if drafts else "none", len(drafts), n))
    plain = (len(out) - 1) * clock(1)
    return (plain / spent if spent else 1.0), rounds
