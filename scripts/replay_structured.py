"""Replay plain constrained decoding and auto over the Qwen pair's constrained T = 0 answers with a fixed
cost table, beside the hindsight ceiling. Deterministic: no timing, so it means something on a busy machine.

The table is this machine's (Qwen 1.5B Q4_K_M, 2 threads, ~600 tokens of context, median of 7): a pass
feeding k tokens with logits on the last row only (LAST) and on every row (ALL); a pass feeding `fed`
tokens with logits on `rows` of them costs LAST[fed] + ALL[rows] - LAST[rows]. `--likely` also replays
drafting the usual tokenization of forced bytes (`Guide.likely`). `python scripts/replay_structured.py`."""
import argparse
import statistics

from edgespec import Engine
from edgespec.bench import structured as S
from edgespec.constraints import Constraint, Guide, tokenizer_for
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.copy import CopyDrafter
from edgespec.hub import local_path
from edgespec import policy as P
from edgespec.registry import load_registry

LAST = [37.8, 53.6, 74.2, 91.2, 114.4, 133.6, 148.8, 191.8, 205.1, 220.6, 236.2, 247.9, 264.4, 283.9, 296.8,
        264.5, 283.6, 298.5, 309.4, 315.6, 330.5, 347.5, 367.3, 373.6, 388, 402, 416, 430.3, 432, 434, 435, 436.4]
ALL = [37.1, 63.1, 86.3, 111.0, 131.5, 155.1, 185.3, 237.1, 258.7, 281.8, 292.6, 305.2, 321.5, 341.0, 367.9,
       306.5, 352.5, 365.1, 394.3, 399.2, 408.4, 423.5, 441.6, 449.6, 467, 485, 503, 521.6, 521, 520, 519, 518.9]


class Measured(P.Costs):
    def pass_cost(self, fed, rows):
        fed, rows = max(fed, 1), max(1, min(rows, fed))
        return (LAST[min(fed, 32) - 1] + ALL[min(rows, 32) - 1] - LAST[min(rows, 32) - 1]) / 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--likely", action="store_true", help="also replay drafting the usual tokenization of forced bytes")
    args = ap.parse_args()
    costs = Measured(tuple(a / 1000 for a in ALL), draft_step=0.020)
    pair = load_registry().get("qwen2.5-coder-1.5b")
    modes = ["none", "auto"] + (["likely"] if args.likely else [])
    rows = []
    rows_cheap = P.rows_cheap
    with Engine.load(str(local_path(pair.target)), drafter="none", n_ctx=4096, threads=2, cache_ram=0) as eng:
        V, tok = eng.n_vocab, tokenizer_for(eng.target)
        for it in S.load(None):
            ptoks = eng.chat_tokens([{"role": "user", "content": it["prompt"]}])
            out = eng.generate(ptoks, max_tokens=400, json_schema=it["schema"]).tokens
            c = Constraint.build(json_schema=it["schema"])
            res = {}
            for mode in modes:
                P.rows_cheap = (lambda _: True) if mode == "likely" else rows_cheap
                d = None if mode == "none" else AutoDrafter(P.Policy(costs), CopyDrafter(), None)
                res[mode] = S.replay(d, costs, Guide(c, tok, V), ptoks, out)[0]
            P.rows_cheap = rows_cheap
            res["ceiling"] = S.ceiling(costs, Guide(c, tok, V), ptoks, out)["ceiling"]
            rows.append((it["task"], res))
            print(f"{it['id']:20} {len(out):4} tokens  " + "  ".join(f"{k} {v:.3f}x" for k, v in res.items()),
                  flush=True)
    for task in dict.fromkeys(t for t, _ in rows):
        rs = [r for t, r in rows if t == task]
        print(f"mean {task:14} " + "  ".join(f"{k} {statistics.mean(r[k] for r in rs):.3f}x" for k in rs[0]))


if __name__ == "__main__":
    main()
