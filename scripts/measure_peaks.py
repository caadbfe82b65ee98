"""Peak RSS (VmHWM) of `edgespec run --drafter none --raw --max-tokens 16` for a model and context at
several prompt fractions, flash-attention settings and memory modes, beside `plan --drafter none
--json` with the same flags; one JSON line per run. Usage:
    python scripts/measure_peaks.py MODEL.gguf N_CTX [on,off] [0,0.85,0.99] [default,norepack,q8_0,q8_0+norepack]
(run from the repository root; the memory tables of docs/memory.md were made with it). "-" for
the flash-attention list keeps the default (auto). The modes: default (f16 KV, repacked weights),
norepack (--no-repack), q8_0 / q4_0 (-ctk and -ctv), and their combinations with "+"."""
import json
import os
import subprocess
import sys
import time

import llama_cpp

def prompt_for(path, n_tokens):
    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    words = ("the quick brown fox jumps over the lazy dog while compilers check every line of code "
             "and numbers like 12345 or 67890 appear in tables; ").split(" ")
    base = " ".join(words)
    unit = len(llm.tokenize(base.encode(), add_bos=False))
    reps = max(1, n_tokens // unit)
    t = (base + " ") * reps
    toks = llm.tokenize(t.encode(), add_bos=True)
    toks = toks[:n_tokens]
    out = llm.detokenize(toks[1:]).decode("utf-8", "ignore")
    return out, len(llm.tokenize(out.encode(), add_bos=True))

MODE_FLAGS = {"default": [], "norepack": ["--no-repack"], "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0"],
              "q4_0": ["-ctk", "q4_0", "-ctv", "q4_0"]}


def mode_flags(mode):
    return [f for part in (mode or "default").split("+") for f in MODE_FLAGS[part]]


def run(path, ctx, prompt, fa=None, extra=()):
    cmd = [sys.executable, "-m", "edgespec", "run", "--target", path, "--ctx", str(ctx), "--drafter", "none",
           "--raw", "--max-tokens", "16", "--json", "--prompt", prompt] + list(extra)
    if fa:
        cmd += ["--flash-attn", fa]
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr[-300:]}
    r = json.loads(out.stdout)
    return {"peak_mib": r["peak_rss_bytes"] / 2**20, "tps": r["stats"]["tokens_per_second"], "s": time.time() - t}

def plan(path, ctx, fa=None, extra=()):
    cmd = [sys.executable, "-m", "edgespec", "plan", "--target", path, "--ctx", str(ctx), "--drafter", "none", "--json",
           "--parallel", "1"] + list(extra)
    if fa:
        cmd += ["--flash-attn", fa]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return out.stderr[-300:]
    r = json.loads(out.stdout)
    c = next(c for c in r["configs"] if c["drafter"] == "none" and c["n_ctx"] == ctx)
    return c["estimated_bytes"] / 2**20

if __name__ == "__main__":
    path, ctx = sys.argv[1], int(sys.argv[2])
    fas = [None if f == "-" else f for f in sys.argv[3].split(",")] if len(sys.argv) > 3 else [None]
    fracs = [float(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0.0, 0.85]
    modes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["default"]
    prompts = {}
    for mode in modes:
        flags = mode_flags(mode)
        for fa in fas:
            est = plan(path, ctx, fa, flags)
            for frac in fracs:
                n = max(8, int(frac * ctx))
                if n not in prompts:
                    prompts[n] = prompt_for(path, n)
                p, got = prompts[n]
                r = run(path, ctx, p, fa, flags)
                row = {"model": os.path.basename(path), "ctx": ctx, "fa": fa, "mode": mode, "frac": frac,
                       "prompt_tokens": got, **r, "estimate_mib": est}
                if "peak_mib" in r and isinstance(est, float):
                    row["estimate_over_peak"] = round((est - r["peak_mib"]) / r["peak_mib"], 4)
                print(json.dumps(row), flush=True)
