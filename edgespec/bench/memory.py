"""The memory benchmark: each configuration that fits a budget, in its own process."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .report import _pyplot


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


def memory_bench(settings, opts, items) -> int:
    """Each configuration that fits the budget, run in its own process: tokens/s, acceptance,
    peak RSS (sampled by psutil, and the kernel's high-water mark VmHWM) beside the estimate."""
    import subprocess
    import tempfile

    from dataclasses import replace

    from ..assemble import plan_for, resolve_files
    from ..ggufinfo import read_info

    budget = settings.budget_bytes()
    target, draft = resolve_files(replace(settings, drafter="auto"))
    # the rule `plan` and `run` follow: the prompt cache's share is set aside before fitting
    result = plan_for(replace(settings, drafter="auto"), read_info(target), read_info(draft) if draft else None)
    cache = result["cache_bytes"]
    configs = [c for c in result["configs"] if c["fits"] and c["n_ctx"] == settings.n_ctx]
    firsts = list({it["kind"]: it for it in items}.values())  # one prompt per kind
    rows = []
    for i, cfg in enumerate(configs, 1):
        for it in firsts:
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
                fh.write(it["prompt"])
            cmd = [sys.executable, "-m", "edgespec", "run", "--target", str(target), "--drafter", cfg["drafter"],
                   "--ctx", str(cfg["n_ctx"]), "--json", "--max-tokens", str(opts.bench_tokens), "-f", fh.name,
                   "--flash-attn", settings.flash_attn, "--n-gpu-layers", str(settings.n_gpu_layers),
                   "--draft-n-gpu-layers", str(settings.draft_n_gpu_layers),
                   "--cache-ram", f"{cache}B" if cache else "0"]
            if cfg["drafter"] == "model":
                cmd += ["--draft", str(draft)]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            sampler = RssSampler(child.pid)
            out, err = child.communicate()
            sampled = sampler.stop()
            Path(fh.name).unlink()
            if child.returncode != 0:
                last = err.strip().splitlines()[-1] if err.strip() else "?"
                raise UsageError(f"the {cfg['drafter']} run failed: {last}")
            res = json.loads(out)
            peak = max(sampled, res["peak_rss_bytes"])
            rows.append({"drafter": cfg["drafter"], "n_ctx": cfg["n_ctx"], "id": it["id"], "kind": it["kind"],
                         "tokens_per_second": res["stats"]["tokens_per_second"],
                         "acceptance": res["stats"]["acceptance_rate"], "estimated_bytes": cfg["estimated_bytes"],
                         "peak_rss_bytes": peak, "peak_rss_sampled_bytes": sampled,
                         "error": (cfg["estimated_bytes"] - peak) / peak})
            tps = res["stats"]["tokens_per_second"]
            print(f"[{i}/{len(configs)}] {cfg['drafter']:<6} {it['id']:<20} {tps:6.1f} tok/s  "
                  f"peak {peak / 2**20:7.0f} MiB  estimate {cfg['estimated_bytes'] / 2**20:7.0f} MiB",
                  file=sys.stderr, flush=True)
    report = {"budget_bytes": budget, "cache_bytes": cache, "fit_bytes": result["fit_bytes"],
              "choice": result["choice"], "rows": rows}
    out_path = Path(opts.out)
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
