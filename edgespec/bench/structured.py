"""`bench --kinds structured`: JSON answers under a schema, against plain decoding.

For every prompt of `workloads/structured.jsonl` ({id, kind: "structured", task: "extraction" |
"generation", prompt, schema}; chat template applied) it times, on one loaded target and in
the same run: plain unconstrained greedy decoding of the same prompt (the reference), and under
the schema `auto`, `none` (plain constrained decoding through llguidance's masks) and
llama-cpp-python's own grammar path (`LlamaGrammar.from_json_schema`, what its server does for
`response_format`). Answers differ in length, so every ratio is of decode tokens per second.

Per prompt and mean per task: the ratio to plain, validity (`json.loads` + `jsonschema`), the
share of `auto`'s tokens that were forced by the grammar, copied (copy and n-gram drafts
accepted), drafted by the draft model or sampled by the target; and the hindsight ceiling: the
best forced + copy drafting could do on the exact constrained answer, knowing it (every copy
the context holds, every round's length chosen in hindsight, the policy's calibrated costs),
with the share of its gain `auto` reached.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ..errors import UsageError
from .report import ceiling_fraction

MODES = ("auto", "none", "grammar-peer")
TASKS = ("extraction", "generation")
SHARES = ("forced", "copied", "model", "sampled")


# -- workloads --------------------------------------------------------------------------------
def default_path() -> Path:
    from .workloads import default_workloads
    return default_workloads().parent / "structured.jsonl"


def load(path: str | None, limit: int | None = None) -> list[dict]:
    """The structured prompts: each a JSON object with id, task, prompt and schema (a JSON
    Schema object); at most `limit` per task."""
    from .workloads import first_per_group, read_jsonl
    path = Path(path) if path else default_path()
    items = first_per_group(read_jsonl(
        path, lambda it: isinstance(it["schema"], dict) and it["task"] in TASKS and it["id"] and it["prompt"],
        f"a JSON object with id, task ({' or '.join(TASKS)}), prompt and schema (an object)",
        "the structured workloads"), "task", limit)
    if not items:
        raise UsageError(f"no structured workloads in {path}")
    return items


# -- what an answer is worth ------------------------------------------------------------------
def validity(text: str, schema: dict) -> tuple[bool, str | None]:
    """(the answer parses and validates against `schema`, the reason when it does not)."""
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as exc:
        return False, f"not JSON: {exc.msg} at character {exc.pos}"
    except jsonschema.ValidationError as exc:
        return False, f"schema: {exc.message[:200]}"
    return True, None


def shares(stats) -> dict:
    """Where the answer's tokens came from: forced by the grammar, copied (copy and n-gram
    drafts accepted), drafted by the draft model, or the target's own (sampled); fractions
    that add up to 1."""
    acc = {k: v["accepted"] for k, v in stats.by_drafter.items()}
    parts = {"forced": acc.get("grammar", 0), "copied": acc.get("copy", 0) + acc.get("ngram", 0),
             "model": acc.get("model", 0)}
    # drafts accepted past max_tokens were never emitted: the count is of what was
    parts["sampled"] = max(0, stats.generated - sum(parts.values()))
    total = sum(parts.values())
    return {k: (v / total if total else 0.0) for k, v in parts.items()}


# -- the hindsight ceiling --------------------------------------------------------------------
def _copy_lengths(prompt: list[int], out: list[int]) -> list[int]:
    """Per output position q: the longest run of out[q:] that the context before it (prompt and
    out[:q]) holds somewhere, what a perfect copy drafter could propose there."""
    ctx, where, lens = list(prompt), {}, []
    for j, t in enumerate(ctx):
        where.setdefault(t, []).append(j)
    for q in range(len(out)):
        best = 0
        for j in where.get(out[q], ()):
            m = 1
            while j + m < len(ctx) and q + m < len(out) and ctx[j + m] == out[q + m]:
                m += 1
            best = max(best, m)
        lens.append(best)
        where.setdefault(out[q], []).append(len(ctx))
        ctx.append(out[q])
    return lens


def _walk(guide, out: list[int]) -> tuple[list[tuple[int, int]], list[bool]]:
    """Along the answer: per position, (tokens the grammar forces from there, how many of them
    the answer has), and whether exactly one token is legal there (a row nobody computes)."""
    from ..drafters.ngram import agreed
    forced, single = [], []
    for pos, tok in enumerate(out):
        f = guide.forced()
        forced.append((len(f), agreed(f, out, pos)[0]))
        single.append(int(guide.allowed().sum()) == 1)
        guide.advance([tok])
    return forced, single


def ceiling(costs, guide, prompt: list[int], out: list[int]) -> dict:
    """Ratios to plain decoding, in `costs`' calibrated seconds, of drafting `out` (a constrained
    T = 0 answer) knowing it: "ceiling" forced + perfect copy drafts, every round's length
    chosen in hindsight; "forced" the forced drafts alone; "none" plain constrained decoding.
    The engine's rounds are modelled as they run: a round drafts the forced tokens, then the
    copy; one pass feeds what the cache lacks and computes only the rows the mask leaves open;
    a pass without an open row is not made. Also the answer's share of one-legal-token
    positions and of positions a copy could cover."""
    n = len(out)
    if n < 2:
        return {"ceiling": 1.0, "forced": 1.0, "none": 1.0, "single_share": 0.0, "copyable_share": 0.0}
    forced, single = _walk(guide, out)
    copies = _copy_lengths(prompt, out)
    single.append(True)  # past the answer's end only end-of-generation is legal

    def best_time(use_forced: bool, use_copy: bool) -> float:
        # states (position, tokens pending for the next pass; 0: the prompt's last row is at hand)
        reach: dict[int, set[int]] = {0: {0}}
        moves: dict[tuple[int, int], list[tuple[float, int, int]]] = {}
        for pos in range(n):
            for pend in reach.get(pos, ()):
                out_moves = []
                f, a = forced[pos] if use_forced else (0, 0)
                f = min(f, n - pos)
                lengths = [0]
                if a >= f and use_copy and pos + f < n:
                    lengths = range(min(copies[pos + f], n - pos - f - 1, costs.max_rows) + 1)
                for g in lengths:
                    k = f + g
                    took = min(a, f) if a < f else k
                    rows = sum(not single[pos + i] for i in range(k + 1) if pend or i)
                    fed = pend + k
                    nxt = min(n, pos + took + 1)
                    if rows:
                        out_moves.append((costs.pass_cost(fed, rows), nxt, 1))
                    else:  # nothing to compute: the tokens wait for the next pass
                        out_moves.append((0.0, nxt, pend + k + 1))
                moves[(pos, pend)] = out_moves
                for _, nxt, p in out_moves:
                    reach.setdefault(nxt, set()).add(p)
        best: dict[tuple[int, int], float] = {(n, p): 0.0 for p in reach.get(n, ())}
        for pos in range(n - 1, -1, -1):
            for pend in reach.get(pos, ()):
                best[(pos, pend)] = min(c + best[(nxt, p)] for c, nxt, p in moves[(pos, pend)])
        return best[(0, 0)]

    plain = (n - 1) * costs.verify_cost(1)
    return {"ceiling": plain / best_time(True, True), "forced": plain / best_time(True, False),
            "none": plain / best_time(False, False),
            "single_share": sum(single[:n]) / n, "copyable_share": sum(c > 0 for c in copies) / n}


def replay(drafter, costs, guide, prompt: list[int], out: list[int]) -> tuple[float, dict]:
    """Run `drafter` (None: plain constrained decoding) over a known constrained T = 0 answer as
    the engine's loop would, with every pass timed by `costs` (`pass_cost`: tokens fed, rows
    computed) instead of a device: (the ratio to plain decoding, accepted tokens per source).
    Deterministic, so policies can be compared on the same answers and costs."""
    import numpy as np

    from ..drafters import NO_DRAFT, Round
    from ..drafters.ngram import agreed
    from ..policy import drafts_likely
    from ..sampling import SamplingParams
    greedy, rng = SamplingParams(0.0), np.random.default_rng(0)
    tokens, n, i, pend, spent = list(prompt), len(out), 0, 0, 0.0
    got = {"grammar": 0, "none": 0}
    if drafter is not None:
        drafter.begin(tokens)
    ahead = guide.likely if drafts_likely(getattr(drafter, "policy", None)) else guide.forced  # as the engine
    while i < n:
        room = n - i - 1
        forced = ahead()[:room] if drafter is not None and room > 0 else []  # as Engine._draft does
        guide.advance(forced)
        left = room - len(forced)
        inner = drafter.propose(tokens + forced, left, greedy, rng, guide) if drafter is not None and left > 0 \
            else NO_DRAFT
        inner_toks = inner.tokens[:guide.legal_prefix(inner.tokens)]
        guide.rollback(len(forced))
        drafts = forced + inner_toks
        masks = guide.masks(drafts)
        rows = sum(np.count_nonzero(m) > 1 for j, m in enumerate(masks) if pend or j)
        fed = pend + len(drafts)
        took = costs.pass_cost(fed, rows) if rows else 0.0
        spent += took
        acc = agreed(drafts, out, i)[0]
        new = out[i:i + acc + 1]
        guide.advance(new)
        tokens.extend(new)
        i += len(new)
        pend = 1 if rows else pend + len(new)
        nf = min(acc, len(forced))
        got["grammar"] += nf
        got[inner.source if inner_toks else "none"] = got.get(inner.source if inner_toks else "none", 0) + acc - nf
        if drafter is not None:
            drafter.observe(Round(list(tokens), inner, max(0, acc - len(forced)), rows, took, 0.0, fed))
    return ((n - 1) * costs.verify_cost(1) / spent if spent else 1.0), got


# -- the peer ---------------------------------------------------------------------------------
class GrammarPeer:
    """llama-cpp-python's Llama decoding greedily under `LlamaGrammar.from_json_schema`
    (llama.cpp's own grammar sampler): what its server does for response_format."""

    def __init__(self, path, n_ctx: int, threads: int):
        import llama_cpp
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.is_eog = llama_cpp.llama_vocab_is_eog

    def run(self, prompt_tokens: list[int], schema: dict, n: int) -> tuple[list[int], str, float]:
        """(tokens, text, decode tokens/s: after the first token, as the engine counts)."""
        from llama_cpp import LlamaGrammar
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        self.llm.reset()
        out, t_first = [], None
        for tok in self.llm.generate(prompt_tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True,
                                     grammar=grammar):
            if self.is_eog(self.vocab, tok):
                break
            if t_first is None:
                t_first = time.perf_counter()
            out.append(tok)
            if len(out) >= n:
                break
        dt = time.perf_counter() - t_first if t_first else 0.0
        text = self.llm.detokenize(out).decode("utf-8", errors="replace")
        return out, text, ((len(out) - 1) / dt if dt > 0 else 0.0)

    def close(self) -> None:
        self.llm.close()


# -- measuring --------------------------------------------------------------------------------
def _generate(engine, ptoks, n, schema=None):
    # from nothing every time, as the main benchmark does (no reused prefix, nothing learnt)
    engine.reset()
    r = engine.generate(ptoks, max_tokens=n, temperature=0.0, json_schema=schema)
    return r.tokens, r.text, r.stats


def measure(spec, items: list[dict], modes, n: int, trials: int, peer=None, log=None) -> list[dict]:
    """One row per prompt: plain unconstrained decoding and every mode under the schema, timed
    in turns (the order rotates every trial); ratios are paired per trial, then the median."""
    from ..engine import Engine
    from ..request import Request
    plain = Engine(spec.target, None)
    runners = {"plain": (plain, False)}
    for m in modes:
        if m == "auto":
            runners[m] = (spec, True)
        elif m == "none":
            runners[m] = (plain, True)
        elif m == "grammar-peer" and peer is not None:
            runners[m] = (peer, True)
    policy = getattr(spec.drafter, "policy", None)
    prompts = [spec.chat_tokens([{"role": "user", "content": it["prompt"]}]) for it in items]

    def once(name, ptoks, schema, budget):
        runner, constrained = runners[name]
        if isinstance(runner, GrammarPeer):
            toks, text, tps = runner.run(ptoks, schema, budget)
            return toks, text, tps, None
        toks, text, st = _generate(runner, ptoks, budget, schema if constrained else None)
        return toks, text, st.tokens_per_second, st

    for name in runners:  # warm-up: page in, build kernels, llguidance's tokenizer
        once(name, prompts[0], items[0]["schema"], 8)
    rows, t_start = [], time.perf_counter()
    names = list(runners)
    for i, (it, ptoks) in enumerate(zip(items, prompts), 1):
        schema = it["schema"]
        row = {"id": it["id"], "task": it["task"], "prompt_tokens": len(ptoks), "modes": {}}
        tps: dict[str, list[float]] = {name: [] for name in names}
        for t in range(trials):
            k = t % len(names)
            results = {name: once(name, ptoks, schema, n) for name in names[k:] + names[:k]}
            for name, (_, _, speed, _) in results.items():
                tps[name].append(speed)
            if t:
                continue
            row["plain_generated"] = len(results["plain"][0])
            exact = results.get("none", results.get("auto"))
            for name, (toks, text, _, st) in results.items():
                if name == "plain":
                    continue
                ok, why = validity(text, schema)
                m = row["modes"][name] = {"generated": len(toks), "valid": ok, "invalid_reason": why,
                                          "text": text}
                if name in ("auto", "none") and exact is not None:
                    m["identical_to_none"] = toks == exact[0]
                if st is not None:
                    m.update(shares=shares(st), by_drafter=st.by_drafter, finish_reason=st.finish_reason,
                             target_forwards=st.target_forwards)
            if policy is not None and exact is not None and exact[0]:
                guide = spec.guide(Request.build(json_schema=schema))
                row["ceiling"] = ceiling(policy.costs, guide, ptoks, exact[0])
        row["plain_tps"] = statistics.median(tps["plain"])
        for name in row["modes"]:
            row["modes"][name]["tps"] = statistics.median(tps[name])
            row["modes"][name]["ratio"] = statistics.median(v / p for v, p in zip(tps[name], tps["plain"]) if p > 0)
        rows.append(row)
        if log is not None:
            eta = (time.perf_counter() - t_start) / i * (len(items) - i)
            cells = "  ".join(f"{k} x{m['ratio']:.2f}{'' if m['valid'] else ' INVALID'}"
                              for k, m in row["modes"].items())
            log(f"[{i}/{len(items)}] {it['id']:<20} plain {row['plain_tps']:5.1f} tok/s  {cells}  (eta {eta:.0f}s)")
    return rows


# -- reporting --------------------------------------------------------------------------------
def summarize(rows: list[dict]) -> dict:
    """Per task: mean ratios (of the per-prompt paired ratios), validity, mean shares, the mean
    ceiling and the share of its gain each mode reached."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        rs = [r for r in rows if r["task"] == task]
        d = {"prompts": len(rs), "plain_tps": statistics.mean(r["plain_tps"] for r in rs), "modes": {}}
        if all("ceiling" in r for r in rs):
            for key in ("ceiling", "forced", "none", "single_share", "copyable_share"):
                d[key if key != "ceiling" else "ceiling"] = statistics.mean(r["ceiling"][key] for r in rs)
        for name in rs[0]["modes"]:
            ms = [r["modes"][name] for r in rs]
            m = d["modes"][name] = {"tps": statistics.mean(x["tps"] for x in ms),
                                    "ratio": statistics.mean(x["ratio"] for x in ms),
                                    "valid": f"{sum(x['valid'] for x in ms)}/{len(ms)}",
                                    "validity_rate": sum(x["valid"] for x in ms) / len(ms)}
            if all("shares" in x for x in ms):
                m["shares"] = {k: statistics.mean(x["shares"][k] for x in ms) for k in SHARES}
            if all("identical_to_none" in x for x in ms):
                m["identical_to_none"] = f"{sum(x['identical_to_none'] for x in ms)}/{len(ms)}"
            if "ceiling" in d:
                m["ceiling_fraction"] = ceiling_fraction(m["ratio"], d["ceiling"])
        out[task] = d
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_tables(rows: list[dict], summary: dict) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["modes"]))
    lines = ["| task | mode | tok/s | plain tok/s | ratio to plain | valid | forced | copied | model | sampled |"
             " T=0 same as none |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, d in summary.items():
        for name, m in d["modes"].items():
            s = m.get("shares")
            cells = [_pct(s[k]) for k in SHARES] if s else ["-"] * 4
            lines.append(f"| {task} | {name} | {m['tps']:.1f} | {d['plain_tps']:.1f} | {m['ratio']:.2f}x | "
                         f"{m['valid']} | " + " | ".join(cells) + f" | {m.get('identical_to_none', '-')} |")
    if any("ceiling" in d for d in summary.values()):
        lines += ["", "| task | one-legal-token positions | copyable positions | model: none | model: forced only |"
                  " ceiling (forced + copy, hindsight) | auto: ratio, share of the ceiling's gain |",
                  "|---|---|---|---|---|---|---|"]
        for task, d in summary.items():
            if "ceiling" not in d:
                continue
            a = d["modes"].get("auto")
            cell = f"{a['ratio']:.2f}x, {_pct(a.get('ceiling_fraction'))}" if a else "-"
            lines.append(f"| {task} | {_pct(d['single_share'])} | {_pct(d['copyable_share'])} | {d['none']:.2f}x | "
                         f"{d['forced']:.2f}x | {d['ceiling']:.2f}x | {cell} |")
    lines += ["", "| prompt | task | tokens (plain, constrained) | ceiling | " + " | ".join(names) + " |",
              "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        gen = r["modes"].get("none", r["modes"].get("auto", {})).get("generated", "-")
        c = f"{r['ceiling']['ceiling']:.2f}x" if "ceiling" in r else "-"
        cells = [f"{r['modes'][n]['ratio']:.2f}x{'' if r['modes'][n]['valid'] else ' (invalid)'}"
                 if n in r["modes"] else "-" for n in names]
        lines.append(f"| {r['id']} | {r['task']} | {r['plain_generated']}, {gen} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(settings, opts, progress=None) -> int:
    """The structured benchmark that `opts` describes, on the models of `settings`."""
    from ..engine import Engine
    items = load(opts.workloads, opts.limit)
    spec = Engine.from_settings(settings, progress=progress)
    with spec:
        peer = (GrammarPeer(spec.target.path, spec.target.n_ctx, spec.target.threads)
                if "grammar-peer" in opts.modes else None)
        try:
            rows = measure(spec, items, opts.modes, opts.bench_tokens, opts.trials, peer,
                           log=lambda s: print(s, file=sys.stderr, flush=True))
        finally:
            if peer is not None:
                peer.close()
        policy = getattr(spec.drafter, "policy", None)
        model = getattr(spec.drafter, "model", None)
        summary = summarize(rows)
        report = {"kind": "structured", "target": str(spec.target.path),
                  "draft": str(model.backend.path) if model else None, "threads": spec.target.threads,
                  "bench_tokens": opts.bench_tokens, "trials": opts.trials, "modes": list(opts.modes),
                  "calibration": list(policy.costs.verify) if policy else None,
                  "costs": spec.drafter.describe_costs() if hasattr(spec.drafter, "describe_costs") else None,
                  "rows": rows, "by_task": summary}
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_tables(rows, summary))
    print(f"\nJSON: {out}")
    return 0
