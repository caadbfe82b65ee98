"""Several requests on one engine: `bench --parallel-requests [N]` (default N = 4).

On one engine loaded with parallel=N (both models' contexts holding N sequences) it measures, in
one run, speculative decoding (drafter auto) and plain decoding (drafter none, over the same loaded
target) at temperature 0:

1. Throughput. N different chat prompts (the first prompt of each kind of the workloads; --kinds,
   --limit and --workloads select others) served one after another, each alone, then all N at once
   from N threads. Reported: each answer's tokens, whether every concurrent answer equals its
   serial answer (and where it first parted if not), the wall times, the aggregate tokens/s of
   both (all tokens over the wall time, prompt processing included) and their ratio; and across
   the modes, auto concurrent against plain serial.
2. Latency beside a long answer. One thread streams a long answer (2 x --max-tokens, 256 by
   default); once its first token has arrived another thread sends a short request (--max-tokens
   / 8, 16 by default). Reported: the short request's wall time, the long answer's, their ratio
   (the goal: at most 0.3), and both requests' wall times alone for reference.

Every request starts from nothing (empty KV caches, drafters reset) so that no answer reuses an
earlier one's prompt or learns from it; each engine is warmed up with one short generation first.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from ..assemble import MAX_PARALLEL as MAX_REQUESTS
from ..errors import UsageError
from ..progress import report as report_progress
from .workloads import default_workloads, load_workloads

MODES = ("auto", "none")   # speculative, and plain decoding as its peer
GOAL = 0.3                 # the short request's wall time over the long answer's, at most
TASK = "benchmarking"


@dataclass(frozen=True)
class ParallelOptions:
    requests: int = 4                # N: prompts at once, and the engine's parallel
    max_tokens: int = 128            # per answer in the throughput part
    long_tokens: int = 256           # the long answer of the latency part
    short_tokens: int = 16           # the short request beside it
    workloads: Optional[str] = None  # None: the packaged workloads/prompts.jsonl
    kinds: Optional[str] = None
    limit: Optional[int] = 1         # prompts per kind
    out: str = "bench-results/parallel.json"

    @classmethod
    def of(cls, opts) -> "ParallelOptions":
        """From bench's Options: the latency part's budgets follow --max-tokens (x2 and /8)."""
        n = opts.bench_tokens
        return cls(requests=opts.parallel_requests, max_tokens=n, long_tokens=2 * n, short_tokens=max(2, n // 8),
                   workloads=opts.workloads, kinds=opts.kinds, limit=opts.limit if opts.limit is not None else 1,
                   out=opts.out if opts.out != "bench-results/bench.json" else cls.out)

    def validate(self) -> "ParallelOptions":
        if not 2 <= self.requests <= MAX_REQUESTS:
            raise UsageError(f"--parallel-requests takes 2..{MAX_REQUESTS} requests, got {self.requests}")
        if min(self.max_tokens, self.long_tokens, self.short_tokens) < 1:
            raise UsageError("--max-tokens must be >= 1")
        return self


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _parted(out: list[int], ref: list[int]) -> Optional[int]:
    """The first index where two answers differ (None: identical)."""
    return next((j for j, (a, c) in enumerate(zip(out, ref)) if a != c),
                None if len(out) == len(ref) else min(len(out), len(ref)))


def _one(engine, prompt: str, n: int) -> dict:
    """One request alone, from nothing: its tokens, stats and wall time."""
    engine.reset()
    t0 = time.perf_counter()
    r = engine.chat(_messages(prompt), max_tokens=n, temperature=0.0)
    return {"tokens": r.tokens, "stats": r.stats, "wall_s": time.perf_counter() - t0}


def _row(item: dict, run: dict) -> dict:
    st = run["stats"]
    return {"id": item["id"], "kind": item["kind"], "prompt_tokens": st.prompt_tokens, "generated": len(run["tokens"]),
            "wall_s": run["wall_s"], "prompt_s": st.prompt_seconds, "decode_tps": st.tokens_per_second,
            "drafted": st.drafted, "accepted": st.accepted, "finish_reason": st.finish_reason}


def _threads(jobs: list[Callable[[], dict]]) -> tuple[list[dict], float]:
    """Run the jobs at once, one thread each, released together: (their results, the wall time
    from the release to the last one's end). A job's exception is raised here."""
    results: list = [None] * len(jobs)
    errors: list = []
    gate = threading.Barrier(len(jobs) + 1)

    def work(i):
        try:
            gate.wait()
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return results, wall


def _timed_chat(engine, prompt: str, n: int) -> Callable[[], dict]:
    def job():
        t0 = time.perf_counter()
        r = engine.chat(_messages(prompt), max_tokens=n, temperature=0.0)
        return {"tokens": r.tokens, "stats": r.stats, "wall_s": time.perf_counter() - t0}
    return job


def throughput(engine, items: list[dict], n: int, step: Callable[[str], None]) -> dict:
    """The prompts one after another, then all at once; answers compared, tokens/s of both."""
    serial = []
    for it in items:
        serial.append(_one(engine, it["prompt"], n))
        step(f"serial {it['id']}")
    engine.reset()
    conc, wall = _threads([_timed_chat(engine, it["prompt"], n) for it in items])
    step("concurrent")
    s_wall = sum(r["wall_s"] for r in serial)
    s_tok = sum(len(r["tokens"]) for r in serial)
    c_tok = sum(len(r["tokens"]) for r in conc)
    rows = []
    for it, s, c in zip(items, serial, conc):
        parted = _parted(c["tokens"], s["tokens"])
        rows.append({"id": it["id"], "kind": it["kind"], "serial": _row(it, s), "concurrent": _row(it, c),
                     "identical": parted is None, "first_divergence": parted,
                     "gap_at_divergence": None if parted is None else _gap(engine, it["prompt"], s["tokens"],
                                                                            c["tokens"], parted)})
    s_tps = s_tok / s_wall if s_wall > 0 else 0.0
    c_tps = c_tok / wall if wall > 0 else 0.0
    return {"prompts": rows, "identical": all(r["identical"] for r in rows),
            "serial": {"wall_s": s_wall, "tokens": s_tok, "tps": s_tps},
            "concurrent": {"wall_s": wall, "tokens": c_tok, "tps": c_tps},
            "ratio": c_tps / s_tps if s_tps > 0 else None,
            "_answers": [s["tokens"] for s in serial]}


def _gap(engine, prompt: str, ref: list[int], other: list[int], j: int) -> Optional[float]:
    """Where two greedy answers parted: the target's logit of the serial answer's token less that
    of the concurrent answer's, at that position (the prompt and the serial answer's first j
    tokens evaluated alone, as one batch: within llama.cpp's batch rounding of the decode path).
    A gap under the measured difference between a row alone and in a shared pass (0.4-0.6 logits
    with repacked Q4_K weights) is a near-tie that kernel rounding can flip. None: one answer ended."""
    if j >= len(ref) or j >= len(other):
        return None
    tokens = engine.chat_tokens(_messages(prompt)) + list(ref[:j])
    engine.reset()
    try:
        row = engine.target.eval(tokens, [len(tokens) - 1], 0)[0]
    finally:
        engine.reset()
    return round(float(row[ref[j]] - row[other[j]]), 3)


def latency(engine, long_item: dict, short_item: dict, long_n: int, short_n: int,
            step: Callable[[str], None]) -> dict:
    """A short request sent once a long answer's first token has arrived, against both alone."""
    long_alone = _one(engine, long_item["prompt"], long_n)
    step("long answer alone")
    short_alone = _one(engine, short_item["prompt"], short_n)
    step("short request alone")
    engine.reset()
    first = threading.Event()
    out: dict = {}
    errors: list = []

    def long_job():
        try:
            t0 = time.perf_counter()
            with engine.stream_chat(_messages(long_item["prompt"]), max_tokens=long_n, temperature=0.0) as s:
                for ev in s:
                    if ev.token is not None and not first.is_set():
                        out["first_token_s"] = time.perf_counter() - t0
                        first.set()
            out["long"] = {"tokens": list(s.tokens), "stats": s.stats, "wall_s": time.perf_counter() - t0}
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)
        finally:
            first.set()

    th = threading.Thread(target=long_job, daemon=True)
    th.start()
    first.wait()
    short = None
    if not errors:
        short = _timed_chat(engine, short_item["prompt"], short_n)()
        out["long_running_when_short_ended"] = th.is_alive()
    th.join()
    if errors:
        raise errors[0]
    step("short request beside the long answer")
    lng = out["long"]
    ratio = short["wall_s"] / lng["wall_s"] if lng["wall_s"] > 0 else None
    return {"long": {**_row(long_item, lng), "alone_wall_s": long_alone["wall_s"],
                     "first_token_s": out.get("first_token_s"),
                     "identical_to_alone": _parted(lng["tokens"], long_alone["tokens"]) is None},
            "short": {**_row(short_item, short), "alone_wall_s": short_alone["wall_s"],
                      "identical_to_alone": _parted(short["tokens"], short_alone["tokens"]) is None},
            "short_over_long": ratio, "goal": GOAL, "meets_goal": ratio is not None and ratio <= GOAL,
            "long_still_running_when_short_ended": out.get("long_running_when_short_ended")}


def _pick_long(items: list[dict], answers: list[list[int]], n: int) -> int:
    """The prompt whose answer ran to the token limit (the longest when none did)."""
    full = [i for i, a in enumerate(answers) if len(a) >= n]
    return full[0] if full else max(range(len(items)), key=lambda i: len(answers[i]))


def measure(spec, plain, items: list[dict], opts: ParallelOptions, progress=None) -> dict:
    engines = {"auto": spec, "none": plain}
    total = len(engines) * (len(items) + 5)  # warm-up, serial, concurrent, long alone, short alone, both
    done = 0
    t_start = time.perf_counter()

    def step(mode):
        def tick(what):
            nonlocal done
            done += 1
            report_progress(progress, TASK, done, total, unit="steps", detail=f"{mode}: {what}")
            if getattr(progress, "live", False):  # a bar on a terminal draws it already
                return
            eta = (time.perf_counter() - t_start) / done * (total - done)
            print(f"[{done}/{total}] {mode:<4} {what:<40} (eta {eta:.0f}s)", file=sys.stderr, flush=True)
        return tick

    modes: dict = {}
    for name, eng in engines.items():
        tick = step(name)
        eng.reset()
        eng.chat(_messages("Hello"), max_tokens=8, temperature=0.0)  # warm-up: page in, build kernels
        tick("warm-up")
        modes[name] = throughput(eng, items, opts.max_tokens, tick)
    answers = modes["none"]["_answers"]
    li = _pick_long(items, answers, opts.max_tokens)
    si = (li + 1) % len(items)
    for name, eng in engines.items():
        modes[name]["latency"] = latency(eng, items[li], items[si], opts.long_tokens, opts.short_tokens, step(name))
    auto_ans = modes["auto"].pop("_answers")
    modes["none"].pop("_answers")
    for row, a, p in zip(modes["auto"]["prompts"], auto_ans, answers):
        parted = _parted(a, p)
        row["serial_identical_to_plain"], row["serial_first_divergence_from_plain"] = parted is None, parted
    ps = modes["none"]["serial"]["tps"]
    return {"target": str(spec.target.path), "draft": _draft_path(spec), "threads": spec.target.threads,
            "parallel": spec.parallel, "requests": len(items), "max_tokens": opts.max_tokens,
            "parallel_exact": bool(spec.exact_shared),
            "long_tokens": opts.long_tokens, "short_tokens": opts.short_tokens, "temperature": 0.0,
            "modes": modes,
            "auto_concurrent_over_plain_serial": modes["auto"]["concurrent"]["tps"] / ps if ps > 0 else None,
            "auto_serial_over_plain_serial": modes["auto"]["serial"]["tps"] / ps if ps > 0 else None}


def _loadavg() -> Optional[list[float]]:
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):  # not on every platform
        return None


def _draft_path(spec) -> Optional[str]:
    model = getattr(spec.drafter, "model", None)
    backend = getattr(model, "backend", None)
    return str(backend.path) if backend is not None else None


def format_report(r: dict) -> str:
    lines = [f"{r['requests']} requests on one engine with parallel={r['parallel']}"
             f"{' (--parallel-exact)' if r.get('parallel_exact') else ''}, {r['max_tokens']} tokens "
             f"each, T=0, {r['threads']} threads; tok/s = all tokens / wall time",
             f"{'drafter':<8} {'serial':>6} {'wall':>7} {'tok/s':>6}  {'at once':>7} {'wall':>7} {'tok/s':>6}  "
             f"{'ratio':>6}  same answers"]
    for name, m in r["modes"].items():
        s, c = m["serial"], m["concurrent"]
        same = sum(p["identical"] for p in m["prompts"])
        parted = [f"{p['id']} at {p['first_divergence']}"
                  + (f", gap {p['gap_at_divergence']:.2f}" if p.get("gap_at_divergence") is not None else "")
                  for p in m["prompts"] if not p["identical"]]
        lines.append(f"{name:<8} {s['tokens']:6d} {s['wall_s']:6.1f}s {s['tps']:6.1f}  {c['tokens']:7d} "
                     f"{c['wall_s']:6.1f}s {c['tps']:6.1f}  x{m['ratio'] or 0:5.2f}  {same}/{len(m['prompts'])}"
                     + (f" (parted: {', '.join(parted)})" if parted else ""))
    lines.append(f"auto at once / plain serial: x{r['auto_concurrent_over_plain_serial'] or 0:.2f}   "
                 f"auto serial / plain serial: x{r['auto_serial_over_plain_serial'] or 0:.2f}")
    auto, plain = r["modes"]["auto"]["prompts"], r["modes"]["none"]["prompts"]
    lines.append(f"\n{'prompt':<22} {'tokens':>6} {'auto wall':>14} {'plain wall':>14}  auto=plain")
    def walls(x):
        return f"{x['serial']['wall_s']:5.1f}s/{x['concurrent']['wall_s']:5.1f}s"

    for a, p in zip(auto, plain):
        same = "yes" if a["serial_identical_to_plain"] else f"parted at {a['serial_first_divergence_from_plain']}"
        lines.append(f"{a['id']:<22} {a['serial']['generated']:6d} {walls(a):>14} {walls(p):>14}  {same}")
    lines.append("(wall: serial/at once)")
    first = next(iter(r["modes"].values()))["latency"]
    lines.append(f"\nlatency beside a long answer ({first['long']['id']}, {r['long_tokens']} tokens at most; "
                 f"short request {first['short']['id']}, {r['short_tokens']}):")
    lines.append(f"{'drafter':<8} {'short':>7} {'alone':>7} {'long':>7} {'alone':>7}  short/long (goal <= {GOAL})")
    for name, m in r["modes"].items():
        lt = m["latency"]
        lines.append(f"{name:<8} {lt['short']['wall_s']:6.2f}s {lt['short']['alone_wall_s']:6.2f}s "
                     f"{lt['long']['wall_s']:6.2f}s {lt['long']['alone_wall_s']:6.2f}s  "
                     f"{lt['short_over_long'] or 0:.2f} {'ok' if lt['meets_goal'] else 'over'}"
                     f"  ({lt['long']['generated']} long tokens)")
    return "\n".join(lines)


def main(settings, opts, progress=None) -> int:
    """`bench --parallel-requests N`: `opts` is bench's Options (or a ParallelOptions)."""
    from ..engine import Engine
    po = (opts if isinstance(opts, ParallelOptions) else ParallelOptions.of(opts)).validate()
    items = load_workloads(po.workloads or str(default_workloads()), po.kinds, po.limit)
    if len(items) < po.requests:
        raise UsageError(f"--parallel-requests {po.requests} needs {po.requests} prompts; the selection has "
                         f"{len(items)}: raise --limit or name more --kinds")
    items = items[:po.requests]
    settings = replace(settings, parallel=po.requests, drafter="auto").validate()
    spec = Engine.from_settings(settings, progress=progress)  # calibrates the pair first if it never was
    with spec:
        if spec.parallel < po.requests:
            raise UsageError(f"the engine holds {spec.parallel} sequences, not {po.requests}: "
                             "give it more memory or fewer --parallel-requests")
        plain = Engine(spec.target, None, parallel=po.requests)  # the same loaded target
        plain.exact_shared = spec.exact_shared  # --parallel-exact for both
        before = _loadavg()
        result = measure(spec, plain, items, po, progress)
        result["loadavg_before"], result["loadavg_after"] = before, _loadavg()  # a busy machine shows here
    out = Path(po.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    print(f"\nJSON: {out}")
    return 0
