"""`bench --kinds agent`: a recorded agent session replayed turn by turn through the agent's API.

The session is what `serve --record FILE` wrote while an agent (Claude Code, Codex) worked: one JSON
line per request, its path (/v1/messages, /v1/responses, /v1/chat/completions) and body. Each server
below starts fresh and gets the session's requests in their order, each streamed at T = 0 (the agent's
own sampling settings would make two servers' answers differ for reasons that are not theirs); the
bodies are replayed as recorded, so every server reads the same conversation whatever it answers.

    edgespec none            plain decoding through `edgespec serve --drafter none`
    edgespec auto            `edgespec serve` (the default drafter)
    llama-server ngram-mod   with --peer llama-server: llama.cpp's server, its prompt cache on as it
    llama-server draft       runs by default, n-gram drafting / the draft model; "best" is the faster

Per request: the time to its first content event (TTFT: its prompt's evaluation, what the prompt cache
kept, the queue), its decode rate (output tokens over the time after the first event), and its total;
per server the session's total time. Ratios are to edgespec none, and with --peer to llama-server's
faster mode, in the same run. Minutes per server on a CPU: an agent's first prompt is ~20,000 tokens.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from .llama_server import Served, _free_port, find_llama_server

ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
OURS = ("edgespec none", "edgespec auto")
THEIRS = ("llama-server ngram-mod", "llama-server draft")


def load_session(path: Path) -> list[dict]:
    """The replayable requests of a `serve --record` file: [{path, body}] (other routes left out)."""
    if not path.is_file():
        raise UsageError(f"--agent-session {path}: no such file (record one with `serve --record FILE`)")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise UsageError(f"{path}:{n}: not a JSON line (a `serve --record` file has one request a line)") from None
        route = str(item.get("path", "")).split("?")[0]
        if route in ROUTES and isinstance(item.get("body"), dict):
            out.append({"path": route, "body": item["body"]})
    if not out:
        raise UsageError(f"{path}: no /v1/messages, /v1/responses or /v1/chat/completions request in it")
    return out


class Refused(Exception):
    """A server answered a recorded request with an error: recorded as such, the session goes on."""


def replay(url: str, turn: dict, timeout: float = 3600) -> dict:
    """One recorded request, streamed at T = 0: {ttft, total, output_tokens, prompt_tokens, cached}."""
    import httpx
    body = dict(turn["body"], stream=True, temperature=0)
    if turn["path"] == "/v1/chat/completions":
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", url + turn["path"], json=body, timeout=timeout,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        if r.status_code != 200:
            r.read()
            message = f"{turn['path']} answered {r.status_code}: {r.text[:300]}"
            if 400 <= r.status_code < 500:  # the server does not serve this request (a crash is no refusal)
                raise Refused(message)
            raise UsageError(f"{url}{message}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if first is None and _content(ev):
                first = time.perf_counter() - t0
            usage = _usage(ev) or usage
    total = time.perf_counter() - t0
    first = total if first is None else first
    out_tokens = int(usage.get("output", 0))
    return {"ttft": first, "total": total, "output_tokens": out_tokens, "prompt_tokens": usage.get("input"),
            "cached": usage.get("cached"),
            "decode_tps": out_tokens / (total - first) if total > first and out_tokens > 1 else None}


def _content(ev: dict) -> bool:
    """Whether an event carries the answer's first text or call (not a keep-alive)."""
    kind = ev.get("type")
    if kind == "content_block_delta":
        d = ev.get("delta", {})
        return bool(d.get("text") or d.get("partial_json"))
    if kind == "content_block_start":
        return ev.get("content_block", {}).get("type") == "tool_use"
    if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
        return bool(ev.get("delta"))
    if "choices" in ev and ev["choices"]:
        d = ev["choices"][0].get("delta", {})
        return bool(d.get("content") or d.get("tool_calls"))
    return False


def _usage(ev: dict) -> Optional[dict]:
    if ev.get("type") == "message_delta" and ev.get("usage"):
        u = ev["usage"]
        cached = u.get("cache_read_input_tokens") or 0
        return {"output": u.get("output_tokens", 0), "input": (u.get("input_tokens") or 0) + cached, "cached": cached}
    if ev.get("type") == "response.completed":
        u = ev.get("response", {}).get("usage") or {}
        return {"output": u.get("output_tokens", 0), "input": u.get("input_tokens"),
                "cached": (u.get("input_tokens_details") or {}).get("cached_tokens")}
    if ev.get("usage"):
        u = ev["usage"]
        return {"output": u.get("completion_tokens", 0), "input": u.get("prompt_tokens"),
                "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
    return None


def commands(target: Path, draft: Optional[Path], n_ctx: int, threads: int, binary: Optional[Path]) -> dict:
    # each as a user runs it: its own defaults for parallel sequences and the prompt cache (an agent's
    # side requests take a sequence of their own rather than evict the main conversation)
    ours = [sys.executable, "-m", "edgespec", "serve", "--target", str(target), "--ctx", str(n_ctx),
            "--threads", str(threads), "--host", "127.0.0.1"]
    if draft is not None:
        ours += ["--draft", str(draft)]
    cmds = {"edgespec none": ours + ["--drafter", "none"], "edgespec auto": ours + ["--drafter", "auto"]}
    if binary is not None:
        theirs = [str(binary), "-m", str(target), "-c", str(n_ctx), "-t", str(threads),
                  "--host", "127.0.0.1", "--no-webui", "--jinja"]
        cmds["llama-server ngram-mod"] = theirs + ["--spec-type", "ngram-mod"]
        if draft is not None:
            cmds["llama-server draft"] = theirs + ["-md", str(draft), "--spec-type", "draft-simple"]
    return cmds


def run(settings, session: list[dict], out: Path, peer: bool = False, llama_server: Optional[str] = None) -> dict:
    from ..assemble import resolve_files
    target, draft = resolve_files(settings)
    threads = settings.threads or _threads()
    binary = find_llama_server(llama_server) if peer else None
    cmds = commands(target, draft, settings.n_ctx, threads, binary)
    logs = out.parent / "agent-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for name, cmd in cmds.items():  # one at a time: each has the machine to itself
        port = _free_port()
        server = Served(name, cmd + ["--port", str(port)], port, logs / (re.sub(r"\W+", "-", name) + ".log"))
        try:
            server.wait_ready()
            turns = results[name] = []
            for i, turn in enumerate(session, 1):
                try:
                    t = replay(server.url, turn)
                except Refused as exc:  # the server cannot serve this request: said, and the session goes on
                    turns.append({"error": str(exc)})
                    print(f"bench: {name}: request {i}/{len(session)}: refused: {exc}", file=sys.stderr, flush=True)
                    continue
                turns.append(t)
                print(f"bench: {name}: request {i}/{len(session)}: first token {t['ttft']:.1f} s, "
                      f"{t['output_tokens']} tokens, {t['total']:.1f} s", file=sys.stderr, flush=True)
        finally:
            server.stop()
            report = _write(out, target, draft, settings.n_ctx, threads, session, results)  # what ran so far
    return report


def _write(out: Path, target, draft, n_ctx: int, threads: int, session: list, results: dict) -> dict:
    report = {"target": str(target), "draft": str(draft) if draft else None, "n_ctx": n_ctx,
              "threads": threads, "requests": len(session), "servers": results, "summary": summarize(results)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


def _threads() -> int:
    from ..backend import default_threads
    return default_threads()


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per server: the session's total time, its summed TTFT, its decode rate over the turns it
    answered, and how many it refused. Ratios compare the requests every server answered (a server
    that refused a long request would otherwise look faster): to edgespec none, and to llama-server's
    faster mode."""
    answered = [i for i in range(max((len(t) for t in results.values()), default=0))
                if all(i < len(t) and "error" not in t[i] for t in results.values())]
    out = {}
    for name, turns in results.items():
        ok = [t for t in turns if "error" not in t]
        decode_time = sum(t["total"] - t["ttft"] for t in ok)
        tokens = sum(t["output_tokens"] for t in ok)
        out[name] = {"total_s": sum(t["total"] for t in ok), "ttft_s": sum(t["ttft"] for t in ok),
                     "decode_tps": tokens / decode_time if decode_time > 0 else None,
                     "refused": len(turns) - len(ok),
                     "common_s": sum(turns[i]["total"] for i in answered)}
    plain = out.get("edgespec none", {}).get("common_s")
    theirs = [out[n]["common_s"] for n in THEIRS if n in out]
    best = min(theirs) if theirs else None
    for s in out.values():
        s["vs_plain"] = s["common_s"] / plain if plain else None
        s["vs_llama_server_best"] = s["common_s"] / best if best else None
    return out


def format_table(summary: dict) -> str:
    head = ("server", "total s", "TTFT s", "decode tok/s", "refused", "vs plain", "vs llama-server")
    lines = ["{:<24} {:>8} {:>8} {:>13} {:>8} {:>9} {:>16}".format(*head)]
    for name, s in summary.items():
        dt = f"{s['decode_tps']:.1f}" if s["decode_tps"] else "-"
        vp = f"x{s['vs_plain']:.2f}" if s["vs_plain"] else "-"
        vb = f"x{s['vs_llama_server_best']:.2f}" if s["vs_llama_server_best"] else "-"
        lines.append(f"{name:<24} {s['total_s']:>8.1f} {s['ttft_s']:>8.1f} {dt:>13} {s['refused']:>8} {vp:>9} {vb:>16}")
    if any(s["refused"] for s in summary.values()):
        lines.append("(ratios over the requests every server answered)")
    return "\n".join(lines)


def main(settings, opts, session_file: Optional[str]) -> int:
    from ..registry import _shipped
    path = Path(session_file) if session_file else _shipped("workloads/agent-session.jsonl")
    session = load_session(path)
    report = run(settings, session, Path(opts.out), peer=opts.peer == "llama-server", llama_server=opts.llama_server)
    print(format_table(report["summary"]))
    print(f"\nJSON: {opts.out}")
    return 0
