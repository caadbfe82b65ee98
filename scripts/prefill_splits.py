"""Issue 49, item 1: does a prompt's KV depend on how its prefill was cut into passes?

    python scripts/prefill_splits.py MODEL.gguf [MODEL.gguf ...] [--json out.json]

For each model and each setting (flash attention on/off, 1 and 2 threads, KV f16 and q8_0) the same
text (~700 tokens) is prefilled into a fresh context in several ways, then its last token is decoded
alone; each way is compared with the reference, today's rule (whole 128-token pieces from position 0):

    grid128     pieces of 128 (the reference; the last piece short)
    irregular   random piece sizes 1..200 (a later turn keeping whatever a cache held)
    min64x4     random sizes, each at least 64 and a multiple of 4 rows, the last piece padded up to that
    pad64x4     random sizes 1..200, every piece padded with dummy rows to at least 64 and a multiple of 4
    ones        the last 20 tokens one by one (a decode's kernels), the rest in 128 pieces

and, against a second reference, every piece padded to a whole number of 64-row tiles (a lead on flash
attention's CPU kernel: whole tiles of 64 query rows in one kernel, the rows left over in another):

    grid128pad  pieces of 128, the last one padded to a multiple of 64 (the second reference)
    pad64m      random sizes 1..200, every piece padded to a multiple of 64 (a later turn's new tokens)
    mult64      random multiples of 64 (64..192), the last padded
    pad64x4b    pad64x4 against this reference: every pass of at least 64 rows and a multiple of 4 (flash
                attention's CPU kernel takes a whole pass by its tiled path from 64 query rows on, the
                repacked weights' gemm rows in fours: ops.cpp, neq1 >= GGML_FA_TILE_Q)

Padding: dummy tokens appended after a piece's real ones, at later positions (the causal mask hides them
from the real rows), then removed from the cache (llama_memory_seq_rm) before the next piece.
Compared: llama_state_seq_get_data's bytes of the sequence (KV and all) and the last row's logits
(max |difference|; 0.0 is bit-exact). Prints a table; --json writes the rows.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgespec.backend import LlamaBackend  # noqa: E402

TEXT = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n") * 3 + \
       ("The harbour was quiet all winter. The nets were mended twice, the boats were painted, and the "
        "children counted the days until spring on the wall of the school. ") * 6


def _sizes(n: int, rng: random.Random, lo: int, hi: int, mult: int = 1) -> list[int]:
    out, left = [], n
    while left > 0:
        s = min(left, rng.randint(lo, hi))
        s = max(mult, s - s % mult) if left > s else s
        out.append(min(s, left))
        left -= out[-1]
    return out


def _prefill(b: LlamaBackend, toks: list[int], sizes: list[int], pad_to=None) -> None:
    at = 0
    for s in sizes:
        piece = toks[at:at + s]
        if pad_to is not None:
            want = pad_to(s)
            dummy = [toks[(at + k) % len(toks)] for k in range(want - s)]
            b.eval(piece + dummy, [])
            assert b.truncate(at + s)
        else:
            b.eval(piece, [])
        at += s


def _pad(s: int) -> int:
    n = max(64, s)
    return n + (-n) % 4


def _pad64(s: int) -> int:
    return s + (-s) % 64


def run(model: str, fa: str, threads: int, kv: str, seed: int = 0) -> list[dict]:
    b = LlamaBackend(model, n_ctx=1024, flash_attn=fa, threads=threads, type_k=kv, type_v=kv if fa == "on" else "f16")
    toks = b.tokenize(TEXT)[:700]
    head, last = toks[:-1], toks[-1]
    n = len(head)
    rng = random.Random(seed)
    ways = {
        "grid128": (_sizes(n, rng, 128, 128), None),
        "irregular": (_sizes(n, rng, 1, 200), None),
        "min64x4": (_sizes(n, rng, 64, 200, 4), _pad),
        "pad64x4": (_sizes(n, rng, 1, 200), _pad),
        "ones": ([128] * ((n - 20) // 128) + ([(n - 20) % 128] if (n - 20) % 128 else []) + [1] * 20, None),
        "grid128pad": (_sizes(n, rng, 128, 128), _pad64),
        "pad64m": (_sizes(n, rng, 1, 200), _pad64),
        "mult64": (_sizes(n, rng, 64, 192, 64), _pad64),
        "pad64x4b": (_sizes(n, rng, 1, 200), _pad),  # pad64x4 against grid128pad (every pass >= 64 rows)
    }
    out, ref = [], None
    for name, (sizes, pad) in ways.items():
        b.reset()
        _prefill(b, head, sizes, pad)
        state = b.save_state(0)[1]
        row = b.eval([last], [0])[0].copy()
        if ref is None or name == "grid128pad":
            ref = (state, row)
        out.append({"model": Path(model).name, "flash_attn": fa, "threads": threads, "kv": kv, "way": name,
                    "pieces": len(sizes), "state_equal": state == ref[0],
                    "logit_diff": float(np.abs(row - ref[1]).max())})
    b.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--json", default=None)
    ap.add_argument("--flash-attn", default="on,off", help="settings to try (default on,off)")
    ap.add_argument("--threads", default="1,2", help="default 1,2")
    ap.add_argument("--kv", default="f16,q8_0", help="default f16,q8_0")
    a = ap.parse_args()
    rows = []
    for model, fa, threads, kv in itertools.product(a.models, a.flash_attn.split(","),
                                                    [int(t) for t in a.threads.split(",")], a.kv.split(",")):
        got = run(model, fa, threads, kv)
        rows += got
        cells = "  ".join(f"{r['way']} {'=' if r['state_equal'] else 'x'} {r['logit_diff']:.3g}"
                          for r in got[1:] if r["way"] != "grid128pad")
        print(f"{Path(model).name:<42} fa {fa:<3} t{threads} kv {kv:<5} {cells}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
