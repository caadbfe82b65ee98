"""Will it fit? Peak resident memory estimated from GGUF metadata, before loading anything.

The estimate adds up the parts llama.cpp allocates on a CPU: the mapped weights, the copies it
repacks for its kernels, the KV cache at its element types for each sequence, a prompt micro-batch's
activations, the vocabulary tables, the runtime (both measured on this machine by probe.py) and the
n-gram index. docs/memory.md ("The parts, as edgespec/memory.py counts them") says how each is
counted; the constants below carry the measurements they were fitted to. `plan()` fits a budget,
trying the cheaper memory modes (MemoryMode) before it drops the draft model or shrinks the context.
"""
from __future__ import annotations

import math

import re
from dataclasses import asdict, dataclass, replace
from typing import Optional

from .defaults import N_CTX
from .errors import UsageError

MiB = 2**20
# Constants that do not depend on the machine (sizes of llama.cpp's and CPython's data
# structures on 64-bit Linux, ggml's graph allocator), fitted to whole-process peak RSS of
# SmolLM2-135M, gemma-3-270m and Qwen2.5-Coder 0.5B / 1.5B on two llama.cpp builds of the same
# machine (AVX-512 and AVX2-only) - docs/memory.md. What does vary between machines comes
# from probe.machine_figures().
RUN_EXTRA = 12 * MiB                # what a run adds beyond the probe's interpreter and context
VOCAB_BYTES_PER_TOKEN = 275         # llama.cpp's vocabulary + edgespec's token list, per token
VOCAB_BYTES_PER_MERGE = 160         # llama.cpp's BPE ranks, per merge
# resident f32 activations per token of a full micro-batch, x n_ff and x n_embd: fitted to the
# growth from a short prompt to a full context with flash attention on (SmolLM2, Qwen 0.5B/1.5B)
ACTIVATION_FF = 2.94
ACTIVATION_EMBD = 4.8
NGRAM_BYTES_PER_TOKEN = 8 * 160  # N_MAX dict entries of a short tuple key each
N_UBATCH = 512
# ggml's KV element types: (bytes per block, elements per block); the keys are backend.KV_TYPES
KV_TYPE_SIZES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}


def kv_row_bytes(n_elements: int, type_name: str) -> int:
    """ggml_row_size: the bytes of n_elements of a KV element type (whole blocks)."""
    size, block = KV_TYPE_SIZES[type_name]
    return -(-n_elements // block) * size


@dataclass(frozen=True)
class MemoryMode:
    """How the models hold their memory: the KV caches' element types, the target's and the
    draft model's, and whether llama.cpp keeps repacked copies of the weights (both models)."""
    repack: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"

    @property
    def quantized_v(self) -> bool:
        return self.type_v != "f16" or self.draft_type_v != "f16"

    @property
    def name(self) -> str:
        """'default', 'KV q8_0', 'no repack', 'KV q8_0 + no repack', 'K q8_0 V f16', ..."""
        def kv(k, v):
            return f"KV {k}" if k == v else f"K {k} V {v}"
        words = []
        target, draft = (self.type_k, self.type_v), (self.draft_type_k, self.draft_type_v)
        if target == draft:
            if target != ("f16", "f16"):
                words.append(kv(*target))
        else:
            words += [f"target {kv(*target)}", f"draft {kv(*draft)}"]
        if not self.repack:
            words.append("no repack")
        return " + ".join(words) or "default"

    def as_dict(self) -> dict:
        return dict(asdict(self), name=self.name, speed=mode_speed(self))

    def cheaper(self, flash_attn: str) -> list["MemoryMode"]:
        """This mode, then the ones the planner may trade to under a budget, in its order: q8_0
        KV caches (every f16 one; the V caches only with flash attention, which a quantized V
        needs), then no repacked weights, then both. The same mode is not listed twice."""
        v_ok = flash_attn != "off"
        q8 = replace(self, **{f: "q8_0" for f in ("type_k", "type_v", "draft_type_k", "draft_type_v")
                              if getattr(self, f) == "f16" and (v_ok or not f.endswith("type_v"))})
        out = []
        for m in (self, q8, replace(self, repack=False), replace(q8, repack=False)):
            if m not in out:
                out.append(m)
        return out


DEFAULT_MODE = MemoryMode()
# What each mode costs in speed on the target, as a ratio to the default mode (f16 KV, repacked
# weights) measured in the same run (below 1: slower), at two context depths (512 and 4096 tokens
# already in the cache): decode, one token; prefill, 256 tokens; verify_k, one pass of k tokens
# returning k rows, as speculation verifies. Wall-time medians of 7 (depth 512) and 5 (depth 4096)
# rounds that alternate the modes (process CPU time agreed within 0.06), Qwen2.5-Coder-1.5B Q4_K_M,
# n_ctx 8192, flash attention on, 2 threads, this project's AVX-512 build (docs/memory.md#memory-modes):
#   python scripts/measure_modes.py ~/.cache/edgespec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --rounds 7
#   python scripts/measure_modes.py ~/.cache/edgespec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
#       --depth 4096 --rounds 5
# A q8_0 KV cache costs little at a short depth and much at a long one (flash attention over a
# quantized cache); without repacking, prefill is faster and decoding slower. Keyed by (repack,
# the target's K type, V type); a mode that is not here was not measured.
MODE_SPEED = {
    (True, "f16", "f16"): {
        512: {"decode": 1.0, "prefill": 1.0, "verify_2": 1.0, "verify_4": 1.0, "verify_8": 1.0},
        4096: {"decode": 1.0, "prefill": 1.0, "verify_2": 1.0, "verify_4": 1.0, "verify_8": 1.0}},
    (True, "q8_0", "q8_0"): {
        512: {"decode": 0.94, "prefill": 0.93, "verify_2": 0.92, "verify_4": 0.92, "verify_8": 0.79},
        4096: {"decode": 0.68, "prefill": 0.24, "verify_2": 0.62, "verify_4": 0.62, "verify_8": 0.58}},
    (False, "f16", "f16"): {
        512: {"decode": 0.76, "prefill": 1.59, "verify_2": 0.68, "verify_4": 0.74, "verify_8": 0.85},
        4096: {"decode": 0.86, "prefill": 1.12, "verify_2": 0.70, "verify_4": 0.82, "verify_8": 0.89}},
    (False, "q8_0", "q8_0"): {
        512: {"decode": 0.70, "prefill": 1.28, "verify_2": 0.64, "verify_4": 0.70, "verify_8": 0.82},
        4096: {"decode": 0.73, "prefill": 0.26, "verify_2": 0.63, "verify_4": 0.64, "verify_8": 0.67}},
}


# What the planner weighs modes by: one request at the planned context, its prompt as long as the
# context's depth and an answer of ANSWER_TOKENS, a prompt token costing PREFILL_SHARE of a decoded
# one (a CPU evaluates 50-100 prompt tokens a second where it decodes 10-30).
ANSWER_TOKENS = 256
PREFILL_SHARE = 1 / 8


def mode_time(mode: MemoryMode, n_ctx: int) -> Optional[float]:
    """A request's time at depth `n_ctx` in `mode`, relative units (MODE_SPEED's factors,
    interpolated between the measured depths on a log scale, the deepest one's beyond): None
    when the mode was not measured."""
    f = mode_speed(mode)
    if f is None:
        return None
    lo, hi = min(f), max(f)
    d = min(max(n_ctx, lo), hi)
    w = math.log(d / lo) / math.log(hi / lo) if hi > lo else 0.0

    def at(what: str) -> float:
        return (1 - w) * f[lo][what] + w * f[hi][what]
    return n_ctx * PREFILL_SHARE / at("prefill") + ANSWER_TOKENS / at("decode")


def by_speed(modes: list[MemoryMode], n_ctx: int) -> list[MemoryMode]:
    """`modes` with the first (the asked one) kept first and the others fastest first at the
    planned context (mode_time; unmeasured ones last, in their order). A q8_0 KV cache is the
    cheaper mode at a short context and the slowest at a long one (its prefill at depth 4,096
    runs at 0.24x f16's): no fixed order is right for both."""
    if len(modes) <= 2:
        return list(modes)
    rest = modes[1:]
    timed = sorted((m for m in rest if mode_time(m, n_ctx) is not None), key=lambda m: mode_time(m, n_ctx))
    return [modes[0], *timed, *(m for m in rest if mode_time(m, n_ctx) is None)]


def _least(modes: list[MemoryMode]) -> MemoryMode:
    """The mode of `modes` that takes the least memory: the most quantized KV caches, no repacking."""
    def saving(m: MemoryMode) -> tuple:
        quantized = sum(KV_TYPE_SIZES["f16"][0] * KV_TYPE_SIZES[t][1] / KV_TYPE_SIZES[t][0]
                        for t in (m.type_k, m.type_v, m.draft_type_k, m.draft_type_v))
        return (quantized + (0 if m.repack else 4), -modes.index(m))
    return max(modes, key=saving)


def mode_speed(mode: MemoryMode) -> Optional[dict]:
    """MODE_SPEED's measured factors for this mode (the target's), {depth: {what: factor}}; None
    when not measured."""
    return MODE_SPEED.get((mode.repack, mode.type_k, mode.type_v))


def speed_words(mode: MemoryMode) -> str:
    """What a mode costs, in words: its measured speed factors (MODE_SPEED), or that it was not measured."""
    f = mode_speed(mode)
    if f is None:
        return "its speed was not measured here"
    if mode == DEFAULT_MODE:
        return "the fastest mode"
    a, b = f[512], f[4096]
    return (f"measured speed against the default mode at a context depth of 512 / 4096 tokens: "
            f"x{a['decode']:.2f} / x{b['decode']:.2f} decoding, x{a['verify_4']:.2f} / x{b['verify_4']:.2f} "
            f"verifying 4 tokens, x{a['prefill']:.2f} / x{b['prefill']:.2f} prefilling")


def machine_figures() -> dict:
    """This machine's measured figures (probe.py): runtime, context overhead, copied types."""
    from .probe import machine_figures as figures
    return figures()


@dataclass(frozen=True)
class ModelEstimate:
    weights: int
    repacked: int
    kv_cache: int
    activations: int
    vocab_tables: int
    output: int
    attention: int = 0  # beyond `activations`: the attention scores of a micro-batch (flash attention off)

    @property
    def total(self) -> int:
        return (self.weights + self.repacked + self.kv_cache + self.activations + self.attention + self.vocab_tables
                + self.output)


def attention_scratch(n_head: int, n_ubatch: int, n_kv: int, flash_attn: str) -> int:
    """Resident bytes of one micro-batch's attention against n_kv cached positions. Without
    flash attention llama.cpp materialises the scores and their softmax (or the f16 copy of them
    that the V product reads), heads x n_ubatch x n_kv each, and an f32 mask; with it (on, or
    auto on a CPU) only an f16 mask, the scores being computed tile by tile."""
    if flash_attn == "off":
        return (2 * 4 * n_head + 4) * n_ubatch * n_kv
    return 2 * n_ubatch * n_kv


def _arch(info, key, default=None):
    return info.fields.get(f"{info.architecture}.{key}", default)


def _per_layer(value, n_layer: int, default: int) -> list[int]:
    """A hyperparameter that GGUF stores either once or per layer (an array)."""
    if value is None:
        return [default] * n_layer
    if isinstance(value, (list, tuple)):
        vals = [int(v) for v in value][:n_layer]
        return vals + [vals[-1] if vals else default] * (n_layer - len(vals))
    return [int(value)] * n_layer


def estimate_model(info, n_ctx: int, *, n_ubatch: int = N_UBATCH, gpu_layers: int = 0,
                   rows: int = 33, repacked_types=None, flash_attn: str = "off", n_seq: int = 1,
                   type_k: str = "f16", type_v: str = "f16", repack: bool = True) -> ModelEstimate:
    """`info`: a GGUFInfo. `gpu_layers`: layers llama.cpp will offload (0 on a CPU-only build).
    `repacked_types`: the weight types llama.cpp copies on this CPU (default: measured); none
    with `repack` False. `type_k`, `type_v`: the KV cache's element types (KV_TYPE_SIZES).
    `n_seq`: sequences in the context, n_ctx tokens each: one unified KV cache of n_ctx x n_seq
    cells, which a micro-batch attends over. `rows`: logits rows of a pass, all sequences together."""
    from gguf.constants import GGMLQuantizationType

    from .ggufinfo import _tensor_bytes
    if not repack:
        repacked_types = ()
    elif repacked_types is None:
        repacked_types = machine_figures()["repacked_types"]
    repacked_types = set(repacked_types)
    n_layer = int(_arch(info, "block_count", 1) or 1)
    n_embd = int(_arch(info, "embedding_length", 0) or 0)
    heads = _per_layer(_arch(info, "attention.head_count"), n_layer, 1)
    raw_kv = _arch(info, "attention.head_count_kv")
    # per layer, 0 means a layer without attention (hybrid models); once, 0 or absent means MHA
    heads_kv = _per_layer(raw_kv, n_layer, 0) if isinstance(raw_kv, (list, tuple)) else \
        [int(raw_kv or 0) or h for h in heads]
    k_len = int(_arch(info, "attention.key_length", n_embd // max(heads[0], 1)))
    v_len = int(_arch(info, "attention.value_length", n_embd // max(heads[0], 1)))
    n_cpu = max(0, n_layer - max(0, gpu_layers))
    on_cpu = n_cpu / n_layer
    output_on_cpu = gpu_layers <= n_layer
    tensors = info.fields["_tensors"]
    weights = repacked = 0
    for name, (dims, ttype) in tensors.items():
        size = _tensor_bytes(dims, ttype)
        block = name.startswith("blk.")
        share = on_cpu if block else (1.0 if output_on_cpu else 0.0)
        weights += int(size * share)
        if len(dims) < 2 or GGMLQuantizationType(ttype).name not in repacked_types:
            continue
        # copied: matrices that multiply (not the embedding table, which is only gathered
        # from), and the embedding's duplicate that serves as the output matrix when the file
        # ties the two
        tied_output = name == "token_embd.weight" and "output.weight" not in tensors
        if block or name == "output.weight" or tied_output:
            repacked += int(size * share)
    # the KV cache of the layers on the CPU, the first n_cpu (llama.cpp offloads the last ones);
    # sliding-window layers keep a full-size cache too (swa_full is on by default)
    cells = n_ctx * max(1, n_seq)
    # (one row of a layer's K holds kv_heads x k_len elements per cell, as llama.cpp allocates it)
    kv = cells * sum(kv_row_bytes(h * k_len, type_k) + kv_row_bytes(h * v_len, type_v) for h in heads_kv[:n_cpu])
    n_ff = max(_per_layer(_arch(info, "feed_forward_length"), n_layer, 4 * n_embd)) or 4 * n_embd
    # the backend's micro-batch: at most one sequence's context, and a prompt goes in by canonical
    # pieces (slots.PIECE) on a CPU: the most rows a pass computes in host RAM (on a GPU the pieces
    # are the batch, their activations in its memory)
    from .slots import PIECE
    ub = min(n_ubatch, n_ctx, PIECE)
    activations = int(ub * 4 * (ACTIVATION_FF * n_ff + ACTIVATION_EMBD * n_embd))
    # the worst case of any prompt that fits: its last full micro-batch against the whole context
    # (a short prompt touches neither this nor the activations; see docs/memory.md)
    attention = attention_scratch(max(heads[:n_cpu]), ub, cells, flash_attn) if n_cpu else 0
    merges = int(info.fields.get("tokenizer.ggml.merges.count", 0))
    vocab = VOCAB_BYTES_PER_TOKEN * info.n_vocab + VOCAB_BYTES_PER_MERGE * merges
    return ModelEstimate(weights, repacked, kv, activations, vocab, rows * info.n_vocab * 4, attention)


def estimate_process(target_info, draft_info=None, *, n_ctx: int, drafter: str = "none",
                     gpu_layers: int = 0, draft_gpu_layers: int = 0, flash_attn: str = "off",
                     n_seq: int = 1, mode: MemoryMode = DEFAULT_MODE) -> dict:
    """Whole-process peak RSS for a configuration, by part (bytes). `n_seq`: sequences served
    at once (--parallel), n_ctx tokens each, in both models' contexts. `mode`: KV element types
    and repacking (MemoryMode)."""
    fig = machine_figures()
    repacked_types = fig["repacked_types"]
    mode = mode or DEFAULT_MODE
    # logits rows the target returns per pass and sequence: one when decoding plainly, up to 33
    # when verifying; a pass serves every sequence
    t = estimate_model(target_info, n_ctx, gpu_layers=gpu_layers, rows=(1 if drafter == "none" else 33) * n_seq,
                       repacked_types=repacked_types, flash_attn=flash_attn, n_seq=n_seq,
                       type_k=mode.type_k, type_v=mode.type_v, repack=mode.repack)
    contexts = 1
    runtime_parts = {"interpreter": int(fig["runtime_bytes"]), "context": int(fig["context_overhead_bytes"]),
                     "run": RUN_EXTRA, "source": fig.get("source", "measured")}
    parts = {"runtime": 0, "target": t.total, "target_parts": asdict(t), "n_seq": n_seq}
    if drafter == "model" and draft_info is not None:
        d = estimate_model(draft_info, n_ctx, gpu_layers=draft_gpu_layers, rows=n_seq, repacked_types=repacked_types,
                           flash_attn=flash_attn, n_seq=n_seq, type_k=mode.draft_type_k, type_v=mode.draft_type_v,
                           repack=mode.repack)
        parts["draft"] = d.total
        parts["draft_parts"] = asdict(d)
        contexts = 2
    runtime_parts["context"] *= contexts
    parts["runtime"] = runtime_parts["interpreter"] + runtime_parts["context"] + runtime_parts["run"]
    parts["runtime_parts"] = runtime_parts
    if drafter == "ngram":
        parts["ngram_index"] = n_seq * n_ctx * NGRAM_BYTES_PER_TOKEN  # an index per sequence
    parts["total"] = parts["runtime"] + parts["target"] + parts.get("draft", 0) + parts.get("ngram_index", 0)
    return parts


_UNITS = {"b": 1, "k": 1000, "kb": 1000, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str, what: str = "the size", *, zero: bool = False) -> int:
    """'2GiB', '1500MB', '2g', '512 MiB', '3.5GB', '2147483648B' -> bytes. Single letters are
    decimal (k, m, g). A bare number is refused: "10" meant as 10 GiB would be 10 bytes.
    `what` names the setting in the message (e.g. "--memory-budget")."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m and unit == "":
        n = m.group(1)
        sizes = list(dict.fromkeys([f"{n}GiB", f"{n}MB", "2GiB"]))  # "2": 2GiB or 2MB, not 2GiB twice
        like = (", ".join(sizes[:-1]) + f" or {sizes[-1]} ({n}B for bytes)") if float(n) else "2GiB or 512MiB"
        raise UsageError(f"{what} {str(text).strip()!r} has no unit: write a size with a unit, like {like}")
    if not m or unit not in _UNITS:
        raise UsageError(f"{what}: cannot read the size {text!r}: write a number and a unit, like 2GiB, 1500MB or 2g")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0 and not (zero and value == 0):
        raise UsageError(f"{what} {str(text).strip()!r} must be more than zero")
    return value


def available_memory() -> int:
    import psutil
    return int(psutil.virtual_memory().available)


def total_memory() -> int:
    """RAM and swap of this machine (0 when unknown): more than this can never be resident."""
    try:
        import psutil
        return int(psutil.virtual_memory().total + psutil.swap_memory().total)
    except Exception:
        return 0


CTX_CHOICES = (32768, 16384, 8192, 4096, 2048, 1024)
AUTO_PARALLEL = 4  # n_seq None (--parallel not given): as many sequences as fit, at most this many


def wanted_drafters(drafter: str, draft_info=None) -> list[str]:
    """The planner's configurations for a drafter mode, best first: the one asked for, then the
    cheaper ones it may fall back to (model -> n-gram -> none)."""
    wanted = ["model", "ngram", "none"] if drafter in ("auto", "model") else [drafter]
    if draft_info is None:
        wanted = [d for d in wanted if d != "model"] or ["none"]
    return wanted


def _seqs(n: int) -> str:
    return f"{n} sequence" + ("" if n == 1 else "s")


def plan(target_info, draft_info=None, *, n_ctx: int = N_CTX, drafter: str = "auto",
         budget: int | None = None, gpu_layers: int = 0, draft_gpu_layers: int = 0, flash_attn: str = "off",
         n_seq: int | None = 1, modes=None) -> dict:
    """Every configuration with its estimate, and the one that fits best: the wanted drafter at
    the wanted context first, in each memory mode of `modes` in turn (the asked one first, then
    the cheaper ones: MemoryMode.cheaper; default: the default mode alone), then cheaper drafters
    (model -> n-gram -> none), then smaller contexts; all of them for `n_seq` sequences at once.
    `n_seq` None: the most sequences, up to AUTO_PARALLEL, at which the wanted drafter fits at the
    wanted context in the asked mode, and 1 (the fallbacks above) when not even one does:
    parallelism never costs the draft model, the context or the mode.
    The result's `parallel` is the number of sequences planned for; `configs` are the asked
    mode's, `mode_configs` the other modes' (each with its `mode` name), `modes` the modes tried
    in order, and the choice says its `memory_mode` (and the flash attention it needs)."""
    budget = available_memory() if budget is None else max(0, budget)
    modes = list(modes or [DEFAULT_MODE])
    asked = modes[0]
    wanted = wanted_drafters(drafter, draft_info)
    auto = n_seq is None
    est = dict(gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn)
    if auto:
        n_seq = largest_parallel(target_info, draft_info, n_ctx=n_ctx, drafter=wanted[0], budget=budget,
                                 limit=AUTO_PARALLEL, mode=asked, **est) or 1
    ctxs = [n_ctx] + [c for c in CTX_CHOICES if c < n_ctx]
    by_mode: dict[MemoryMode, list[dict]] = {}
    for m in modes:
        by_mode[m] = []
        for d in ("model", "ngram", "none"):
            if d == "model" and draft_info is None:
                continue
            for c in ctxs:
                e = estimate_process(target_info, draft_info, n_ctx=c, drafter=d, n_seq=n_seq, mode=m, **est)
                by_mode[m].append({"drafter": d, "n_ctx": c, "mode": m.name, "estimated_bytes": e["total"],
                                   "fits": e["total"] <= budget, "parts": e})
    with_seqs = f" with {_seqs(n_seq)}" if n_seq > 1 else ""
    choice, chosen_mode, reason = None, None, ""
    for c in ctxs:
        for d in wanted:
            for m in modes:
                hit = next((x for x in by_mode[m] if x["drafter"] == d and x["n_ctx"] == c and x["fits"]), None)
                if not hit:
                    continue
                choice, chosen_mode = hit, m
                if d == wanted[0] and c == n_ctx:
                    reason = ("the requested configuration fits" if m == asked else
                              f"{wanted[0]} at n_ctx {n_ctx}{with_seqs} does not fit in {size_words(budget)} "
                              f"in the {asked.name} memory mode; {m.name} makes it fit")
                else:
                    reason = (f"{wanted[0]} at n_ctx {n_ctx}{with_seqs} does not fit in {size_words(budget)}"
                              + (", in any memory mode" if len(modes) > 1 else ""))
                break
            if choice:
                break
        if choice:
            break
    result = {"budget_bytes": budget, "parallel": n_seq, "parallel_auto": auto, "configs": by_mode[asked],
              "mode_configs": [x for m in modes[1:] for x in by_mode[m]], "modes": [m.as_dict() for m in modes]}
    if choice:
        needs_fa = "on" if chosen_mode.quantized_v and flash_attn == "auto" else flash_attn
        result["choice"] = ({k: v for k, v in choice.items() if k != "parts"}
                            | {"reason": reason, "memory_mode": chosen_mode.as_dict(), "flash_attn": needs_fa})
    else:
        result["choice"] = {"reason": f"nothing fits in {size_words(budget)}, not even plain decoding at n_ctx "
                            f"{ctxs[-1]}{with_seqs}" + (" in its cheapest memory mode" if len(modes) > 1 else "")}
    return result


def mode_of(choice: dict) -> MemoryMode:
    """The MemoryMode of a plan's choice (the default when it names none)."""
    m = choice.get("memory_mode")
    if not m:
        return DEFAULT_MODE
    return MemoryMode(**{k: m[k] for k in ("repack", "type_k", "type_v", "draft_type_k", "draft_type_v")})


def largest_parallel(target_info, draft_info=None, *, n_ctx: int, drafter: str, budget: int, limit: int,
                     gpu_layers: int = 0, draft_gpu_layers: int = 0, flash_attn: str = "off",
                     mode: MemoryMode = DEFAULT_MODE) -> int:
    """The most sequences (at most `limit`) whose estimate for `drafter` at n_ctx each fits in
    `budget`; 0 when not even one does. The estimate grows with the number of sequences."""
    def fits(n):
        return estimate_process(target_info, draft_info, n_ctx=n_ctx, drafter=drafter, gpu_layers=gpu_layers,
                                draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn, n_seq=n,
                                mode=mode)["total"] <= budget
    lo, hi = 0, max(0, limit) + 1  # fits(lo) holds (or lo is 0); hi does not fit (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_context(target_info, draft_info=None, *, drafter: str, budget: int, limit: int,
                    gpu_layers: int = 0, draft_gpu_layers: int = 0, flash_attn: str = "off",
                    step: int = 256, n_seq: int = 1, mode: MemoryMode = DEFAULT_MODE) -> int:
    """The largest n_ctx (a multiple of `step`, at most `limit`) whose estimate for `drafter`
    with `n_seq` sequences of it in `mode` fits in `budget`; 0 when not even `step` tokens fit.
    The estimate grows with n_ctx."""
    def fits(n):
        return estimate_process(target_info, draft_info, n_ctx=n, drafter=drafter, gpu_layers=gpu_layers,
                                draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn,
                                n_seq=n_seq, mode=mode)["total"] <= budget
    lo, hi = 0, max(0, limit // step)  # in steps: fits(lo * step) holds (or lo is 0), hi is the cap
    if hi and fits(hi * step):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


CONFIG_WORDS = {"model": "target + draft model", "ngram": "target + n-gram drafting", "none": "target alone"}
PART_WORDS = {"weights": "weights", "repacked": "copied weights", "kv_cache": "KV cache",
              "attention": "attention scratch", "activations": "activations", "vocab_tables": "vocabulary",
              "output": "logits"}


def size_words(n: int) -> str:
    """A budget in the unit that shows it: 1.50 GiB, 512 MiB, 1 KiB, 100 bytes (never "0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} GiB" if unit == "GiB" else f"{n / size:,.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def explain(result: dict, target_info, draft_info=None, *, n_ctx: int, drafter: str, budget_given: bool,
            gpu_layers: int = 0, draft_gpu_layers: int = 0, flash_attn: str = "off") -> list[str]:
    """`plan`'s result in sentences for a person: what fits, in which memory mode and at what
    speed, what was dropped and why, how many sequences at once and what their KV caches cost,
    the largest context that fits for each configuration, and where the chosen peak goes."""
    # what the configurations must fit in: assemble.plan_for's result keeps the prompt cache's
    # share apart (fit_bytes = budget_bytes - cache_bytes); memory.plan's is the budget itself
    budget = result.get("fit_bytes", result["budget_bytes"])
    configs = {(c["drafter"], c["n_ctx"]): c for c in result["configs"]}
    every = {(c["drafter"], c["n_ctx"], c.get("mode", DEFAULT_MODE.name)): c
             for c in result["configs"] + result.get("mode_configs", [])}
    modes = [MemoryMode(**{k: m[k] for k in ("repack", "type_k", "type_v", "draft_type_k", "draft_type_v")})
             for m in result.get("modes", [])] or [DEFAULT_MODE]
    asked = modes[0]
    wanted = wanted_drafters(drafter, draft_info)[0]
    n_seq = result.get("parallel", 1)
    source = "--memory-budget" if budget_given else "the RAM available now"
    # the budget in the unit that shows it (1 KiB, 312.3 MiB: never "0.00 GiB"), as `run` says it
    if "cache_bytes" not in result:
        lines = [f"Budget: {size_words(budget)} ({source})."]
    elif result["cache_bytes"]:
        lines = [f"Budget: {size_words(result['budget_bytes'])} ({source}), less {size_words(result['cache_bytes'])} "
                 f"kept for the prompt cache (--cache-ram SIZE changes it, --cache-ram 0 turns it off): "
                 f"{size_words(budget)} for the models."]
    else:
        lines = [f"Budget: {size_words(budget)} ({source}), none of it kept for a prompt cache (--cache-ram 0)."]
    with_what = {"model": f"the draft model {draft_info.path.name}" if draft_info is not None else "a draft model",
                 "ngram": "n-gram drafting", "none": "no drafter"}[wanted]
    lines.append(f"Wanted: {target_info.path.name} with {with_what} at n_ctx {n_ctx}, flash attention {flash_attn}, "
                 f"memory mode {asked.name}.")
    ch = result["choice"]
    chosen = mode_of(ch) if "drafter" in ch else None
    if "drafter" in ch:
        spare = budget - ch["estimated_bytes"]
        in_mode = f" in memory mode {chosen.name}" if chosen != asked else ""
        fits = "Fits" if ch["n_ctx"] == n_ctx else f"Would fit with --ctx {ch['n_ctx']}"
        lines.append(f"{fits}: {CONFIG_WORDS[ch['drafter']]} at n_ctx {ch['n_ctx']}{in_mode}, a peak of about "
                     f"{_gib(ch['estimated_bytes'])} ({_gib(spare)} to spare).")
        if ch.get("flash_attn", flash_attn) != flash_attn:
            lines.append(f"Flash attention: {ch['flash_attn']}, not {flash_attn}: a quantized V cache needs it.")
    else:
        lines.append(f"Nothing fits: {ch['reason']}.")
    if len(modes) > 1:
        d, c = (ch["drafter"], ch["n_ctx"]) if "drafter" in ch else (wanted, n_ctx)
        def speed(m):
            f = mode_speed(m)
            return (f" (x{f[512]['decode']:.2f} / x{f[4096]['decode']:.2f} decoding at depth 512 / 4096)"
                    if f and m != DEFAULT_MODE else "")
        peaks = [f"{m.name} {_gib(every[(d, c, m.name)]['estimated_bytes'])}{speed(m)}" for m in modes
                 if (d, c, m.name) in every]
        tail = ""
        if chosen is not None:
            tail = f"; chosen: {chosen.name}" + ("" if chosen == asked else f" ({speed_words(chosen)})")
        lines.append(f"Memory modes, tried in this order ({CONFIG_WORDS[d]} at n_ctx {c}): " + ", ".join(peaks)
                     + tail + ".")
    order = ["model", "ngram", "none"]
    for d in order[order.index(wanted):]:
        if "drafter" in ch and d == ch["drafter"]:
            break
        c = configs.get((d, n_ctx))
        if c is not None and not c["fits"]:
            cheapest = every.get((d, n_ctx, _least(modes).name), c)
            also = (f" (about {_gib(cheapest['estimated_bytes'])} in memory mode {_least(modes).name})"
                    if cheapest is not c else "")
            lines.append(f"Dropped: {CONFIG_WORDS[d]} at n_ctx {n_ctx} needs about {_gib(c['estimated_bytes'])}{also}, "
                         f"{_gib(cheapest['estimated_bytes'] - budget)} over the budget.")
    if "drafter" in ch and ch["n_ctx"] != n_ctx:
        lines.append(f"Dropped: n_ctx {n_ctx}: nothing fits at it; --ctx {ch['n_ctx']} would (run and serve never "
                     "lower a context themselves: they refuse, and say so).")
    lines.append(_parallel_words(result, every, target_info, draft_info, wanted=wanted, n_ctx=n_ctx,
                                 budget=budget, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers,
                                 flash_attn=flash_attn))
    from .ggufinfo import trained_context
    trained = [trained_context(i) for i in (target_info, draft_info) if i]
    limit = min([t for t in trained if t] or [CTX_CHOICES[0] * 4])
    each = f"each of {n_seq} sequences, " if n_seq > 1 else ""
    for m in dict.fromkeys([asked, _least(modes)]):
        largest = []
        for d in order:
            if d == "model" and draft_info is None:
                continue
            n = largest_context(target_info, draft_info, drafter=d, budget=budget, limit=limit, gpu_layers=gpu_layers,
                                draft_gpu_layers=draft_gpu_layers, flash_attn=flash_attn, n_seq=n_seq, mode=m)
            largest.append(f"{CONFIG_WORDS[d]} {n:,} tokens" if n else f"{CONFIG_WORDS[d]} none")
        in_mode = f" in memory mode {m.name}" if len(modes) > 1 else ""
        lines.append(f"Largest context that fits{in_mode} ({each}the model was trained for {limit:,}): "
                     + "; ".join(largest) + ".")
    if "drafter" in ch:
        parts = every[(ch["drafter"], ch["n_ctx"], ch.get("mode", DEFAULT_MODE.name))]["parts"]
        shares = {}
        for key in ("target_parts", "draft_parts"):
            for name, v in parts.get(key, {}).items():
                shares[name] = shares.get(name, 0) + v
        shares["runtime"] = parts["runtime"] + parts.get("ngram_index", 0)
        words = [f"{PART_WORDS.get(k, k)} {v / 2**20:,.0f} MiB" for k, v in shares.items() if v >= 2**20 // 2]
        lines.append("Where the peak goes: " + ", ".join(words) + ".")
    if flash_attn == "off" and "drafter" in ch:
        lines.append("Flash attention is off: attention scores for every cached position are materialised "
                     "(--flash-attn auto avoids most of that scratch).")
    return lines


def _parallel_words(result: dict, every: dict, target_info, draft_info, *, wanted: str, n_ctx: int,
                    budget: int, **est) -> str:
    """'Parallel: 2 sequences (auto: as many as fit, 3 would need about 1.92 GiB): KV 224 MiB of
    the peak.' How many sequences the plan is for, why, and what their KV caches cost."""
    n = result.get("parallel", 1)
    modes = [mode_of({"memory_mode": m}) for m in result.get("modes", [])] or [DEFAULT_MODE]
    mode = modes[0]  # auto: as many sequences as fit in the asked mode
    req = every.get((wanted, n_ctx, mode.name))
    ch = result["choice"]
    if result.get("parallel_auto"):
        if req is None or not req["fits"]:
            why = "auto: not even one fits as wanted"
        elif n < AUTO_PARALLEL:
            more = estimate_process(target_info, draft_info, n_ctx=n_ctx, drafter=wanted, n_seq=n + 1, mode=mode,
                                    **est)
            why = f"auto: as many as fit, {n + 1} would need about {_gib(more['total'])}"
        else:
            why = f"auto: the most without --parallel, {AUTO_PARALLEL}"
    else:
        why = f"--parallel {n}"
        kept = ch.get("drafter") == wanted and ch.get("n_ctx") == n_ctx  # in one of the modes
        if req is not None and not kept and n > 1:  # fewer sequences, in the cheapest mode the planner tries
            k = largest_parallel(target_info, draft_info, n_ctx=n_ctx, drafter=wanted, budget=budget, limit=n - 1,
                                 mode=_least(modes), **est)
            if k:
                why += f"; --parallel {k} fits {CONFIG_WORDS[wanted]} at n_ctx {n_ctx}"
    kv = ""
    if "drafter" in ch:
        parts = every[(ch["drafter"], ch["n_ctx"], ch.get("mode", DEFAULT_MODE.name))]["parts"]
        kv_bytes = sum(parts.get(key, {}).get("kv_cache", 0) for key in ("target_parts", "draft_parts"))
        kv = f": KV {kv_bytes / 2**20:,.0f} MiB of the peak"
    return f"Parallel: {_seqs(n)} at once ({why}){kv}."


def peak_rss() -> int:
    """This process's peak resident memory, in bytes.

    Linux: VmHWM, the high-water mark of this process image. (ru_maxrss is not used there: it
    survives exec, so a child started from a large parent reports the parent's peak.)"""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
