"""Replay auto over the Qwen pair's constrained T = 0 answers with a fixed cost curve (DESIGN 2c): forced-only
drafting against drafting the usual tokenization of forced bytes, beside the hindsight ceiling. Deterministic:
no timing, so it means something on a busy machine. `python scripts/replay_structured.py`."""
import numpy as np
from edgespec import Engine
from edgespec.bench import structured as S
from edgespec.constraints import Guide, Constraint, tokenizer_for
from edgespec.policy import Costs, Policy
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.copy import CopyDrafter
from edgespec.hub import local_path
from edgespec.registry import load_registry
pair = load_registry().get("qwen2.5-coder-1.5b")
ks, ms = [1, 2, 4, 8, 16], [30, 59, 99, 222, 264]
curve = tuple(float(np.interp(k, ks, ms)) / 1000 if k <= 16 else 0.264 + (k - 16) * 0.010 for k in range(1, 33))
costs = Costs(curve, draft_step=0.6 * 0.030)
items = S.load(None)
with Engine.load(str(local_path(pair.target)), drafter="none", n_ctx=4096, threads=2, cache_ram=0) as eng:
    V = eng.n_vocab
    tok = tokenizer_for(eng.target)
    for it in items:
        schema = it["schema"]
        ptoks = eng.chat_tokens([{"role": "user", "content": it["prompt"]}])
        r = eng.generate(ptoks, max_tokens=300, json_schema=schema)
        out = r.tokens
        c = Constraint.build(json_schema=schema)
        res = {}
        for mode in ("forced", "likely"):
            g = Guide(c, tok, V)
            if mode == "forced":
                g.likely = g.forced
            d = AutoDrafter(Policy(costs), CopyDrafter(), None)
            ratio, got = S.replay(d, costs, g, ptoks, out)
            res[mode] = (round(ratio, 3), got)
        ce = S.ceiling(costs, Guide(c, tok, V), ptoks, out)
        print(it["id"], len(out), res, {k: round(v, 3) for k, v in ce.items()}, flush=True)
