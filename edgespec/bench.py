"""Benchmark edgespec against plain decoding, measured in the same run on the same loaded target.

For every workload prompt (chat template applied) it times the decode phase of plain greedy
decoding and of speculative decoding, checks that the two produced the same tokens, and
reports per kind: tokens/s, acceptance and the ratio to plain. With --acceptance it also
measures, at temperature 1, exact speculative sampling's acceptance against "sample from p
and compare with the draft's argmax" (what llama.cpp's server and llama-cpp-python do).
With a calibrated target it also reports, per prompt, the prompt-lookup ceiling: the
speed-up that the n-gram drafter would give if every round's draft length were chosen
knowing the output in advance (costs from the calibration). No policy can beat it.
Writes JSON and prints a table.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .errors import UsageError
from .sampling import SamplingParams

DEFAULT_WORKLOADS = Path(__file__).resolve().parent.parent / "workloads" / "prompts.jsonl"


MODES = ("auto", "model", "ngram", "lookup-peer")


def setup_arg_parser(p):
    p.add_argument("--workloads", default=str(DEFAULT_WORKLOADS), metavar="FILE",
                   help="JSONL of {id, kind, prompt} (default: workloads/prompts.jsonl)")
    p.add_argument("--kinds", default=None, metavar="K1,K2", help="only these kinds")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per kind")
    p.add_argument("--bench-tokens", type=int, default=128, metavar="N", help="tokens per generation (default 128)")
    p.add_argument("--trials", type=int, default=1, metavar="N", help="timed repetitions per prompt (default 1)")
    p.add_argument("--modes", default="auto", metavar="M1,M2",
                   help="what to compare with plain decoding: " + ", ".join(MODES) + " (default auto); "
                   "lookup-peer is llama-cpp-python's own LlamaPromptLookupDecoding")
    p.add_argument("--sweep", default=None, metavar="G1,G2",
                   help="also run the n-gram drafter at these fixed draft lengths (for the chart)")
    p.add_argument("--acceptance", action="store_true",
                   help="also measure T=1 acceptance of the draft model: exact sampling vs draft-argmax matching")
    p.add_argument("--out", default="bench-results/bench.json", metavar="FILE",
                   help="JSON output; a PNG chart is written beside it when matplotlib is installed")
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
        self.inner, self.name, self.backend = inner, "model-argmax", inner.backend

    def begin(self, tokens):
        self.inner.begin(tokens)

    def propose(self, tokens, gamma, params, rng):
        drafts, _ = self.inner.propose(tokens, gamma, SamplingParams(0.0), rng)
        return drafts, None

    def accept(self, tokens):
        self.inner.accept(tokens)

    def close(self):
        pass


def copy_ceiling(costs, prompt: list[int], out: list[int]) -> float:
    """Plain decoding's time over the hindsight-best n-gram schedule's, both in calibrated costs.

    At each position the drafter's proposal and how much of it the output confirms are fixed
    by the output; a dynamic programme over positions picks every round's draft length
    (0 allowed) to minimise the total verification cost."""
    from .drafters.ngram import NgramIndex
    idx, toks, n_out = NgramIndex(), list(prompt), len(out)
    if not n_out:
        return 1.0
    offers = []  # (continuation tokens available, how many of them the output confirms)
    for pos in range(n_out):
        _, cont = idx.lookup(toks, costs.max_rows - 1)
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


def _run(engine, prompt_tokens, n, params, seed=None):
    # from nothing every time: a reused prompt prefix would change the last bits of the KV
    # values (and so, at near-ties, which token greedy decoding picks), and trials of one
    # prompt must not learn from each other
    engine.reset()
    toks = [t for t, _ in engine.generate_tokens(prompt_tokens, n, params, seed)]
    return toks, engine.last_stats


def _timed_run(runner, prompt_tokens, n, params):
    """(tokens, decode tokens/s, stats or None) for an edgespec engine or the lookup peer."""
    if isinstance(runner, LookupPeer):
        out, speed = runner.run(prompt_tokens, n)
        return out, speed, None
    out, st = _run(runner, prompt_tokens, n, params)
    return out, st.tokens_per_second, st


class LookupPeer:
    """llama-cpp-python's Llama with its LlamaPromptLookupDecoding draft model, greedy."""

    def __init__(self, path, n_ctx, threads):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   draft_model=LlamaPromptLookupDecoding(), verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.is_eog = llama_cpp.llama_vocab_is_eog

    def run(self, prompt_tokens, n):
        self.llm.reset()
        out, t_first = [], None
        for tok in self.llm.generate(prompt_tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if self.is_eog(self.vocab, tok):
                break
            if t_first is None:
                t_first = time.perf_counter()  # decode phase: after the first token
            out.append(tok)
            if len(out) >= n:
                break
        dt = time.perf_counter() - t_first if t_first else 0.0
        return out, (len(out) - 1) / dt if dt > 0 else 0.0

    def close(self):
        self.llm.close()


def _engines(spec, modes, sweep):
    from .drafters.ngram import NgramDrafter
    from .engine import Engine
    out = {}
    for m in modes:
        if m == "auto":
            out[m] = spec
        elif m == "model" and spec.drafter is not None:
            out[m] = Engine(spec.target, spec.drafter, gamma=spec.gamma)
        elif m == "ngram":
            out[m] = Engine(spec.target, ngram=NgramDrafter(), gamma=spec.gamma)
    for g in sweep:
        out[f"ngram-g{g}"] = Engine(spec.target, ngram=NgramDrafter(), gamma=g)
    return out


def main(args) -> int:
    from .cli import load_engine
    from .engine import Engine

    items = load_workloads(args.workloads, args.kinds, args.limit)
    if args.memory_budget:
        return memory_bench(args, items)
    if args.bench_tokens < 1 or args.trials < 1:
        raise UsageError("--bench-tokens and --trials must be >= 1")
    modes = [m for m in (args.modes or "").split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UsageError(f"unknown bench mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    try:
        sweep = [int(g) for g in args.sweep.split(",")] if args.sweep else []
    except ValueError:
        raise UsageError(f"--sweep takes draft lengths like 1,2,4,8, got {args.sweep!r}") from None
    args.drafter = "auto"
    spec = load_engine(args)
    plain = Engine(spec.target, None)
    engines = _engines(spec, modes, sweep)
    peer = LookupPeer(spec.target.path, spec.target.n_ctx, spec.target.threads) if "lookup-peer" in modes else None
    greedy = SamplingParams(0.0)
    rows = []
    with spec:
        prompts = [spec.target.tokenize(spec.format_chat([{"role": "user", "content": it["prompt"]}]))
                   for it in items]
        for eng in [plain, *engines.values(), *([peer] if peer else [])]:  # warm-up: page in, build kernels
            _timed_run(eng, prompts[0], 8, greedy)
        t_start = time.perf_counter()
        for i, (it, ptoks) in enumerate(zip(items, prompts), 1):
            row = {"id": it["id"], "kind": it["kind"], "prompt_tokens": len(ptoks), "modes": {}}
            runners = [("plain", plain), *engines.items()] + ([("lookup-peer", peer)] if peer else [])
            tps: dict[str, list[float]] = {name: [] for name, _ in runners}
            for t in range(args.trials):
                # rotate the order every trial, so that no mode always runs first or last
                k = t % len(runners)
                results = {name: _timed_run(eng, ptoks, args.bench_tokens, greedy)
                           for name, eng in runners[k:] + runners[:k]}
                ref = results["plain"][0]
                if t == 0 and spec.policy is not None:  # greedy from nothing: the same ref every trial
                    row["ngram_ceiling"] = copy_ceiling(spec.policy.costs, ptoks, ref)
                for name, (out, speed, st) in results.items():
                    tps[name].append(speed)
                    if name == "plain":
                        continue
                    parted = next((j for j, (a, c) in enumerate(zip(out, ref)) if a != c),
                                  None if len(out) == len(ref) else min(len(out), len(ref)))
                    m = row["modes"][name] = dict(identical=parted is None, first_divergence=parted,
                                                  generated=len(out))
                    if st is not None:
                        m.update(drafted=st.drafted, accepted=st.accepted, acceptance=st.acceptance_rate,
                                 by_drafter=st.by_drafter, accept_histogram=st.accept_histogram,
                                 target_forwards=st.target_forwards)
            row["plain_tps"] = statistics.median(tps["plain"])
            for name, vals in tps.items():
                if name != "plain":
                    m = row["modes"][name]
                    m["tps"] = statistics.median(vals)
                    # paired: each trial's ratio to the plain run beside it, then the median
                    m["ratio"] = statistics.median(v / p for v, p in zip(vals, tps["plain"]) if p > 0)
            if args.acceptance and spec.drafter is not None:
                t1 = SamplingParams(1.0)
                model = Engine(spec.target, spec.drafter, gamma=spec.gamma)
                _, se = _run(model, ptoks, args.bench_tokens, t1, seed=i)
                _, sa = _run(Engine(spec.target, ArgmaxDrafts(spec.drafter), gamma=spec.gamma),
                             ptoks, args.bench_tokens, t1, seed=i)
                row.update(t1_exact_acceptance=se.acceptance_rate, t1_argmax_acceptance=sa.acceptance_rate)
            rows.append(row)
            eta = (time.perf_counter() - t_start) / i * (len(items) - i)
            ratios = "  ".join(f"{k} x{m['ratio']:.2f}{'' if m['identical'] else '*'}"
                               for k, m in row["modes"].items())
            print(f"[{i}/{len(items)}] {it['id']:<20} plain {row['plain_tps']:5.1f} tok/s  {ratios}  (eta {eta:.0f}s)",
                  file=sys.stderr, flush=True)
    if peer:
        peer.close()
    summary = summarize(rows)
    report = {"target": str(spec.target.path),
              "draft": str(spec.drafter.backend.path) if spec.drafter else None,
              "gamma": spec.gamma, "threads": spec.target.threads, "bench_tokens": args.bench_tokens,
              "trials": args.trials, "calibration": list(spec.policy.costs.verify) if spec.policy else None,
              "rows": rows, "by_kind": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(summary))
    print(f"\nJSON: {out}")
    png = plot(report, out.with_suffix(".png"))
    if png:
        print(f"chart: {png}")
    return 0


def summarize(rows: list[dict]) -> dict:
    kinds: dict[str, list[dict]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(r)
    out = {}
    for kind, rs in kinds.items():
        plain = statistics.mean(r["plain_tps"] for r in rs)
        d = {"prompts": len(rs), "plain_tps": plain, "modes": {}}
        for name in rs[0]["modes"]:
            ms = [r["modes"][name] for r in rs]
            d["modes"][name] = {
                "tps": statistics.mean(m["tps"] for m in ms),
                "ratio": statistics.mean(m["ratio"] for m in ms),  # of the per-prompt paired ratios
                "acceptance": (sum(m.get("accepted", 0) for m in ms) / max(1, sum(m.get("drafted", 0) for m in ms))),
                "identical": f"{sum(m['identical'] for m in ms)}/{len(ms)}"}
        if "ngram_ceiling" in rs[0]:
            d["ngram_ceiling"] = statistics.mean(r["ngram_ceiling"] for r in rs)
        if "t1_exact_acceptance" in rs[0]:
            d["t1_exact_acceptance"] = statistics.mean(r["t1_exact_acceptance"] for r in rs)
            d["t1_argmax_acceptance"] = statistics.mean(r["t1_argmax_acceptance"] for r in rs)
        out[kind] = d
    return out


def format_table(summary: dict) -> str:
    lines = ["| kind | mode | tok/s | plain tok/s | ratio | acceptance (T=0) | T=0 identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for kind, d in summary.items():
        for name, m in d["modes"].items():
            acc = f"{m['acceptance']:.2f}" if name != "lookup-peer" else "-"
            lines.append(f"| {kind} | {name} | {m['tps']:.1f} | {d['plain_tps']:.1f} | {m['ratio']:.2f}x | "
                         f"{acc} | {m['identical']} |")
    if any("ngram_ceiling" in d for d in summary.values()):
        lines += ["", "| kind | prompt-lookup ceiling: hindsight-best draft lengths, calibrated costs |", "|---|---|"]
        for kind, d in summary.items():
            lines.append(f"| {kind} | {d['ngram_ceiling']:.2f}x |")
    if any("t1_exact_acceptance" in d for d in summary.values()):
        lines += ["", "| kind | T=1 acceptance, exact min(1, p/q) | T=1 acceptance, argmax match |", "|---|---|---|"]
        for kind, d in summary.items():
            lines.append(f"| {kind} | {d['t1_exact_acceptance']:.2f} | {d['t1_argmax_acceptance']:.2f} |")
    return "\n".join(lines)


def _pyplot():
    """matplotlib's pyplot drawing to files, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(report: dict, path: Path) -> Path | None:
    """Tokens/s against n-gram draft length per kind (from --sweep), plain and auto as lines."""
    plt = _pyplot()
    if plt is None:
        return None
    by_kind = report["by_kind"]
    sweep = sorted({int(k[7:]) for d in by_kind.values() for k in d["modes"] if k.startswith("ngram-g")})
    if not sweep:
        return None
    fig, axes = plt.subplots(1, len(by_kind), figsize=(4 * len(by_kind), 3.4), sharey=True)
    for ax, (kind, d) in zip(np.atleast_1d(axes), by_kind.items()):
        ax.plot(sweep, [d["modes"][f"ngram-g{g}"]["tps"] for g in sweep], "o-", label="n-gram, fixed length")
        ax.axhline(d["plain_tps"], color="gray", ls="--", label="plain decoding")
        if "auto" in d["modes"]:
            ax.axhline(d["modes"]["auto"]["tps"], color="green", ls=":", label="auto")
        ax.set_xscale("log", base=2)
        ax.set_title(kind)
        ax.set_xlabel("draft length")
    np.atleast_1d(axes)[0].set_ylabel("decode tokens/s")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


class RssSampler:
    """Peak resident memory of another process, sampled by psutil in a thread."""

    def __init__(self, pid: int, interval: float = 0.01):
        import threading

        import psutil
        self.proc, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        import psutil
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def memory_bench(args, items) -> int:
    """Each configuration that fits the budget, run in its own process: tokens/s, acceptance,
    peak RSS (sampled by psutil, and the kernel's high-water mark VmHWM) beside the estimate."""
    import subprocess
    import tempfile

    from .cli import target_name
    from .ggufinfo import read_info
    from .hub import resolve
    from .memory import parse_size, plan

    budget = parse_size(args.memory_budget)
    target, pair_draft = resolve(target_name(args), models_file=args.models)
    draft = args.draft or pair_draft
    result = plan(read_info(target), read_info(draft) if draft else None, n_ctx=args.ctx, budget=budget)
    configs = [c for c in result["configs"] if c["fits"] and c["n_ctx"] == args.ctx]
    firsts = list({it["kind"]: it for it in items}.values())  # one prompt per kind
    rows = []
    for i, cfg in enumerate(configs, 1):
        for it in firsts:
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
                fh.write(it["prompt"])
            cmd = [sys.executable, "-m", "edgespec", "run", "--target", str(target), "--drafter", cfg["drafter"],
                   "--ctx", str(cfg["n_ctx"]), "--json", "--max-tokens", str(args.bench_tokens), "-f", fh.name]
            if cfg["drafter"] == "model":
                cmd += ["--draft", str(draft)]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            sampler = RssSampler(child.pid)
            out, err = child.communicate()
            sampled = sampler.stop()
            Path(fh.name).unlink()
            if child.returncode != 0:
                raise UsageError(f"the {cfg['drafter']} run failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
            res = json.loads(out)
            peak = max(sampled, res["peak_rss_bytes"])
            rows.append({"drafter": cfg["drafter"], "n_ctx": cfg["n_ctx"], "id": it["id"], "kind": it["kind"],
                         "tokens_per_second": res["stats"]["tokens_per_second"],
                         "acceptance": res["stats"]["acceptance_rate"], "estimated_bytes": cfg["estimated_bytes"],
                         "peak_rss_bytes": peak, "peak_rss_sampled_bytes": sampled,
                         "error": (cfg["estimated_bytes"] - peak) / peak})
            print(f"[{i}/{len(configs)}] {cfg['drafter']:<6} {it['id']:<20} {res['stats']['tokens_per_second']:6.1f} tok/s  "
                  f"peak {peak / 2**20:7.0f} MiB  estimate {cfg['estimated_bytes'] / 2**20:7.0f} MiB",
                  file=sys.stderr, flush=True)
    report = {"budget_bytes": budget, "choice": result["choice"], "rows": rows}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    by_drafter = {}  # per configuration: its runs' mean speed and acceptance, highest peak
    for r in rows:
        by_drafter.setdefault(r["drafter"], []).append(r)
    summary = [{"drafter": d, "n_ctx": rs[0]["n_ctx"], "estimate": rs[0]["estimated_bytes"],
                "peak": max(r["peak_rss_bytes"] for r in rs),
                "tps": statistics.mean(r["tokens_per_second"] for r in rs),
                "acceptance": statistics.mean(r["acceptance"] for r in rs)} for d, rs in by_drafter.items()]
    print("| drafter | n_ctx | tok/s | acceptance | peak RSS (MiB) | estimate (MiB) | error |")
    print("|---|---|---|---|---|---|---|")
    for c in summary:
        print(f"| {c['drafter']} | {c['n_ctx']} | {c['tps']:.1f} | {c['acceptance']:.2f} | {c['peak'] / 2**20:.0f} | "
              f"{c['estimate'] / 2**20:.0f} | {100 * (c['estimate'] - c['peak']) / c['peak']:+.1f}% |")
    print(f"\nJSON: {out_path}")
    plt = _pyplot()
    if plt is not None and summary:
        x = np.arange(len(summary))
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(x - 0.2, [c["estimate"] / 2**20 for c in summary], 0.4, label="estimate")
        ax.bar(x + 0.2, [c["peak"] / 2**20 for c in summary], 0.4, label="measured peak RSS")
        ax.axhline(budget / 2**20, color="red", ls="--", label="budget")
        ax.set_xticks(x, [c["drafter"] for c in summary])
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_path.with_suffix(".png"), dpi=110)
        print(f"chart: {out_path.with_suffix('.png')}")
    return 0
