"""Benchmark edgespec against plain decoding, measured in the same run on the same loaded target.

For every workload prompt (chat template applied) it times the decode phase of plain greedy
decoding and of speculative decoding, checks that the two produced the same tokens, and
reports per kind: tokens/s, acceptance and the ratio to plain. With --acceptance it also
measures, at temperature 1, exact speculative sampling's acceptance against "sample from p
and compare with the draft's argmax" (what llama.cpp's server and llama-cpp-python do).
Writes JSON and prints a table.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from .errors import UsageError
from .sampling import SamplingParams

DEFAULT_WORKLOADS = Path(__file__).resolve().parent.parent / "workloads" / "prompts.jsonl"


def setup_arg_parser(p):
    p.add_argument("--workloads", default=str(DEFAULT_WORKLOADS), metavar="FILE",
                   help="JSONL of {id, kind, prompt} (default: workloads/prompts.jsonl)")
    p.add_argument("--kinds", default=None, metavar="K1,K2", help="only these kinds")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per kind")
    p.add_argument("--bench-tokens", type=int, default=128, metavar="N", help="tokens per generation (default 128)")
    p.add_argument("--trials", type=int, default=1, metavar="N", help="timed repetitions per prompt (default 1)")
    p.add_argument("--acceptance", action="store_true",
                   help="also measure T=1 acceptance: exact sampling vs draft-argmax matching")
    p.add_argument("--out", default="bench-results/bench.json", metavar="FILE", help="JSON output file")
    p.set_defaults(func=main)


def load_workloads(path: str, kinds: str | None = None, limit: int | None = None) -> list[dict]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read workloads file {path}: {exc.strerror}") from None
    items, per_kind = [], {}
    wanted = set(kinds.split(",")) if kinds else None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            item["id"], item["kind"], item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{path}:{n}: expected a JSON object with id, kind and prompt") from None
        if wanted and item["kind"] not in wanted:
            continue
        per_kind[item["kind"]] = per_kind.get(item["kind"], 0) + 1
        if limit is None or per_kind[item["kind"]] <= limit:
            items.append(item)
    if not items:
        raise UsageError(f"no workloads selected from {path}")
    return items


class ArgmaxDrafts:
    """Wraps a model drafter so it proposes its argmax and hands no q to the verifier: the
    target then samples from p and accepts while equal (llama.cpp server's scheme). Exact, but
    accepts less than min(1, p/q) sampling at T > 0."""

    def __init__(self, inner):
        self.inner, self.name = inner, "model-argmax"

    def begin(self, tokens):
        self.inner.begin(tokens)

    def propose(self, tokens, gamma, params, rng):
        drafts, _ = self.inner.propose(tokens, gamma, SamplingParams(0.0), rng)
        return drafts, None

    def accept(self, tokens):
        self.inner.accept(tokens)

    def close(self):
        pass


def _run(engine, prompt_tokens, n, params, seed=None):
    # from an empty cache every time: a reused prompt prefix would change the last bits of
    # the KV values, and so, at near-ties, which token greedy decoding picks
    engine.target.reset()
    if getattr(engine.drafter, "backend", None) is not None:
        engine.drafter.backend.reset()
    toks = [t for t, _ in engine.generate_tokens(prompt_tokens, n, params, seed)]
    return toks, engine.last_stats


def main(args) -> int:
    from .cli import load_engine
    from .engine import Engine

    items = load_workloads(args.workloads, args.kinds, args.limit)
    if args.bench_tokens < 1 or args.trials < 1:
        raise UsageError("--bench-tokens and --trials must be >= 1")
    spec = load_engine(args)
    plain = Engine(spec.target, None)
    greedy = SamplingParams(0.0)
    rows = []
    with spec:
        prompts = [spec.target.tokenize(spec.format_chat([{"role": "user", "content": it["prompt"]}]))
                   for it in items]
        _run(plain, prompts[0], 8, greedy)  # warm-up: page in weights, build kernels
        if spec.drafter:
            _run(spec, prompts[0], 8, greedy)
        t_start = time.perf_counter()
        for i, (it, ptoks) in enumerate(zip(items, prompts), 1):
            row = {"id": it["id"], "kind": it["kind"], "prompt_tokens": len(ptoks), "plain_tps": [],
                   "spec_tps": []}
            for _ in range(args.trials):
                ref, s0 = _run(plain, ptoks, args.bench_tokens, greedy)
                out, s1 = _run(spec, ptoks, args.bench_tokens, greedy)
                row["plain_tps"].append(s0.tokens_per_second)
                row["spec_tps"].append(s1.tokens_per_second)
            parted = next((j for j, (a, c) in enumerate(zip(out, ref)) if a != c),
                          None if len(out) == len(ref) else min(len(out), len(ref)))
            row.update(identical=parted is None, first_divergence=parted, generated=len(out), drafted=s1.drafted, accepted=s1.accepted,
                       acceptance=s1.acceptance_rate, accept_histogram=s1.accept_histogram,
                       target_forwards=s1.target_forwards, drafter=s1.drafter)
            row["plain_tps"] = statistics.median(row["plain_tps"])
            row["spec_tps"] = statistics.median(row["spec_tps"])
            row["ratio"] = row["spec_tps"] / row["plain_tps"] if row["plain_tps"] else 0.0
            if args.acceptance and spec.drafter is not None:
                t1 = SamplingParams(1.0)
                _, se = _run(spec, ptoks, args.bench_tokens, t1, seed=i)
                argmax_engine = Engine(spec.target, ArgmaxDrafts(spec.drafter), gamma=spec.gamma)
                _, sa = _run(argmax_engine, ptoks, args.bench_tokens, t1, seed=i)
                row.update(t1_exact_acceptance=se.acceptance_rate, t1_argmax_acceptance=sa.acceptance_rate)
            rows.append(row)
            eta = (time.perf_counter() - t_start) / i * (len(items) - i)
            print(f"[{i}/{len(items)}] {it['id']:<22} plain {row['plain_tps']:6.1f} tok/s  edgespec "
                  f"{row['spec_tps']:6.1f} tok/s  x{row['ratio']:.2f}  accept {row['acceptance']:.2f}  "
                  f"{'identical' if row['identical'] else 'DIFFERENT'}  (eta {eta:.0f}s)",
                  file=sys.stderr, flush=True)
    summary = summarize(rows)
    report = {"target": str(spec.target.path), "drafter": rows[0]["drafter"],
              "draft": str(spec.drafter.backend.path) if getattr(spec.drafter, "backend", None) else None,
              "gamma": spec.gamma, "threads": spec.target.threads, "bench_tokens": args.bench_tokens,
              "trials": args.trials, "rows": rows, "by_kind": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(summary))
    print(f"\nJSON: {out}")
    return 0


def summarize(rows: list[dict]) -> dict:
    kinds = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r)
    out = {}
    for kind, rs in kinds.items():
        plain = statistics.mean(r["plain_tps"] for r in rs)
        spec = statistics.mean(r["spec_tps"] for r in rs)
        d = {"prompts": len(rs), "plain_tps": plain, "spec_tps": spec, "ratio": spec / plain if plain else 0.0,
             "acceptance": (sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))),
             "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}"}
        if "t1_exact_acceptance" in rs[0]:
            d["t1_exact_acceptance"] = statistics.mean(r["t1_exact_acceptance"] for r in rs)
            d["t1_argmax_acceptance"] = statistics.mean(r["t1_argmax_acceptance"] for r in rs)
        out[kind] = d
    return out


def format_table(summary: dict) -> str:
    has_t1 = any("t1_exact_acceptance" in d for d in summary.values())
    head = "| kind | prompts | plain tok/s | edgespec tok/s | ratio | acceptance (T=0) | T=0 tokens identical |"
    sep = "|---|---|---|---|---|---|---|"
    if has_t1:
        head += " T=1 acceptance, exact | T=1 acceptance, argmax match |"
        sep += "---|---|"
    lines = [head, sep]
    for kind, d in summary.items():
        line = (f"| {kind} | {d['prompts']} | {d['plain_tps']:.1f} | {d['spec_tps']:.1f} | {d['ratio']:.2f}x | "
                f"{d['acceptance']:.2f} | {d['identical']} |")
        if has_t1:
            line += f" {d.get('t1_exact_acceptance', 0):.2f} | {d.get('t1_argmax_acceptance', 0):.2f} |"
        lines.append(line)
    return "\n".join(lines)
