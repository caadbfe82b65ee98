"""Measure, once per model and setting, what a verifying pass costs on this device.

The result is cached as JSON under ~/.cache/edgespec/calibration/, keyed by everything that
changes the figures: the model files (path, size, mtime), GPU layers, threads, flash attention
and the llama-cpp-python version. `python -m edgespec calibrate` redoes it.

A snapshot taken while something else loads the machine is wrong by up to 60x (llama.cpp's
threads wait on each other when a core is taken), and it would decide every later run. So:
passes are timed after a warm-up that lasts until their times settle, in interleaved sweeps
over a sample of row counts (the rest interpolated), each figure the median of its sweeps;
a sweep during which other processes used the CPU (psutil) is measured again, and so is a
result that contradicts itself (a 1-row pass costing more than a bigger one, repeats that
disagree). What still fails is stored as *provisional*: used, corrected online by the engine
(costs.OnlineCosts), and measured again at the next load.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable, Optional

import numpy as np

from .cachefile import read_text
from .costs import Costs
from .progress import log, report
from .registry import cache_dir
from .sampling import SamplingParams, warp

MAX_ROWS = 32
# row counts timed; the others are interpolated. 15 and 16 bracket a kernel change seen on CPUs
# (a 16-row pass can cost less than a 15-row one); the engine's passes correct what is missed
SAMPLE_ROWS = (1, 2, 3, 4, 6, 8, 12, 15, 16, 24, 32)
SWEEPS = 3             # interleaved sweeps over the sample; a figure is the median of its sweeps
MAX_SWEEPS = 6         # sweeps at most, when some were disturbed or disagree
TIME_BUDGET = 30.0     # seconds after which what was measured is taken (twice that to replace disturbed sweeps)
WARM_BUDGET = 4.0      # seconds of warm-up at most
WAIT = 3.0             # seconds to wait for other load to pass before concluding the machine is busy
SETTLE = 0.15          # warm-up ends when the last three passes of a size are within 15% of each other
SPREAD = 1.5           # sweeps of one row count that differ by more than this factor disagree
CATCH_UP_BATCH = 16    # tokens the draft model evaluates at once to time its catching up
REMEASURE = 3          # loads that measure a provisional calibration again before it is kept as is
FILLER = "The quick brown fox jumps over the lazy dog while the compiler checks every line. "
FORMAT = 2
WARM_STEPS = 4         # progress steps the warm-up counts for, however many passes it takes


# -- other load on the machine ------------------------------------------------------------------
class LoadMeter:
    """CPU time that other processes (and the hypervisor) took since `reset`, from psutil."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        try:
            import psutil
            self._psutil = psutil
            self._start = (time.perf_counter(), psutil.cpu_times(), psutil.Process().cpu_times())
        except Exception:  # psutil missing or /proc unreadable: no opinion
            self._start = None

    @staticmethod
    def _busy(c) -> float:
        # guest time is already inside user time on Linux; steal is time another VM took
        return (sum(c) - c.idle - getattr(c, "iowait", 0.0) - getattr(c, "guest", 0.0)
                - getattr(c, "guest_nice", 0.0))

    def others(self) -> Optional[float]:
        """Cores' worth of CPU used by others since reset (None when unknown)."""
        if self._start is None:
            return None
        try:
            t0, sys0, own0 = self._start
            wall = time.perf_counter() - t0
            sys1, own1 = self._psutil.cpu_times(), self._psutil.Process().cpu_times()
        except Exception:
            return None
        if wall < 0.2:  # CPU times tick every 10 ms: too short a span says nothing
            return None
        own = (own1.user + own1.system) - (own0.user + own0.system)
        return max(0.0, (self._busy(sys1) - self._busy(sys0) - own) / wall)


def contention_limit(threads: int) -> float:
    """Other load (in cores) above which our threads must share cores: what the machine has
    beyond our threads, plus a quarter core of background noise."""
    try:
        cores = os.cpu_count() or 1
    except Exception:  # pragma: no cover
        cores = 1
    return max(0.0, cores - threads) + 0.25


# -- the cache key --------------------------------------------------------------------------------
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
    from .selftest import build_key
    # the build too: the same version built for other instruction sets (AMX, CUDA) runs at another speed
    return {"target": _model_key(target), "draft": _model_key(draft) if draft else None,
            "max_rows": max_rows, "llama_cpp_python": lcpp, "build": build_key(), "format": FORMAT}


def _key_path(key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "calibration" / f"{digest}.json"


def cached_calibrations() -> list[dict]:
    """What each cached calibration is for (`doctor` lists them): its models, threads, a target step."""
    rows = []
    for f in sorted((cache_dir() / "calibration").glob("*.json")):
        text = read_text(f)  # regular files of bounded size only, as every cache read
        try:
            data = json.loads(text) if text is not None else None
            key, verify = data["key"], data["verify"]
            target, draft = key["target"], key.get("draft")
            rows.append({"target": os.path.basename(target["path"]),
                         "draft": os.path.basename(draft["path"]) if draft else None,
                         "threads": target.get("threads"), "step_ms": 1000 * float(verify[0]),
                         "source": data.get("source") or "measured", "file": str(f)})
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            continue  # not ours, or damaged: measured again when it is needed
    return rows


# -- measuring -----------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Figures and where they came from."""

    costs: Costs
    source: str                 # "calibrated" (measured now), "cached", "corrected online" (cached,
                                # written back by the engine), "defaults" (nothing measured)
    provisional: bool = False   # doubtful: measured under load or self-contradictory
    info: dict = field(default_factory=dict)


def _row_overhead(n_vocab: int, clock=time.perf_counter) -> float:
    """Python-side cost of one verified row: warping and sampling float32 logits."""
    row = np.random.default_rng(0).normal(0, 3, n_vocab).astype(np.float32)
    times = []
    for _ in range(5):
        t = clock()
        warp(row, SamplingParams(1.0))
        times.append(clock() - t)
    return median(times)


def _interpolate(points: dict[int, float], max_rows: int) -> list[float]:
    ks = sorted(points)
    out = []
    for k in range(1, max_rows + 1):
        if k in points:
            out.append(points[k])
            continue
        lo = max((x for x in ks if x < k), default=ks[0])
        hi = min((x for x in ks if x > k), default=ks[-1])
        out.append(points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo))
    return out


def _settled(times: list[float]) -> bool:
    last = times[-3:]
    return len(last) == 3 and max(last) <= (1 + SETTLE) * min(last)


def measure(target, draft=None, *, max_rows: int = MAX_ROWS, rows: tuple[int, ...] = SAMPLE_ROWS,
            sweeps: int = SWEEPS, max_sweeps: int = MAX_SWEEPS, time_budget: float = TIME_BUDGET,
            progress: Optional[Callable[[int, int, str], None]] = None, clock=time.perf_counter,
            meter: Optional[LoadMeter] = None, sleep=time.sleep) -> Calibration:
    """Time target passes returning logits for a sample of row counts (the rest interpolated)
    and draft steps, robustly: see the module's docstring. `progress(done, total, detail)`."""
    m = _Measurement(target, draft, max_rows, rows, sweeps, time_budget, progress, clock, meter or LoadMeter())
    m.warm_up()
    busy = m.wait_for_quiet(sleep)
    if busy:
        cal = _under_load(target, draft, m.warm, m.max_rows, busy, clock() - m.t_start)
        m.finish()
        return cal
    m.sweep(max_sweeps)
    m.again()
    cal = m.result()
    m.finish()
    return cal


class _Measurement:
    """One calibration's passes and what they gave: `measure` runs its phases in order (warm-up,
    a wait for a quiet machine, sweeps over the sampled row counts, a second look at the counts whose
    repeats disagree, the figures)."""

    def __init__(self, target, draft, max_rows, rows, sweeps, time_budget, progress, clock, meter):
        self.target, self.draft, self.clock, self.meter, self.progress = target, draft, clock, meter, progress
        self.max_rows = max_rows = max(1, min(max_rows, target.n_ctx // 2))
        self.sample = sorted({k for k in rows if k <= max_rows} | {1, max_rows})
        self.sweeps, self.time_budget = sweeps, time_budget
        filler = target.tokenize(FILLER * 8, add_bos=True)[:min(64, target.n_ctx - max_rows)]
        self.batch = (target.tokenize(FILLER * 8, add_bos=False) * 2)[:max_rows]
        self.limit = contention_limit(getattr(target, "threads", None) or os.cpu_count() or 1)
        self.t_start = clock()
        target.reset()
        target.eval(filler, [])
        self.base = target.n_past
        self.dbase = None
        if draft is not None:
            draft.reset()
            draft.eval(filler, [])
            self.dbase = draft.n_past
        self.clean: list[bool] = []  # per sweep: did it run without other processes taking the CPU
        self.seen: list[dict[int, list[float]]] = []  # per sweep: row count -> its timings
        self.steps: list[float] = []
        self.batches: list[float] = []  # the draft model catching up on CATCH_UP_BATCH tokens at once
        self.loads: list[Optional[float]] = []
        self.warm: dict[int, list[float]] = {}
        # the progress total is fixed by the first report (a bar that grows goes backwards): the
        # warm-up and the planned sweeps; passes beyond the plan close in on it, the end reaches it
        self.planned = len(self.sample) * sweeps + WARM_STEPS
        self.done = 0

    # -- one pass, one step, the bar ------------------------------------------------------------
    def verify(self, k: int) -> float:
        self.target.truncate(self.base)
        t = self.clock()
        self.target.eval(self.batch[:k], range(k))
        return self.clock() - t

    def step(self, n: int = 1) -> float:
        self.draft.truncate(self.dbase)
        t = self.clock()
        self.draft.eval(self.batch[:n], [n - 1])
        return self.clock() - t

    def tick(self, detail: str, warming: bool = False) -> None:
        self.done = min(self.done + 1, WARM_STEPS - 1) if warming else self.done + 1
        if self.progress:
            self.progress(_shown(self.done, self.planned), self.planned, detail)

    def finish(self) -> None:
        if self.progress:
            self.progress(self.planned, self.planned, "done")

    def over_budget(self) -> bool:
        # until two sweeps ran undisturbed, up to twice the budget: a busy spell may pass
        budget = self.time_budget if sum(self.clean) >= 2 else 2 * self.time_budget
        return self.clock() - self.t_start > budget

    # -- the phases -------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Kernels, buffers, CPU clocks: until a small and a large pass both settle."""
        self.meter.reset()
        self.warm = {k: [] for k in sorted({1, min(8, self.max_rows)})}
        for _ in range(12):
            for k in self.warm:
                self.warm[k].append(self.verify(k))
            if self.draft is not None:
                self.step()
            self.tick("warming up", warming=True)
            if all(_settled(v) for v in self.warm.values()) or self.clock() - self.t_start > WARM_BUDGET:
                break
        self.done = max(self.done, WARM_STEPS)

    def wait_for_quiet(self, sleep) -> float:
        """The other processes' load (0: quiet), after giving a passing spell a moment to end."""
        busy = _contended(self.meter.others(), self.limit)
        for _ in range(int(WAIT / 0.5)) if busy else ():
            self.meter.reset()
            sleep(0.5)
            busy = _contended(self.meter.others(), self.limit)
            if not busy:
                break
        return busy

    def sweep(self, max_sweeps: int) -> None:
        """Sweeps over the sampled row counts (rotated, every other one reversed) until enough ran
        undisturbed and agree, or the budget is spent."""
        sample = self.sample
        while not (self.seen and self.over_budget()):
            n = len(self.seen)
            order = sample[n % len(sample):] + sample[:n % len(sample)]
            if n % 2:
                order.reverse()
            self.meter.reset()
            times: dict[int, list[float]] = {k: [] for k in sample}
            for i, k in enumerate(order):
                if i and self.over_budget():  # a pass under heavy load can take seconds: stop where we are
                    break
                times[k].append(self.verify(k))
                if i == len(order) // 2 and k != 1:  # single-token passes are cheap and decide most
                    times[1].append(self.verify(1))
                self.tick(f"target pass with {k} rows")
            if self.draft is not None:
                self.steps.extend(self.step() for _ in range(3))
                self.batches.append(self.step(CATCH_UP_BATCH))
            other = self.meter.others()
            self.loads.append(other)
            self.clean.append(not _contended(other, self.limit))
            self.seen.append(times)
            if len(self.seen) >= max_sweeps:
                break
            if (len(self.seen) >= self.sweeps and sum(self.clean) >= 2
                    and not _doubts(_figures(self.seen, self.clean)[1])):
                break
        self.n_sweeps = len(self.seen)  # before `again` adds its sweep

    def again(self) -> None:
        """Row counts whose repeats disagree get two passes more, in a sweep of their own."""
        _, spread = _figures(self.seen, self.clean)
        again = [k for k, (_, r) in spread.items() if r > SPREAD]
        if not again or self.over_budget():
            return
        extra: dict[int, list[float]] = {k: [] for k in self.sample}
        for _ in range(2):
            for k in again:
                extra[k].append(self.verify(k))
                self.tick(f"target pass with {k} rows, again")
        self.seen.append(extra)
        self.clean.append(True)
        self.loads.append(None)

    def result(self) -> Calibration:
        target, draft, clock = self.target, self.draft, self.clock
        n = self.n_sweeps
        figures, spread = _figures(self.seen, self.clean)
        doubts = _doubts(spread)
        ones = figures[1]
        bigger = min((v for k, v in figures.items() if k > 1), default=ones)
        if ones > bigger:  # a 1-row pass cannot cost more than a bigger one
            figures[1] = bigger
        per_row = _row_overhead(target.n_vocab, clock)
        verify_costs = tuple(c + k * per_row for k, c in enumerate(_interpolate(figures, self.max_rows), 1))
        draft_step = prefill = None
        if draft is not None:
            one = median(self.steps)
            prefill = max(0.0, median(self.batches) - one) / (CATCH_UP_BATCH - 1)
            draft_step = one + _row_overhead(draft.n_vocab, clock)
            draft.reset()
        target.reset()
        clean = self.clean
        provisional = sum(clean) < 2 or bool(doubts)
        if sum(clean) < 2:
            doubts.append(f"other processes used the CPU in {n - sum(clean[:n])} of {n} sweeps")
        info = {"rows": self.sample, "sweeps": n, "clean_sweeps": sum(clean),
                "other_load_cores": [None if x is None else round(x, 2) for x in self.loads],
                "seconds": round(clock() - self.t_start, 2), "doubts": doubts,
                "pass_ms": {str(k): round(1000 * v, 2) for k, v in figures.items()}}
        if provisional:
            # info, not warning: nothing for the user to do, the engine corrects it as it runs
            log.info("the calibration may be off (%s): it is used as provisional, corrected as the engine runs "
                     "and measured again at the next load", "; ".join(doubts))
        return Calibration(Costs(verify_costs, draft_step, prefill), "calibrated", provisional, info)


def _shown(done: int, total: int) -> int:
    """Steps done as the progress shows them in a fixed `total`: as they are up to nine tenths,
    then ever closer to the total without reaching it (sweeps measured again were not planned);
    only the end reports the total itself."""
    knee = 0.9 * total
    if done <= knee:
        return done
    return min(total - 1, int(total - (total - knee) * math.exp(-(done - knee) / (total - knee))))


def _contended(other: Optional[float], limit: float) -> float:
    """The other load when it is above the limit, else 0 (falsy)."""
    return other if other is not None and other > limit else 0.0


def _under_load(target, draft, warm: dict[int, list[float]], max_rows: int, other: float, seconds: float
                ) -> Calibration:
    """What to believe when the machine is too busy to measure: a pass's time now says nothing
    of the device, and speculation decided on it would be a gamble. Each row is taken to cost a
    whole step (no drafting) at the fastest single-token pass seen; the engine's own passes
    correct that as it runs, and the next load measures again."""
    step = min(warm[1])
    if draft is not None:
        draft.reset()
    target.reset()
    doubts = [f"other processes used {other:.2f} cores during the warm-up"]
    log.info("the machine is busy (%s): verification costs are provisional, corrected as the engine runs "
                "and measured again at the next load", doubts[0])
    info = {"rows": [], "sweeps": 0, "clean_sweeps": 0, "other_load_cores": [round(other, 2)],
            "seconds": round(seconds, 2), "doubts": doubts, "pass_ms": {"1": round(1000 * step, 2)}}
    return Calibration(Costs(tuple(step * k for k in range(1, max_rows + 1)), step if draft is not None else None),
                       "calibrated", True, info)


def _figures(sweeps: list[dict[int, list[float]]], clean: list[bool]) -> tuple[dict[int, float], dict]:
    """Per row count, the median over the undisturbed sweeps (over all of them when fewer than
    two ran undisturbed), and (median, quartile ratio) for the consistency checks."""
    use = [s for s, c in zip(sweeps, clean) if c] if sum(clean) >= 2 else sweeps
    figures, spread = {}, {}
    for k in sweeps[0]:
        ts = sorted(t for s in use for t in s[k]) or sorted(t for s in sweeps for t in s[k])
        if not ts:  # never reached (the time ran out): interpolated from its neighbours
            continue
        # the median; of two, the smaller (another process can slow a pass, never speed it)
        figures[k] = median(ts) if len(ts) != 2 else ts[0]
        # quartiles, so that one disturbed sweep among four or more does not count
        lo, hi = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        spread[k] = (figures[k], hi / lo if lo > 0 else math.inf)
    return figures, spread


def _doubts(spread: dict[int, tuple[float, float]]) -> list[str]:
    """What makes the figures contradict themselves."""
    out = []
    wild = [k for k, (_, r) in spread.items() if r > SPREAD]
    if len(wild) > len(spread) // 4:
        out.append(f"repeated passes of {len(wild)} row counts disagree by more than {SPREAD}x")
    ones = spread.get(1, (0.0, 1.0))[0]
    if len(spread) > 1 and ones > 1.1 * min(m for k, (m, _) in spread.items() if k > 1):
        out.append("a 1-row pass measured slower than a bigger pass")
    return out


# -- the cache ------------------------------------------------------------------------------------
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 60


def _read(path, key) -> Optional[dict]:
    """The cached record, or None when the file is missing, unreadable or of another shape."""
    text = read_text(path)  # a regular file of bounded size only: never a FIFO or a device
    try:
        data = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    verify, step = data.get("verify"), data.get("draft_step")
    if not (isinstance(verify, list) and verify and all(_number(v) for v in verify)):
        return None
    if step is not None and not _number(step):
        return None
    prefill = data.get("draft_prefill")
    if prefill is not None and not (_number(prefill) or prefill == 0):
        return None
    return data


def _read_cached(path, key) -> Optional[Costs]:
    data = _read(path, key)
    return _costs(data) if data else None


def _costs(data: dict) -> Costs:
    return Costs(tuple(float(v) for v in data["verify"]), data["draft_step"], data.get("draft_prefill"))


def _as_calibration(data: dict) -> Calibration:
    info = data.get("info") if isinstance(data.get("info"), dict) else {}
    source = "corrected online" if data.get("source") == "corrected online" else "cached"
    return Calibration(_costs(data), source,
                       data.get("provisional") is True, info)


def _write(path, record: dict) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("cannot write the calibration to %s (%s): it will be measured again next time; "
                    "set EDGESPEC_CACHE to a writable folder", path.parent, exc.strerror or exc)
        return False


def obtain(target, draft=None, *, mode: str = "auto", progress=None) -> Calibration:
    """The figures for this model and setting. mode "auto": the cache, else measure (and
    measure again a provisional one, at most REMEASURE loads in a row); "now": measure;
    "never": the cache or cautious defaults. `progress` receives Progress("calibrate", ...)."""
    key = calibration_key(target, draft)
    path = _key_path(key)
    data = _read(path, key) if mode != "now" else None
    attempts = data.get("attempts", 1) if data else 0
    attempts = attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else REMEASURE
    if data is not None and (mode == "never" or not data.get("provisional") or attempts >= REMEASURE):
        return _as_calibration(data)
    if mode == "never":
        return Calibration(provisional(target, draft), "defaults", True)
    cal = measure(target, draft, progress=lambda k, n, detail: report(progress, "calibrate", k, n, "steps", detail))
    record = {"key": key, "verify": list(cal.costs.verify), "draft_step": cal.costs.draft_step,
              "draft_prefill": cal.costs.draft_prefill, "source": "calibrated", "provisional": cal.provisional,
              "attempts": attempts + 1 if cal.provisional else 1, "measured_at": time.time(), "info": cal.info}
    _write(path, record)
    return cal


EXACT_PROBE = 8  # rows the exactness probe tries at most


def exact_rows(target, probe: int = EXACT_PROBE) -> Optional[int]:
    """The most tokens one pass may feed while each of its rows still gets, bit for bit, the
    logits a single-row decode gives; None when `probe` rows still do. On x86 CPUs with
    repacked Q4_K weights: 3 (llama.cpp's 4-row kernels round otherwise); an F16 target 1. With
    `--bit-exact` the policy keeps passes within it (policy.Policy.bit_exact)."""
    if target.n_ctx < 64:
        return None
    filler = target.tokenize(FILLER * 2, add_bos=True)[:32]
    cont = target.tokenize(FILLER, add_bos=False)[:probe]
    try:
        target.reset()
        target.eval(filler, [])
        base = target.n_past
        alone = [np.array(target.eval([t], [0])[0]) for t in cont]
        for k in range(2, len(cont) + 1):
            target.truncate(base)
            rows = target.eval(cont[:k], list(range(k)))
            if not all(np.array_equal(rows[i], alone[i]) for i in range(k)):
                return k - 1
        return None
    finally:
        target.reset()


def exact_limit(target, draft=None, cal: Optional[Calibration] = None, mode: str = "auto") -> Optional[int]:
    """exact_rows for this model and setting: from the calibration's record, else probed (about
    15 passes) and added to it; None with mode "never" when it was never probed."""
    info = cal.info if cal is not None else {}
    if "exact_rows" in info:
        v = info["exact_rows"]
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None
    if mode == "never":
        return None
    found = exact_rows(target)
    key = calibration_key(target, draft)
    path = _key_path(key)
    record = _read(path, key)
    if record is not None:
        record["info"] = {**(record.get("info") if isinstance(record.get("info"), dict) else {}),
                          "exact_rows": found}
        _write(path, record)
    log.info("passes of up to %s tokens compute each row as a single-row decode", found or f"{EXACT_PROBE}+")
    return found


def load_or_measure(target, draft=None, *, force: bool = False, progress=None) -> Costs:
    """Cached figures for this model and setting, else measured ones (see `obtain`)."""
    return obtain(target, draft, mode="now" if force else "auto", progress=progress).costs


def write_back(target, draft, costs: Costs, meter: Optional[LoadMeter] = None) -> bool:
    """Store figures the engine's passes showed to hold, unless other processes loaded the
    machine meanwhile (`meter`, reset here): slow figures from a busy spell are not kept."""
    if meter is not None:
        other = meter.others()
        meter.reset()
        if other is not None and other > contention_limit(getattr(target, "threads", None) or 1):
            log.debug("online cost correction not stored: other processes used %.2f cores", other)
            return False
    key = calibration_key(target, draft)
    path = _key_path(key)
    old = _read(path, key) or {}
    info = old.get("info") if isinstance(old.get("info"), dict) else {}
    if old.get("source") != "corrected online":  # keep what the calibration itself measured
        info = {**info, "calibrated_verify": old.get("verify"), "calibrated_draft_step": old.get("draft_step")}
    record = {"key": key, "verify": list(costs.verify), "draft_step": costs.draft_step,
              "draft_prefill": costs.draft_prefill, "source": "corrected online", "provisional": False,
              "attempts": 1, "measured_at": time.time(), "info": info}
    ok = _write(path, record)
    if ok:
        log.info("verification costs corrected from this run's passes and stored: T(1) %.1f ms",
                 1000 * costs.verify[0])
    return ok


def provisional(target, draft=None) -> Costs:
    """Figures to start from when nothing was measured: each verified row costs a whole step,
    so nothing is drafted until the passes the engine runs show otherwise."""
    return Costs(verify=tuple(0.05 * k for k in range(1, MAX_ROWS + 1)),
                 draft_step=0.05 if draft is not None else None)


def cached(target, draft=None) -> Optional[Costs]:
    """The cached figures for this model and setting, without measuring."""
    key = calibration_key(target, draft)
    return _read_cached(_key_path(key), key)

