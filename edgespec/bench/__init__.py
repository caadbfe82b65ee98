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

`--kinds structured` runs the structured-output benchmark instead (`bench/structured.py`):
JSON answers under a schema with auto, none and llama-cpp-python's grammar path against plain
unconstrained decoding; validity, forced / copied / sampled shares and the hindsight ceiling.

`--kinds agent` replays a recorded agent session (`serve --record FILE`; `--agent-session FILE`)
through `serve` with plain decoding and auto, and llama-server with `--peer llama-server`
(`bench/agent.py`): each request's time to first token, decode rate, and the session's total.

`--parallel-requests [N]` (default 4) runs the several-requests benchmark instead
(`bench/parallel.py`): N prompts (one per kind unless --limit) served one after another and then all
at once on one engine with parallel=N, auto and plain decoding, answers compared, aggregate tokens/s
and their ratio; and the wall time of a short request (--max-tokens / 8) sent beside a long answer
(2 x --max-tokens). JSON to --out (default bench-results/parallel.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..sampling import SamplingParams
from .ceiling import copy_ceiling
from .peers import ArgmaxDrafts, LookupPeer
from .report import format_table, plot, summarize
from .workloads import default_workloads, load_workloads

# auto-bit-exact: auto with --bit-exact (passes within the rows the build computes exactly) beside it
MODES = ("auto", "auto-bit-exact", "model", "ngram", "lookup-peer")
STRUCTURED = "structured"  # the kind that runs bench/structured.py
STRUCTURED_TOKENS = 512    # its default answer budget: a JSON answer cut short is invalid
AGENT = "agent"            # the kind that replays a recorded agent session (bench/agent.py)


@dataclass(frozen=True)
class Options:
    workloads: Optional[str] = None      # None: the packaged workloads/prompts.jsonl
    kinds: Optional[str] = None
    limit: Optional[int] = None
    bench_tokens: int = 128
    trials: int = 1
    modes: tuple[str, ...] = ("auto",)
    sweep: tuple[int, ...] = ()
    acceptance: bool = False
    out: str = "bench-results/bench.json"
    parallel_requests: Optional[int] = None  # N: the several-requests benchmark (bench/parallel.py)
    peer: Optional[str] = None               # "llama-server": the peer benchmark (bench/llama_server.py)
    llama_server: Optional[str] = None       # its binary (None: found or built)
    agent_session: Optional[str] = None      # --kinds agent: the `serve --record` file (None: the packaged one)
    agent_max_tokens: int = 4096             # --kinds agent: every replayed answer's cap (0: the agent's own)
    rpc_latency_ms: Optional[tuple[float, ...]] = None  # the network benchmark's round trips (bench/rpc.py)
    sampling: SamplingParams = SamplingParams()  # the decode modes' law (T > 0: answers are not compared)

    @property
    def structured(self) -> bool:
        return STRUCTURED in (self.kinds or "").split(",")

    @property
    def agent(self) -> bool:
        return AGENT in (self.kinds or "").split(",")

    def validate(self) -> "Options":
        if self.bench_tokens < 1 or self.trials < 1:
            raise UsageError("--max-tokens and --trials must be >= 1")
        if self.agent:
            if self.kinds != AGENT or self.structured or self.sweep or self.acceptance \
                    or self.parallel_requests is not None or self.modes != ("auto",):
                raise UsageError(f"--kinds {AGENT} runs on its own (a recorded session, replayed through "
                                 "edgespec none and auto, and llama-server with --peer): leave out other kinds, "
                                 "--modes, --sweep, --acceptance and --parallel-requests")
            if self.agent_max_tokens < 0:
                raise UsageError("--agent-max-tokens must be >= 0 (0: the agent's own limits), "
                                 f"got {self.agent_max_tokens}")
            return self
        if self.agent_session is not None:
            raise UsageError(f"--agent-session goes with --kinds {AGENT}")
        if self.limit is not None and self.limit < 1:
            raise UsageError("--limit must be >= 1")
        if self.structured and self.kinds != STRUCTURED:
            raise UsageError(f"--kinds {STRUCTURED} runs on its own (its prompts carry schemas); "
                             f"got --kinds {self.kinds}")
        if self.kinds is not None and not self.structured:
            self._check_kinds()
        allowed = _structured_modes() if self.structured else MODES
        bad = [m for m in self.modes if m not in allowed]
        if bad:
            raise UsageError(f"unknown bench mode(s) {', '.join(bad)}; choose from {', '.join(allowed)}")
        if any(not 1 <= g <= 32 for g in self.sweep):
            raise UsageError(f"--sweep draft lengths must be in 1..32, got {list(self.sweep)}")
        if self.parallel_requests is not None:
            from .parallel import MAX_REQUESTS
            if not 2 <= self.parallel_requests <= MAX_REQUESTS:
                raise UsageError(f"--parallel-requests takes 2..{MAX_REQUESTS} requests, got {self.parallel_requests}")
            if self.structured or self.sweep or self.acceptance or self.trials != 1 or self.modes != ("auto",):
                raise UsageError("--parallel-requests runs on its own (auto against plain decoding, one trial): "
                                 "leave out --kinds structured, --modes, --sweep, --acceptance and --trials")
        if self.peer is not None:
            if self.peer != "llama-server":
                raise UsageError(f"--peer takes llama-server, got {self.peer!r}")
            if self.structured or self.sweep or self.acceptance or self.parallel_requests is not None \
                    or self.modes != ("auto",):
                raise UsageError("--peer llama-server runs on its own (its five servers): leave out --kinds "
                                 "structured, --modes, --sweep, --acceptance and --parallel-requests")
        return self

    def _check_kinds(self) -> None:
        """Every kind named is one of the workloads' (or one that runs on its own): else they are listed."""
        path = self.workloads or str(default_workloads())
        known = sorted({it["kind"] for it in load_workloads(path)})
        bad = [k for k in self.kinds.split(",") if k not in known]
        if bad:
            raise UsageError(f"--kinds: no workloads of kind {', '.join(repr(k) for k in bad)} in {path}; its kinds "
                             f"are {', '.join(known)} ({STRUCTURED} and {AGENT} run benchmarks of their own)")


def add_arguments(p) -> None:
    p.add_argument("--workloads", default=None, metavar="FILE",
                   help="JSONL of {id, kind, prompt} (default: the workloads shipped with edgespec)")
    p.add_argument("--kinds", default=None, metavar="K1,K2", help="only these kinds")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per kind")
    p.add_argument("--max-tokens", "-n", "--bench-tokens", dest="bench_tokens", type=int, default=None, metavar="N",
                   help=f"tokens per generation (default 128; {STRUCTURED_TOKENS} for --kinds {STRUCTURED})")
    p.add_argument("--trials", type=int, default=1, metavar="N", help="timed repetitions per prompt (default 1)")
    p.add_argument("--modes", default=None, metavar="M1,M2",
                   help="what to compare with plain decoding: " + ", ".join(MODES) + " (default auto); "
                   "lookup-peer is llama-cpp-python's own LlamaPromptLookupDecoding; with --kinds "
                   f"{STRUCTURED}: " + ", ".join(_structured_modes()) + " (default all three)")
    p.add_argument("--sweep", default=None, metavar="G1,G2",
                   help="also run the n-gram drafter at these fixed draft lengths (for the chart)")
    p.add_argument("--acceptance", action="store_true",
                   help="also measure T=1 acceptance of the draft model: exact sampling vs draft-argmax matching")
    p.add_argument("--out", default="bench-results/bench.json", metavar="FILE",
                   help="JSON output; a PNG chart is written beside it when matplotlib is installed "
                   "(--parallel-requests: default bench-results/parallel.json, no chart)")
    p.add_argument("--parallel-requests", nargs="?", type=int, const=4, default=None, metavar="N",
                   help="instead: N requests (default 4) one after another and then at once on one engine "
                   "with parallel=N, auto and plain, and a short request beside a long answer (bench/parallel.py)")
    p.add_argument("--parallel-exact", action=argparse.BooleanOptionalAction, default=None,
                   help="with --parallel-requests: auto's shared passes cut into exact ones (the default, as serve)")
    p.add_argument("--peer", default=None, choices=("llama-server",),
                   help="instead: llama.cpp's llama-server (plain, draft-simple, ngram-mod) beside edgespec serve "
                   "(none, auto) on the same GGUFs through the same endpoint, interleaved; --trials defaults to 2 "
                   "(bench/llama_server.py)")
    p.add_argument("--agent-session", default=None, metavar="FILE|NAME",
                   help=f"with --kinds {AGENT}: the session to replay, as `serve --record FILE` wrote it, or a "
                   "shipped one: codex (the default; workloads/agent-session.jsonl) or claude-code "
                   "(workloads/agent-session-claude.jsonl)")
    p.add_argument("--agent-max-tokens", type=int, default=4096, metavar="N",
                   help=f"with --kinds {AGENT}: every replayed answer held to N tokens, on every server alike "
                   "(default 4096; 0: the agent's own limits, up to 32,000 for Claude Code)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, metavar="T",
                   help="sample every mode at T (default 0: greedy, each answer compared with plain decoding's; "
                   "at T > 0 trial t of every mode uses seed t, and answers differ by design)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="with --temperature: top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="with --temperature: top-p (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="with --temperature: min-p (0 = off)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="with --peer: the llama-server binary (default $LLAMA_SERVER, else built once from the "
                   "llama.cpp that llama-cpp-python vendors, ~12 minutes on 2 cores)")
    p.add_argument("--rpc-latency-ms", default=None, metavar="MS1,MS2",
                   help="instead: plain and auto with the target on llama.cpp rpc-servers (--rpc, else one started "
                   "on loopback) behind a delay proxy of each round-trip time, e.g. 0,2,10,30; with --peer "
                   "llama-server its draft-simple and ngram-mod too (bench/rpc.py; JSON: bench-results/bench-rpc.json)")
    _add_host_cost(p)


def _add_host_cost(p) -> None:
    from . import hostcost
    hostcost.add_arguments(p)


def options_from_args(args) -> Options:
    try:
        sweep = tuple(int(g) for g in args.sweep.split(",")) if args.sweep else ()
    except ValueError:
        raise UsageError(f"--sweep takes draft lengths like 1,2,4,8, got {args.sweep!r}") from None
    structured = STRUCTURED in (args.kinds or "").split(",")
    if getattr(args, "parallel_requests", None) is not None and "," in (getattr(args, "memory_budget", None) or ""):
        raise UsageError("--parallel-requests runs one configuration: give --memory-budget one size, not a sweep")
    modes = args.modes if args.modes is not None else ",".join(_structured_modes()) if structured else "auto"
    tokens = args.bench_tokens if args.bench_tokens is not None else STRUCTURED_TOKENS if structured else 128
    return Options(workloads=args.workloads, kinds=args.kinds, limit=args.limit, bench_tokens=tokens,
                   trials=args.trials, modes=tuple(m for m in modes.split(",") if m), sweep=sweep,
                   acceptance=args.acceptance, out=args.out,
                   parallel_requests=getattr(args, "parallel_requests", None), peer=getattr(args, "peer", None),
                   llama_server=getattr(args, "llama_server", None),
                   agent_session=getattr(args, "agent_session", None),
                   agent_max_tokens=getattr(args, "agent_max_tokens", 4096),
                   rpc_latency_ms=_rpc_latencies(getattr(args, "rpc_latency_ms", None)),
                   sampling=SamplingParams(getattr(args, "temperature", 0.0), getattr(args, "top_k", 0),
                                           getattr(args, "top_p", 1.0), getattr(args, "min_p", 0.0))).validate()


def _rpc_latencies(text):
    if text is None:
        return None
    from .rpc import parse_latencies
    return parse_latencies(text)


def _structured_modes() -> tuple[str, ...]:
    from .structured import MODES as modes
    return modes


def _run(engine, prompt_tokens, n, params, seed=None):
    # from nothing every time: a reused prompt prefix would change the last bits of the KV
    # values (and so, at near-ties, which token greedy decoding picks), and trials of one
    # prompt must not learn from each other
    engine.reset()
    r = engine.generate(prompt_tokens, max_tokens=n, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, min_p=params.min_p, seed=seed)
    return r.tokens, r.stats


def _timed_run(runner, prompt_tokens, n, params, seed=None):
    """(tokens, decode tokens/s, stats or None) for an edgespec engine or the lookup peer."""
    if isinstance(runner, LookupPeer):
        out, speed = runner.run(prompt_tokens, n)
        return out, speed, None
    out, st = _run(runner, prompt_tokens, n, params, seed=seed)
    return out, st.tokens_per_second, st


def _engines(main, modes, sweep, gamma):
    """One engine per mode, all over the main engine's loaded backends."""
    from ..assemble import make_drafter
    from ..drafters.ngram import NgramDrafter
    from ..engine import Engine
    auto = main.drafter
    model = getattr(auto, "model", None)
    out = {}
    for m in modes:
        if m == "auto":
            out[m] = main
        elif m == "auto-bit-exact":
            exact = make_drafter("auto", main.target, model.backend if model is not None else None, gamma=gamma)
            exact.policy.bit_exact = True
            out[m] = Engine(main.target, exact)
        elif m == "model" and model is not None:
            out[m] = Engine(main.target, make_drafter("model", main.target, model.backend, gamma=gamma))
        elif m == "ngram":
            out[m] = Engine(main.target, NgramDrafter(gamma))
    for g in sweep:
        out[f"ngram-g{g}"] = Engine(main.target, NgramDrafter(g))
    return out


def _compare(row, results, ref, greedy: bool = True):
    """Each mode's output against plain decoding's (at T = 0), and its drafting figures."""
    for name, (out, speed, st) in results.items():
        if name == "plain":
            continue
        parted = next((j for j, (a, c) in enumerate(zip(out, ref)) if a != c),
                      None if len(out) == len(ref) else min(len(out), len(ref)))
        # at T > 0 the modes draw from the generator in other orders: the same law, other answers
        m = row["modes"][name] = dict(identical=parted is None if greedy else True,
                                      first_divergence=parted if greedy else None, generated=len(out))
        if st is not None:
            m.update(drafted=st.drafted, accepted=st.accepted, acceptance=st.acceptance_rate,
                     by_drafter=st.by_drafter, accept_histogram=st.accept_histogram,
                     target_forwards=st.target_forwards, costs=st.costs)


def _ratios(row, tps):
    row["plain_tps"] = statistics.median(tps["plain"])
    for name, vals in tps.items():
        if name != "plain":
            m = row["modes"][name]
            m["tps"] = statistics.median(vals)
            # paired: each trial's ratio to the plain run beside it, then the median
            m["ratio"] = statistics.median(v / p for v, p in zip(vals, tps["plain"]) if p > 0)


def _acceptance(main, ptoks, n, gamma, seed) -> dict:
    """T = 1 acceptance of the draft model: exact min(1, p/q) sampling vs argmax matching."""
    from ..assemble import make_drafter
    from ..engine import Engine
    model = make_drafter("model", main.target, main.drafter.draft_backend, gamma=gamma)
    t1 = SamplingParams(1.0)
    _, se = _run(Engine(main.target, model), ptoks, n, t1, seed=seed)
    _, sa = _run(Engine(main.target, ArgmaxDrafts(model)), ptoks, n, t1, seed=seed)
    return dict(t1_exact_acceptance=se.acceptance_rate, t1_argmax_acceptance=sa.acceptance_rate)


def main(settings, opts: Options, progress=None) -> int:
    """Run the benchmark that `opts` describes on the models of `settings`; print the table."""
    from ..engine import Engine

    if opts.rpc_latency_ms is not None:
        from . import rpc
        return rpc.main(settings, opts, progress)
    if opts.structured:
        from . import structured
        return structured.main(settings, opts, progress)
    if opts.parallel_requests is not None:
        from . import parallel
        return parallel.main(settings, opts, progress)
    if opts.agent:
        from . import agent
        return agent.main(settings, opts, opts.agent_session)
    if opts.peer is not None:
        from . import llama_server
        return llama_server.main(settings, opts, progress, opts.llama_server)
    items = load_workloads(opts.workloads or str(default_workloads()), opts.kinds, opts.limit)
    if settings.memory_budget is not None:
        from .memory import memory_bench
        return memory_bench(settings, opts, items)
    spec = Engine.from_settings(settings, progress=progress)
    with spec:
        plain = Engine(spec.target, None)
        engines = _engines(spec, opts.modes, opts.sweep, settings.gamma)
        peer = (LookupPeer(spec.target.path, spec.target.n_ctx, spec.target.threads)
                if "lookup-peer" in opts.modes else None)
        try:
            rows = _measure(spec, plain, engines, peer, items, opts)
        finally:
            if peer:
                peer.close()
        policy = getattr(spec.drafter, "policy", None)
        model = getattr(spec.drafter, "model", None)
        report = {"target": str(spec.target.path), "draft": str(model.backend.path) if model else None,
                  "gamma": settings.gamma, "threads": spec.target.threads, "bench_tokens": opts.bench_tokens,
                  "trials": opts.trials, "calibration": list(policy.costs.verify) if policy else None,
                  "sampling": dataclasses.asdict(opts.sampling),
                  "rows": rows, "by_kind": summarize(rows)}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    sp = opts.sampling
    print(format_table(report["by_kind"], "" if sp.greedy else
                       f"T={sp.temperature:g} top-k {sp.top_k} top-p {sp.top_p:g} min-p {sp.min_p:g}"))
    print(f"\nJSON: {out}")
    png = plot(report, out.with_suffix(".png"))
    if png:
        print(f"chart: {png}")
    return 0


def _measure(spec, plain, engines, peer, items, opts) -> list[dict]:
    greedy = SamplingParams(0.0)
    params = opts.sampling
    policy = getattr(spec.drafter, "policy", None)
    prompts = [spec.chat_tokens([{"role": "user", "content": it["prompt"]}]) for it in items]
    runners = [("plain", plain), *engines.items()] + ([("lookup-peer", peer)] if peer else [])
    for _, eng in runners:  # warm-up: page in, build kernels
        _timed_run(eng, prompts[0], 8, greedy)
    if not params.greedy:
        print(f"sampling at T = {params.temperature} (top-k {params.top_k}, top-p {params.top_p}, min-p "
              f"{params.min_p}): trial t of every mode with seed t; answers are not compared", file=sys.stderr)
    rows = []
    t_start = time.perf_counter()
    for i, (it, ptoks) in enumerate(zip(items, prompts), 1):
        row = {"id": it["id"], "kind": it["kind"], "prompt_tokens": len(ptoks), "modes": {}}
        tps: dict[str, list[float]] = {name: [] for name, _ in runners}
        for t in range(opts.trials):
            # rotate the order every trial, so that no mode always runs first or last
            k = t % len(runners)
            results = {name: _timed_run(eng, ptoks, opts.bench_tokens, params, seed=t)
                       for name, eng in runners[k:] + runners[:k]}
            ref = results["plain"][0]
            if t == 0 and policy is not None and params.greedy:  # greedy from nothing: the same ref every trial
                row["ngram_ceiling"] = copy_ceiling(policy.costs, ptoks, ref)
            for name, (_, speed, _) in results.items():
                tps[name].append(speed)
            _compare(row, results, ref, params.greedy)
        _ratios(row, tps)
        if opts.acceptance and getattr(spec.drafter, "model", None) is not None:
            row.update(_acceptance(spec, ptoks, opts.bench_tokens, 4, seed=i))
        rows.append(row)
        eta = (time.perf_counter() - t_start) / i * (len(items) - i)
        ratios = "  ".join(f"{k} x{m['ratio']:.2f}{'' if m['identical'] else '*'}" for k, m in row["modes"].items())
        print(f"[{i}/{len(items)}] {it['id']:<20} plain {row['plain_tps']:5.1f} tok/s  {ratios}  (eta {eta:.0f}s)",
              file=sys.stderr, flush=True)
    return rows
