"""Several requests at once, server beside server: llama-server -np N and edgespec serve --parallel N.

    python scripts/parallel_servers.py --llama-server PATH [--requests 4] [--max-tokens 128] [--pair NAME]

Each server is started alone on the same GGUFs (the pair's target; edgespec also its draft), 2 threads,
--ctx tokens per sequence. After one warm-up request it answers N prompts (the first of each kind of
the workloads, as `bench --parallel-requests`) one after another, then the same N at once from N
threads, chat endpoint, T = 0. Printed per server: the serial and at-once wall times, all completion
tokens over them, their ratio, and how many at-once answers equal their serial ones. Servers run one
at a time (each has the machine to itself); the figure is one run's: on a noisy machine run it twice.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgespec.bench.llama_server import Served, _free_port  # noqa: E402
from edgespec.bench.parallel import _threads  # noqa: E402
from edgespec.bench.workloads import default_workloads, load_workloads  # noqa: E402


def measure(server: Served, prompts: list[str], n: int) -> dict:
    server.ask("Hello", 8)  # warm-up
    serial, t0 = [], time.perf_counter()
    for p in prompts:
        serial.append(server.ask(p, n))
    s_wall = time.perf_counter() - t0
    conc, c_wall = _threads([lambda p=p: server.ask(p, n) for p in prompts])  # released together
    s_tok, c_tok = sum(x[1] for x in serial), sum(x[1] for x in conc)
    return {"serial_s": s_wall, "at_once_s": c_wall, "serial_tps": s_tok / s_wall, "at_once_tps": c_tok / c_wall,
            "ratio": (c_tok / c_wall) / (s_tok / s_wall), "equal": sum(a[0] == b[0] for a, b in zip(serial, conc))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, metavar="PATH")
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="comma-separated server names to run")
    a = ap.parse_args()
    from edgespec.assemble import Settings, resolve_files
    target, draft = resolve_files(Settings(target=a.pair).validate())
    items = load_workloads(str(default_workloads()), None, 1)[:a.requests]
    prompts = [it["prompt"] for it in items]
    n = a.requests
    ls = [a.llama_server, "-m", str(target), "-c", str(a.ctx * n), "-t", str(a.threads), "-np", str(n),
          "--host", "127.0.0.1", "--no-webui"]
    es = [sys.executable, "-m", "edgespec", "serve", "--target", str(target), "--draft", str(draft),
          "--ctx", str(a.ctx), "--threads", str(a.threads), "--parallel", str(n), "--host", "127.0.0.1"]
    servers = {f"llama-server -np {n}": ls, f"edgespec --parallel {n} none": es + ["--drafter", "none"],
               f"edgespec --parallel {n} auto": es + ["--drafter", "auto"],
               f"edgespec --parallel {n} auto --parallel-exact": es + ["--drafter", "auto", "--parallel-exact"]}
    only = set(a.only.split(",")) if a.only else None
    print(f"{n} prompts ({', '.join(it['id'] for it in items)}), {a.max_tokens} tokens, T = 0, {a.threads} threads")
    print(f"{'server':<44} {'serial':>8} {'at once':>8} {'tok/s':>12} {'ratio':>6}  equal")
    for name, cmd in servers.items():
        if only and name not in only:
            continue
        port = _free_port()
        s = Served(name, cmd + ["--port", str(port)], port, Path(f"/tmp/parallel_servers_{port}.log"))
        try:
            s.wait_ready()
            r = measure(s, prompts, a.max_tokens)
        finally:
            s.stop()
        print(f"{name:<44} {r['serial_s']:7.1f}s {r['at_once_s']:7.1f}s {r['serial_tps']:5.1f}/{r['at_once_tps']:5.1f}"
              f"  x{r['ratio']:.2f}  {r['equal']}/{n}", flush=True)


if __name__ == "__main__":
    main()
