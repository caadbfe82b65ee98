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
plain on the same prompt. The servers' own `timings` (prompt_ms, predicted_ms: both servers
report them) split that into the prompt's pass and the decoding, in a second table.

The answers are compared with llama-server plain's answer to the prompt evaluated whole
(`cache_prompt: false`, one untimed request a prompt and trial). Its timed answer is not the
reference: llama-server reuses the prefix the previous prompt left in its cache, evaluates only
the rest, and its kernels compute a row differently by where it falls in a batch, so its answer
to a prompt depends on the prompt before it (creative-sea after creative-song parted from its
answer after "Say hi." at character 87). edgespec cuts a reused prefix back to the kernels' row
groups, so its answers do not depend on what came before. JSON in bench-results/peer.json, with
the answers.
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
from typing import NamedTuple, Optional

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

    def ask(self, prompt: str, max_tokens: int, fresh: bool = False) -> "Answer":
        """The answer to one chat request at T = 0, its size and times; `fresh`:
        the whole prompt evaluated, nothing of it taken from the cache (llama-server's
        `cache_prompt: false`)."""
        import httpx
        body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": False}
        if fresh:
            body["cache_prompt"] = False
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise UsageError(f"{self.name} answered {r.status_code}: {r.text[:300]}")
        out = r.json()
        t = out.get("timings") or {}
        return Answer(out["choices"][0]["message"]["content"] or "", int(out["usage"]["completion_tokens"]), wall,
                      t.get("prompt_ms"), t.get("predicted_ms"))

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


class Answer(NamedTuple):
    text: str
    tokens: int
    wall: float                  # seconds at the client
    prompt_ms: Optional[float]   # the server's own timings (None where it gave none)
    predicted_ms: Optional[float]


def run(target: Path, draft: Path, items: list[dict], *, binary: Path, n_ctx: int, threads: int, trials: int,
        max_tokens: int, out: Path, peers=PEERS) -> dict:
    logs = out.parent / "peer-logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmds = commands(binary, target, draft, n_ctx, threads)
    runs: dict[str, dict[str, list[Answer]]] = {it["id"]: {n: [] for n in peers} for it in items}
    whole: dict[str, list[str]] = {it["id"]: [] for it in items}  # the reference answers, a trial each
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
                if REFERENCE in servers:  # untimed: the answer to the prompt evaluated whole
                    whole[it["id"]].append(servers[REFERENCE].ask(it["prompt"], max_tokens, fresh=True).text)
        finally:
            for s in servers.values():
                s.stop()
    print(file=sys.stderr)
    report = {"target": str(target), "draft": str(draft), "threads": threads, "n_ctx": n_ctx, "trials": trials,
              "max_tokens": max_tokens, "llama_server": str(binary), "reference": REFERENCE_WHOLE,
              "rows": summarize(items, runs, whole)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


REFERENCE_WHOLE = f"{REFERENCE}, the prompt evaluated whole (cache_prompt: false)"


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(items: list[dict], runs: dict[str, dict[str, list[Answer]]], whole: dict[str, list[str]]) -> list[dict]:
    """Per prompt and server: median speeds (over wall time; and decoding alone, from the
    server's timings), the ratio to llama-server plain, and whether every trial's answer
    equals the reference answer of the same trial."""
    rows = []
    for it in items:
        got_all, ref = runs[it["id"]], whole.get(it["id"], [])
        row = {"id": it["id"], "kind": it["kind"], "peers": {}}
        for name, got in got_all.items():
            same = [a.text == b for a, b in zip(got, ref)]
            row["peers"][name] = {
                "tok_s": _median([a.tokens / a.wall for a in got if a.wall > 0]),
                "decode_tok_s": _median([(a.tokens - 1) / a.predicted_ms * 1000 for a in got
                                         if a.predicted_ms and a.tokens > 1]),
                "prompt_ms": _median([a.prompt_ms for a in got]),
                "tokens": got[0].tokens, "walls": [round(a.wall, 3) for a in got],
                "same_as_plain": all(same) if same else None, "same_trials": sum(same),
                "stable": len({a.text for a in got}) == 1, "answer": got[0].text}
        base = row["peers"].get(REFERENCE, {})
        for p in row["peers"].values():
            p["ratio"] = round(p["tok_s"] / base["tok_s"], 3) if base.get("tok_s") else None
            p["decode_ratio"] = (round(p["decode_tok_s"] / base["decode_tok_s"], 3)
                                 if p["decode_tok_s"] and base.get("decode_tok_s") else None)
        rows.append(row)
    return rows


def format_table(report: dict) -> str:
    rows = report["rows"]
    names = list(rows[0]["peers"]) if rows else []

    def table(key: str, speed: str) -> list[str]:
        lines = ["| prompt | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
        for r in rows:
            cells = []
            for n in names:
                p = r["peers"][n]
                mark = "" if p.get("same_as_plain") is None else (" =" if p["same_as_plain"] else " ≠")
                if p.get(key) is None:
                    cells.append("-")
                elif n == REFERENCE:
                    cells.append(f"1.00 ({p[speed]:.1f} tok/s){mark}")
                else:
                    cells.append(f"{p[key]:.2f}{mark}")
            head = f"| {r['id']} ({r['kind']}, {r['peers'][names[0]]['tokens']} tok) | "
            lines.append(head + " | ".join(cells) + " |")
        return lines

    out = [f"tok/s over wall time as a ratio to {REFERENCE} (median of {report['trials']}), "
           f"{report['max_tokens']}-token answers at T = 0; = : every trial's answer equals "
           f"{report.get('reference', REFERENCE)}", ""] + table("ratio", "tok_s")
    if any(p.get("decode_ratio") is not None for r in rows for p in r["peers"].values()):
        out += ["", "decoding alone (the servers' own timings: tokens after the first over predicted_ms), "
                "as a ratio to the same", ""] + table("decode_ratio", "decode_tok_s")
    return "\n".join(out)


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
