"""`bench --peer llama-server`: edgespec's server beside llama.cpp's own, through the same endpoint.

llama-server is built from the llama.cpp that llama-cpp-python vendors, with edgespec's CMake
flags (scripts/build_llama_server.py; or --llama-server PATH). Five servers run at once on the
same GGUFs, each with one sequence and the same threads and context:

    llama-server plain          no speculation: the reference every ratio is taken against
    llama-server draft-simple   -md DRAFT --spec-type draft-simple
    llama-server ngram-mod      --spec-type ngram-mod
    edgespec none               plain decoding through `edgespec serve`
    edgespec auto               `edgespec serve --drafter auto` (the default)

Every prompt of the workloads (the first of each kind unless --limit says more) is sent to each
server in turn (interleaved, the order turned by one every prompt and trial, so drift on a noisy
machine falls on all of them alike), as one
OpenAI chat request at T = 0 with --max-tokens (default 128); --trials times (default 2), each
trial on freshly started servers (llama-server's ngram-mod keeps an n-gram memory of earlier
answers across requests, and a repeated prompt would be answered from it). A
request's speed is its completion tokens over its wall time at the client (prompt, queue, SSE
and all: what an app sees); the table gives each server's median as a ratio to llama-server
plain on the same prompt, and whether its answers equal llama-server plain's in the same trials
(the text). JSON in bench-results/peer.json.
"""
from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import UsageError

ROOT = Path(__file__).resolve().parent.parent.parent
PEERS = ("llama-server plain", "llama-server draft-simple", "llama-server ngram-mod", "edgespec none",
         "edgespec auto")
REFERENCE = PEERS[0]
STARTUP_SECONDS = 300


def find_llama_server(given: Optional[str]) -> Path:
    """`given`, $LLAMA_SERVER, or the build of scripts/build_llama_server.py (built when missing)."""
    path = given or os.environ.get("LLAMA_SERVER")
    if path:
        p = Path(path).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise UsageError(f"--llama-server {path}: no executable there; leave it out to build one")
        return p
    script = ROOT / "scripts" / "build_llama_server.py"
    if not script.is_file():
        raise UsageError("no llama-server: give --llama-server PATH (the build script comes with a source checkout)")
    print("bench: finding or building llama-server (a first build takes ~12 minutes on 2 cores)",
          file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise UsageError("llama-server could not be built (see above); give --llama-server PATH")
    return Path(r.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One server process on a free port, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        self._fh = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> None:
        import httpx
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-1500:]
                raise UsageError(f"{self.name} exited while starting (exit {self.proc.returncode}):\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise UsageError(f"{self.name} did not become ready in {STARTUP_SECONDS} s (log: {self.log})")

    def ask(self, prompt: str, max_tokens: int) -> tuple[str, int, float]:
        """(answer text, completion tokens, wall seconds) of one chat request at T = 0."""
        import httpx
        body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": False}
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise UsageError(f"{self.name} answered {r.status_code}: {r.text[:300]}")
        out = r.json()
        return out["choices"][0]["message"]["content"] or "", int(out["usage"]["completion_tokens"]), wall

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._fh.close()


def commands(binary: Path, target: Path, draft: Path, n_ctx: int, threads: int) -> dict[str, list[str]]:
    """Each peer's command line, without its port."""
    common = [str(binary), "-m", str(target), "-c", str(n_ctx), "-t", str(threads), "-np", "1",
              "--host", "127.0.0.1", "--no-webui"]
    ours = [sys.executable, "-m", "edgespec", "serve", "--target", str(target), "--draft", str(draft), "--ctx",
            str(n_ctx), "--threads", str(threads), "--parallel", "1", "--host", "127.0.0.1"]
    return {"llama-server plain": common,
            "llama-server draft-simple": common + ["-md", str(draft), "--spec-type", "draft-simple"],
            "llama-server ngram-mod": common + ["--spec-type", "ngram-mod"],
            "edgespec none": ours + ["--drafter", "none"],
            "edgespec auto": ours + ["--drafter", "auto"]}


def run(target: Path, draft: Path, items: list[dict], *, binary: Path, n_ctx: int, threads: int, trials: int,
        max_tokens: int, out: Path, peers=PEERS) -> dict:
    logs = out.parent / "peer-logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmds = commands(binary, target, draft, n_ctx, threads)
    runs: dict[str, dict[str, list[tuple[str, int, float]]]] = {it["id"]: {n: [] for n in peers} for it in items}
    total, done = len(items) * trials * len(peers), 0
    for trial in range(trials):
        # fresh servers every trial: nothing a server remembers (llama-server's n-gram memory of
        # earlier answers, either one's prompt cache) may answer a repeated prompt for it
        servers: dict[str, Served] = {}
        try:
            for name in peers:
                port = _free_port()
                servers[name] = Served(name, cmds[name] + ["--port", str(port)], port,
                                       logs / (re.sub(r"\W+", "-", name) + f"-{trial + 1}.log"))
            for s in servers.values():
                s.wait_ready()
                s.ask("Say hi.", 4)  # warm-up: first-request costs (repacking, llguidance) out of the figures
            for i, it in enumerate(items):
                # the order turns by one a prompt and a trial: no server is always first after a switch
                names = list(servers)
                shift = (i + trial) % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[it["id"]][name].append(servers[name].ask(it["prompt"], max_tokens))
                    done += 1
                    print(f"\rbench: {done}/{total} requests ({it['id']}, {name})".ljust(72), end="",
                          file=sys.stderr, flush=True)
        finally:
            for s in servers.values():
                s.stop()
    print(file=sys.stderr)
    rows = []
    for it in items:
        got_all = runs[it["id"]]
        ref = got_all.get(REFERENCE)
        row = {"id": it["id"], "kind": it["kind"], "peers": {}}
        for name, got in got_all.items():
            speeds = [n / wall for _, n, wall in got if wall > 0]
            # equal to plain's answer in the same trial (llama-server plain itself may part from
            # its own earlier answer: its batches differ when a prompt is partly cached)
            same = [a[0] == b[0] for a, b in zip(got, ref)] if ref else []
            row["peers"][name] = {"tok_s": statistics.median(speeds), "tokens": got[0][1],
                                  "walls": [round(w, 3) for _, _, w in got],
                                  "same_as_plain": all(same) if same else None,
                                  "same_trials": sum(same), "stable": len({t for t, _, _ in got}) == 1}
        base = row["peers"].get(REFERENCE, {}).get("tok_s")
        for p in row["peers"].values():
            p["ratio"] = round(p["tok_s"] / base, 3) if base else None
        rows.append(row)
    report = {"target": str(target), "draft": str(draft), "threads": threads, "n_ctx": n_ctx, "trials": trials,
              "max_tokens": max_tokens, "llama_server": str(binary), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


def format_table(report: dict) -> str:
    rows = report["rows"]
    names = list(rows[0]["peers"]) if rows else []
    head = "| prompt | " + " | ".join(n for n in names) + " |"
    lines = [f"tok/s over wall time as a ratio to {REFERENCE} (median of {report['trials']}), "
             f"{report['max_tokens']}-token answers at T = 0; = : the answer equals {REFERENCE}'s", "",
             head, "|" + " --- |" * (len(names) + 1)]
    for r in rows:
        cells = []
        for n in names:
            p = r["peers"][n]
            mark = "" if n == REFERENCE else (" =" if p["same_as_plain"] else " ≠")
            cells.append(f"{p['ratio']:.2f}{mark}" if n != REFERENCE else f"1.00 ({p['tok_s']:.1f} tok/s)")
        lines.append(f"| {r['id']} ({r['kind']}, {r['peers'][names[0]]['tokens']} tok) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(settings, opts, progress=None, llama_server: Optional[str] = None) -> int:
    from ..assemble import resolve_files
    from .workloads import default_workloads, load_workloads
    target, draft = resolve_files(settings, progress=progress)
    if draft is None:
        raise UsageError("--peer llama-server compares draft-model modes: give a pair (or --target and --draft)")
    items = load_workloads(opts.workloads or str(default_workloads()), opts.kinds, opts.limit or 1)
    binary = find_llama_server(llama_server)
    from ..backend import default_threads
    threads = settings.threads or default_threads()
    out = Path(opts.out if opts.out != "bench-results/bench.json" else "bench-results/peer.json")
    report = run(Path(target), Path(draft), items, binary=binary, n_ctx=settings.n_ctx, threads=threads,
                 trials=2 if opts.trials == 1 else opts.trials, max_tokens=opts.bench_tokens,
                 out=out)
    print(format_table(report))
    print(f"\nJSON: {out}")
    return 0
