"""`bench --kinds agent`: a recorded agent session replayed turn by turn through the agent's API.

The session is what `serve --record FILE` wrote while an agent (Claude Code, Codex) worked: one JSON
line per request, its path (/v1/messages, /v1/responses, /v1/chat/completions) and body. Each server
below starts fresh and gets the session's requests in their order, each streamed at T = 0 (the agent's
own sampling settings would make two servers' answers differ for reasons that are not theirs) with its
answer capped at --agent-max-tokens; the bodies are otherwise replayed as recorded, so every server
reads the same conversation whatever it answers.

    edgespec none            plain decoding through `edgespec serve --drafter none`
    edgespec auto            `edgespec serve` (the default drafter)
    llama-server ngram-mod   with --peer llama-server: llama.cpp's server, its prompt cache on as it
    llama-server draft       runs by default, n-gram drafting / the draft model; "best" is the faster

Per request: its prompt's tokens and how many of them came from the server's cache, the time to its
first content event (TTFT: its prompt's evaluation, the queue), its decode rate (output tokens over the
time after the first event), its total, and its output tokens side by side (at T = 0 on the same
rendered prompt the servers should write the same answer: a difference is shown, not hidden); per
server the session's total time. Ratios are to edgespec none, and with --peer to llama-server's faster
mode, in the same run; each edgespec mode also against none over the requests it answered with as many
output tokens (a near-tie at T = 0 may send one mode into a longer answer). Minutes per server on a
CPU: an agent's first prompt is 3,000-23,000 tokens.

With --peer every server gets the session in a form both accept and render alike (`both_accept`): what
only edgespec reads (Codex's `namespace` tool and `additional_tools` input item, Claude Code's system
blocks) is written as edgespec reads it, in fields llama-server reads the same way; the report lists
what was changed. Without --peer the bodies go as recorded (but for the cap).
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
# the sessions shipped in workloads/, by the name --agent-session takes for them
SHIPPED = {"codex": "workloads/agent-session.jsonl", "claude-code": "workloads/agent-session-claude.jsonl"}
# Responses input items both servers read (llama-server refuses a request with any other)
COMMON_ITEMS = frozenset({"message", "function_call", "function_call_output"})
OURS = ("edgespec none", "edgespec auto")
THEIRS = ("llama-server ngram-mod", "llama-server draft")


def session_path(name: Optional[str]) -> Path:
    """--agent-session: a shipped session's name (codex, claude-code) or a `serve --record` file."""
    from ..registry import _shipped
    if name is None or name in SHIPPED:
        return _shipped(SHIPPED[name or "codex"])
    return Path(name)


def both_accept(session: list[dict]) -> tuple[list[dict], list[str]]:
    """The session in a form llama-server accepts and renders as edgespec does, and what was changed.

    Responses: an `additional_tools` item's tools join `tools` (llama-server refuses the item); a
    `namespace` tool's functions are offered one by one, as edgespec offers them (llama-server leaves
    the tool out); hosted tools go, as edgespec passes them over; input items other than messages and
    function calls go. Messages: see _messages_both_accept. Chat: as recorded."""
    out, changed = [], set()
    for turn in session:
        body = json.loads(json.dumps(turn["body"]))
        if turn["path"] == "/v1/responses":
            items = body.get("input") if isinstance(body.get("input"), list) else None
            tools = list(body.get("tools") or ())
            if items is not None:
                for item in items:
                    if isinstance(item, dict) and item.get("type") == "additional_tools":
                        tools += item.get("tools") or []
                        changed.add("Responses: an additional_tools item's tools moved to tools")
                    elif isinstance(item, dict) and item.get("type", "message") not in COMMON_ITEMS:
                        changed.add(f"Responses: {item.get('type')} input items left out")
                body["input"] = [i for i in items
                                 if not isinstance(i, dict) or i.get("type", "message") in COMMON_ITEMS]
            kept = []
            for t in tools:
                if not isinstance(t, dict):
                    changed.add("Responses: tools that are no objects left out")
                elif t.get("type") == "function":
                    kept.append(t)
                elif t.get("type") == "namespace":  # its functions, as edgespec offers them
                    kept += [f for f in t.get("tools") or () if isinstance(f, dict) and f.get("type") == "function"]
                    changed.add("Responses: namespace tools' functions offered one by one (as edgespec offers them)")
                else:
                    changed.add(f"Responses: {t.get('type')} tools left out (edgespec passes them over too)")
            names = [f.get("name") for f in kept]
            kept = [f if names.count(f.get("name")) == 1 else None for f in kept]
            if None in kept:
                changed.add("Responses: functions sharing a name (edgespec offers them as namespace.name) left out")
                kept = [f for f in kept if f is not None]
            if "tools" in body or kept:
                body["tools"] = kept
        elif turn["path"] == "/v1/messages":
            _messages_both_accept(body, changed)
        out.append({"path": turn["path"], "body": body})
    return out, sorted(changed)


def _messages_both_accept(body: dict, changed: set) -> None:
    """A Messages body in place: what llama-server reads another way than edgespec, written as
    edgespec reads it (server/anthropic.py's own functions: system blocks and a tool result's blocks
    joined, an error result's text marked, Claude Code's billing header left out), in fields
    llama-server reads the same way; server tools left out."""
    from ..server.anthropic import _result, _text, _without_billing
    from ..server.schemas import ApiError
    try:
        system = body.get("system")
        if isinstance(system, list):
            if _without_billing(system) is not system:
                changed.add("Messages: Claude Code's billing header block left out of system")
            body["system"] = _text(_without_billing(system), "system")
            changed.add("Messages: system text blocks joined by a newline (llama-server joins them with nothing)")
        for m in body.get("messages") or ():
            for b in m.get("content") if isinstance(m, dict) and isinstance(m.get("content"), list) else ():
                if isinstance(b, dict) and b.get("type") == "tool_result" and \
                        (isinstance(b.get("content"), list) or b.get("is_error")):
                    b["content"] = _result(b, "tool_result")["content"]
                    b.pop("is_error", None)
                    changed.add("Messages: tool_result blocks joined, an error's text beginning 'Error: '")
    except ApiError as exc:  # a body edgespec refuses: the session is not one to replay
        raise UsageError(f"a recorded /v1/messages request edgespec refuses: {exc.message}") from None
    if isinstance(body.get("tools"), list):
        kept = [t for t in body["tools"] if isinstance(t, dict) and t.get("type") in (None, "custom")]
        for t in body["tools"]:
            if t not in kept:
                changed.add(f"Messages: server tool {t.get('type') if isinstance(t, dict) else t!r} left out")
        body["tools"] = kept


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


CAP_FIELDS = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens",
              "/v1/chat/completions": "max_tokens"}


def capped(session: list[dict], cap: Optional[int]) -> list[dict]:
    """Every request's answer held to `cap` tokens (its own limit where lower), for every server
    alike: at T = 0 a small model can loop where the agent's own sampling would not (llama-server
    wrote 6,600 tokens and was still going on a Codex request edgespec answered in 41; Claude Code
    asks for up to 32,000)."""
    if not cap:
        return session
    out = []
    for turn in session:
        body, key = dict(turn["body"]), CAP_FIELDS[turn["path"]]
        chat = turn["path"] == "/v1/chat/completions"
        keys = [k for k in (key, "max_completion_tokens") if k in body] if chat else []
        for k in keys or [key]:
            given = body.get(k)
            ok = isinstance(given, int) and not isinstance(given, bool) and given > 0
            body[k] = min(given, cap) if ok else cap
        out.append({"path": turn["path"], "body": body})
    return out


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
            usage.update(_usage(ev) or {})
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
    """The counts an event carries: {output, input (all prompt tokens), cached}, those it has."""
    if ev.get("type") in ("message_start", "message_delta"):
        # Anthropic: input_tokens leaves out the tokens read from a cache. llama-server says them in
        # message_start only, edgespec again in message_delta (message_start comes before its prefill)
        u = (ev.get("message") or {}).get("usage") if ev["type"] == "message_start" else ev.get("usage")
        if not u:
            return None
        out = {"output": u["output_tokens"]} if ev["type"] == "message_delta" and "output_tokens" in u else {}
        if "cache_read_input_tokens" in u:
            cached = u.get("cache_read_input_tokens") or 0
            out.update(input=(u.get("input_tokens") or 0) + cached, cached=cached)
        return out
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


def run(settings, session: list[dict], out: Path, peer: bool = False, llama_server: Optional[str] = None,
        cap: Optional[int] = None) -> dict:
    from ..assemble import resolve_files
    target, draft = resolve_files(settings)
    threads = settings.threads or _threads()
    binary = find_llama_server(llama_server) if peer else None
    cmds = commands(target, draft, settings.n_ctx, threads, binary)
    changed = None
    if peer:  # every server reads the same requests, in the form all of them accept
        session, changed = both_accept(session)
        for line in changed:
            print(f"bench: the session as both servers take it: {line}", file=sys.stderr, flush=True)
    session = capped(session, cap)
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
            report = _write(out, target, draft, settings.n_ctx, threads, session, results, changed, cap)  # so far
    return report


def _write(out: Path, target, draft, n_ctx: int, threads: int, session: list, results: dict,
           changed: Optional[list] = None, cap: Optional[int] = None) -> dict:
    report = {"target": str(target), "draft": str(draft) if draft else None, "n_ctx": n_ctx,
              "threads": threads, "requests": len(session), "max_tokens_cap": cap,
              "form": "as recorded" if changed is None else "both accept", "changed": changed,
              "servers": results, "summary": summarize(results), "per_request": per_request(results)}
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
    faster mode. Each edgespec mode also against none over the requests of those it answered with as
    many output tokens: `alike_requests`, `alike_s` (its time there), `vs_plain_alike`."""
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
                     "common_s": sum(turns[i]["total"] for i in answered), "common_requests": len(answered)}
    plain = out.get("edgespec none", {}).get("common_s")
    theirs = [out[n]["common_s"] for n in THEIRS if n in out]
    best = min(theirs) if theirs else None
    for s in out.values():
        s["vs_plain"] = s["common_s"] / plain if plain else None
        s["vs_llama_server_best"] = s["common_s"] / best if best else None
    # against plain, also over the requests answered with as many tokens as plain did (token counts,
    # not the texts): at T = 0 a near-tie in the batched logits may send a mode into a longer answer,
    # whose time says nothing of its speed. llama-server counts tokens its own way (one more on most
    # answers, 17 more on a tool call): compared in totals only
    none = results.get("edgespec none")
    if none is not None:
        for name, turns in results.items():
            if not name.startswith("edgespec"):
                continue
            alike = [i for i in answered if turns[i]["output_tokens"] == none[i]["output_tokens"]]
            mine, theirs_s = (sum(t[i]["total"] for i in alike) for t in (turns, none))
            out[name].update(alike_requests=len(alike), alike_s=mine,
                             vs_plain_alike=mine / theirs_s if theirs_s else None)
    return out


def per_request(results: dict[str, list[dict]]) -> list[dict]:
    """Request by request, each server's prompt tokens, tokens from its cache, output tokens, TTFT and
    total; `same_prompt` / `same_output`: whether the servers that answered agree on the counts (at
    T = 0 on one rendered prompt the answers should be the same)."""
    rows = []
    for i in range(max((len(t) for t in results.values()), default=0)):
        row = {"request": i + 1, "servers": {}}
        for name, turns in results.items():
            t = turns[i] if i < len(turns) else {"error": "not run"}
            keys = ("prompt_tokens", "cached", "output_tokens", "ttft", "total")
            row["servers"][name] = {"error": t["error"]} if "error" in t else {k: t.get(k) for k in keys}
        answered = [v for v in row["servers"].values() if "error" not in v]
        row["same_prompt"] = len({v["prompt_tokens"] for v in answered}) <= 1
        row["same_output"] = len({v["output_tokens"] for v in answered}) <= 1
        rows.append(row)
    return rows


def format_requests(rows: list[dict]) -> str:
    """One line a request and server: prompt tokens / from cache, output tokens, TTFT, total."""
    lines = ["{:>3} {:<24} {:>8} {:>8} {:>7} {:>8} {:>8}".format(
        "#", "server", "prompt", "cached", "output", "TTFT s", "total s")]
    for row in rows:
        for name, v in row["servers"].items():
            if "error" in v:
                lines.append(f"{row['request']:>3} {name:<24} refused: {v['error'][:60]}")
                continue
            lines.append("{:>3} {:<24} {:>8} {:>8} {:>7} {:>8.1f} {:>8.1f}".format(
                row["request"], name, v["prompt_tokens"] if v["prompt_tokens"] is not None else "-",
                v["cached"] if v["cached"] is not None else "-", v["output_tokens"], v["ttft"], v["total"]))
        if not (row["same_prompt"] and row["same_output"]):
            what = [w for w, same in (("prompt", row["same_prompt"]), ("output", row["same_output"])) if not same]
            lines.append(f"    request {row['request']}: the servers' {' and '.join(what)} token counts differ")
    return "\n".join(lines)


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
    differ = [(name, s) for name, s in summary.items()
              if "alike_requests" in s and s["alike_requests"] != s.get("common_requests")]
    for name, s in differ:
        n, vs = s["alike_requests"], s["vs_plain_alike"]
        if n == 0:
            lines.append(f"{name}: no request answered with as many tokens as plain")
            continue
        lines.append(f"{name}: over the {n} request{'s' * (n != 1)} it answered with as many tokens as plain, "
                     f"{s['alike_s']:.1f} s" + (f", x{vs:.2f} of plain's" if vs is not None else ""))
    return "\n".join(lines)


def main(settings, opts, session_file: Optional[str]) -> int:
    session = load_session(session_path(session_file))
    report = run(settings, session, Path(opts.out), peer=opts.peer == "llama-server", llama_server=opts.llama_server,
                 cap=opts.agent_max_tokens)
    print(format_requests(report["per_request"]))
    print()
    print(format_table(report["summary"]))
    print(f"\nJSON: {opts.out}")
    return 0
