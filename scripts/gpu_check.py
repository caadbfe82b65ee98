"""CUDA offload check: plain, model and n-gram drafting with every layer on the GPU, T = 0
equality with plain decoding, the calibrated cost curve, auto against plain, and the host's share of
each answer's decode time (wall time outside llama_decode, at T = 0 and T = 0.8 top-p 0.95).

Run from the repository root with a CUDA build of llama-cpp-python and a small model:
    python scripts/gpu_check.py MODEL.gguf      (results: gpu_check.json in $OUT or here)
docs/gpu-check-h200.json came from SmolLM2-135M cut to 8 blocks (scripts/truncate_gguf.py)."""
import llama_cpp  # noqa: F401  first: on this image numpy loaded first breaks llama.cpp's tokenizer init
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from edgespec import Engine  # noqa: E402
from edgespec.backend import gpu_offload_supported  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else ".gpu/smol8.gguf"

# the host's share: llama_decode timed where edgespec calls it (backend.py looks it up per call)
_decode = llama_cpp.llama_decode
_in_decode = [0.0]


def _timed_decode(*args):
    t = time.perf_counter()
    try:
        return _decode(*args)
    finally:
        _in_decode[0] += time.perf_counter() - t


llama_cpp.llama_decode = _timed_decode


def host_share(result, decode_before: float) -> float:
    """1 - (time in llama_decode) / (decode wall time) of one answer."""
    wall = result.stats.decode_seconds
    return round(1 - (_in_decode[0] - decode_before) / wall, 3) if wall > 0 else 0.0
out = {"gpu_offload": gpu_offload_supported()}
print("gpu offload:", out["gpu_offload"], flush=True)
prompts = [json.loads(line)["prompt"] for line in open("workloads/prompts.jsonl")]


def chat(eng, p, **kw):
    return eng.chat([{"role": "user", "content": p}], **kw)


with Engine.load(MODEL, drafter="none", n_ctx=2048) as plain:
    ref = []
    t = time.perf_counter()
    for p in prompts[:6]:
        plain.reset()
        ref.append(chat(plain, p, max_tokens=96))
    out["plain_tps"] = [round(r.stats.tokens_per_second, 1) for r in ref]
    print("plain tok/s", out["plain_tps"], round(time.perf_counter() - t, 1), "s", flush=True)

for mode, kw in (("model", dict(draft=MODEL, drafter="model", gamma=4)), ("ngram", dict(drafter="ngram", gamma=4)),
                 ("auto", dict(draft=MODEL, drafter="auto", calibrate="now"))):
    with Engine.load(MODEL, n_ctx=2048, **kw) as eng:
        rows = []
        for p, r in zip(prompts[:6], ref):
            eng.reset()
            before = _in_decode[0]
            s = chat(eng, p, max_tokens=96)
            share = host_share(s, before)
            eng.reset()
            before = _in_decode[0]
            hot = chat(eng, p, max_tokens=96, temperature=0.8, top_p=0.95, seed=1)
            share_hot = host_share(hot, before)
            parted = next((i for i, (a, b) in enumerate(zip(s.tokens, r.tokens)) if a != b),
                          None if len(s.tokens) == len(r.tokens) else min(len(s.tokens), len(r.tokens)))
            rows.append({"tps": round(s.stats.tokens_per_second, 1), "ratio": round(
                s.stats.tokens_per_second / r.stats.tokens_per_second, 2), "parted": parted,
                "drafted": s.stats.drafted, "accepted": s.stats.accepted, "by": s.stats.by_drafter,
                "host_share_t0": share, "host_share_t08_top_p": share_hot})
        out[mode] = rows
        if mode == "auto":
            costs = eng.drafter.policy.costs
            out["verify_ms"] = [round(1000 * c, 2) for c in costs.verify]
            out["draft_step_ms"] = round(1000 * (costs.draft_step or 0), 2)
            out["cost_source"] = eng.drafter.describe_costs()
        print(mode, json.dumps(rows), flush=True)
print("verify ms", out.get("verify_ms"), "draft step", out.get("draft_step_ms"), flush=True)
for mode in ("model", "ngram", "auto"):
    rows = out.get(mode, [])
    if rows:
        print(f"host share of a round, {mode}: T = 0 median "
              f"{sorted(r['host_share_t0'] for r in rows)[len(rows) // 2]:.1%}, T = 0.8 top-p 0.95 median "
              f"{sorted(r['host_share_t08_top_p'] for r in rows)[len(rows) // 2]:.1%}", flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "gpu_check.json"), "w") as fh:
    json.dump(out, fh, indent=1, default=str)
