"""Measure, once per model and setting, what a verifying pass costs on this device.

The result is cached as JSON under ~/.cache/edgespec/calibration/, keyed by everything that
changes the figures: the model files (path, size, mtime), GPU layers, threads, flash attention
and the llama-cpp-python version. `python -m edgespec calibrate` redoes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from .policy import Costs
from .registry import cache_dir
from .sampling import SamplingParams, warp

MAX_ROWS = 32
FILLER = "The quick brown fox jumps over the lazy dog while the compiler checks every line. "


def _model_key(backend) -> dict:
    st = os.stat(backend.path)
    # n_ctx is left out: it barely moves the cost of a pass, and recalibrating for every
    # context size would cost a user 20 s each time
    settings = {k: v for k, v in backend.settings.items() if k != "n_ctx"}
    return {"path": str(os.path.abspath(backend.path)), "size": st.st_size, "mtime": st.st_mtime_ns, **settings}


def calibration_key(target, draft=None, max_rows: int = MAX_ROWS) -> dict:
    try:
        from llama_cpp import __version__ as lcpp
    except ImportError:  # pragma: no cover
        lcpp = "?"
    return {"target": _model_key(target), "draft": _model_key(draft) if draft else None,
            "max_rows": max_rows, "llama_cpp_python": lcpp, "format": 1}


def _key_path(key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "calibration" / f"{digest}.json"


def _timed(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _row_overhead(n_vocab: int) -> float:
    """Python-side cost of one verified row: warping and sampling float32 logits."""
    row = np.random.default_rng(0).normal(0, 3, n_vocab).astype(np.float32)
    return _timed(lambda: warp(row, SamplingParams(1.0)), 5)


def measure(target, draft=None, *, max_rows: int = MAX_ROWS, reps: int = 2, progress=None) -> Costs:
    """Time target passes returning logits for k = 1..max_rows rows, and one draft step."""
    max_rows = max(1, min(max_rows, target.n_ctx // 2))
    filler = target.tokenize(FILLER * 8, add_bos=True)[:min(64, target.n_ctx - max_rows)]
    batch = (target.tokenize(FILLER * 8, add_bos=False) * 2)[:max_rows]
    target.reset()
    target.eval(filler, [])
    base = target.n_past
    per_row = _row_overhead(target.n_vocab)

    def verify(k):
        target.truncate(base)
        target.eval(batch[:k], range(k))

    verify(4)  # warm-up: kernels, buffers
    costs = []
    for k in range(1, max_rows + 1):
        costs.append(_timed(lambda: verify(k), reps) + k * per_row)
        if progress:
            progress(k, max_rows)
    target.reset()
    draft_step = None
    if draft is not None:
        draft.reset()
        draft.eval(filler, [])
        dbase = draft.n_past

        def step():
            draft.truncate(dbase)
            draft.eval(batch[:1], [0])
        step()
        draft_step = _timed(step, reps * 3) + _row_overhead(draft.n_vocab)
        draft.reset()
    return Costs(verify=tuple(costs), draft_step=draft_step)


def _progress(k: int, n: int) -> None:
    # a progress line for people; scripts reading stderr get only what they asked for
    if sys.stderr.isatty():
        print(f"\rcalibrating on this device (once per model and setting): target pass {k}/{n}",
              end="" if k < n else "\n", file=sys.stderr, flush=True)


def load_or_measure(target, draft=None, *, force: bool = False, quiet: bool = False) -> Costs:
    key = calibration_key(target, draft)
    path = _key_path(key)
    if not force and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return Costs(verify=tuple(data["verify"]), draft_step=data["draft_step"])
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: measure again
    costs = measure(target, draft, progress=None if quiet else _progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "verify": list(costs.verify), "draft_step": costs.draft_step},
                              indent=1))
    os.replace(tmp, path)
    return costs
