"""Measure, once per model and setting, what a verifying pass costs on this device.

The result is cached as JSON under ~/.cache/edgespec/calibration/, keyed by everything that
changes the figures: the model files (path, size, mtime), GPU layers, threads, flash attention
and the llama-cpp-python version. `python -m edgespec calibrate` redoes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from .policy import Costs
from .progress import log, report
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


def _read_cached(path, key) -> Costs | None:
    """The cached figures, or None when the file is missing, unreadable or of another shape."""
    try:
        data = json.loads(path.read_text())
        verify, step = data["verify"], data["draft_step"]
        ok = (data.get("key") == key and isinstance(verify, list) and verify
              and all(isinstance(v, (int, float)) and 0 < v < 60 for v in verify)
              and (step is None or (isinstance(step, (int, float)) and 0 < step < 60)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Costs(verify=tuple(float(v) for v in verify), draft_step=step) if ok else None


def load_or_measure(target, draft=None, *, force: bool = False, progress=None) -> Costs:
    """Cached figures for this model and setting, else measure (and cache when the cache is
    writable). `progress` receives `Progress("calibrate", k, n, "steps")` reports."""
    key = calibration_key(target, draft)
    path = _key_path(key)
    if not force:
        cached = _read_cached(path, key)
        if cached is not None:
            return cached
    costs = measure(target, draft, progress=(lambda k, n: report(progress, "calibrate", k, n, "steps",
                                                                   f"target pass with {k} rows")))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "verify": list(costs.verify), "draft_step": costs.draft_step},
                                  indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache the calibration in %s (%s): it will be measured again next time; "
                    "set EDGESPEC_CACHE to a writable folder", path.parent, exc.strerror or exc)
    return costs


def provisional(target, draft=None) -> Costs:
    """Figures to start from when nothing was measured: each verified row costs a whole step,
    so nothing is drafted until the passes the engine runs show otherwise."""
    return Costs(verify=tuple(0.05 * k for k in range(1, MAX_ROWS + 1)),
                 draft_step=0.05 if draft is not None else None)


def cached(target, draft=None) -> Costs | None:
    """The cached figures for this model and setting, without measuring."""
    key = calibration_key(target, draft)
    return _read_cached(_key_path(key), key)
