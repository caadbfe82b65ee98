"""Does a sequence's row come out the same in a pass shared with other sequences as alone?

    python scripts/batch_invariance.py MODEL.gguf [--no-repack] [--flash-attn on|off|auto] [--threads N]

Two checks on the real backend (edgespec.backend.LlamaBackend), printing the largest |logit
difference| of each (0.0: bit-exact):
1. four sequences one row each in one pass, against the same row decoded alone;
2. two sequences over 40 rounds of random multi-row parts with rejected drafts cut back
   (the second sequence's rows against a backend running its parts alone).
Measured on this project's machine (2 cores, AVX-512): SmolLM2 Q4_1 0.0 and 0.0; Qwen2.5-Coder-1.5B
Q4_K_M 0.36 and 0.64 with repacked weights, 0.0 and 0.58 with --no-repack.
"""
import argparse

import numpy as np

from edgespec.backend import LlamaBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--flash-attn", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    kw = dict(n_ctx=1024, flash_attn=a.flash_attn, threads=a.threads, repack=not a.no_repack)
    alone, shared = LlamaBackend(a.model, **kw), LlamaBackend(a.model, n_seq=4, **kw)
    texts = ["The lighthouse keeper climbed the stairs every night", "def fibonacci(n):\n    if n < 2:",
             "TCP and UDP differ in that", "The sea was calm and the"]
    toks = [alone.tokenize(t) for t in texts]
    for s, t in enumerate(toks):
        shared.eval(t, [0], seq=s)
    alone.eval(toks[1], [0])
    nxt = [500, 600, 700, 800]
    rows = shared.eval_batch([(s, [nxt[s]], [0]) for s in range(4)])
    print("1. one row in a 4-sequence pass vs alone:", float(np.abs(rows[1] - alone.eval([nxt[1]], [0])).max()))
    alone.reset()
    shared.reset()
    shared.eval(toks[0], [0], seq=0)
    shared.eval(toks[1], [0], seq=1)
    alone.eval(toks[1], [0])
    rng, worst = np.random.default_rng(0), 0.0
    for _ in range(40):
        ka, kb = (int(k) for k in rng.integers(1, 5, 2))
        ta, tb = [int(t) for t in rng.integers(100, 5000, ka)], [int(t) for t in rng.integers(100, 5000, kb)]
        out = shared.eval_batch([(0, ta, list(range(ka))), (1, tb, list(range(kb)))])
        worst = max(worst, float(np.abs(out[1] - alone.eval(tb, list(range(kb)))).max()))
        ca, cb = int(rng.integers(0, ka)), int(rng.integers(0, kb))  # drafts rejected: cut back
        shared.truncate(len(shared.held(0)) - ka + ca + 1, 0)
        shared.truncate(len(shared.held(1)) - kb + cb + 1, 1)
        alone.truncate(alone.n_past - kb + cb + 1)
    print("2. 40 rounds of multi-row parts with rejections, vs alone:", worst)


if __name__ == "__main__":
    main()
