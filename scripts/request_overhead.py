"""Where a short request's time goes: `edgespec serve --drafter none` beside llama-server plain on
the same GGUF, the same prompts, one at a time, each in --trials variants (a number appended: every request
evaluates its prompt; the first variant is a warm-up, not counted).

    python scripts/request_overhead.py MODEL.gguf [--llama-server PATH] [--tokens 30] [--trials 4]

For every request: the client's wall time, the server's own prompt and decode times (edgespec's
`edgespec` field, llama-server's `timings`), and the rest (HTTP, JSON, the queue, templating and
tokenizing: what the server costs beyond llama.cpp's passes). edgespec also says how its rest
splits (`edgespec.server_seconds`: prepare = body checked, template, tokens, constraint; queue;
total at the server). Medians in milliseconds.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["Write a haiku about autumn rain.", "Name three uses of a hash map.",
           "Say hello in French, Spanish and German.", "What is a mutex? One sentence."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: none, edgespec only)")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    from edgespec.bench.llama_server import Served, _free_port
    logs = ROOT / "bench-results" / "overhead-logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmds = {"edgespec none": [sys.executable, "-m", "edgespec", "serve", "--target", args.model, "--drafter", "none",
                              "--ctx", str(args.ctx), "--threads", str(args.threads), "--parallel", "1"]}
    if args.llama_server:
        cmds["llama-server"] = [args.llama_server, "-m", args.model, "-c", str(args.ctx), "-t", str(args.threads),
                                "-np", "1", "--host", "127.0.0.1", "--no-webui"]
    servers = {}
    try:
        for name, cmd in cmds.items():
            port = _free_port()
            servers[name] = Served(name, cmd + ["--port", str(port)], port, logs / f"{name.split()[0]}.log")
        for s in servers.values():
            s.wait_ready()
        import httpx
        rows = {name: [] for name in servers}
        texts: dict = {}
        walls: dict = {}
        for prompt in PROMPTS:
            for trial in range(args.trials + 1):
                for name, s in servers.items():
                    # a new prompt every time (the trial's number in it): each request evaluates its prompt
                    body = {"messages": [{"role": "user", "content": f"{prompt} (#{trial})"}],
                            "max_tokens": args.tokens, "temperature": 0}
                    t0 = time.perf_counter()
                    out = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).json()
                    wall = time.perf_counter() - t0
                    if trial == 0:
                        continue
                    t = out["timings"]
                    row = {"wall": wall * 1000, "prompt": t["prompt_ms"], "decode": t["predicted_ms"],
                           "tokens": out["usage"]["completion_tokens"]}
                    ext = out.get("edgespec", {}).get("server_seconds")
                    if ext:
                        row.update(prepare=ext["prepare"] * 1000, queue=ext["queue"] * 1000,
                                   at_server=ext["total"] * 1000)
                    row["rest"] = row["wall"] - row["prompt"] - row["decode"]
                    rows[name].append(row)
                    texts.setdefault((prompt, trial), {})[name] = out["choices"][0]["message"]["content"]
                    walls.setdefault((prompt, trial), {})[name] = wall
        same = sum(len(set(v.values())) == 1 for v in texts.values())
        print(f"answers equal across the servers: {same}/{len(texts)}")
        if len(servers) == 2:  # the same request to both, one after the other: their ratio
            ratios = [w["edgespec none"] / w["llama-server"] for w in walls.values()]
            print(f"edgespec none / llama-server wall time, same request: median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
        for name, got in rows.items():
            med = {k: statistics.median(r[k] for r in got) for k in got[0]}
            print(f"{name:14s} " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items()))
    finally:
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
