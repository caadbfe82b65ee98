"""The memory-budget sweep: `bench --memory-budget 1GiB,1.5GiB,2GiB,3GiB,4GiB`.

For each budget the planner picks a configuration in its fallback order (the pair with its
draft model in the asked memory mode, then in the cheaper ones: q8_0 KV, no repacked weights,
both; then n-gram drafting alone, then plain decoding, then smaller contexts) by the rule `plan`
and `run` follow (the prompt cache's share, --cache-ram, set aside first), and one process per
budget and prompt runs it with `--memory-budget`, `--cache-ram` and the chosen memory mode set,
so that what it measures (peak RSS, decode speed, acceptance) is that configuration alone. Plain
decoding in the default mode (f16 KV, repacked weights, no budget) runs too, before and after the
budgets, each prompt in its own process: every budget's speed is also given as a ratio to it.
A budget that fits nothing, or whose run fails, is a row that says so; the sweep goes on.
Table, JSON and a chart.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from ..errors import UsageError

MiB = 2**20


def parse_budgets(text: str) -> list[int]:
    """'1GiB,2GiB,4GiB' -> bytes, in the order given."""
    from ..memory import parse_size
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise UsageError(f"--memory-budget takes sizes like 1GiB,2GiB,4GiB, got {text!r}")
    return [parse_size(p, "--memory-budget") for p in parts]


def choices(settings, t_info, d_info, budgets: list[int]) -> list[dict]:
    """The planner's choice for each budget, by the rule `plan` and `run` follow (assemble.plan_for:
    the prompt cache's share set aside first): {budget_bytes, cache_bytes, fit_bytes, drafter,
    n_ctx, estimated_bytes, reason, memory_mode (memory.MemoryMode.as_dict), flash_attn} (drafter
    None when nothing fits)."""
    from ..assemble import plan_for
    out = []
    for b in budgets:
        res = plan_for(replace(settings, memory_budget=b), t_info, d_info)
        ch = res["choice"]
        out.append({"budget_bytes": b, "cache_bytes": res["cache_bytes"], "fit_bytes": res["fit_bytes"],
                    "drafter": ch.get("drafter"), "n_ctx": ch.get("n_ctx"),
                    "estimated_bytes": ch.get("estimated_bytes"), "reason": ch["reason"],
                    "memory_mode": ch.get("memory_mode"), "flash_attn": ch.get("flash_attn", settings.flash_attn)})
    return out


def mode_flags(mode: Optional[dict]) -> list[str]:
    """The command-line flags of a memory mode (memory.MemoryMode.as_dict), none for the default."""
    if not mode:
        return []
    flags = [] if mode["repack"] else ["--no-repack"]
    for key, flag in (("type_k", "-ctk"), ("type_v", "-ctv"), ("draft_type_k", "-ctkd"), ("draft_type_v", "-ctvd")):
        if mode[key] != "f16":
            flags += [flag, mode[key]]
    return flags


def child_command(settings, target, draft, choice: dict, prompt_file: str, max_tokens: int) -> list[str]:
    """`edgespec run` for one budget: the chosen context and memory mode, the budget itself (the
    child plans again and drops the draft model exactly as the sweep's plan did), the settings
    that decide memory."""
    drafter = {"model": "auto", "ngram": "auto", "none": "none"}[choice["drafter"]]
    cache = choice.get("cache_bytes")  # the share the sweep's plan set aside, given explicitly
    cmd = [sys.executable, "-m", "edgespec", "run", "--target", str(target), "--drafter", drafter,
           "--ctx", str(choice["n_ctx"]), "--memory-budget", f"{choice['budget_bytes']}B",
           *(["--cache-ram", f"{cache}B" if cache else "0"] if cache is not None else []), "--json",
           "--max-tokens", str(max_tokens), "-f", prompt_file, "--flash-attn", settings.flash_attn,
           "--n-gpu-layers", str(settings.n_gpu_layers), "--draft-n-gpu-layers", str(settings.draft_n_gpu_layers),
           *mode_flags(choice.get("memory_mode"))]
    if draft is not None and choice["drafter"] != "none":
        cmd += ["--draft", str(draft)]
    if settings.threads:
        cmd += ["--threads", str(settings.threads)]
    if settings.models_file:
        cmd += ["--models", str(settings.models_file)]
    return cmd


def baseline_command(settings, target, prompt_file: str, max_tokens: int) -> list[str]:
    """Plain decoding of the target in the default memory mode, no budget: what every budget's
    speed is a ratio to."""
    cmd = [sys.executable, "-m", "edgespec", "run", "--target", str(target), "--drafter", "none",
           "--ctx", str(settings.n_ctx), "--cache-ram", "0", "--json", "--max-tokens", str(max_tokens),
           "-f", prompt_file, "--flash-attn", settings.flash_attn, "--n-gpu-layers", str(settings.n_gpu_layers)]
    if settings.threads:
        cmd += ["--threads", str(settings.threads)]
    return cmd


def run_child(cmd: list[str]) -> dict:
    """Run one configuration in its own process: its --json result, with the peak RSS both as
    the child's own high-water mark and as sampled from outside."""
    from .memory import RssSampler
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = RssSampler(child.pid)
    out, err = child.communicate()
    sampled = sampler.stop()
    if child.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else "?"
        raise UsageError(f"the run for this budget failed: {last}")
    res = json.loads(out)
    res["peak_rss_sampled_bytes"] = sampled
    return res


def sweep(settings, budgets: list[int], prompts: list[dict], *, max_tokens: int = 128,
          runner: Optional[Callable[[list[str]], dict]] = None, say: Optional[Callable[[str], None]] = None,
          baseline: bool = True) -> dict:
    """Plan each budget, run its choice once per prompt (each in its own process, by `runner`:
    default run_child), report. `baseline`: also run plain f16 decoding of each prompt before and
    after the budgets (no budget), and give each budget's speed as a ratio to its mean."""
    from ..assemble import resolve_files
    from ..ggufinfo import read_info
    runner = runner or run_child
    target, draft = resolve_files(replace(settings, drafter="auto"))
    t_info, d_info = read_info(target), read_info(draft) if draft else None
    files = {}
    for it in prompts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as fh:
            fh.write(it["prompt"])
        files[it["id"]] = fh.name
    plain: dict[str, list[float]] = {it["id"]: [] for it in prompts}

    def run_plain(when: str):
        for it in prompts:
            try:
                res = runner(baseline_command(settings, target, files[it["id"]], max_tokens))
            except UsageError as exc:
                if say:
                    say(f"plain decoding ({when}) failed: {exc}")
                continue
            plain[it["id"]].append(res["stats"]["tokens_per_second"])
    rows = []
    try:
        if baseline:
            run_plain("before")
            if say:
                say("plain f16 decoding, no budget: " + ", ".join(f"{k} {statistics.mean(v):.2f} tok/s"
                                                                  for k, v in plain.items() if v))
        for i, ch in enumerate(choices(settings, t_info, d_info, budgets), 1):
            row = dict(ch, runs=[])
            if ch["drafter"] is not None:
                for it in prompts:
                    try:
                        res = runner(child_command(settings, target, draft, ch, files[it["id"]], max_tokens))
                    except UsageError as exc:  # this budget's run failed: a row that says so, and on to the next
                        row["error"] = str(exc)
                        break
                    st = res["stats"]
                    row["runs"].append({"id": it["id"], "kind": it["kind"],
                                        "tokens_per_second": st["tokens_per_second"],
                                        "acceptance": st["acceptance_rate"], "drafter": st.get("drafter"),
                                        "peak_rss_bytes": max(res["peak_rss_bytes"],
                                                              res.get("peak_rss_sampled_bytes", 0))})
            if row["runs"] and "error" not in row:
                row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in row["runs"])
                row["tokens_per_second"] = statistics.mean(r["tokens_per_second"] for r in row["runs"])
                row["acceptance"] = statistics.mean(r["acceptance"] for r in row["runs"])
            rows.append(row)
            if say:
                say(f"[{i}/{len(budgets)}] {describe(row)}")
        if baseline:
            run_plain("after")
    finally:
        for name in files.values():
            Path(name).unlink(missing_ok=True)
    plain_tps = {k: statistics.mean(v) for k, v in plain.items() if v}
    for row in rows:  # each prompt against plain decoding of the same prompt
        ratios = [r["tokens_per_second"] / plain_tps[r["id"]] for r in row["runs"] if plain_tps.get(r["id"])]
        if ratios and "tokens_per_second" in row:
            row["speed_vs_plain"] = statistics.mean(ratios)
    return {"target": str(target), "draft": str(draft) if draft else None, "wanted_n_ctx": settings.n_ctx,
            "flash_attn": settings.flash_attn, "max_tokens": max_tokens, "rows": rows,
            "plain_tokens_per_second": {k: v for k, v in plain.items() if v}}


CONFIG_NAMES = {"model": "pair (draft model)", "ngram": "n-gram only", "none": "plain decoding"}


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / MiB:.3g} MiB"


def _cache_words(row: dict) -> str:
    cache = row.get("cache_bytes")
    return f" ({_size(cache)} of it for the prompt cache)" if cache else ""


def _mode_name(row: dict) -> str:
    return (row.get("memory_mode") or {}).get("name", "default")


def describe(row: dict) -> str:
    head = f"{_size(row['budget_bytes'])}{_cache_words(row)}"
    if row["drafter"] is None:
        return f"{head}: nothing fits ({row['reason']})"
    s = (f"{head}: {CONFIG_NAMES[row['drafter']]} at n_ctx {row['n_ctx']}, memory mode {_mode_name(row)}, "
         f"planned {row['estimated_bytes'] / MiB:.0f} MiB")
    if "error" in row:
        s += f", but its run failed: {row['error']}"
    if "peak_rss_bytes" in row:
        s += f", measured {row['peak_rss_bytes'] / MiB:.0f} MiB, {row['tokens_per_second']:.1f} tok/s"
    if "speed_vs_plain" in row:
        s += f" (x{row['speed_vs_plain']:.2f} plain f16 decoding)"
    return s


def format_table(report: dict) -> str:
    lines = ["| budget | prompt cache (MiB) | configuration | n_ctx | memory mode | planned (MiB) "
             "| measured peak (MiB) | tok/s | x plain f16 | acceptance |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        b = _size(r["budget_bytes"])
        cache = f"{r['cache_bytes'] / MiB:.3g}" if r.get("cache_bytes") is not None else ""
        if r["drafter"] is None:
            lines.append(f"| {b} | {cache} | nothing fits | | | | | | | |")
            continue
        config = CONFIG_NAMES[r["drafter"]] + (" (run failed)" if "error" in r else "")
        peak = f"{r['peak_rss_bytes'] / MiB:.0f}" if "peak_rss_bytes" in r else ""
        tps = f"{r['tokens_per_second']:.1f}" if "tokens_per_second" in r else ""
        ratio = f"{r['speed_vs_plain']:.2f}" if "speed_vs_plain" in r else ""
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else ""
        lines.append(f"| {b} | {cache} | {config} | {r['n_ctx']} | {_mode_name(r)} | {r['estimated_bytes'] / MiB:.0f} "
                     f"| {peak} | {tps} | {ratio} | {acc} |")
    plain = report.get("plain_tokens_per_second") or {}
    if plain:
        lines.append("")
        lines.append("plain f16 decoding (no budget), tok/s, before and after: "
                     + "; ".join(f"{k} " + " / ".join(f"{x:.2f}" for x in v) for k, v in plain.items()))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Optional[Path]:
    """Planned and measured peak per budget against the budget itself, tok/s written on top."""
    from .report import _pyplot
    plt = _pyplot()
    rows = [r for r in report["rows"] if r["drafter"] is not None]
    if plt is None or not rows:
        return None
    import numpy as np
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.bar(x - 0.2, [r["estimated_bytes"] / MiB for r in rows], 0.4, label="planned")
    ax.bar(x + 0.2, [r.get("peak_rss_bytes", 0) / MiB for r in rows], 0.4, label="measured peak RSS")
    ax.scatter(x, [r["budget_bytes"] / MiB for r in rows], marker="_", s=900, color="red", label="budget")
    for xi, r in zip(x, rows):
        if "tokens_per_second" in r:
            ax.annotate(f"{r['tokens_per_second']:.1f} tok/s", (xi, r["estimated_bytes"] / MiB), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(x, [f"{_size(r['budget_bytes'])}\n{CONFIG_NAMES[r['drafter']]}\nn_ctx {r['n_ctx']}\n{_mode_name(r)}"
                      for r in rows], fontsize=7)
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(settings, budgets: list[int], opts) -> int:
    """The sweep as `bench --memory-budget A,B,...` runs it (`opts`: the bench's Options; one
    prompt per kind): progress on stderr, table on stdout, JSON as budgets.json beside --out."""
    from .workloads import default_workloads, load_workloads

    def say(text):
        print(text, file=sys.stderr, flush=True)
    items = load_workloads(opts.workloads or str(default_workloads()), opts.kinds, opts.limit)
    prompts = list({it["kind"]: it for it in reversed(items)}.values())[::-1]  # the first of each kind
    report = sweep(settings, budgets, prompts, max_tokens=opts.bench_tokens, say=say)
    out_path = Path(opts.out).with_name("budgets.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"\nJSON: {out_path}")
    png = plot(report, out_path.with_suffix(".png"))
    if png:
        print(f"chart: {png}")
    return 0
