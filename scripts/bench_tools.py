"""Time a tool call: `auto` under the call's grammar against plain decoding of the same call.

python scripts/bench_tools.py [PAIR] [--threads N] [--trials 3]

For each request (tool_choice "required" on a weather / a calendar / a search tool), the answer
is generated (1) with drafter auto, constrained to the model's call format, and (2) with plain
unconstrained decoding of the same prompt (drafter none): its answer is the same call when the
model would have made it anyway. Reported: decode tokens/s of each and the ratio, per request and
on average, from the same loaded target in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "create_event", "description": "Add an event to the calendar",
     "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                    "time": {"type": "string"}, "attendees": {"type": "array", "items": {"type": "string"}}},
                    "required": ["title", "date", "time", "attendees"]}}},
    {"type": "function", "function": {"name": "search_files", "description": "Search files by a query",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "extension": {"type": "string"}},
                    "required": ["query", "extension"]}}},
]
ASKS = ["What is the weather in Lisbon right now, in celsius?",
        "Put 'Quarterly review with Dana Whitfield' on my calendar for 2026-03-14 at 15:30 with Dana Whitfield "
        "and Omar Haddad.",
        "Find my python files that mention 'retry_with_backoff'."]


def main(argv=None) -> int:
    from edgespec.assemble import Settings
    from edgespec.engine import Engine
    from edgespec.request import Request
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pair", nargs="?", default="qwen2.5-coder-1.5b")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--trials", type=int, default=3)
    a = p.parse_args(argv)
    rows = []
    with Engine.from_settings(Settings(target=a.pair, drafter="auto", cache_ram=0, threads=a.threads)) as auto, \
            Engine.from_settings(Settings(target=a.pair, drafter="none", cache_ram=0, threads=a.threads)) as plain:
        for ask in ASKS:
            msgs = [{"role": "user", "content": ask}]
            tps = {"auto": [], "plain": []}
            for _ in range(a.trials):
                for eng in (auto, plain):
                    eng.reset()
                req = Request.build(max_tokens=120, tools=TOOLS, tool_choice="required")
                r = auto.chat(msgs, req)
                # the same prompt (tools offered by the template), decoded plainly without the grammar
                prompt = plain.prepare_chat(msgs, req).tokens
                q = plain.generate(prompt, max_tokens=len(r.tokens))
                tps["auto"].append(r.stats.tokens_per_second)
                tps["plain"].append(q.stats.tokens_per_second)
            call = r.tool_calls[0] if r.tool_calls else None
            rows.append({"ask": ask[:40], "call": call and call.name, "arguments": call and call.arguments,
                         "tokens": len(r.tokens), "auto_tps": statistics.median(tps["auto"]),
                         "plain_tps": statistics.median(tps["plain"]), "by_drafter": r.stats.by_drafter})
    for row in rows:
        row["ratio"] = row["auto_tps"] / row["plain_tps"] if row["plain_tps"] else 0.0
        print(f"{row['ask']:<42} {row['call']:<14} {row['tokens']:4d} tok  auto {row['auto_tps']:5.1f} tok/s  "
              f"plain {row['plain_tps']:5.1f} tok/s  x{row['ratio']:.2f}")
    print(f"mean ratio x{statistics.mean(r['ratio'] for r in rows):.2f}")
    print(json.dumps(rows, default=str), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
