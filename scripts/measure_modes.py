"""The speed cost of each memory mode on one target model: a decode step T(1), a prefill of 256
tokens, and verification passes of k = 2, 4, 8 rows (k tokens, logits for each, as speculation
verifies), all at a context depth of --depth tokens, each as a ratio to the default mode (f16
KV, repacked weights) measured in the same run. The modes are loaded side by side, their contexts
filled to the depth once, and measured in turn, round after round (a busy spell on the machine
falls on every mode alike); the figures are medians over the rounds.

Usage: python scripts/measure_modes.py MODEL.gguf [--ctx 8192] [--depth 512] [--rounds 7]
       [--threads N] [--modes default,q8_0,norepack,q8_0+norepack] [--json]
(run from the repository root on an otherwise idle machine; memory.MODE_SPEED and the speed
table of docs/memory.md were made with it). Times are wall-clock; process CPU time is printed
beside them (with one thread it is what the mode costs whatever else runs).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from edgespec.backend import LlamaBackend, default_threads  # noqa: E402

MODES = {"default": (True, "f16", "f16"), "q8_0": (True, "q8_0", "q8_0"), "norepack": (False, "f16", "f16"),
         "q8_0+norepack": (False, "q8_0", "q8_0"), "q4_0": (True, "q4_0", "q4_0")}
KS = (2, 4, 8)


def tokens_of(backend, n: int) -> list[int]:
    text = ("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
            "    left = [x for x in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n"
            "    return quicksort(left) + [pivot] + quicksort(right)\n\n")
    toks = backend.tokenize(text * (n // 40 + 2))
    return toks[:n]


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def setup(b, toks: list[int], depth: int) -> None:
    """Fill b's context to `depth` tokens (once: the rounds measure at that depth)."""
    b.reset()
    for start in range(0, depth, 512):
        part = toks[start:min(depth, start + 512)]
        b.eval(part, [len(part) - 1])


def one_round(b, toks: list[int], depth: int) -> dict:
    """One of each measurement on backend b, its context at `depth`: {name: (wall, cpu)}; the
    context is cut back to `depth` after each."""
    out = {}
    nxt = toks[depth:depth + 256]
    out["prefill_256"] = timed(lambda: b.eval(nxt, [255]))
    b.truncate(depth)
    b.eval(nxt[:1], [0])  # a warm step, not timed
    b.truncate(depth)
    steps = []
    for _ in range(3):
        steps.append(timed(lambda: b.eval(nxt[:1], [0])))
        b.truncate(depth)
    out["decode"] = tuple(statistics.median(s[i] for s in steps) for i in (0, 1))
    for k in KS:
        out[f"verify_{k}"] = timed(lambda: b.eval(nxt[:k], list(range(k))))
        b.truncate(depth)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=512, help="context depth of the decode steps and passes")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", default="default,q8_0,norepack,q8_0+norepack")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = a.modes.split(",")
    if names[0] != "default":
        names.insert(0, "default")
    threads = a.threads or default_threads()
    backends = {}
    for n in names:
        repack, tk, tv = MODES[n]
        backends[n] = LlamaBackend(a.model, n_ctx=a.ctx, threads=threads, flash_attn="on", repack=repack,
                                   type_k=tk, type_v=tv)
    toks = tokens_of(backends["default"], a.depth + 256)
    for n, b in backends.items():  # fill and warm every mode (page faults, first graphs) before anything counts
        t0 = time.perf_counter()
        setup(b, toks, a.depth)
        print(f"{n}: {a.depth} tokens prefilled in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        one_round(b, toks, a.depth)
    samples = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate, so neither end of a round is favoured
        for n in order:
            samples[n].append(one_round(backends[n], toks, a.depth))
        print(f"round {r + 1}/{a.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    load.append(os.getloadavg()[0])
    keys = ["decode", "prefill_256"] + [f"verify_{k}" for k in KS]
    med = {n: {k: [statistics.median(s[k][i] for s in samples[n]) for i in (0, 1)] for k in keys} for n in names}
    result = {"model": os.path.basename(a.model), "threads": threads, "ctx": a.ctx, "depth": a.depth,
              "rounds": a.rounds, "loadavg_before_after": load,
              "ms": {n: {k: 1000 * v[0] for k, v in med[n].items()} for n in names},
              "cpu_ms": {n: {k: 1000 * v[1] for k, v in med[n].items()} for n in names},
              # speed as a ratio to the default mode's (above 1: faster), by wall time and by CPU time
              "speed": {n: {k: med["default"][k][0] / med[n][k][0] for k in keys} for n in names},
              "speed_cpu": {n: {k: med["default"][k][1] / med[n][k][1] for k in keys} for n in names}}
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['model']}, {threads} threads, n_ctx {a.ctx}, depth {a.depth}, medians of {a.rounds} rounds, "
          f"load average {load[0]:.2f} -> {load[1]:.2f}")
    print(f"{'mode':<16}" + "".join(f"{k:>22}" for k in keys))
    for n in names:
        cells = [f"{result['ms'][n][k]:8.1f}ms x{result['speed'][n][k]:.2f} ({result['speed_cpu'][n][k]:.2f})"
                 for k in keys]
        print(f"{n:<16}" + "".join(f"{c:>22}" for c in cells))
    print("x: speed as a ratio to the default mode (wall time; in brackets: process CPU time)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
