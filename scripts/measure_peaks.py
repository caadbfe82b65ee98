"""Peak RSS (VmHWM) of `edgespec run --drafter none --raw --max-tokens 16` for a model and context at
several prompt fractions and flash-attention settings, beside `plan --drafter none --json`; one JSON
line per run. Usage: python scripts/measure_peaks.py MODEL.gguf N_CTX [on,off] [0,0.85,0.99]
(run from the repository root; the memory table of docs/memory.md was made with it)."""
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

def plan(path, ctx, fa=None):
    cmd = [sys.executable, "-m", "edgespec", "plan", "--target", path, "--ctx", str(ctx), "--drafter", "none", "--json"]
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
    fas = sys.argv[3].split(",") if len(sys.argv) > 3 else [None]
    fracs = [float(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0.0, 0.85]
    for fa in fas:
        for frac in fracs:
            n = max(8, int(frac * ctx))
            p, got = prompt_for(path, n)
            r = run(path, ctx, p, fa)
            print(json.dumps({"model": os.path.basename(path), "ctx": ctx, "fa": fa, "frac": frac,
                              "prompt_tokens": got, **r,
                              "estimate_mib": plan(path, ctx, fa) if frac == fracs[0] else None}), flush=True)
