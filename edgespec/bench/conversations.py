"""Time to first token when conversations take turns: the prompt cache against none.

`python -m edgespec.bench.conversations [PAIR | --target F] [--conversations 3] [--turns 3]`
runs N conversations with long system prompts round robin (turn 1 of each, then turn 2 of
each, ...) twice on one loaded pair: with the prompt cache and with `cache_ram=0` (only the last
request's KV kept, as before), and reports the median time to the first token of the later
turns, the ratio, and whether the answers were the same. Writes JSON next to the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

TOPICS = [("a bakery that sells sourdough, rye and pastries", ["Which bread keeps longest?", "And for toast?",
                                                                "Anything without gluten?", "What about cakes?"]),
          ("a rail travel agency for trips across Europe", ["Paris to Rome?", "How long does it take?",
                                                            "The cheapest way?", "Night trains?"]),
          ("a chess club that coaches beginners", ["Best first opening?", "Why that one?", "And for black?",
                                                   "How do I practise?"]),
          ("a bicycle repair shop", ["My chain slips.", "How much would that cost?", "Can I fix it myself?",
                                     "Which tools?"]),
          ("a library's help desk", ["How do I renew a book?", "Is there a fee?", "Can I reserve one?",
                                     "Opening hours?"])]


def system_prompt(topic: str, words: int) -> str:
    rule = (f"You are the assistant of {topic}. Answer politely, briefly and only about {topic}; "
            "say so when you do not know, never invent prices, and suggest visiting in person for details. ")
    out = ""
    while len(out.split()) < words:
        out += rule
    return out


def run(engine, n: int, turns: int, max_tokens: int) -> dict:
    convs = [[{"role": "system", "content": system_prompt(TOPICS[i % len(TOPICS)][0], 500)}] for i in range(n)]
    out = {"ttft": {}, "answers": {}, "cached": {}}
    for t in range(turns):
        for c in range(n):
            convs[c].append({"role": "user", "content": TOPICS[c % len(TOPICS)][1][t % 4]})
            t0 = time.perf_counter()
            with engine.stream_chat(convs[c], max_tokens=max_tokens) as s:
                first = None
                for _ in s:
                    if first is None:
                        first = time.perf_counter() - t0
            convs[c].append({"role": "assistant", "content": s.text})
            key = f"{t}/{c}"
            out["ttft"][key], out["answers"][key], out["cached"][key] = first, s.tokens, s.stats.reused_prompt_tokens
            out.setdefault("prompt_tokens", {})[key] = s.stats.prompt_tokens
    return out


def main(argv=None) -> int:
    from ..assemble import Settings
    from ..engine import Engine
    from ..frontend import ProgressBar
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.conversations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pair", nargs="?")
    p.add_argument("--target")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results/conversations.json")
    a = p.parse_args(argv)
    results = {}
    for label, cache in (("cache", None), ("no cache", 0)):
        settings = Settings(target=a.target or a.pair, parallel=1, drafter=a.drafter, n_ctx=a.ctx, threads=a.threads,
                            cache_ram=cache)
        with Engine.from_settings(settings, progress=ProgressBar()) as eng:
            eng.chat([{"role": "user", "content": "Hello"}], max_tokens=2)  # warm-up
            eng.reset()
            results[label] = run(eng, a.conversations, a.turns, a.max_tokens)
            results[label]["cache_ram"] = eng.cache.capacity if eng.cache else 0
    later = [k for k in results["cache"]["ttft"] if not k.startswith("0/")]
    med = {k: statistics.median(results[k]["ttft"][x] for x in later) for k in results}
    same = sum(results["cache"]["answers"][k] == results["no cache"]["answers"][k] for k in later)
    summary = {"conversations": a.conversations, "turns": a.turns, "drafter": a.drafter,
               "median_ttft_later_turns_s": med, "ratio": med["cache"] / med["no cache"],
               "identical_answers": f"{same}/{len(later)}",
               "mean_prompt_tokens": statistics.mean(results["cache"]["prompt_tokens"][x] for x in later)}
    print(f"{a.conversations} conversations x {a.turns} turns, drafter {a.drafter}, "
          f"~{summary['mean_prompt_tokens']:.0f} prompt tokens in later turns")
    print("                 median TTFT, turns 2+")
    for k in ("cache", "no cache"):
        print(f"  {k:<12} {1000 * med[k]:10.0f} ms")
    print(f"  ratio        {summary['ratio']:10.2f}x   (answers the same with and without: "
          f"{summary['identical_answers']}; without the cache a prompt is evaluated again and may round otherwise)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
