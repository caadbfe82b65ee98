"""The draft memory on a session where the agent repeats itself: memory on against off.

    python scripts/draft_memory.py [MODEL.gguf] [--drafter auto] [--trials 3] [--threads 1] [--memory 262144]

An agent-shaped task, scripted as chat requests through `Engine.chat` (each request carries the
conversation so far, as agents send it): ask for a tool call that reads a file (JSON), get the file
back and rewrite it whole, ask for the tool call that runs the tests, then ask to rewrite the file
again after a (fake) failure. Then the same task once more in a new session (the agent restarted, a
retry, the next run of the same job), whose context holds none of the first session's answers: only
the memory has them. Each trial loads a fresh engine per setting (the memory
starts empty), the settings interleaved (off, on; then on, off; ...), T = 0; auto decides on the
cost table it loaded (no correction adopted during a run, as in the tests).

Per setting and session: requests, generated tokens, decode tokens/s (tokens after each answer's
first over the decode time), target passes, the session's wall time, drafted/accepted tokens and the memory's share,
and whether the two settings gave the same tokens. Default model: SmolLM2-135M-Instruct Q4_1.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOL = Path.home() / ".cache" / "edgespec" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

SYSTEM = ("You are a coding agent working in a repository. To use a tool, answer with one "
          'JSON object and nothing else: {{"tool": NAME, "args": {{...}}}}. Tools: read_file(path), '
          "write_file(path, content), run(command).")
FILE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2


def spread(xs):
    return max(xs) - min(xs)
'''
STEPS = [
    ("Task: add type hints to stats.py. First read the file: answer with the tool call.", 48),
    ("Tool result (read_file stats.py):\n```python\n" + FILE + "```\nNow rewrite the whole file with type hints "
     "(List[float] arguments, float results). Answer with the full file in a python code block.", 320),
    ("Tool result (write_file): ok. Now run the tests: answer with the tool call that runs `pytest -q`.", 48),
    ("Tool result (run): 1 failed (the file was not saved). Write the whole file again, exactly as before, "
     "in a python code block.", 320),
]


def session(eng) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}]
    out = {"requests": 0, "generated": 0, "passes": 0, "decode_tokens": 0, "decode_seconds": 0.0, "drafted": 0,
           "accepted": 0,
           "memory_drafted": 0, "memory_accepted": 0, "tokens": []}
    t0 = time.perf_counter()
    for text, n in STEPS:
        msgs.append({"role": "user", "content": text})
        r = eng.chat(msgs, max_tokens=n)
        msgs.append({"role": "assistant", "content": r.text})
        st = r.stats
        mem = st.by_drafter.get("memory", {})
        out["requests"] += 1
        out["generated"] += st.generated
        out["passes"] += st.target_forwards
        out["decode_tokens"] += max(0, st.generated - 1)
        out["decode_seconds"] += st.decode_seconds
        out["drafted"] += st.drafted
        out["accepted"] += st.accepted
        out["memory_drafted"] += mem.get("drafted", 0)
        out["memory_accepted"] += mem.get("accepted", 0)
        out["tokens"].append(r.tokens)
    out["wall_seconds"] = time.perf_counter() - t0
    out["tokens_per_second"] = out["decode_tokens"] / out["decode_seconds"] if out["decode_seconds"] else 0.0
    return out


def run(model: str, memory: int, args) -> list[dict]:
    from edgespec.engine import Engine
    with Engine.load(model, drafter=args.drafter, n_ctx=args.ctx, threads=args.threads, parallel=1, cache_ram=0,
                     draft_memory=memory) as eng:
        policy = getattr(eng.drafter, "policy", None)
        if policy is not None:  # auto decides on the table it loaded, in both settings (tests/tables.py's
            # one_table): a correction adopted mid-run, after passes slowed by other load, would
            # change its decisions more than the memory does
            policy.online.persist, policy.online.PERSIST_AFTER = None, 10**9
            policy.online.prior = max(policy.online.prior, 1)
        return [session(eng), session(eng)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(SMOL))
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--memory", type=int, default=256 * 1024, help="--draft-memory of the 'on' setting")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = ap.parse_args()
    settings = {"off": 0, "on": args.memory}
    runs: dict[str, list] = {"off": [], "on": []}
    for trial in range(args.trials):
        order = ("off", "on") if trial % 2 == 0 else ("on", "off")
        for name in order:
            runs[name].append(run(args.model, settings[name], args))
            s1, s2 = runs[name][-1]
            print(f"trial {trial + 1} memory {name:3}: session 1 {s1['tokens_per_second']:.1f} tok/s "
                  f"{s1['wall_seconds']:.1f} s, session 2 {s2['tokens_per_second']:.1f} tok/s "
                  f"{s2['wall_seconds']:.1f} s, accepted {s2['accepted']}/{s2['drafted']} "
                  f"(memory {s2['memory_accepted']}/{s2['memory_drafted']})", file=sys.stderr)
    print(f"{Path(args.model).name}, drafter {args.drafter}, {args.threads} thread(s), {args.trials} trials "
          "interleaved, T = 0; medians (min-max)")
    print("| session | memory | generated | target passes | decode tok/s | wall s | drafted | accepted | "
          "from memory (acc/drafted) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i in (0, 1):
        for name in ("off", "on"):
            rs = [r[i] for r in runs[name]]

            def med(key, fmt="{:.1f}"):
                vals = [r[key] for r in rs]
                return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"
            mem = f"{statistics.median(r['memory_accepted'] for r in rs):.0f}/" \
                  f"{statistics.median(r['memory_drafted'] for r in rs):.0f}"
            print(f"| {i + 1} | {name} | {rs[0]['generated']} | {statistics.median(r['passes'] for r in rs):.0f} | "
                  f"{med('tokens_per_second')} | {med('wall_seconds')} | "
                  f"{statistics.median(r['drafted'] for r in rs):.0f} | "
                  f"{statistics.median(r['accepted'] for r in rs):.0f} | {mem} |")
    same = all(a[i]["tokens"] == b[i]["tokens"] for a in runs["off"] for b in runs["on"] for i in (0, 1))
    print(f"same tokens with memory on and off, every trial and session: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
