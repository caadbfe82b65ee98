"""edgespec's per-token host cost on a real model, against the peers, interleaved in one run.

    python scripts/host_overhead.py MODEL.gguf [--tokens 128] [--trials 5] [--threads 2]

Per trial, each in turn, on the same prompt (flash attention on everywhere):
  loop        a minimal llama-cpp-python loop: one llama_decode a token, numpy argmax of the row
  none-t0     edgespec --drafter none at T = 0
  none-topp   edgespec --drafter none at T = 0.8 top-p 0.95
  llama-topp  llama-cpp-python's Llama at T = 0.8 top-p 0.95 (top-k and min-p off, as edgespec's)
Decode milliseconds a token (prompt excluded), medians, and the ratios the issue asks for. JSON to --out.
"""
import llama_cpp  # first: on this image numpy loaded first breaks llama.cpp's tokenizer init
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())
from edgespec import Engine  # noqa: E402
from edgespec.backend import set_verbose  # noqa: E402

PROMPT = ("Write a Python function that parses a CSV file of orders (id, customer, amount, date) and "
          "returns the total amount per customer for each month, with a docstring and type hints.")


def minimal_loop(model, ctx, vocab, tokens: list[int], n: int) -> float:
    """ms a token of one llama_decode a token with argmax (the floor any loop over llama.cpp pays)."""
    L = llama_cpp
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    arr = (ctypes.c_int32 * len(tokens))(*tokens)  # kept alive while llama.cpp reads it
    assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0
    tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    one = (ctypes.c_int32 * 1)()
    t0 = time.perf_counter()
    for _ in range(n):
        one[0] = tok
        assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
        tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    return (time.perf_counter() - t0) / n * 1000


def edgespec_run(engine, tokens: list[int], n: int, **sampling) -> float:
    engine.reset()
    r = engine.generate(tokens, max_tokens=n, seed=7, **sampling)
    # decode_seconds starts after the prompt's last row: every generated token but the first is a step
    return r.stats.decode_seconds / max(1, len(r.tokens) - 1) * 1000


def llama_run(llm, tokens: list[int], n: int) -> float:
    def gen(k):
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(tokens, max_tokens=k, temperature=0.8, top_p=0.95, top_k=0, min_p=0.0,
                                    seed=7)
        return time.perf_counter() - t0, out["usage"]["completion_tokens"]
    t1, _ = gen(1)
    tn, got = gen(n)
    return (tn - t1) / max(1, got - 1) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/host-overhead.json")
    a = ap.parse_args()
    set_verbose(False)
    L = llama_cpp
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mparams)
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = 1024, 512
    cparams.n_threads = cparams.n_threads_batch = a.threads
    cparams.flash_attn_type = 1  # on
    ctx = L.llama_init_from_model(model, cparams)
    vocab = L.llama_model_get_vocab(model)
    engine = Engine.load(a.model, drafter="none", n_ctx=1024, threads=a.threads, flash_attn="on", calibrate="never")
    # the chat template's prompt, the same tokens for every runner (an instruct model answers at length)
    from edgespec.request import Request
    tokens = list(engine.prepare_chat([{"role": "user", "content": PROMPT}], Request.build(), room=1).tokens)
    llm = llama_cpp.Llama(a.model, n_ctx=1024, n_threads=a.threads, flash_attn=True, verbose=False)
    runs = {"loop": [], "none-t0": [], "none-topp": [], "llama-topp": []}
    for trial in range(a.trials):
        runs["loop"].append(minimal_loop(model, ctx, vocab, tokens, a.tokens))
        runs["none-t0"].append(edgespec_run(engine, tokens, a.tokens))
        runs["none-topp"].append(edgespec_run(engine, tokens, a.tokens, temperature=0.8, top_p=0.95))
        runs["llama-topp"].append(llama_run(llm, tokens, a.tokens))
        print(f"trial {trial + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in runs.items()}
    report = {"model": a.model, "tokens": a.tokens, "threads": a.threads, "ms_per_token": med, "trials": runs,
              "none_t0_vs_loop": med["loop"] / med["none-t0"],
              "none_topp_vs_none_t0": med["none-t0"] / med["none-topp"],
              "none_topp_vs_llama_topp": med["llama-topp"] / med["none-topp"]}
    for k, v in med.items():
        print(f"{k:>11}: {v:.2f} ms a token")
    print(f"edgespec none T=0 speed / minimal loop: {report['none_t0_vs_loop']:.3f}x")
    print(f"edgespec none T=0.8 top-p 0.95 speed / its T=0: {report['none_topp_vs_none_t0']:.3f}x")
    print(f"edgespec none T=0.8 top-p 0.95 speed / llama-cpp-python Llama: {report['none_topp_vs_llama_topp']:.3f}x")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(report, fh, indent=1)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
