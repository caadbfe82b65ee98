"""`python -m edgespec VERB`: the only place that turns errors into messages and exit codes."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import EdgespecError, UsageError

PROG = "edgespec"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("pair", nargs="?", metavar="PAIR",
                   help="model pair name from models.toml (default: the file's default pair)")
    p.add_argument("--target", metavar="PATH", help="target GGUF file (instead of a pair)")
    p.add_argument("--draft", metavar="PATH", help="draft GGUF file (overrides the pair's draft)")
    p.add_argument("--drafter", default="auto", metavar="MODE",
                   help="auto | model | ngram | none. auto (default) picks per round between n-gram "
                   "lookup, the draft model and plain decoding from costs measured on this device; "
                   "model and ngram always draft --gamma tokens; none is plain decoding")
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
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's own logs")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1]; 1 = off")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P x the top probability")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")


def _sampling_kwargs(args) -> dict:
    from .sampling import SamplingParams
    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)  # validate before loading
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop))


def load_engine(args):
    from .engine import DRAFTER_MODES, Engine
    from .registry import load_registry
    if args.drafter not in DRAFTER_MODES:
        raise UsageError(f"unknown drafter {args.drafter!r}; choose one of {', '.join(DRAFTER_MODES)}")
    if args.target and args.pair:
        raise UsageError("give either a pair name or --target PATH, not both")
    target = args.target or args.pair or load_registry(args.models).default
    return Engine.load(target, draft=args.draft, drafter=args.drafter, n_gpu_layers=args.n_gpu_layers,
                       draft_n_gpu_layers=args.draft_n_gpu_layers, n_ctx=args.ctx, threads=args.threads,
                       gamma=args.gamma, verbose=args.verbose, models_file=args.models)


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
        text = args.prompt
    elif args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read prompt file {args.file}: {getattr(exc, 'strerror', None) or exc}") from None
    else:
        text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt is empty: pass --prompt TEXT, --file F or text on stdin")
    return text


def cmd_run(args) -> int:
    kwargs = _sampling_kwargs(args)
    prompt = _read_prompt(args)
    with load_engine(args) as engine:
        if args.raw:
            events = engine.stream(prompt, **kwargs)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            events = engine.stream_chat(messages + [{"role": "user", "content": prompt}], **kwargs)
        tokens, parts = [], []
        for ev in events:
            tokens.append(ev.token)
            parts.append(ev.text)
            if not args.json:
                sys.stdout.write(f"\033[32m{ev.text}\033[0m" if args.show_drafts and ev.from_draft and ev.text
                                 else ev.text)
                sys.stdout.flush()
        stats = engine.last_stats
        if args.json:
            print(json.dumps({"text": "".join(parts), "tokens": tokens, "stats": stats.as_dict()}))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(stats.summary(), file=sys.stderr)
    return 0


# -- bench ----------------------------------------------------------------------------------
def _setup_bench(sub) -> None:
    from . import bench
    bench.setup_arg_parser(sub.add_parser("bench", help="benchmark against plain decoding on the workloads",
                                          description=bench.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    _add_model_args(sub.choices["bench"])


# -- calibrate ------------------------------------------------------------------------------
def _setup_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure what verifying k tokens costs on this device",
                       description="Time target passes returning logits for 1..32 rows and one draft "
                       "step, and cache them for --drafter auto (done automatically on first use).")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from .calibrate import load_or_measure
    from .hub import resolve
    from .registry import load_registry
    if args.target and args.pair:
        raise UsageError("give either a pair name or --target PATH, not both")
    _, pair_draft = resolve(args.target or args.pair or load_registry(args.models).default,
                            models_file=args.models)
    args.drafter = "model" if (args.draft or pair_draft) else "none"
    with load_engine(args) as eng:
        costs = load_or_measure(eng.target, eng.drafter.backend if eng.drafter else None, force=True)
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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
