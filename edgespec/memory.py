"""Will it fit? Peak resident memory estimated from GGUF metadata, before loading anything.

The parts, as llama.cpp allocates them on a CPU (figures checked against its own logs):
- weights: the file's tensors, memory-mapped and all touched;
- repacked weights: on x86 CPUs llama.cpp keeps an interleaved copy of Q4_0/Q4_K/IQ4_NL
  block tensors (CPU_REPACK buffer) beside the mapped original;
- KV cache: layers x n_ctx x kv_heads x head_dim x (K + V) in f16;
- activations: llama.cpp reserves a compute buffer for the worst case (all logits of a
  512-token micro-batch), but edgespec asks for logits on a few rows only, so what becomes
  resident is the activations of a prompt micro-batch: ~2.7 x n_ubatch x (n_ff + n_embd) f32;
- vocabulary tables, in llama.cpp and in Python: ~270 bytes per token and ~170 per BPE merge;
- the Python process itself (interpreter, numpy, llama-cpp-python): 71 MiB;
- the n-gram index (a dict entry per n-gram length per context token).
GPU-offloaded layers live in device memory, not in the process's RSS.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .errors import UsageError

MiB = 2**20
# Fitted to whole-process peak RSS of SmolLM2-135M (n_ctx 2048) and Qwen2.5-Coder 0.5B (8192) /
# 1.5B (2048) with a 750-token prompt; Qwen 1.5B at 8192 is an out-of-sample check. Those three
# vocabularies are all BPE (a merge per token), so they fix only the sum 440 B per token; its split
# into tokens and merges was set from gemma-3-270m (SentencePiece, no merges) - README, "Memory".
RUNTIME_BASE = 71 * MiB
VOCAB_BYTES_PER_TOKEN = 270
VOCAB_BYTES_PER_MERGE = 170
ACTIVATION_FACTOR = 2.7
NGRAM_BYTES_PER_TOKEN = 8 * 160  # N_MAX dict entries of a short tuple key each
REPACKED_TYPES = {"Q4_0", "Q4_K", "IQ4_NL"}
N_UBATCH = 512


@dataclass(frozen=True)
class ModelEstimate:
    weights: int
    repacked: int
    kv_cache: int
    activations: int
    vocab_tables: int
    output: int

    @property
    def total(self) -> int:
        return self.weights + self.repacked + self.kv_cache + self.activations + self.vocab_tables + self.output


def _arch(info, key, default=None):
    return info.fields.get(f"{info.architecture}.{key}", default)


def estimate_model(info, n_ctx: int, *, n_ubatch: int = N_UBATCH, gpu_layers: int = 0,
                   rows: int = 33) -> ModelEstimate:
    """`info`: a GGUFInfo. `gpu_layers`: layers llama.cpp will offload (0 on a CPU-only build)."""
    from gguf.constants import GGMLQuantizationType

    from .ggufinfo import _tensor_bytes
    n_layer = int(_arch(info, "block_count", 1))
    n_embd = int(_arch(info, "embedding_length", 0))
    n_head = int(_arch(info, "attention.head_count", 1) or 1)
    n_head_kv = int(_arch(info, "attention.head_count_kv", n_head) or n_head)
    k_len = int(_arch(info, "attention.key_length", n_embd // n_head))
    v_len = int(_arch(info, "attention.value_length", n_embd // n_head))
    on_cpu = max(0, n_layer - max(0, gpu_layers)) / n_layer if n_layer else 1.0
    weights = repacked = 0
    for name, (dims, ttype) in info.fields["_tensors"].items():
        size = _tensor_bytes(dims, ttype)
        block = name.startswith("blk.")
        share = on_cpu if block else (1.0 if gpu_layers <= n_layer else 0.0)
        weights += int(size * share)
        if block and GGMLQuantizationType(ttype).name in REPACKED_TYPES:
            repacked += int(size * on_cpu)
    kv = int(n_layer * on_cpu) * n_ctx * n_head_kv * (k_len + v_len) * 2
    n_ff = int(_arch(info, "feed_forward_length", 4 * n_embd) or 4 * n_embd)
    ub = min(n_ubatch, n_ctx)
    activations = int(ACTIVATION_FACTOR * ub * (n_ff + n_embd) * 4)
    merges = int(info.fields.get("tokenizer.ggml.merges.count", 0))
    vocab = VOCAB_BYTES_PER_TOKEN * info.n_vocab + VOCAB_BYTES_PER_MERGE * merges
    return ModelEstimate(weights, repacked, kv, activations, vocab, rows * info.n_vocab * 4)


def estimate_process(target_info, draft_info=None, *, n_ctx: int, drafter: str = "none",
                     gpu_layers: int = 0, draft_gpu_layers: int = 0) -> dict:
    """Whole-process peak RSS for a configuration, by part (bytes)."""
    # logits rows the target returns per pass: one when decoding plainly, up to 33 when verifying
    t = estimate_model(target_info, n_ctx, gpu_layers=gpu_layers, rows=1 if drafter == "none" else 33)
    parts = {"runtime": RUNTIME_BASE, "target": t.total, "target_parts": asdict(t)}
    if drafter == "model" and draft_info is not None:
        d = estimate_model(draft_info, n_ctx, gpu_layers=draft_gpu_layers, rows=1)
        parts["draft"] = d.total
        parts["draft_parts"] = asdict(d)
    if drafter == "ngram":
        parts["ngram_index"] = n_ctx * NGRAM_BYTES_PER_TOKEN
    parts["total"] = parts["runtime"] + parts["target"] + parts.get("draft", 0) + parts.get("ngram_index", 0)
    return parts


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '1500MB', '2g', '512 MiB', '3.5GB' -> bytes. Single letters are decimal (k, m, g)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(f"cannot read the size {text!r}: write a number and a unit, like 2GiB, 1500MB or 2g")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"the size {text!r} must be more than zero")
    return value


def available_memory() -> int:
    import psutil
    return int(psutil.virtual_memory().available)


CTX_CHOICES = (32768, 16384, 8192, 4096, 2048, 1024)


def plan(target_info, draft_info=None, *, n_ctx: int = 4096, drafter: str = "auto",
         budget: int | None = None, gpu_layers: int = 0, draft_gpu_layers: int = 0) -> dict:
    """Every configuration with its estimate, and the one that fits best: the wanted drafter at
    the wanted context first, then cheaper drafters (model -> n-gram -> none), then smaller
    contexts."""
    budget = budget or available_memory()
    wanted = ["model", "ngram", "none"] if drafter in ("auto", "model") else [drafter]
    if draft_info is None:
        wanted = [d for d in wanted if d != "model"] or ["none"]
    ctxs = [n_ctx] + [c for c in CTX_CHOICES if c < n_ctx]
    configs = []
    for d in ("model", "ngram", "none"):
        if d == "model" and draft_info is None:
            continue
        for c in ctxs:
            est = estimate_process(target_info, draft_info, n_ctx=c, drafter=d, gpu_layers=gpu_layers,
                                   draft_gpu_layers=draft_gpu_layers)
            configs.append({"drafter": d, "n_ctx": c, "estimated_bytes": est["total"],
                            "fits": est["total"] <= budget, "parts": est})
    choice, reason = None, ""
    for c in ctxs:
        for d in wanted:
            hit = next((x for x in configs if x["drafter"] == d and x["n_ctx"] == c and x["fits"]), None)
            if hit:
                choice = hit
                reason = ("the requested configuration fits" if (d == wanted[0] and c == n_ctx) else
                          f"{wanted[0]} at n_ctx {n_ctx} does not fit in {budget / 2**30:.2f} GiB")
                break
        if choice:
            break
    return {"budget_bytes": budget, "configs": configs,
            "choice": ({k: v for k, v in choice.items() if k != "parts"} | {"reason": reason}) if choice else
            {"reason": f"nothing fits in {budget / 2**30:.2f} GiB, not even plain decoding at n_ctx {ctxs[-1]}"}}


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
