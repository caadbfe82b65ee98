"""The prompt-lookup ceiling: what the n-gram drafter would give if every round's draft length
were chosen knowing the output in advance. No causal policy can beat it."""
from __future__ import annotations


def copy_ceiling(costs, prompt: list[int], out: list[int]) -> float:
    """Plain decoding's time over the hindsight-best n-gram schedule's, both in calibrated costs.

    At each position the drafter's proposal and how much of it the output confirms are fixed
    by the output; a dynamic programme over positions picks every round's draft length
    (0 allowed) to minimise the total verification cost."""
    from ..drafters.ngram import NgramIndex
    idx, toks, n_out = NgramIndex(), list(prompt), len(out)
    if not n_out:
        return 1.0
    offers = []  # (continuation tokens available, how many of them the output confirms)
    for pos in range(n_out):
        cont = idx.continuation(toks, costs.max_rows - 1)
        ok = 0
        while ok < len(cont) and pos + ok < n_out and cont[ok] == out[pos + ok]:
            ok += 1
        offers.append((len(cont), ok))
        toks.append(out[pos])
    best = [0.0] * (n_out + 1)  # best[pos]: least time to produce out[pos:]
    for pos in range(n_out - 1, -1, -1):
        avail, ok = offers[pos]
        best[pos] = min(costs.verify_cost(g + 1) + best[min(n_out, pos + min(g, ok) + 1)]
                        for g in range(avail + 1))
    return n_out * costs.verify_cost(1) / best[0]


