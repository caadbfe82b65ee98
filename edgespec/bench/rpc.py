"""`bench --rpc-latency-ms 0,2,10,30`: speculation over a network, simulated on one machine.

The target's layers run on llama.cpp rpc-servers (edgespec/rpc.py), the draft model here. Without
`--rpc` the benchmark starts its own server, `python -m edgespec rpc-server` on a free loopback
port with the client's threads, and stops it at the end (also on Ctrl-C or an error); with `--rpc
HOST:PORT[,...]` it uses those. For every latency X a `netdelay.DelayProxy` adding X ms of round
trip stands in front of each server, and the engine talks to the proxies:

    edgespec plain   the loaded target decoding alone (`Engine(target, None)`)
    edgespec auto    the engine loaded for this latency: auto calibrated anew over the proxies
                     (calibrate "now"), so its costs are the network's (issue 48, item 3)

Per prompt and trial the two run in turn, the order turned every trial, greedy (T = 0) from an
empty cache, and auto's tokens are compared with plain's (they must be equal). Around each run the
proxies' counters are reset and read: round trips (turns from requests to replies) and bytes each
way. The figures per token are the decoding's alone: the run's traffic less that of the same
prompt answered with one token (its prompt pass, measured once per prompt and mode), over the
tokens after the first, the tokens the decode rate counts. llama.cpp's RPC client sends a pass's
whole graph (~400 KB for a 30-layer model) unless the pass before had the same graph, then a few
KB: every pass whose shape differs from the last (a k-row verification after a one-row step, and
back) pays it, which is most of what speculation adds to the bytes; a pass on a two-token prompt
before each run makes every prompt pass, of the runs and of their one-token twins, send it whole.

With `--peer llama-server` each latency also times llama.cpp's own server through the same proxies
(`--rpc PROXIES -ngl 99`), in two modes: draft-simple with its draft model here (`-md DRAFT -devd
none`, or this machine's GPUs) and ngram-mod. Its rate is decoding alone, from its own timings
(as bench/llama_server.py's second table), its traffic measured as edgespec's (each request sent
with `cache_prompt: false`, so its prompt pass is the same every time).

Order. An rpc-server serves one client at a time, and a client's connection lives as long as its
models: edgespec and llama-server cannot share a server at once, and switching between them loads
the target over the network again. So within a latency: edgespec loads once and runs every prompt
and trial, plain and auto interleaved; then, per trial, each llama-server mode is started fresh
(ngram-mod remembers earlier answers: a repeated prompt would be answered from its memory), runs
every prompt and stops; the modes' order turns every trial. Latencies run in the order given.

On one machine the servers' compute and the client's draft model share the cores: the figures
show what the network's round trips do to each way of decoding, not two machines' compute. The
calibration's load meter would count the server it started as other load (and, the machine
"busy", take every verified row to cost a whole step): while the engine loads, that server's CPU
time is left out. The calibration of each latency is keyed by its proxy's passing port, so it is
deleted from the cache after use; the table marks one taken while the machine was busy. JSON to
--out (default bench-results/bench-rpc.json), the servers' logs beside it in rpc-logs/.
"""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from ..errors import BackendError, UsageError
from .llama_server import _free_port, _median

DEFAULT_OUT = "bench-results/bench-rpc.json"
MODES = ("plain", "auto")
PEER_MODES = ("llama-server draft-simple", "llama-server ngram-mod")
SERVER_START_SECONDS = 60


def parse_latencies(text: str) -> tuple[float, ...]:
    """'0,2,10,30' -> (0.0, 2.0, 10.0, 30.0); a UsageError saying what to write otherwise."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--rpc-latency-ms {text!r}: {part!r} is not a number of milliseconds >= 0; "
                             "write round-trip times like 0,2,10,30")
        out.append(value)
    if len(set(out)) != len(out):
        raise UsageError(f"--rpc-latency-ms {text!r} names a latency twice")
    return tuple(out)


def check(settings, opts) -> None:
    """What this benchmark does not combine with: one line before anything starts."""
    if opts.structured or opts.agent or opts.parallel_requests is not None or opts.sweep or opts.acceptance \
            or opts.modes != ("auto",) or settings.memory_budget is not None:
        raise UsageError("--rpc-latency-ms runs on its own (plain and auto over the network, --peer llama-server "
                         "beside them): leave out --kinds structured/agent, --modes, --sweep, --acceptance, "
                         "--parallel-requests and --memory-budget")
    if not opts.sampling.greedy:
        raise UsageError("--rpc-latency-ms compares auto's answers with plain decoding's at T = 0: leave out "
                         "--temperature")
    if settings.drafter != "auto":
        raise UsageError(f"--rpc-latency-ms measures auto against plain decoding, not drafter {settings.drafter}")


# -- the servers --------------------------------------------------------------------------------------
class LocalRpcServer:
    """`python -m edgespec rpc-server` on a loopback port (a free one unless given), until `stop()`;
    `kill()` ends it as a crash would. The benchmark's, and the tests' (tests/test_rpc.py)."""

    def __init__(self, threads: int, log: Path, port: Optional[int] = None):
        from .. import rpc
        self.port = port or _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(log, "w")
        # a session of its own: a Ctrl-C at the terminal reaches the benchmark alone, which closes its
        # engine while the server still serves (a server gone while the client waits for a pass's
        # logits leaves the client waiting for good), then stops the server
        self.proc = subprocess.Popen([sys.executable, "-m", "edgespec", "rpc-server", "--port", str(self.port),
                                      "--threads", str(threads)], stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + SERVER_START_SECONDS
        try:
            while True:
                try:
                    rpc.hello(self.endpoint, timeout=2)
                    return
                except rpc.RemoteError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                        raise BackendError(f"the benchmark's rpc-server did not start ({tail[0]}; log: {log})")
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """Its exit code (0: it stopped cleanly)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # it frees what it holds and says "stopped"
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return self.proc.returncode


class Proxies:
    """A DelayProxy in front of each server; their counters summed."""

    def __init__(self, upstreams: list[str], latency_ms: float):
        from ..netdelay import DelayProxy
        self.proxies: list = []
        try:
            for up in upstreams:
                p = DelayProxy(up, latency_ms=latency_ms)
                p.start()
                self.proxies.append(p)
        except BaseException:
            self.stop()
            raise
        self.endpoints = [p.address for p in self.proxies]

    def reset(self) -> None:
        for p in self.proxies:
            p.reset_counters()

    def traffic(self) -> dict:
        cs = [p.counters for p in self.proxies]
        return {"round_trips": sum(c.round_trips for c in cs), "up_bytes": sum(c.up_bytes for c in cs),
                "down_bytes": sum(c.down_bytes for c in cs)}

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()


TRAFFIC = ("round_trips", "up_bytes", "down_bytes")


def _decode_traffic(run: dict, prompt: dict) -> dict:
    """A run's traffic less its prompt pass's (never below zero)."""
    return {k: max(0, run[k] - prompt[k]) for k in TRAFFIC}


def _summed(decode: list[dict]) -> dict:
    return {f"decode_{k}": sum(d[k] for d in decode) for k in TRAFFIC}


# -- edgespec ------------------------------------------------------------------------------------------
def _generate(engine, ptoks, n: int, proxies: Proxies):
    """One greedy answer from an empty cache; (result, traffic of the generation alone).
    llama.cpp's RPC client sends a pass's whole graph (~400 KB for a 30-layer model) unless it
    is the graph of the pass before, then a few KB: a pass on a two-token prompt first makes the
    prompt's pass of every run (and of the one-token runs subtracted) send it whole."""
    engine.reset()
    engine.generate(ptoks[:2], max_tokens=1, temperature=0.0)
    engine.reset()  # from nothing: no reused prefix, nothing learnt from the previous run
    proxies.reset()
    r = engine.generate(ptoks, max_tokens=n, temperature=0.0)
    return r, proxies.traffic()


def _forget_calibration(endpoints: str) -> Optional[dict]:
    """The calibration keyed by the proxies' passing ports is of no use after this latency (nor after
    a load that was interrupted): deleted from the cache; what it said (without its samples) is
    returned for the report."""
    from ..registry import cache_dir
    found = None
    for path in (cache_dir() / "calibration").glob("*.json"):
        try:
            record = json.loads(path.read_text())
            if record["key"]["target"].get("rpc") != endpoints:
                continue
            path.unlink()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        info = {k: v for k, v in (record.get("info") or {}).items() if k not in ("samples", "calibrated_verify")}
        found = {"source": record.get("source"), "provisional": record.get("provisional"), "info": info}
    return found


@contextmanager
def _server_cpu_is_remote(pids: list[int]):
    """While the engine loads, the rpc-server processes started here are the remote machine, not
    other load: calibration's load meter (which counts every other process's CPU time as load, and
    under load takes every verified row to cost a whole step) leaves their CPU time out."""
    from .. import calibrate
    try:
        import psutil
        procs = [psutil.Process(p) for p in pids]
    except Exception:  # psutil missing, or the server gone: the meter as it is
        procs = []
    if not procs:
        yield
        return

    def cpu() -> Optional[float]:
        try:
            return sum(t.user + t.system for t in (p.cpu_times() for p in procs))
        except Exception:
            return None
    base = calibrate.LoadMeter

    class Meter(base):
        def reset(self) -> None:
            super().reset()
            self._servers = (time.perf_counter(), cpu())

        def others(self) -> Optional[float]:
            load = super().others()
            t0, c0 = self._servers
            c1, wall = cpu(), time.perf_counter() - t0
            if load is None or c0 is None or c1 is None or wall <= 0:
                return load
            return max(0.0, load - (c1 - c0) / wall)
    calibrate.LoadMeter = Meter
    try:
        yield
    finally:
        calibrate.LoadMeter = base


def measure_edgespec(settings, items: list[dict], opts, proxies: Proxies, progress=None, label: str = "",
                     server_pids: tuple[int, ...] = ()) -> dict:
    """Load the engine over `proxies`, time plain and auto on every prompt and trial, close it."""
    from ..engine import Engine
    endpoints = ",".join(proxies.endpoints)
    t0 = time.perf_counter()
    try:
        with _server_cpu_is_remote(list(server_pids)):
            spec = Engine.from_settings(dataclasses.replace(settings, rpc=endpoints), calibrate="now",
                                        progress=progress)
        load_seconds = time.perf_counter() - t0
        online = getattr(getattr(spec.drafter, "policy", None), "online", None)
        if online is not None:  # its corrections are of a port-keyed calibration forgotten below: not written
            online.persist = None  # (a write from the last round could land after the forgetting)
        draft = spec.drafter.draft_backend if spec.drafter is not None else None
        with spec:
            plain = Engine(spec.target, None)  # the same loaded target, decoding alone
            runners = [("plain", plain), ("auto", spec)]
            prompts = [spec.chat_tokens([{"role": "user", "content": it["prompt"]}]) for it in items]
            for _, eng in runners:  # warm-up: page in, build graphs on the server
                _generate(eng, prompts[0], 8, proxies)
            policy = getattr(spec.drafter, "policy", None)
            result = {"target": str(spec.target.path), "draft": str(draft.path) if draft is not None else None,
                      "load_seconds": round(load_seconds, 2),
                      "calibration": [round(v, 6) for v in policy.costs.verify] if policy else None,
                      "rows": []}
            t_start = time.perf_counter()
            for i, (it, ptoks) in enumerate(zip(items, prompts), 1):
                result["rows"].append(_measure_prompt(it, ptoks, runners, opts, proxies))
                row = result["rows"][-1]
                eta = (time.perf_counter() - t_start) / i * (len(items) - i)
                print(f"{label}[{i}/{len(items)}] {it['id']:<20} plain {row['modes']['plain']['tok_s']:6.1f} tok/s"
                      f"  auto {row['modes']['auto']['tok_s']:6.1f} tok/s x{_f(row['ratio'], '.2f')}"
                      f"{'' if row['identical'] else ' (answers differ)'}  (eta {eta:.0f}s)",
                      file=sys.stderr, flush=True)
    finally:
        measured = _forget_calibration(endpoints)
    result["calibration_record"] = measured
    return result


def _measure_prompt(it: dict, ptoks, runners, opts, proxies: Proxies) -> dict:
    n = opts.bench_tokens
    # each mode's prompt pass alone (untimed): subtracted from its runs' traffic
    prompt_traffic = {name: _generate(eng, ptoks, 1, proxies)[1] for name, eng in runners}
    runs: dict[str, list] = {name: [] for name, _ in runners}
    for t in range(opts.trials):
        k = t % len(runners)  # the order turns every trial: no mode always first
        for name, eng in runners[k:] + runners[:k]:
            runs[name].append(_generate(eng, ptoks, n, proxies))
    ref = [r.tokens for r, _ in runs["plain"]]
    parted = []
    for (r, _), want in zip(runs["auto"], ref):
        parted.append(next((j for j, (a, b) in enumerate(zip(r.tokens, want)) if a != b),
                           None if len(r.tokens) == len(want) else min(len(r.tokens), len(want))))
    row = {"id": it["id"], "kind": it["kind"], "prompt_tokens": len(ptoks),
           "identical": all(p is None for p in parted),
           "first_divergence": next((p for p in parted if p is not None), None),
           "answer": runs["plain"][0][0].text, "modes": {}}
    for name, got in runs.items():
        tps = [r.stats.tokens_per_second for r, _ in got]
        decode = [_decode_traffic(tr, prompt_traffic[name]) for _, tr in got]
        tokens = [max(0, r.stats.generated - 1) for r, _ in got]  # the tokens the decode rate counts
        m = row["modes"][name] = {
            "tok_s": statistics.median(tps), "tok_s_trials": [round(v, 3) for v in tps],
            "generated": got[0][0].stats.generated, "decode_tokens": sum(tokens),
            "prompt_traffic": prompt_traffic[name],
            **_summed(decode),
            "target_forwards": sum(r.stats.target_forwards for r, _ in got)}
        if name == "auto":
            drafted, accepted = sum(r.stats.drafted for r, _ in got), sum(r.stats.accepted for r, _ in got)
            m.update(drafted=drafted, accepted=accepted, acceptance=round(accepted / drafted, 4) if drafted else None,
                     by_drafter_first_trial=got[0][0].stats.by_drafter, costs=got[0][0].stats.costs)
    # paired: each trial's ratio to the plain run beside it, then the median
    row["ratio"] = _median([a.stats.tokens_per_second / p.stats.tokens_per_second
                            for (a, _), (p, _) in zip(runs["auto"], runs["plain"]) if p.stats.tokens_per_second > 0])
    return row


# -- llama-server --------------------------------------------------------------------------------------
def local_draft_devices() -> str:
    """llama-server's -devd for a draft model kept on this machine: its GPUs, else none (the CPU).
    Left to itself it would offload the draft to the rpc-servers' devices too."""
    from .. import rpc
    g = rpc.ggml()
    names = [(g.dev_name(d) or b"").decode() for d in rpc.local_devices()]
    return ",".join(n for n in names if n) or "none"


def peer_commands(binary: Path, target: Path, draft: Path, n_ctx: int, threads: int, endpoints: list[str],
                  draft_devices: str = "none") -> dict[str, list[str]]:
    """llama-server's command lines (without --port): the target's layers on the servers, the draft here."""
    from .llama_server import commands
    base = commands(binary, target, draft, n_ctx, threads)
    remote = ["--rpc", ",".join(endpoints), "-ngl", "99"]
    here = ["-devd", draft_devices] + ([] if draft_devices == "none" else ["-ngld", "99"])
    return {"llama-server draft-simple": base["llama-server draft-simple"] + remote + here,
            "llama-server ngram-mod": base["llama-server ngram-mod"] + remote}


def measure_peers(binary: Path, target: Path, draft: Path, items: list[dict], opts, settings, threads: int,
                  proxies: Proxies, logs: Path, draft_devices: str, latency_ms: float, label: str = "") -> dict:
    """Each llama-server mode through the proxies, a fresh server per trial; answers and traffic."""
    from .llama_server import Served
    cmds = peer_commands(binary, target, draft, settings.n_ctx, threads, proxies.endpoints, draft_devices)
    runs = {name: {it["id"]: [] for it in items} for name in cmds}
    prompt_traffic = {name: {} for name in cmds}
    names = list(cmds)
    for trial in range(opts.trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            port = _free_port()
            tag = name.split()[-1]
            server = Served(name, cmds[name] + ["--port", str(port)], port,
                            logs / f"llama-server-{tag}-{latency_ms:g}ms-{trial + 1}.log")
            try:
                server.wait_ready()
                server.ask("Say hi.", 4)  # warm-up: first-request costs out of the figures
                for it in items:
                    # the timed answer, then its prompt pass alone: each follows a pass of another
                    # graph (an answer's last, or the warm-up's), so each sends its prompt's whole
                    proxies.reset()
                    answer = server.ask(it["prompt"], opts.bench_tokens, fresh=True)
                    runs[name][it["id"]].append((answer, proxies.traffic()))
                    proxies.reset()
                    server.ask(it["prompt"], 1, fresh=True)
                    prompt_traffic[name][it["id"]] = proxies.traffic()
                    print(f"{label}{name} trial {trial + 1}: {it['id']} {answer.tokens} tokens",
                          file=sys.stderr, flush=True)
            finally:
                server.stop()
    out = {}
    for name in cmds:
        rows = []
        for it in items:
            got = runs[name][it["id"]]
            decode = [_decode_traffic(tr, prompt_traffic[name][it["id"]]) for _, tr in got]
            rates = [(a.tokens - 1) / a.predicted_ms * 1000 for a, _ in got if a.predicted_ms and a.tokens > 1]
            rows.append({"id": it["id"], "tok_s": statistics.median(rates) if rates else None,
                         "tok_s_trials": [round(v, 3) for v in rates],
                         "wall_tok_s": _median([a.tokens / a.wall for a, _ in got if a.wall > 0]),
                         "generated": got[0][0].tokens, "decode_tokens": sum(max(0, a.tokens - 1) for a, _ in got),
                         "prompt_traffic": prompt_traffic[name][it["id"]],
                         **_summed(decode),
                         "answer": got[0][0].text})
        out[name] = {"command": cmds[name], "rows": rows}
    return out


# -- the report ---------------------------------------------------------------------------------------
def _per_token(rows: list[dict]) -> dict:
    tokens = sum(r["decode_tokens"] for r in rows)
    if not tokens:
        return {"round_trips_per_token": None, "up_bytes_per_token": None, "down_bytes_per_token": None,
                "kb_per_token": None}
    rt, up, down = (sum(r[f"decode_{k}"] for r in rows) for k in TRAFFIC)
    return {"round_trips_per_token": round(rt / tokens, 3), "up_bytes_per_token": round(up / tokens, 1),
            "down_bytes_per_token": round(down / tokens, 1), "kb_per_token": round((up + down) / tokens / 1000, 3)}


def summarize(level: dict) -> dict:
    """One latency's figures: medians over prompts of the speeds, traffic summed over every run."""
    rows = level["edgespec"]["rows"]
    s = {"identical": all(r["identical"] for r in rows), "ratio": _median(r["ratio"] for r in rows), "modes": {}}
    for m in MODES:
        s["modes"][m] = {"tok_s": _median(r["modes"][m]["tok_s"] for r in rows),
                         **_per_token([r["modes"][m] for r in rows])}
    auto = {r["id"]: r["modes"]["auto"]["tok_s"] for r in rows}
    plain_text = {r["id"]: r["answer"] for r in rows}
    s["peers"] = {}
    for name, peer in (level.get("peers") or {}).items():
        prow = peer["rows"]
        s["peers"][name] = {
            "tok_s": _median(r["tok_s"] for r in prow), "wall_tok_s": _median(r["wall_tok_s"] for r in prow),
            "auto_ratio": _median(auto[r["id"]] / r["tok_s"] for r in prow if r["tok_s"]),
            "same_text_as_plain": sum(r["answer"] == plain_text.get(r["id"]) for r in prow), "prompts": len(prow),
            **_per_token(prow)}
    return s


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: dict) -> str:
    levels = report["latencies"]
    peers = [n for n in PEER_MODES if any(n in lv["summary"]["peers"] for lv in levels)]
    head = ["RTT ms", "T(1) ms", "plain tok/s", "auto tok/s", "auto/plain", "RT/tok plain", "RT/tok auto",
            "KB/tok plain", "KB/tok auto", "T=0 same"]
    for n in peers:
        short = n.split()[-1]
        head += [f"{short} tok/s", f"auto/{short}"]
    lines = [f"decoding over llama.cpp RPC through a delay proxy: {report['bench_tokens']}-token answers at T = 0, "
             f"median of {report['trials']} trial(s) and {report['prompts']} prompt(s); RT/tok: round trips per "
             "decoded token, KB/tok: kilobytes (1000 bytes) both ways per decoded token; T(1): auto's calibrated "
             "one-row pass (*: provisional, the machine was busy: each row costed a whole step)", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for lv in levels:
        s, cal = lv["summary"], lv["edgespec"].get("calibration")
        busy = "*" if (lv["edgespec"].get("calibration_record") or {}).get("provisional") else ""
        p, a = s["modes"]["plain"], s["modes"]["auto"]
        cells = [f"{lv['latency_ms']:g}", _f(cal[0] * 1000 if cal else None) + busy, _f(p["tok_s"]), _f(a["tok_s"]),
                 _f(s["ratio"], ".2f"), _f(p["round_trips_per_token"], ".2f"), _f(a["round_trips_per_token"], ".2f"),
                 _f(p["kb_per_token"], ".1f"), _f(a["kb_per_token"], ".1f"), "yes" if s["identical"] else "NO"]
        for n in peers:
            q = s["peers"].get(n, {})
            cells += [_f(q.get("tok_s")), _f(q.get("auto_ratio"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    if peers:
        lines += ["", "llama-server's decoding (its own timings) and traffic per decoded token", "",
                  "| RTT ms | server | tok/s | wall tok/s | RT/tok | KB/tok | same text as edgespec plain |",
                  "|" + " --- |" * 7]
        for lv in levels:
            for n in peers:
                q = lv["summary"]["peers"].get(n)
                if q:
                    lines.append(f"| {lv['latency_ms']:g} | {n} | {_f(q['tok_s'])} | {_f(q['wall_tok_s'])} | "
                                 f"{_f(q['round_trips_per_token'], '.2f')} | {_f(q['kb_per_token'], '.1f')} | "
                                 f"{q['same_text_as_plain']}/{q['prompts']} |")
    return "\n".join(lines)


# -- the benchmark --------------------------------------------------------------------------------------
def main(settings, opts, progress=None) -> int:
    from .. import rpc
    from ..assemble import resolve_files
    from ..backend import default_threads
    from .workloads import default_workloads, load_workloads
    check(settings, opts)
    latencies = opts.rpc_latency_ms
    # bench/__init__.py's default --out is the plain benchmark's file: this one writes its own
    out = Path(opts.out if opts.out != "bench-results/bench.json" else DEFAULT_OUT)
    logs = out.parent / "rpc-logs"
    items = load_workloads(opts.workloads or str(default_workloads()), opts.kinds, opts.limit)
    threads = settings.threads or default_threads()
    binary = draft_devices = target = draft = None
    if opts.peer is not None:
        from .llama_server import find_llama_server
        target, draft = resolve_files(settings, progress=progress)
        if draft is None:
            raise UsageError("--peer llama-server compares draft-model modes: give a pair (or --target and --draft)")
        binary = find_llama_server(opts.llama_server)
    given = settings.rpc_servers()
    if given:
        rpc.check_servers(given)  # one line for a server that is away or busy, before anything loads
    own = None
    report = {"target": None, "draft": None, "threads": threads, "n_ctx": settings.n_ctx,
              "bench_tokens": opts.bench_tokens, "trials": opts.trials, "prompts": len(items),
              "rpc_output": settings.rpc_output, "rpc_draft": settings.rpc_draft, "latencies": []}
    try:
        if not given:
            print(f"bench: starting an rpc-server on loopback ({threads} threads)", file=sys.stderr, flush=True)
            own = LocalRpcServer(threads, logs / "rpc-server.log")
        servers = given or [own.endpoint]
        report["rpc_servers"] = servers
        report["own_server"] = own is not None
        for latency in latencies:
            label = f"bench: {latency:g} ms: "
            proxies = Proxies(servers, latency)
            try:
                print(f"{label}loading the target through {', '.join(proxies.endpoints)} and calibrating auto",
                      file=sys.stderr, flush=True)
                level = {"latency_ms": latency, "proxies": proxies.endpoints,
                         "edgespec": measure_edgespec(settings, items, opts, proxies, progress, label,
                                                      (own.proc.pid,) if own is not None else ())}
                if binary is not None:
                    if draft_devices is None:
                        draft_devices = local_draft_devices()
                    level["peers"] = measure_peers(binary, Path(target), Path(draft), items, opts, settings, threads,
                                                   proxies, logs, draft_devices, latency, label)
            finally:
                proxies.stop()
            level["summary"] = summarize(level)
            report["latencies"].append(level)
    finally:
        if own is not None:
            own.stop()
    first = report["latencies"][0]["edgespec"]
    report.update(target=first["target"], draft=first["draft"], llama_server=str(binary) if binary else None,
                  draft_devices=draft_devices)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"\nJSON: {out}")
    return 0
