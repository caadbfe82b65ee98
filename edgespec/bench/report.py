"""Per-kind summaries, the Markdown table and the chart of a benchmark run."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np


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
        if all("ngram_ceiling" in r for r in rs):
            d["ngram_ceiling"] = statistics.mean(r["ngram_ceiling"] for r in rs)
            for m in d["modes"].values():
                m["ceiling_fraction"] = ceiling_fraction(m["ratio"], d["ngram_ceiling"])
        if "t1_exact_acceptance" in rs[0]:
            d["t1_exact_acceptance"] = statistics.mean(r["t1_exact_acceptance"] for r in rs)
            d["t1_argmax_acceptance"] = statistics.mean(r["t1_argmax_acceptance"] for r in rs)
        out[kind] = d
    return out


def ceiling_fraction(ratio: float, ceiling: float) -> float | None:
    """How much of the hindsight ceiling's gain over plain decoding a mode reached: 1 is the
    ceiling, 0 plain decoding, below 0 slower than plain. None where the ceiling is within 2%
    of plain (nothing to reach: the fraction would be noise)."""
    if ceiling - 1.0 < 0.02:
        return None
    return (ratio - 1.0) / (ceiling - 1.0)


def _fraction(f) -> str:
    return "-" if f is None else f"{100 * f:.0f}%"


def format_table(summary: dict, sampling: str = "") -> str:
    """`sampling`: the law the modes sampled (empty: T = 0, where answers are compared with plain's)."""
    if sampling:
        lines = [f"| kind | mode | tok/s | plain tok/s | ratio | acceptance ({sampling}) |",
                 "|---|---|---|---|---|---|"]
    else:
        lines = ["| kind | mode | tok/s | plain tok/s | ratio | acceptance (T=0) | T=0 identical to plain |",
                 "|---|---|---|---|---|---|---|"]
    for kind, d in summary.items():
        for name, m in d["modes"].items():
            acc = f"{m['acceptance']:.2f}" if name != "lookup-peer" else "-"
            lines.append(f"| {kind} | {name} | {m['tps']:.1f} | {d['plain_tps']:.1f} | {m['ratio']:.2f}x | "
                         f"{acc} |" + ("" if sampling else f" {m['identical']} |"))
    if any("ngram_ceiling" in d for d in summary.values()):
        # per kind, every mode beside the hindsight prompt-lookup ceiling of the same run
        names = list(dict.fromkeys(n for d in summary.values() for n in d["modes"]))
        lines += ["", "| kind | prompt-lookup ceiling | " + " | ".join(f"{n}: ratio, share of the ceiling's gain"
                                                               for n in names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for kind, d in summary.items():
            if "ngram_ceiling" not in d:
                continue
            cells = [f"{d['modes'][n]['ratio']:.2f}x, {_fraction(d['modes'][n].get('ceiling_fraction'))}"
                     if n in d["modes"] else "-" for n in names]
            lines.append(f"| {kind} | {d['ngram_ceiling']:.2f}x | " + " | ".join(cells) + " |")
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


