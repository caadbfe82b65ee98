"""An agent-sized prompt's time to first token through `edgespec serve`, beside llama.cpp
evaluating the same tokens in 512-token batches (llama-cpp-python's Llama.eval), in one run.

The prompt is Claude Code's first request as recorded (tests/data/; ~20,000 tokens with its
system prompt and 24 tools on Qwen2.5-Coder's template). Three timings, each a fresh process:

  llama.cpp   Llama(n_batch=512).eval(tokens): the reference
  serve       the request alone through /v1/messages, streamed: first content event - sent
  serve+1     the same, while a second, short request of the same client streams its answer

Prints the ratios and writes JSON (--out). Minutes per timing on a CPU: run it in the background.

    python scripts/prefill_ratio.py [--target GGUF] [--ctx 32768] [--out docs/prefill-ratio.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path.home() / ".cache" / "edgespec" / "models"
REQUEST = ROOT / "tests" / "data" / "claude-code-2.1.197-first-request.json"


def body_of(max_tokens: int = 8) -> dict:
    body = json.loads(REQUEST.read_text())["body"]
    return dict(body, max_tokens=max_tokens, temperature=0)


def prompt_tokens(target: str, ctx: int) -> list[int]:
    from edgespec import Engine
    from edgespec.server.anthropic import MessagesRequest
    chat = MessagesRequest.model_validate(body_of()).chat()
    with Engine.load(target, drafter="none", n_ctx=ctx, calibrate="never") as eng:
        prompt = eng.prepare_chat(chat.engine_messages(), chat.engine_request(ctx), room=1)
        return list(prompt.tokens)


def llama_cpp_seconds(target: str, tokens: list[int], ctx: int, threads: int | None) -> float:
    from llama_cpp import Llama
    llm = Llama(target, n_ctx=ctx, n_batch=512, n_ubatch=512, n_threads=threads, verbose=False)
    t0 = time.perf_counter()
    llm.eval(tokens)
    seconds = time.perf_counter() - t0
    llm.close()
    return seconds


def first_event_seconds(url: str, body: dict, label: str, out: dict) -> None:
    """Time from sending to the first content of a streamed Messages request (not a keep-alive's
    empty text delta), and the server's own prompt seconds."""
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/messages", json=dict(body, stream=True), timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            delta = ev.get("delta") or {}
            if first is None and (delta.get("text") or delta.get("partial_json")
                                  or (ev.get("content_block") or {}).get("type") == "tool_use"):
                first = time.perf_counter() - t0
            if ev.get("type") == "message_delta":
                out[label + "_usage"] = ev["usage"]
                out[label + "_prompt_seconds"] = ev["edgespec"]["prompt_seconds"]
    out[label] = first if first is not None else time.perf_counter() - t0
    out[label + "_total"] = time.perf_counter() - t0


def serve(target: str, ctx: int, threads: int | None, port: int, second: bool) -> dict:
    cmd = [sys.executable, "-m", "edgespec", "serve", "--target", target, "--ctx", str(ctx), "--port", str(port),
           "--cache-ram", "0", "--parallel", "2"] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit("serve exited")
            time.sleep(0.5)
        out: dict = {}
        threads_ = [threading.Thread(target=first_event_seconds, args=(url, body_of(), "big", out))]
        if second:  # the agent's side request: a short one, sent just after the big one
            small = {"max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content":
                     "Write a 5-word title for a chat about the capital of France."}]}
            threads_.append(threading.Thread(target=first_event_seconds, args=(url, small, "small", out)))
        for i, t in enumerate(threads_):
            t.start()
            if i == 0:
                time.sleep(1.0)
        for t in threads_:
            t.join()
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--out", default="bench-results/prefill-ratio.json")
    args = p.parse_args()
    tokens = prompt_tokens(args.target, args.ctx)
    print(f"prompt: {len(tokens)} tokens", flush=True)
    ref = llama_cpp_seconds(args.target, tokens, args.ctx, args.threads)
    print(f"llama.cpp eval, 512-token batches: {ref:.1f} s ({len(tokens) / ref:.1f} tok/s)", flush=True)
    alone = serve(args.target, args.ctx, args.threads, args.port, second=False)
    print(f"serve, alone: first token after {alone['big']:.1f} s: {alone['big'] / ref:.3f}x llama.cpp", flush=True)
    both = serve(args.target, args.ctx, args.threads, args.port, second=True)
    print(f"serve, a short request beside it: first token after {both['big']:.1f} s: {both['big'] / ref:.3f}x "
          f"llama.cpp; the short one's first token after {both['small']:.1f} s", flush=True)
    result = {"target": args.target, "ctx": args.ctx, "prompt_tokens": len(tokens), "llama_cpp_seconds": ref,
              "serve_alone": alone, "serve_with_second": both,
              "ratio_alone": alone["big"] / ref, "ratio_with_second": both["big"] / ref}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
