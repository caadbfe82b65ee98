"""What the CLI verbs and `serve` share: the model and sampling flags, the Settings and Request
they become, notices and progress bars on the terminal. One module, so that neither imports the
other (the server's verb lives in server/command.py, the rest in cli.py)."""
from __future__ import annotations

import argparse
import logging
import sys

from .assemble import DEFAULT_CACHE_MAX, KV_TYPE_NAMES, Settings
from .errors import UsageError

# --memory-budget and --cache-ram, defined once for every verb (run, bench, calibrate, serve, plan)
BUDGET_FLAGS = {
    "--memory-budget": dict(
        metavar="SIZE", default=None,
        help="RAM for the whole process, with a unit: 2GiB, 1500MB, 2g. What fits is chosen by `plan`'s rule "
        "(draft model, then n-gram drafting, then plain decoding), after the prompt cache's share (--cache-ram) "
        "is set aside. Default: no limit (`plan`: the RAM available now)"),
    "--cache-ram": dict(
        metavar="SIZE", default=None,
        help="host RAM kept for the prompt cache, the KV caches of prompts and conversations that may come back "
        "(e.g. 512MiB; 0 = off); it is taken out of --memory-budget before the models are fitted. Default: a "
        f"tenth of --memory-budget or of the free RAM, at most {DEFAULT_CACHE_MAX // 2**30} GiB"),
}
# the memory modes' flags (llama-server's names), for every verb that loads or plans models
MEMORY_MODE_FLAGS = {
    ("--no-repack",): dict(
        dest="repack", action="store_false", default=True,
        help="keep no repacked copy of the weights (llama.cpp's CPU_REPACK buffer): the weights' memory once, "
        "not twice for Q4_0/Q4_K models (about 600 MiB less for Qwen2.5-Coder-1.5B), at some speed "
        "(docs/memory.md#memory-modes). Default: repacked"),
    ("--cache-type-k", "-ctk"): dict(
        metavar="TYPE", default="f16", choices=KV_TYPE_NAMES,
        help="the target's K cache element type: f16, q8_0 (34/64 of f16's bytes) or q4_0 (18/64); default f16"),
    ("--cache-type-v", "-ctv"): dict(
        metavar="TYPE", default="f16", choices=KV_TYPE_NAMES,
        help="the target's V cache element type, as -ctk; a quantized V needs flash attention (auto becomes on); "
        "default f16"),
    ("--cache-type-k-draft", "-ctkd"): dict(
        metavar="TYPE", default=None, choices=KV_TYPE_NAMES,
        help="the draft model's K cache element type (default: the target's, -ctk)"),
    ("--cache-type-v-draft", "-ctvd"): dict(
        metavar="TYPE", default=None, choices=KV_TYPE_NAMES,
        help="the draft model's V cache element type (default: the target's, -ctv)"),
}
# --parallel, for the verbs that serve several requests at once (serve) and `plan`; run, the chat
# and bench hold one conversation and plan for one sequence (Settings(parallel=1))
PARALLEL_FLAGS = {
    ("--parallel", "-np"): dict(
        type=int, default=None, metavar="N",
        help="requests generated at once (1..64), each with its own --ctx tokens: both models' KV caches grow "
        "N-fold, the weights do not (docs/memory.md). Default: as many as the memory budget allows with the "
        "wanted drafter and context, at most 4 (1 when not even one fits)"),
    ("--parallel-exact",): dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="each request's rows (and draft steps) in passes of their own, planned as if alone, so that a "
        "greedy answer given beside others equals its answer alone (llama.cpp computes a row beside another "
        "request's rows otherwise: a near-tie can flip). On by default; --no-parallel-exact shares the passes "
        "for more throughput at once (docs/exactness.md)"),
}


PROG = "edgespec"


class _Stderr(logging.Handler):
    """The library's notices, one line each on whatever sys.stderr is when they come (a handler
    bound to the stream of the moment writes to a closed one once tests swap streams)."""

    def emit(self, record):
        try:
            ProgressBar.finish_open()  # a notice never lands on a half-drawn bar
            sys.stderr.write(f"{PROG}: {record.getMessage()}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def notice(text: str) -> None:
    """One line for the person at the terminal (verbs such as `serve` that report as they go):
    through the `edgespec.cli` logger, which the CLI's handler writes while a verb runs."""
    logging.getLogger("edgespec.cli").warning(text)


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
    (nothing at all when stderr is not a terminal). A line reaching 100% ends itself; one left
    open (work that ended short of it, or another task starting) is ended by `finish()`, or
    `ProgressBar.finish_open()` for whichever bar drew last, before anything else is printed."""

    _open: "ProgressBar | None" = None  # the bar whose line the cursor is on (one terminal line for all)

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._task = None

    def finish(self) -> None:
        """End this bar's line with a newline if it is open; nothing otherwise."""
        if ProgressBar._open is not self:
            return
        ProgressBar._open = None
        try:
            self.stream.write("\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    @classmethod
    def finish_open(cls) -> None:
        """End the open line of whichever bar drew last (before a banner, a prompt, a notice)."""
        if cls._open is not None:
            cls._open.finish()

    def __call__(self, p) -> None:
        if not self.live:
            return
        if ProgressBar._open is not None and (ProgressBar._open is not self or self._task != p.task):
            ProgressBar._open.finish()  # another task's line stays on the screen, ended
        self._task = p.task
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
        ProgressBar._open = self
        if frac is not None and frac >= 1.0:
            self.finish()
        self.stream.flush()


class _Help(argparse.HelpFormatter):
    """Every option's default in --help: appended where the help text does not say it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" not in text and action.option_strings and action.default not in (None, False, [], "==SUPPRESS==")
                and action.nargs != 0):
            text += f" (default {action.default})"
        return text


class _RawHelp(_Help, argparse.RawDescriptionHelpFormatter):
    """The same, for a description laid out by hand (bench's)."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2, as for every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("pair", nargs="?", metavar="PAIR",
                   help="model pair name from models.toml (default: the file's default pair)")
    p.add_argument("--target", "-m", "--model", metavar="PATH", help="target GGUF file (instead of a pair)")
    p.add_argument("--draft", "-md", "--model-draft", metavar="PATH",
                   help="draft GGUF file (overrides the pair's draft)")
    if drafter:
        from .assemble import REGISTRY
        p.add_argument("--drafter", default="auto", metavar="MODE",
                       help="; ".join(f"{k.name}: {k.help}" for k in REGISTRY.values()) + " (default auto)")
        p.add_argument("--bit-exact", action="store_true",
                       help="keep auto's verifying passes to the rows this build computes as a single-token "
                       "decode does (measured at calibration): T = 0 answers then equal plain decoding's bit "
                       "for bit, at the cost of speed where longer passes pay (a GPU, an F16 target). Default: "
                       "the target's distribution exactly; at T = 0 its batched logits, as llama.cpp and vLLM "
                       "verify (docs/exactness.md). With --drafter auto or none only: the fixed drafters verify "
                       "--gamma drafts a pass, and are refused with it")
    p.add_argument("--models", metavar="FILE", help="your own models.toml, extending the built-in one "
                   "(also $EDGESPEC_MODELS)")
    p.add_argument("--ctx", "-c", "--ctx-size", type=int, default=Settings.n_ctx, metavar="N",
                   help="context size in tokens (default %(default)s)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                   help="CPU threads (default: $EDGESPEC_THREADS, else the physical cores)")
    p.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", type=int, default=Settings.n_gpu_layers, metavar="N",
                   help="target layers to offload to the GPU; -1 = all, 0 = CPU only (default %(default)s)")
    p.add_argument("--draft-n-gpu-layers", "-ngld", "--n-gpu-layers-draft", type=int,
                   default=Settings.draft_n_gpu_layers, metavar="N",
                   help="draft layers to offload to the GPU (default %(default)s)")
    p.add_argument("--gamma", "--draft-max", type=int, default=Settings.gamma, metavar="N",
                   help="draft length per round for --drafter model/ngram (default %(default)s; auto chooses its own)")
    for flag, kw in BUDGET_FLAGS.items():  # --memory-budget, --cache-ram: the same on every verb
        p.add_argument(flag, **kw)
    _add_flash_attn_arg(p)
    _add_memory_mode_args(p)
    _add_rpc_args(p)
    p.add_argument("--draft-memory", type=int, default=Settings.draft_memory, metavar="N",
                   help="keep the last N tokens of earlier answers (oldest evicted first) for the lookup drafting of "
                   "later requests: a tool call or a file an agent wrote before is drafted whole the next time "
                   "(docs/agents.md); 0 = off (default 0). Drafts only: answers are verified as before")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's own logs")


def _add_rpc_args(p: argparse.ArgumentParser) -> None:
    """--rpc (llama-server's name) and its two companions: docs/distributed.md."""
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                   help="run the target's layers on these llama.cpp rpc-servers (start one on the big machine "
                   "with `python -m edgespec rpc-server --host 0.0.0.0`; trusted networks only: RPC has no "
                   "authentication). The draft model, the drafters and the sampling stay here; each verifying "
                   "pass pays one round trip for all its rows")
    p.add_argument("--rpc-output", choices=("remote", "local"), default="remote",
                   help="with --rpc: the output layer on the servers (each verified row sends its logits back, "
                   "~600 KB at a 152k vocabulary) or here (hidden states come back, this machine computes the "
                   "logits); default remote")
    p.add_argument("--rpc-draft", action="store_true", help="with --rpc: the draft model on the servers too")


def _add_memory_mode_args(p: argparse.ArgumentParser) -> None:
    """--no-repack, -ctk/-ctv and the draft's -ctkd/-ctvd: the memory modes (llama-server's names)."""
    for flags, kw in MEMORY_MODE_FLAGS.items():
        p.add_argument(*flags, **kw)


def _add_flash_attn_arg(p: argparse.ArgumentParser) -> None:
    from .assemble import FLASH_ATTN, Settings
    p.add_argument("--flash-attn", "-fa", choices=FLASH_ATTN, default=Settings.flash_attn,
                   help=f"llama.cpp's flash attention (default {Settings.flash_attn}): off materialises "
                   "attention scores for every cached position, hundreds of MiB at long contexts; "
                   "see docs/memory.md")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", "--n-predict", type=int, default=256, metavar="N",
                   help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep the K most likely tokens; 0 = off (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1]; 1 = off (default 1)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens below P x the top probability; 0 = off (default 0)")
    p.add_argument("--seed", "-s", type=int, default=None, metavar="S",
                   help="random seed for reproducible sampling (default: a fresh one each run)")
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
    if not value.strip():
        raise UsageError(f"{flag} is empty: give a file" + ("" if file_only else " or JSON text"))
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
                  memory_budget=args.memory_budget, cache_ram=getattr(args, "cache_ram", None),
                  models_file=args.models, verbose=getattr(args, "verbose", False),
                  bit_exact=getattr(args, "bit_exact", False))
    if getattr(args, "draft_memory", None) is not None:
        fields["draft_memory"] = args.draft_memory
    if getattr(args, "flash_attn", None) is not None:
        fields["flash_attn"] = args.flash_attn
    if getattr(args, "parallel_exact", None) is not None:  # --parallel-exact / --no-parallel-exact
        fields["parallel_exact"] = args.parallel_exact
    for name in ("rpc", "rpc_output", "rpc_draft"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    for name in ("repack", "cache_type_k", "cache_type_v", "cache_type_k_draft", "cache_type_v_draft"):
        if hasattr(args, name):  # the memory modes (every verb with the model flags, and plan)
            fields[name] = getattr(args, name)
    fields.update(overrides)
    return Settings(**fields).validate()


def load_engine(args, **overrides):
    from .engine import Engine
    return Engine.from_settings(settings_from_args(args, **overrides), progress=ProgressBar())


# -- run ------------------------------------------------------------------------------------
