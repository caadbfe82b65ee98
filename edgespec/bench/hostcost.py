"""The host's share of a round, measured without a GPU (`bench --host-cost`).

edgespec's real engine, rounds and sampling run over a simulated device: `SimBackend`, whose passes
return logits rows recorded once from real GGUF models (a target and its draft at the same positions:
SmolLM2-135M at 49,152 tokens, Qwen2.5-Coder 1.5B / 0.5B at 151,936, gemma-3-270m at 262,144) and take
a settable time: a target pass feeding n tokens `a + b * n` ms (default 3 + 0.1, a 1.5B on a laptop
GPU), a draft step `draft` ms (default 1). The pass itself waits (the GIL released, as llama_decode
does); everything else a round does is the host's: reading rows, the sampling law, verification, the
constraint's masks, the loop's bookkeeping, the stream.

    efficiency = device time / wall time

per vocabulary, sampling setting, draft length k (0: plain decoding) and number of requests at once.
Beside it, per row, the host time of edgespec's law and draw against llama.cpp's own sampler chain
(`llama_sampler_*` through llama-cpp-python) on the same recorded rows.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..backend import CanonMarks
from ..errors import UsageError
from ..sampling import SamplingParams, greedy_token, row_law, sample

log = logging.getLogger("edgespec")

ROWS = 48  # recorded positions per model
STRUCTURED_ROWS = 200  # at most, under the schema (the whole answer)
PROMPT = ("Write a Python function that parses a CSV file of orders (id, customer, amount, date) and "
          "returns the total amount per customer for each month, with a docstring and type hints.")


@dataclass(frozen=True)
class Vocab:
    name: str
    pair: str                   # models.toml pair whose target is recorded
    draft: Optional[str]        # the pair's own draft ("draft"), or None: the target cut to `blocks`
    blocks: int = 0


VOCABS = {
    "49k": Vocab("49k", "smollm2-135m", None, 24),
    "152k": Vocab("152k", "qwen2.5-coder-1.5b", "draft"),
    "262k": Vocab("262k", "gemma-3-270m", None, 12),
}


@dataclass(frozen=True)
class Setting:
    name: str
    params: SamplingParams
    structured: bool = False  # under the extract-people schema

    @property
    def schema(self) -> Optional[dict]:
        return _people()[1] if self.structured else None


# a list of records: the structured case that ran slower than plain (issue 47), the benchmark's own
# `extract-people`; its prompt carries the schema, without which Qwen2.5-Coder-1.5B answers {"people":[]},
# and gemma-3-270m answers so with it: the first of these prompts whose answer lists the people is recorded
PEOPLE_ID = "extract-people"
PEOPLE_SHORT = (
    "Extract every person mentioned in this message as JSON with their name, email and phone.\n\n"
    "Hi team, for the vendor review please contact Dana Whitfield (dana.whitfield@northwind-labs.com, "
    "+1 415 555 0142) about the contract, Marcus Lee (marcus.lee@northwind-labs.com, +1 415 555 0178) "
    "about the hiring plan, Priya Raman (priya.raman@northwind-labs.com, +1 628 555 0109) about the budget "
    "and Tomas Ortega (t.ortega@harbor-freight.io, +1 510 555 0193) about shipping.\n\nJSON:")
LISTED = 64  # answer tokens at least: a list, not an empty one


@functools.lru_cache(maxsize=1)
def _people() -> tuple[str, dict]:
    """The extract-people prompt and schema of workloads/structured.jsonl."""
    from ..registry import workloads_path
    for line in (workloads_path().parent / "structured.jsonl").read_text(encoding="utf-8").splitlines():
        item = json.loads(line) if line.strip() else {}
        if item.get("id") == PEOPLE_ID:
            return item["prompt"], item["schema"]
    raise UsageError(f"workloads/structured.jsonl has no {PEOPLE_ID!r} prompt")


SETTINGS = {
    "greedy": Setting("T=0", SamplingParams()),
    "top-p": Setting("T=0.8 top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95)),
    "top-k": Setting("T=0.7 top-k 40 top-p 0.9", SamplingParams(temperature=0.7, top_k=40, top_p=0.9)),
    "min-p": Setting("T=0.8 min-p 0.05", SamplingParams(temperature=0.8, min_p=0.05)),
    "schema": Setting("T=0 JSON schema", SamplingParams(), structured=True),
}


# -- recorded rows ----------------------------------------------------------------------------------
def _paths(vocab: Vocab) -> tuple[Path, Path]:
    from ..hub import local_path
    from ..registry import load_registry
    pair = load_registry().get(vocab.pair)
    target = local_path(pair.target)
    if target is None:
        raise UsageError(f"{pair.target.file} is not downloaded: run `python -m edgespec pull {vocab.pair}` "
                         "(or `make test-models`)")
    if vocab.draft:
        draft = local_path(getattr(pair, vocab.draft))
        if draft is None:
            raise UsageError(f"the draft of {vocab.pair} is not downloaded: run `python -m edgespec pull {vocab.pair}`")
        return target, draft
    return target, truncated(target, vocab.blocks)


def truncated(target: Path, blocks: int) -> Path:
    """A copy of `target` that keeps its first `blocks` blocks (scripts/truncate_gguf.py: the same
    tokenizer, other predictions), made once in the model cache (the test suite's draft too)."""
    from ..registry import cache_dir
    stem = target.stem.split(".Q")[0]  # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct
    draft = cache_dir() / "models" / f"{stem}.first{blocks}.gguf"
    if not draft.exists():
        draft.parent.mkdir(parents=True, exist_ok=True)
        part = draft.with_name(f"{draft.name}.{os.getpid()}.part")  # test workers may write it at once
        script = Path(__file__).resolve().parents[2] / "scripts" / "truncate_gguf.py"
        subprocess.run([sys.executable, str(script), str(target), str(part), "--blocks", str(blocks)],
                       check=True, stdout=subprocess.DEVNULL)
        os.replace(part, draft)
    return draft


def _answer(target, tokens: list, structured: bool) -> list:
    """The target's rows along its greedy answer (appended to `tokens`), under the extract-people schema or not."""
    guide = None
    if structured:
        from ..constraints import Constraint, Guide, tokenizer_for
        guide = Guide(Constraint.build(json_schema=_people()[1]), tokenizer_for(target), target.n_vocab)
    target.reset()
    rows = [target.eval(tokens, [len(tokens) - 1])[0]]
    while len(rows) < (STRUCTURED_ROWS if structured else ROWS):
        if guide is not None:
            nxt = greedy_token(rows[-1], guide.allowed())
            if target.is_eog(nxt):
                break
            guide.advance([nxt])
        else:  # the argmax, an end of generation too: the simulation never ends, its rows are real
            nxt = greedy_token(rows[-1])
        tokens.append(nxt)
        rows.append(target.eval([nxt], [0])[0])
    return rows


def recorded(vocab: Vocab, progress: Optional[Callable[[str], None]] = None, structured: bool = False) -> dict:
    """The rows of `vocab`'s target and draft along the target's greedy answer to PROMPT (ROWS of
    them), or with `structured` to the extract-people workload under its schema (the whole answer, at most
    STRUCTURED_ROWS), recorded from the GGUFs on first use and kept under ~/.cache/edgespec/hostcost.
    Row 0 is the prompt's last position."""
    from ..backend import LlamaBackend
    from ..registry import cache_dir
    target_path, draft_path = _paths(vocab)
    kind = f"-{PEOPLE_ID}" if structured else ""
    out = cache_dir() / "hostcost" / f"{vocab.name}{kind}-{target_path.stem}-{draft_path.stem}.npz"
    if not out.exists():
        if progress:
            progress(f"recording logits rows of {target_path.name} and {draft_path.name}"
                     f"{' under a JSON schema' if structured else ''} (once)")
        from ..engine import Engine
        target = LlamaBackend(target_path, n_ctx=1024)
        try:
            for text in ((_people()[0], PEOPLE_SHORT) if structured else (PROMPT,)):
                # through the chat template: an instruct model answers at length (a raw prompt may end at once)
                tokens = Engine(target).chat_tokens([{"role": "user", "content": text}])
                prompt_len = len(tokens)
                rows = _answer(target, tokens, structured)
                if len(rows) > LISTED:
                    break
        finally:
            target.close()
        draft = LlamaBackend(draft_path, n_ctx=1024)
        try:
            drows = draft.eval(tokens, list(range(prompt_len - 1, len(tokens))))
        finally:
            draft.close()
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(f"{out.name}.{os.getpid()}.part.npz")
        np.savez(part, target=np.stack(rows), draft=drows, tokens=np.array(tokens, np.int64),
                 prompt_len=np.int64(prompt_len))
        os.replace(part, out)
    with np.load(out) as f:
        return {"target": f["target"], "draft": f["draft"], "tokens": f["tokens"].tolist(),
                "prompt_len": int(f["prompt_len"]), "target_path": target_path, "draft_path": draft_path}


# -- the simulated device ---------------------------------------------------------------------------
_precise = threading.local()


def _fine_timer() -> None:
    """Linux wakes a sleeping thread up to its timer slack (50 us by default) late, and each
    `time.sleep(0)` costs as much: the device's own lateness, which would count as the host's. The
    thread that waits for the simulated device asks for 1 ns (prctl PR_SET_TIMERSLACK), once."""
    if getattr(_precise, "set", False):
        return
    _precise.set = True
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(29, ctypes.c_ulong(1), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _wait(seconds: float) -> None:
    """The device's time: asleep (the GIL free, as in llama_decode) until 0.3 ms before the end, then
    yielding until it (a sleep alone overshoots by 0.02-1 ms, which would count as device time)."""
    _fine_timer()
    end = time.perf_counter() + seconds
    if seconds > 0.0003:
        time.sleep(seconds - 0.0003)
    while time.perf_counter() < end:
        time.sleep(0)


class SimBackend(CanonMarks):
    """A Backend whose passes return recorded rows (row of position p: rows[(p - offset) % len(rows)]) and
    wait `a_ms + b_ms * tokens fed`; the tokenizer is the real model's (`vocab`, a LlamaBackend).
    `busy`: the seconds its passes took (their nominal times). End of generation never comes (the answer runs to its
    budget)."""

    canonical_piece = 64
    canonical_tile = 0  # slots.tile_of: the grid

    def __init__(self, vocab, rows: np.ndarray, a_ms: float, b_ms: float, n_seq: int = 1, name: str = "sim",
                 offset: int = 0):
        self.vocab, self.rows = vocab, np.ascontiguousarray(rows, dtype=np.float32)
        self.offset = offset  # the position of row 0
        self.a, self.b = a_ms / 1000.0, b_ms / 1000.0
        self.n_vocab = self.rows.shape[1]
        self.n_ctx, self.n_seq, self.n_batch = 4096, n_seq, 512
        self.path = Path(f"{name}.gguf")
        self.can_truncate = True
        self.settings = {"sim": name}
        self._held: list[list[int]] = [[] for _ in range(n_seq)]
        self._canon = [0] * n_seq  # backend.CanonMarks
        self.busy = 0.0
        self.passes = 0
        self.fed: list[int] = []  # tokens fed, per pass
        self._lock = threading.Lock()

    # the tokenizer's calls go to the real model's vocabulary
    def tokenize(self, text, add_bos=True, special=True):
        return self.vocab.tokenize(text, add_bos, special)

    def token_to_piece(self, token, special=False):
        return self.vocab.token_to_piece(token, special)

    def token_text(self, token):
        return self.vocab.token_text(token)

    def chat_template(self):
        return self.vocab.chat_template()

    def guidance_tokenizer(self):  # called under constraints.tokenizer_for's lock
        tok = getattr(self.vocab, "_llg_tokenizer", None)
        if tok is None:  # built once per vocabulary, as for a loaded model
            tok = self.vocab._llg_tokenizer = self.vocab.guidance_tokenizer()
        return tok

    def __getattr__(self, name):  # the rest of the tokenizer's surface (longest_piece, special_texts, ...)
        if name in ("vocab", "rows"):
            raise AttributeError(name)
        return getattr(self.vocab, name)

    def is_eog(self, token):
        return False

    @property
    def tokens(self):
        return self._held[0]

    @property
    def n_past(self):
        return len(self._held[0])

    def held(self, seq=0):
        return self._held[seq]

    def sequence(self, seq):
        from ..backend import SequenceView
        return SequenceView(self, seq)

    def eval(self, tokens, rows, seq=0):
        return self.eval_batch([(seq, tokens, rows)])[0]

    lends_rows = True  # as LlamaBackend: copy=False returns views of the "device's" output

    def eval_batch(self, parts, copy: bool = True):
        from ..backend import _compute
        outs, fed = [], 0
        n = len(self.rows)
        for seq, tokens, rows in parts:
            base = len(self._held[seq])
            if base + len(tokens) > self.n_ctx:
                raise UsageError("the simulated context is full")
            got = [self.rows[(base + r - self.offset) % n] for r in rows]  # read as llama_get_logits_ith is
            outs.append(np.array(got, dtype=np.float32).reshape(len(rows), self.n_vocab) if copy else got)
            fed += len(tokens)
        t = self.a + self.b * fed
        _compute.call(_wait, t)
        with self._lock:
            self.busy += t
            self.passes += 1
            self.fed.append(fed)
        for seq, tokens, _ in parts:
            self._held[seq].extend(int(t) for t in tokens)
        return outs

    def abort_when(self, stop):
        import contextlib
        return contextlib.nullcontext()

    def truncate(self, pos, seq=0):
        del self._held[seq][pos:]
        self._cut_canon(seq, pos)
        return True

    def pos_max(self, seq=0):
        return len(self._held[seq]) - 1

    def reset(self, seq=None):
        for s in (range(self.n_seq) if seq is None else [seq]):
            self._held[s].clear()
            self._cut_canon(s)

    def keep_prefix(self, tokens, seq=0):
        held = self._held[seq]
        n = 0
        for a, b in zip(held, tokens[:-1]):
            if a != b:
                break
            n += 1
        self.truncate(n, seq)
        return n

    def copy_prefix(self, src, dst, n):
        n = min(n, len(self._held[src]))
        self._held[dst][:] = self._held[src][:n]
        self._copy_canon(src, dst)
        return n

    def close(self):
        pass


# -- one configuration --------------------------------------------------------------------------------
@dataclass
class Run:
    vocab: str
    setting: str
    k: int
    parallel: int
    tokens: int
    wall: float
    device: float

    @property
    def efficiency(self) -> float:
        return self.device / self.wall if self.wall > 0 else 0.0


def run_once(rec: dict, vocab_backend, setting: Setting, k: int, parallel: int, tokens: int,
             a_ms: float, b_ms: float, draft_ms: float, vocab_name: str = "") -> Run:
    """One generation of `tokens` tokens per request (`parallel` requests at once) through the real
    Engine over the simulated target and draft; wall and device time of the whole."""
    from ..drafters.model import ModelDrafter
    from ..engine import Engine
    offset = rec["prompt_len"] - 1
    target = SimBackend(vocab_backend, rec["target"], a_ms, b_ms, n_seq=parallel, name="target", offset=offset)
    draft = SimBackend(vocab_backend, rec["draft"], draft_ms, 0.0, n_seq=parallel, name="draft",
                       offset=offset) if k else None
    width = max(target.n_vocab, draft.n_vocab if draft else 0)
    engine = Engine(target, ModelDrafter(draft, width, gamma=k) if k else None,
                    parallel=parallel if parallel > 1 else None)
    prompt = rec["tokens"][:rec["prompt_len"]]
    opts = dict(max_tokens=tokens, temperature=setting.params.temperature, top_k=setting.params.top_k,
                top_p=setting.params.top_p, min_p=setting.params.min_p, seed=1234)
    if setting.schema is not None:
        opts["json_schema"] = setting.schema
    results = [None] * parallel
    try:
        engine.generate(prompt, **{**opts, "max_tokens": 2})  # first use apart (the grammar's tokenizer)
        for be in (target, draft):
            if be is not None:
                be.busy = 0.0

        def one(i):
            results[i] = engine.generate(prompt, **opts)

        t0 = time.perf_counter()
        if parallel == 1:
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(parallel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    n = sum(len(r.tokens) for r in results if r is not None)
    return Run(vocab_name, setting.name, k, parallel, n, wall, target.busy + (draft.busy if draft else 0.0))


# -- per row: edgespec's law against llama.cpp's sampler chain ------------------------------------------
def _llama_chain(params: SamplingParams):
    import llama_cpp as L
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if params.greedy:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        return chain
    if params.top_k:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(params.min_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(params.temperature))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(1234))
    return chain


def per_row(rows: np.ndarray, params: SamplingParams, repeat: int = 3) -> dict:
    """Median microseconds a row: edgespec's law and draw (greedy: the argmax) and llama.cpp's chain
    (its candidates array filled from the row, then the chain applied and a token drawn), the one that
    reads a row first alternating."""
    import ctypes

    import llama_cpp as L
    rng = np.random.default_rng(0)
    ours, theirs = [], []
    n = rows.shape[1]
    data = np.zeros(n, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    ids = np.arange(n, dtype=np.int32)
    arr = L.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=n,
                                   selected=-1, sorted=False)
    chain = _llama_chain(params)

    def edgespec(row):
        t0 = time.perf_counter()
        if params.greedy:
            greedy_token(row)
        else:
            sample(row_law(row, params), rng)
        ours.append(time.perf_counter() - t0)

    def llama(row):
        t0 = time.perf_counter()
        data["id"] = ids
        data["logit"] = row
        arr.size, arr.selected, arr.sorted = n, -1, False
        L.llama_sampler_apply(chain, ctypes.byref(arr))
        theirs.append(time.perf_counter() - t0)

    try:
        for r in range(repeat):
            for i, row in enumerate(rows):  # who reads the row first (from memory, not the cache) alternates
                first, second = (edgespec, llama) if (i + r) % 2 == 0 else (llama, edgespec)
                first(row)
                second(row)
    finally:
        L.llama_sampler_free(chain)
    return {"edgespec_us": statistics.median(ours) * 1e6, "llama_cpp_us": statistics.median(theirs) * 1e6}


# -- the benchmark -------------------------------------------------------------------------------------
def _list(text: str, what: str, cast=str) -> tuple:
    try:
        out = tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} takes a comma-separated list, got {text!r}") from None
    if not out:
        raise UsageError(f"{what} is empty")
    return out


def options(args) -> dict:
    """`bench --host-cost`'s options from the command line, checked (UsageError names the bad one)."""
    a_b = _list(args.device_ms, "--device-ms", float)
    if len(a_b) != 2 or a_b[0] <= 0 or a_b[1] < 0:
        raise UsageError(f"--device-ms takes A,B: a target pass costs A + B ms a token fed (A > 0, B >= 0), "
                         f"got {args.device_ms!r}")
    if not args.draft_ms > 0:
        raise UsageError(f"--draft-ms must be > 0, got {args.draft_ms}")
    ks = _list(args.host_k, "--host-k", int)
    if any(not 0 <= k <= 16 for k in ks):
        raise UsageError(f"--host-k draft lengths must be in 0..16, got {args.host_k}")
    parallels = _list(args.host_parallel, "--host-parallel", int)
    if any(not 1 <= p <= 8 for p in parallels):
        raise UsageError(f"--host-parallel takes 1..8 requests at once, got {args.host_parallel}")
    trials = 5 if args.trials == 1 else args.trials  # bench's default is 1: as --peer's 2, one trial says little
    tokens = args.bench_tokens if args.bench_tokens is not None else 64
    if trials < 1 or tokens < 1:
        raise UsageError("--trials and --max-tokens must be >= 1")
    out = args.out if args.out != "bench-results/bench.json" else "bench-results/host-cost.json"
    return dict(vocabs=_list(args.vocabs, "--vocabs"), settings=_list(args.settings, "--settings"), ks=ks,
                parallels=parallels, trials=trials, tokens=tokens, a_ms=a_b[0], b_ms=a_b[1],
                draft_ms=args.draft_ms, out=out)


def add_arguments(p) -> None:
    g = p.add_argument_group("--host-cost (the host's share of a round over a simulated device; no GPU needed)")
    g.add_argument("--host-cost", action="store_true",
                   help="instead: edgespec's rounds over recorded logits rows and a simulated device; efficiency = "
                   "device time / wall time, and per row edgespec's law against llama.cpp's sampler chain "
                   "(--trials defaults to 5 and takes at least 2, --max-tokens defaults to 64)")
    g.add_argument("--device-ms", default="3,0.1", metavar="A,B",
                   help="a simulated target pass costs A + B ms a token fed (default 3,0.1: a 1.5B on a laptop GPU)")
    g.add_argument("--draft-ms", type=float, default=1.0, metavar="MS", help="a simulated draft step (default 1)")
    g.add_argument("--vocabs", default="49k,152k,262k", metavar="V1,V2",
                   help="vocabularies: " + ", ".join(f"{k} ({v.pair})" for k, v in VOCABS.items()))
    g.add_argument("--settings", default=",".join(SETTINGS), metavar="S1,S2",
                   help="sampling settings: " + ", ".join(f"{k} ({v.name})" for k, v in SETTINGS.items()))
    g.add_argument("--host-k", default="0,1,4,8", metavar="K1,K2", help="draft lengths (0: plain decoding)")
    g.add_argument("--host-parallel", default="1,4", metavar="P1,P2", help="requests at once")


def main(*, vocabs=("49k", "152k", "262k"), settings=tuple(SETTINGS), ks=(0, 1, 4, 8), parallels=(1, 4),
         trials: int = 5, tokens: int = 64, a_ms: float = 3.0, b_ms: float = 0.1, draft_ms: float = 1.0,
         out: Optional[str] = None, progress=None, say=log.info) -> dict:
    """Every configuration, interleaved trials; `progress(Progress)` after each run. Returns the report
    (written as JSON to `out`)."""
    from ..backend import LlamaBackend
    from ..progress import report as tell
    for v in vocabs:
        if v not in VOCABS:
            raise UsageError(f"unknown vocabulary {v!r}: choose from {', '.join(VOCABS)}")
    for s in settings:
        if s not in SETTINGS:
            raise UsageError(f"unknown setting {s!r}: choose from {', '.join(SETTINGS)}")
    report = {"device": {"target_ms": [a_ms, b_ms], "draft_ms": draft_ms}, "trials": trials,
              "tokens": tokens, "runs": [], "rows": []}
    total = len(vocabs) * (len(settings) * len(ks) * len(parallels) * trials + len(settings))
    done = 0
    for vname in vocabs:
        rec = recorded(VOCABS[vname], progress=lambda m: say(m))
        people = recorded(VOCABS[vname], progress=lambda m: say(m), structured=True) if "schema" in settings else None
        vocab_backend = LlamaBackend(rec["draft_path"], n_ctx=256, n_batch=64)
        try:
            for sname in settings:
                setting = SETTINGS[sname]
                r = per_row(rec["target"], setting.params)
                report["rows"].append({"vocab": vname, "setting": setting.name, **r})
                done += 1
                tell(progress, "host-cost", done, total, "steps", f"{vname} per row")
            configs = [(s, k, p) for s in settings for k in ks for p in parallels]
            runs: dict = {c: [] for c in configs}
            for _ in range(trials):  # interleaved: each trial runs every configuration once
                for c in configs:
                    s, k, p = c
                    runs[c].append(run_once(people if SETTINGS[s].schema else rec, vocab_backend, SETTINGS[s], k, p,
                                            tokens, a_ms, b_ms, draft_ms, vname))
                    done += 1
                    tell(progress, "host-cost", done, total, "steps", f"{vname} {s} k={k} x{p}")
            for (s, k, p), got in runs.items():
                eff = statistics.median(r.efficiency for r in got)
                wall = statistics.median(r.wall / max(1, r.tokens) for r in got)
                dev = statistics.median(r.device / max(1, r.tokens) for r in got)
                report["runs"].append({"vocab": vname, "setting": SETTINGS[s].name, "k": k, "parallel": p,
                                       "efficiency": round(eff, 4), "wall_ms_per_token": round(wall * 1e3, 3),
                                       "device_ms_per_token": round(dev * 1e3, 3),
                                       "host_ms_per_token": round((wall - dev) * 1e3, 3),
                                       "trials": [round(r.efficiency, 4) for r in got]})
        finally:
            vocab_backend.close()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def format_report(report: dict) -> str:
    lines = [f"simulated device: target pass {report['device']['target_ms'][0]} ms + "
             f"{report['device']['target_ms'][1]} ms a token fed, draft step {report['device']['draft_ms']} ms; "
             f"medians of {report['trials']} interleaved trials, {report['tokens']} tokens a request",
             "", f"{'vocab':>6} {'setting':<26} {'k':>2} {'par':>3} {'efficiency':>10} {'wall ms/tok':>11} "
             f"{'host ms/tok':>11}"]
    for r in report["runs"]:
        lines.append(f"{r['vocab']:>6} {r['setting']:<26} {r['k']:>2} {r['parallel']:>3} {r['efficiency']:>10.1%} "
                     f"{r['wall_ms_per_token']:>11.3f} {r['host_ms_per_token']:>11.3f}")
    lines += ["", "per row (median us): edgespec's law and draw against llama.cpp's sampler chain",
              f"{'vocab':>6} {'setting':<26} {'edgespec':>9} {'llama.cpp':>9} {'ratio':>6}"]
    for r in report["rows"]:
        lines.append(f"{r['vocab']:>6} {r['setting']:<26} {r['edgespec_us']:>9.1f} {r['llama_cpp_us']:>9.1f} "
                     f"{r['edgespec_us'] / r['llama_cpp_us']:>6.2f}")
    return "\n".join(lines)
