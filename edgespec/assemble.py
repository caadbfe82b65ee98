"""From settings to the parts of a running Engine: resolve the files, check the pair, fit the
memory budget, load the backends, build the drafter, calibrate. The CLI, the benchmark, the
library and the server all go through `Settings` and `Engine.from_settings` (which calls
`load_parts`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Union

from .defaults import ALL_LAYERS, GAMMA, N_CTX, cpu_count
from .errors import UsageError
from .progress import ProgressCallback, log



@dataclass(frozen=True)
class DrafterKind:
    """One `--drafter` mode: how to build it (`make(target, model, gamma, policy)`: `model` the
    ModelDrafter over the draft backend or None, `policy()` builds the calibrated policy), whether it
    loads a draft model, which of the memory planner's configurations it is ("model", "ngram"
    (an index over the context) or "none"), and whether it keeps its passes within the rows this
    build computes exactly when asked (`bit_exact`). A new drafter is a `drafters.Drafter` and one
    line here."""

    name: str
    model: str                  # "needs" | "uses" (when the pair has one) | "no"
    plans_as: str
    help: str
    make: Callable = field(repr=False, default=lambda target, model, gamma, policy: None)
    bit_exact: bool = False     # honours Settings.bit_exact (auto's policy; plain decoding is exact anyway)

    def build(self, target, model, gamma: int, policy=None):
        return self.make(target, model, gamma, policy)


def _ngram(target, model, gamma, policy):
    from .drafters.ngram import NgramDrafter
    return NgramDrafter(gamma)


def _copy(target, model, gamma, policy):
    from .drafters.copy import CopyDrafter
    return CopyDrafter(gamma)


def _auto(target, model, gamma, policy):
    from .drafters.auto import AutoDrafter
    from .drafters.copy import CopyDrafter
    return AutoDrafter(policy(), CopyDrafter(), model)


REGISTRY = {k.name: k for k in (
    DrafterKind("auto", "uses", "model", "per round: a copy of the context, the draft model or no draft, from costs "
                "measured on this device", _auto, bit_exact=True),
    DrafterKind("model", "needs", "model", "the draft model, --gamma tokens a round",
                lambda target, model, gamma, policy: model),
    DrafterKind("ngram", "no", "ngram", "prompt lookup (n-grams of the context), --gamma tokens a round", _ngram),
    DrafterKind("copy", "no", "ngram", "aligned copies of the prompt or the answer (edits), --gamma tokens a round",
                _copy),
    DrafterKind("none", "no", "none", "plain decoding", bit_exact=True),
)}
DRAFTERS = tuple(REGISTRY)
CALIBRATE = ("auto", "now", "never")
FLASH_ATTN = ("on", "off", "auto")
DEFAULT_CACHE_MAX = 2**30  # the default prompt cache: at most 1 GiB of host RAM
KV_TYPE_NAMES = ("f16", "q8_0", "q4_0")  # backend.KV_TYPES, without importing llama.cpp
MAX_PARALLEL = 64


def offloaded_layers(n_gpu_layers: int) -> int:
    """Layers llama.cpp will really put on the GPU for an n_gpu_layers setting: none on a
    CPU-only build. What the memory planner is given, from every entry point."""
    from .backend import ALL_GPU_LAYERS, gpu_offload_supported
    if n_gpu_layers == 0 or not gpu_offload_supported():
        return 0
    return ALL_GPU_LAYERS if n_gpu_layers < 0 else n_gpu_layers


def off_host(settings: "Settings", t_info=None) -> tuple[int, int]:
    """(target, draft) layers not in this machine's RAM: offloaded to a GPU, or on the --rpc servers
    (every repeating layer, and the output layer unless --rpc-output local). --memory-budget is this
    machine's RAM; what the servers hold, `plan --rpc` checks against their free memory."""
    from .backend import ALL_GPU_LAYERS
    target = offloaded_layers(settings.n_gpu_layers)
    draft = offloaded_layers(settings.draft_n_gpu_layers)
    if settings.rpc:
        n_layer = int(t_info.fields.get(f"{t_info.architecture}.block_count", 0) or 0) if t_info else 0
        target = ALL_GPU_LAYERS if settings.rpc_output == "remote" or not n_layer else n_layer
        if settings.rpc_draft:
            draft = ALL_GPU_LAYERS
    return target, draft


def check_drafter(mode) -> None:
    if mode not in DRAFTERS:
        raise UsageError(f"unknown drafter {mode!r}; choose one of {', '.join(DRAFTERS)}")


def _check_int(name: str, value, low: int, high: Optional[int] = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not (ok and (high is None or value <= high)):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise UsageError(f"{name} must be an integer {span}, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """Everything that decides which models run and how. `target`: a models.toml pair name or a
    GGUF path (None: the models file's default pair); `draft` overrides the pair's draft."""

    target: Optional[str] = None
    draft: Optional[str] = None
    drafter: str = "auto"
    n_ctx: int = N_CTX
    threads: Optional[int] = None
    n_gpu_layers: int = ALL_LAYERS
    draft_n_gpu_layers: int = ALL_LAYERS
    gamma: int = GAMMA                 # draft length of the fixed-length drafters (model, ngram)
    memory_budget: Union[int, str, None] = None
    cache_ram: Union[int, str, None] = None  # prompt cache in host RAM (bytes or "512MiB"; 0: none; None: default)
    cache_dir: Optional[str] = None          # and on disk, for restarts (None: not on disk)
    models_file: Optional[str] = None
    verbose: bool = False              # llama.cpp's own logs
    flash_attn: str = "auto"           # llama.cpp's flash attention: "on", "off" or "auto" (docs/memory.md)
    parallel: Optional[int] = None     # sequences generating at once, n_ctx each (None: as many as fit, up to 4)
    parallel_exact: bool = True        # each sequence's rows in passes of their own (Engine.exact_shared)
    bit_exact: bool = False            # auto's passes kept within the exact rows (policy.bit_exact)
    # the memory modes (docs/memory.md#memory-modes), llama-server's names: repacked weight copies,
    # the KV caches' element types (the draft's None: the target's)
    repack: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: Optional[str] = None
    cache_type_v_draft: Optional[str] = None
    # llama.cpp's RPC backend (edgespec/rpc.py, docs/distributed.md): the target's layers on these
    # rpc-servers ("host:port,..." or a list), its output layer there or here; the draft there too
    rpc: Union[str, list, tuple, None] = None
    rpc_output: str = "remote"
    rpc_draft: bool = False
    # earlier answers kept for drafting later requests, in tokens (0: off): drafters/recall.py
    draft_memory: int = 0

    def rpc_servers(self) -> list[str]:
        """The endpoints of `rpc` ([] without)."""
        if not self.rpc:
            return []
        from .rpc import parse_servers
        return parse_servers(self.rpc if isinstance(self.rpc, str) else ",".join(map(str, self.rpc)))

    def validate(self) -> "Settings":
        """Check every field before anything is downloaded or loaded; returns self, or a copy
        with flash_attn "on" when a quantized V cache needs it and flash_attn is "auto"."""
        check_drafter(self.drafter)
        _check_int("n_ctx (--ctx)", self.n_ctx, 16)
        _check_int("gamma (--gamma)", self.gamma, 1, 32)
        if self.parallel is not None:
            _check_int("parallel (--parallel)", self.parallel, 1, MAX_PARALLEL)
        if self.threads is not None:
            _check_int("threads (--threads)", self.threads, 1, 1024)
            cpus = cpu_count()
            if self.threads > cpus:
                # more threads than CPUs wait on each other: a token costs seconds, not milliseconds
                raise UsageError(f"threads (--threads) {self.threads} is more than the {cpus} CPUs this process "
                                 f"can use: pass {cpus} or fewer, or leave it out (default: $EDGESPEC_THREADS, "
                                 "else physical cores)")
        else:
            from .backend import default_threads
            default_threads()  # $EDGESPEC_THREADS, checked as --threads is
        if self.flash_attn not in FLASH_ATTN:
            raise UsageError(f"flash_attn (--flash-attn) must be one of {', '.join(FLASH_ATTN)}, "
                             f"got {self.flash_attn!r}")
        if not isinstance(self.parallel_exact, bool):
            raise UsageError(f"parallel_exact must be True or False, got {self.parallel_exact!r}")
        if not isinstance(self.bit_exact, bool):
            raise UsageError(f"bit_exact (--bit-exact) must be True or False, got {self.bit_exact!r}")
        if self.bit_exact and not REGISTRY[self.drafter].bit_exact:
            # a fixed drafter verifies gamma drafts a pass as asked: cutting them to the exact rows would
            # silently change --gamma, and auto already drafts copies, lookups and the model within them
            raise UsageError(f"bit_exact (--bit-exact) needs drafter auto (or none): auto keeps each verifying pass "
                             f"within the rows this build computes exactly, the {self.drafter} drafter verifies up to "
                             f"gamma (--gamma) {self.gamma} drafts a pass whatever that computes; use --drafter auto, "
                             "or drop --bit-exact")
        if not isinstance(self.repack, bool):
            raise UsageError(f"repack must be True or False, got {self.repack!r}")
        for name, flag in (("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"), ("cache_type_k_draft", "-ctkd"),
                           ("cache_type_v_draft", "-ctvd")):
            v = getattr(self, name)
            if v is not None and v not in KV_TYPE_NAMES:
                raise UsageError(f"{name} ({flag}) must be one of {', '.join(KV_TYPE_NAMES)}, got {v!r}")
        _check_int("n_gpu_layers", self.n_gpu_layers, -1)
        _check_int("draft_n_gpu_layers", self.draft_n_gpu_layers, -1)
        _check_int("draft_memory (--draft-memory)", self.draft_memory, 0)
        self.rpc_servers()
        if self.rpc_output not in ("remote", "local"):
            raise UsageError(f"rpc_output (--rpc-output) must be remote or local, got {self.rpc_output!r}")
        if self.rpc_draft and not self.rpc:
            raise UsageError("--rpc-draft puts the draft model on the --rpc servers: give --rpc HOST:PORT too")
        for name in ("target", "draft", "models_file", "cache_dir"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, Path)):
                raise UsageError(f"{name} must be a path or a name, got {type(v).__name__}")
        if self.memory_budget is not None:
            self.budget_bytes()
        cache = self.cache_bytes()
        if self.cache_ram is not None and self.memory_budget is not None and cache >= self.budget_bytes():
            raise UsageError(f"cache_ram (--cache-ram) {self.cache_ram} leaves nothing of memory_budget "
                             f"(--memory-budget) {self.memory_budget} for the models: give the cache less")
        mode = self.memory_mode()
        if mode.quantized_v:
            quant = next(v for v in (mode.type_v, mode.draft_type_v) if v != "f16")
            if self.flash_attn == "off":
                flag = "--cache-type-v" if mode.type_v != "f16" else "--cache-type-v-draft"
                raise UsageError(f"a {quant} V cache ({flag} {quant}) needs flash attention: drop --flash-attn off "
                                 "(or keep the V cache f16)")
            if self.flash_attn == "auto":
                logging.getLogger("edgespec").info("flash attention on, not auto: a %s V cache needs it", quant)
                return replace(self, flash_attn="on")
        return self

    def memory_mode(self):
        """The memory mode these settings ask for (memory.MemoryMode)."""
        from .memory import MemoryMode
        return MemoryMode(repack=self.repack, type_k=self.cache_type_k, type_v=self.cache_type_v,
                          draft_type_k=self.cache_type_k_draft or self.cache_type_k,
                          draft_type_v=self.cache_type_v_draft or self.cache_type_v)

    def memory_modes(self) -> list:
        """The modes the planner may use, in its order: the asked one, then the cheaper ones
        (memory.MemoryMode.cheaper: q8_0 KV, no repacked weights, both), fastest first at this
        context (memory.by_speed), when there is a memory budget to fit; the asked one alone
        without one."""
        from .memory import by_speed
        mode = self.memory_mode()
        return by_speed(mode.cheaper(self.flash_attn), self.n_ctx) if self.memory_budget is not None else [mode]

    def cheapest_mode(self):
        """The mode of the planner's that takes the least memory (q8_0 KV and no repacked weights)."""
        return self.memory_mode().cheaper(self.flash_attn)[-1] if self.memory_budget is not None \
            else self.memory_mode()

    def budget_bytes(self) -> Optional[int]:
        from .memory import parse_size
        b = self.memory_budget
        if b is None:
            return None
        if isinstance(b, int) and not isinstance(b, bool):
            if b <= 0:
                raise UsageError(f"the memory budget must be more than zero, got {b}")
            return b
        return parse_size(b, "memory_budget (--memory-budget)")

    def cache_bytes(self) -> int:
        """The prompt cache's size: as given, or by default a tenth of the memory budget or of
        the RAM available now, at most DEFAULT_CACHE_MAX."""
        from .memory import parse_size
        c = self.cache_ram
        if c is None:
            if self.memory_budget is not None:
                return min(DEFAULT_CACHE_MAX, self.budget_bytes() // 10)
            import psutil
            return min(DEFAULT_CACHE_MAX, psutil.virtual_memory().available // 10)
        if isinstance(c, int) and not isinstance(c, bool):
            if c < 0:
                raise UsageError(f"cache_ram must be >= 0 bytes (0 turns the prompt cache off), got {c}")
            return c
        if isinstance(c, str) and c.strip() in ("0", "0.0"):
            return 0
        return parse_size(c, "cache_ram (--cache-ram)", zero=True)  # 0B, 0GiB: off, as 0 is

    def target_name(self) -> str:
        from .registry import load_registry
        return str(self.target) if self.target else load_registry(self.models_file).default


def resolve_files(settings: Settings, *, download: bool = True, progress: Optional[ProgressCallback] = None
                  ) -> tuple[Path, Optional[Path]]:
    """(target path, draft path or None) for these settings; the draft only when the drafter
    wants one."""
    from .hub import resolve
    target, pair_draft = resolve(settings.target_name(), models_file=settings.models_file, download=download,
                                 progress=progress)
    draft = settings.draft or pair_draft
    if REGISTRY[settings.drafter].model == "no":
        draft = None
    if REGISTRY[settings.drafter].model == "needs" and not draft:
        raise UsageError("--drafter model needs a draft: pass --draft PATH or a pair that has one")
    return Path(target), Path(draft) if draft else None


def plan_mode(settings: Settings) -> str:
    """The drafter as the memory planner counts it ("auto", or a registered drafter's plans_as)."""
    return settings.drafter if settings.drafter == "auto" else REGISTRY[settings.drafter].plans_as


def plan_for(settings: Settings, t_info, d_info) -> dict:
    """The one memory-budget rule: memory.plan for these settings (their context, drafter, flash
    attention, number of sequences and the GPU layers llama.cpp will really offload) against
    their budget less the prompt cache's share, which lives in the same RAM. `plan`, `run`,
    `serve`, `Engine.load` and both benchmarks all decide through this. No memory_budget: the
    RAM available now. The result is memory.plan's, with budget_bytes the whole budget,
    cache_bytes the prompt cache's share, fit_bytes what the configurations had to fit in (the
    difference) and parallel the sequences planned for (settings.parallel, or the most that fit
    when it is None). With a memory_budget the cheaper memory modes are tried before the draft
    model is dropped or the context lowered (Settings.memory_modes)."""
    from .memory import available_memory, plan
    given = settings.budget_bytes()
    total = available_memory() if given is None else given
    cache = settings.cache_bytes()
    fit = max(0, total - cache)
    result = plan(t_info, d_info, n_ctx=settings.n_ctx, drafter=plan_mode(settings), budget=fit,
                  gpu_layers=off_host(settings, t_info)[0], draft_gpu_layers=off_host(settings, t_info)[1],
                  flash_attn=settings.flash_attn,
                  n_seq=settings.parallel, modes=settings.memory_modes())
    return dict(result, budget_bytes=total, cache_bytes=cache, fit_bytes=fit)


def parallel_for(settings: Settings, t_info, d_info) -> int:
    """The sequences to load the models for: settings.parallel, or (None) plan_for's choice, the
    most that fit the budget (the RAM available now without one)."""
    if settings.parallel is not None:
        return settings.parallel
    return plan_for(settings, t_info, d_info)["parallel"]


def pair_peak(target_path, draft_path=None, settings: Optional[Settings] = None) -> dict:
    """`plan`'s estimate for a pair's wanted configuration (target + draft model, or target +
    n-gram drafting for a target alone) at the settings' context (default: Settings' defaults),
    read from GGUF metadata without loading: {drafter, n_ctx, estimated_bytes}. Before the
    prompt cache, as `plan`'s peaks are; for one sequence unless the settings say otherwise."""
    from .ggufinfo import read_info
    settings = settings or Settings(parallel=1)
    t = read_info(Path(target_path))
    d = read_info(Path(draft_path)) if draft_path else None
    wanted = "model" if d is not None else "ngram"
    for c in plan_for(settings, t, d)["configs"]:
        if c["drafter"] == wanted and c["n_ctx"] == settings.n_ctx:
            return {"drafter": wanted, "n_ctx": c["n_ctx"], "estimated_bytes": c["estimated_bytes"]}
    raise AssertionError("plan_for always estimates the wanted configuration")  # pragma: no cover


def budget_words(result: dict) -> str:
    """'1.80 GiB (2.00 GiB less 0.20 GiB for the prompt cache, --cache-ram)': plan_for's figure
    as `plan` and `run` both say it."""
    from .memory import size_words
    fit, cache = result["fit_bytes"], result["cache_bytes"]
    if not cache:
        return size_words(fit)
    return (f"{size_words(fit)} ({size_words(result['budget_bytes'])} less {size_words(cache)} "
            "kept for the prompt cache, --cache-ram)")


def _smaller_parallel(settings: Settings, t_info, d_info, result: dict, drafter: str) -> int:
    """The most sequences, fewer than planned, at which `drafter` fits at the wanted context (0: none)."""
    from .memory import largest_parallel
    return largest_parallel(t_info, d_info, n_ctx=settings.n_ctx, drafter=drafter, budget=result["fit_bytes"],
                            limit=result["parallel"] - 1, gpu_layers=off_host(settings, t_info)[0],
                            draft_gpu_layers=off_host(settings, t_info)[1],
                            flash_attn=settings.flash_attn, mode=settings.cheapest_mode())


def fit_budget(settings: Settings, t_info, d_info) -> tuple:
    """(drafter mode, keep the draft model?, sequences, memory mode) that fit the budget at the
    wanted context size (`decide`); a UsageError where nothing does, its notes logged."""
    d = decide(settings, t_info, d_info)
    if not d["ok"]:
        raise UsageError(d["error"])
    for note in d["notes"]:
        log.warning("%s", note)
    return d["drafter"], d["keep_draft"], d["parallel"], d["memory_mode"]


def decide(settings: Settings, t_info, d_info) -> dict:
    """What `run`, `serve`, the benchmarks and `Engine.load` do with these settings, and what
    `plan` says they will do: {ok, drafter, keep_draft, parallel, memory_mode, n_ctx, notes} or
    {ok: False, error}. With a memory budget, memory.plan's order at the wanted context (never
    lower: a smaller context is a hint in the error): the draft model in the asked memory mode,
    then in the cheaper ones (q8_0 KV, no repacked weights, both), then n-gram drafting, then
    plain decoding; sequences as given, or the most at which the wanted drafter fits (up to 4).
    Without one: the drafter asked, and as many sequences as asked or as fit the RAM now."""
    from .memory import mode_of, speed_words, wanted_drafters
    if settings.memory_budget is None:
        return {"ok": True, "drafter": settings.drafter, "keep_draft": d_info is not None,
                "parallel": parallel_for(settings, t_info, d_info), "memory_mode": settings.memory_mode(),
                "n_ctx": settings.n_ctx, "notes": []}
    kind = REGISTRY[settings.drafter]
    mode = plan_mode(settings)
    result = plan_for(settings, t_info, d_info)  # the prompt cache lives in the same RAM
    choice, n = result["choice"], result["parallel"]
    seqs = f" with {n} sequences (--parallel {n})" if n > 1 else ""
    asked = settings.memory_mode()
    if choice.get("n_ctx") != settings.n_ctx:
        fewer = _smaller_parallel(settings, t_info, d_info, result, wanted_drafters(mode, d_info)[-1]) if n > 1 else 0
        fits = ([f"--parallel {fewer} (fits)"] if fewer else []) + \
            ([f"--ctx {choice['n_ctx']} (fits)"] if "n_ctx" in choice else [])
        hint = (f"pass {' or '.join(fits)}, " if fits else "") + \
            "raise --memory-budget or lower --cache-ram (see `edgespec plan`)"
        modes = settings.memory_modes()
        cheapest = f" in memory mode {settings.cheapest_mode().name}" if len(modes) > 1 else ""
        return {"ok": False, "error": f"{t_info.path.name}{seqs} does not fit in {budget_words(result)} even without "
                                      f"a drafter at n_ctx {settings.n_ctx}{cheapest}: {hint}"}
    got = choice["drafter"]
    memory_mode = mode_of(choice)
    wanted = "model" if d_info is not None else ("ngram" if mode in ("auto", "ngram") else "none")
    in_mode = (f", in memory mode {memory_mode.name} ({speed_words(memory_mode)})"
               if memory_mode != asked else "")
    notes = []
    if got != wanted:
        fewer = _smaller_parallel(settings, t_info, d_info, result, wanted) if n > 1 else 0
        modes = settings.memory_modes()
        anyway = " in any memory mode" if len(modes) > 1 else ""
        notes.append(f"the {wanted} drafter does not fit in {budget_words(result)} at n_ctx {settings.n_ctx}{seqs}"
                     f"{anyway}: using {got} drafting instead"
                     f"{f' (--parallel {fewer} keeps it)' if fewer else ''}{in_mode}")
    elif memory_mode != asked:
        notes.append(f"the {wanted} drafter does not fit in {budget_words(result)} at n_ctx {settings.n_ctx}{seqs} "
                     f"in memory mode {asked.name}: using memory mode {memory_mode.name} ({speed_words(memory_mode)})")
    if settings.drafter == "auto" and got != "none":
        drafter = "auto"
    elif got == kind.plans_as:  # it fits as asked (copy plans as an n-gram index)
        drafter = settings.drafter
    else:
        drafter = got
    return {"ok": True, "drafter": drafter, "keep_draft": got == "model", "parallel": n, "memory_mode": memory_mode,
            "n_ctx": settings.n_ctx, "notes": notes}


def check_context(settings: Settings, t_info, d_info=None) -> None:
    """Refuse, before anything is allocated, a context the model was not trained for or that
    cannot fit in this machine's memory at all (llama.cpp would take a minute to fail)."""
    from .ggufinfo import trained_context
    from .memory import estimate_model, total_memory
    for info in (t_info, d_info):
        trained = trained_context(info) if info is not None else None
        if trained is not None and settings.n_ctx > trained:
            raise UsageError(f"n_ctx (--ctx) {settings.n_ctx} is more than the {trained} tokens {info.path.name} "
                             f"was trained for: pass --ctx {trained} or less")
    # a lower bound (no copied weights, no runtime, one sequence unless more are asked for): what
    # is refused here could never run
    n = settings.parallel or 1
    cheapest = settings.cheapest_mode()
    need = estimate_model(t_info, settings.n_ctx, gpu_layers=off_host(settings, t_info)[0],
                          repacked_types=(), flash_attn=settings.flash_attn, n_seq=n,
                          type_k=cheapest.type_k, type_v=cheapest.type_v).total
    have = total_memory()
    if have and need > have:
        seqs, lower = (f" x {n} sequences (--parallel {n})", "--parallel or --ctx") if n > 1 else ("", "--ctx")
        raise UsageError(f"n_ctx (--ctx) {settings.n_ctx}{seqs} needs at least {need / 2**30:.1f} GiB for "
                         f"{t_info.path.name} and its KV cache, more than this machine's {have / 2**30:.1f} GiB of RAM "
                         f"and swap: lower {lower} (see `edgespec plan`)")


def load_parts(settings: Settings, *, download: bool = True, calibrate: str = "auto",
               progress: Optional[ProgressCallback] = None):
    """Load the models and drafter that `settings` describe: (target backend, drafter or None,
    prompt cache or None), what `Engine.from_settings` puts together (this module knows no Engine)."""
    from .backend import LlamaBackend
    from .ggufinfo import check_pair, read_info

    settings = settings.validate()  # a quantized V cache turns flash attention auto into on
    if calibrate not in CALIBRATE:
        raise UsageError(f"calibrate must be one of {', '.join(CALIBRATE)}, got {calibrate!r}")
    target_path, draft_path = resolve_files(settings, download=download, progress=progress)
    t_info = read_info(target_path)
    d_info = read_info(draft_path) if draft_path else None
    if draft_path:
        check_pair(target_path, draft_path)  # before any weights are loaded
    check_context(settings, t_info, d_info)
    drafter = settings.drafter
    mode = settings.memory_mode()
    if settings.memory_budget is not None:
        drafter, keep_draft, n_seq, mode = fit_budget(settings, t_info, d_info)
        if not keep_draft:
            draft_path = None
    else:  # no limit: as many sequences as asked, or as fit the RAM available now
        n_seq = parallel_for(settings, t_info, d_info)
    # a quantized V cache the budget chose needs flash attention, which auto leaves to llama.cpp
    flash_attn = "on" if mode.quantized_v and settings.flash_attn == "auto" else settings.flash_attn
    # n_ctx is one sequence's context: each context holds n_ctx x n_seq KV cells
    remote = settings.rpc_servers()
    tb = LlamaBackend(target_path, n_ctx=settings.n_ctx, n_seq=n_seq, n_gpu_layers=settings.n_gpu_layers,
                      threads=settings.threads, flash_attn=flash_attn, verbose=settings.verbose,
                      repack=mode.repack, type_k=mode.type_k, type_v=mode.type_v, rpc=remote,
                      rpc_output=settings.rpc_output)
    db = None
    try:
        if drafter != "none" and not tb.can_truncate:
            if drafter != "auto":
                raise UsageError(f"{target_path.name} is a recurrent or hybrid model whose cache cannot be cut "
                                 "back after a rejected draft: speculation is impossible, use --drafter none")
            log.warning("%s is a recurrent or hybrid model; its cache cannot be cut back after a rejection, "
                        "so it decodes without speculation", target_path.name)
            drafter, draft_path = "none", None
        if draft_path:
            db = LlamaBackend(draft_path, n_ctx=settings.n_ctx, n_seq=n_seq, n_gpu_layers=settings.draft_n_gpu_layers,
                              threads=settings.threads, flash_attn=flash_attn, verbose=settings.verbose,
                              repack=mode.repack, type_k=mode.draft_type_k, type_v=mode.draft_type_v,
                              rpc=remote if settings.rpc_draft else None)
        from .promptcache import DiskCache, PromptCache
        cache_bytes = settings.cache_bytes()
        disk = (DiskCache(settings.cache_dir, DiskCache.identity_of(tb),
                          draft_identity=DiskCache.identity_of(db) if db is not None else None,
                          facts=DiskCache.facts_of(tb))
                if settings.cache_dir else None)
        cache = PromptCache(cache_bytes, disk) if cache_bytes or disk is not None else None
        made = make_drafter(drafter, tb, db, gamma=settings.gamma, calibrate=calibrate, progress=progress,
                            memory=settings.draft_memory)
        policy = getattr(made, "policy", None)
        if policy is not None:
            policy.exact_shared = settings.parallel_exact
            policy.bit_exact = settings.bit_exact
        return tb, made, cache
    except BaseException:
        if db is not None:
            db.close()
        tb.close()
        raise


def make_drafter(mode: str, target, draft_backend=None, *, gamma: int = GAMMA, calibrate: str = "auto",
                 progress: Optional[ProgressCallback] = None, memory: int = 0):
    """The drafter object for a mode (see REGISTRY), over loaded backends; `memory`: tokens of
    earlier answers its lookups draw on (drafters/recall.py; 0: none)."""
    from .drafters.model import ModelDrafter
    check_drafter(mode)
    n_vocab = max(target.n_vocab, draft_backend.n_vocab) if draft_backend is not None else target.n_vocab
    model = ModelDrafter(draft_backend, n_vocab, gamma) if draft_backend is not None else None
    made = REGISTRY[mode].build(target, model, gamma,
                                lambda: make_policy(target, draft_backend, calibrate=calibrate, progress=progress))
    if memory and made is not None:
        from .drafters.recall import DraftMemory
        made.use_memory(DraftMemory(memory))
    return made


def make_policy(target, draft_backend=None, *, calibrate: str = "auto", progress=None):
    """auto's policy over this device's costs: calibrated (or cached), then followed online;
    corrections that hold are written back to the calibration cache (not with "never")."""
    from .calibrate import LoadMeter, exact_limit, obtain, write_back
    from .costs import OnlineCosts
    from .policy import Policy
    cal = obtain(target, draft_backend, mode=calibrate, progress=progress)
    exact = exact_limit(target, draft_backend, cal, calibrate)
    persist = None
    if calibrate != "never":
        meter = LoadMeter()  # other load since the last write: a busy spell's figures are not kept

        def persist(costs):
            return write_back(target, draft_backend, costs, meter)
    source = cal.source + (" (provisional)" if cal.provisional else "")
    # a doubtful calibration gets no say once the engine's own passes disagree with it
    trust = 0 if cal.provisional or cal.source == "defaults" else 3
    policy = Policy(OnlineCosts(cal.costs, source, prior=trust, persist=persist))
    policy.exact_rows = exact
    policy.reproducible = True  # each generation decides on its own tokens and the adopted costs
    return policy
