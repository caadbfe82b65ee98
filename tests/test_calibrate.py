"""Calibration that cannot be poisoned, on a fake backend with a fake clock (no real timing):
settled warm-up, medians of interleaved sweeps, disturbed sweeps measured again, a busy
machine or a self-contradictory result stored as provisional and measured again at the next
load; the cache survives files of any shape and an unwritable folder."""
import json
import logging

import numpy as np
import pytest

from edgespec import calibrate
from edgespec.costs import Costs

from fakes import FakeBackend

T1 = 0.06


def true_cost(rows):  # a CPU-like curve with a cheap 16-row pass
    return T1 * (1 + 0.75 * (rows - 1)) if rows != 16 else T1 * 9


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class ClockedBackend(FakeBackend):
    """Each eval advances the fake clock by what the device would take; `slow(n, rows)`
    multiplies the n-th eval (another process taking the cores)."""

    def __init__(self, clock, slow=lambda n, rows: 1.0, **kw):
        super().__init__(np.zeros((8, 8), np.float32), n_ctx=512, **kw)
        self.clock, self.slow, self.threads, self.n = clock, slow, 2, 0

    def eval(self, tokens, rows):
        rows = list(rows)
        self.n += 1
        self.clock.t += true_cost(max(1, len(rows))) * self.slow(self.n, len(rows))
        return super().eval(tokens, rows)


class Meter:
    """A LoadMeter whose readings are scripted: other cores' use per reading."""

    def __init__(self, readings=()):
        self.readings, self.calls = list(readings), 0

    def reset(self):
        pass

    def others(self):
        self.calls += 1
        return self.readings.pop(0) if self.readings else 0.0


def measure(slow=lambda n, rows: 1.0, meter=None, **kw):
    clock = Clock()
    backend = ClockedBackend(clock, slow)
    cal = calibrate.measure(backend, clock=clock, meter=meter or Meter(), sleep=lambda s: None, **kw)
    return cal, clock, backend


def test_a_quiet_device_is_measured_right_and_interpolated_between_samples():
    cal, clock, _ = measure()
    assert not cal.provisional and cal.info["sweeps"] == calibrate.SWEEPS
    for k in (1, 2, 4, 8, 16, 32):
        assert cal.costs.verify_cost(k) == pytest.approx(true_cost(k), rel=1e-6)
    assert cal.costs.verify_cost(5) == pytest.approx(true_cost(5), rel=1e-6)  # not sampled: interpolated
    assert clock.t < 25  # seconds of passes on this fake device (60 ms a step): short


def test_one_slow_pass_does_not_move_the_figures():
    # the 30th eval (some pass in the first sweep) takes 50 times as long
    cal, _, _ = measure(slow=lambda n, rows: 50.0 if n == 30 else 1.0)
    assert not cal.provisional
    for k in calibrate.SAMPLE_ROWS:
        assert cal.costs.verify_cost(k) == pytest.approx(true_cost(k), rel=1e-6)


def test_a_slow_spell_makes_the_repeats_disagree_and_is_measured_again():
    # every single-token pass in the first two sweeps is 20x slow: medians alone would keep it
    spell = {"on": True}

    def slow(n, rows):
        return 20.0 if spell["on"] and rows == 1 and n > 12 else 1.0
    clock = Clock()
    backend = ClockedBackend(clock, slow)
    sweeps_seen = []
    meter = Meter()

    def others():
        sweeps_seen.append(1)
        if len(sweeps_seen) >= 3:  # the spell ends after the warm-up reading and two sweeps
            spell["on"] = False
        return 0.0
    meter.others = others
    cal = calibrate.measure(backend, clock=clock, meter=meter, sleep=lambda s: None)
    assert cal.info["sweeps"] > calibrate.SWEEPS           # it measured again
    assert cal.costs.verify[0] <= min(cal.costs.verify[1:])  # never a 1-row pass dearer than a bigger one


def test_sweeps_disturbed_by_other_processes_are_measured_again_and_left_out():
    # psutil says other processes used a whole core during the first two sweeps (12 passes
    # each), which ran 3x slow: a median over all four sweeps would be off
    meter = Meter([0.0, 1.0, 1.0, 0.0, 0.0])   # the warm-up, then one reading per sweep
    clock = Clock()
    backend = ClockedBackend(clock, lambda n, rows: 3.0 if 8 <= n < 8 + 24 else 1.0)
    cal = calibrate.measure(backend, clock=clock, meter=meter, sleep=lambda s: None)
    assert cal.info["sweeps"] == 4 and cal.info["clean_sweeps"] == 2
    assert not cal.provisional
    for k in calibrate.SAMPLE_ROWS:
        assert cal.costs.verify_cost(k) == pytest.approx(true_cost(k), rel=1e-6)


def test_a_busy_machine_gives_provisional_figures_that_draft_nothing_quickly():
    # one core kept busy all along: llama.cpp's threads wait on each other (passes 10-60x)
    cal, clock, backend = measure(slow=lambda n, rows: 40.0 if rows == 1 else 5.0, meter=Meter([1.0] * 20))
    assert cal.provisional and cal.info["sweeps"] == 0
    v = cal.costs.verify
    assert all(v[k - 1] == pytest.approx(k * v[0]) for k in range(1, 33))  # every row a whole step
    assert backend.n < 40  # the warm-up and no more


def test_a_single_token_pass_dearer_than_bigger_ones_is_clamped_and_provisional():
    # the threads-waiting pathology without other processes to see: only 1-row passes are slow
    cal, _, _ = measure(slow=lambda n, rows: 30.0 if rows == 1 else 1.0)
    assert cal.provisional
    assert cal.costs.verify[0] <= min(cal.costs.verify[1:])
    assert any("1-row pass" in d for d in cal.info["doubts"])


def test_progress_is_reported_and_nothing_is_printed(capsys):
    seen = []
    measure(progress=lambda done, total, detail: seen.append((done, total, detail)))
    assert seen and all(d <= t for d, t, _ in seen)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert any("rows" in detail for _, _, detail in seen)
    assert capsys.readouterr() == ("", "")


# -- the cache ----------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    fb = FakeBackend(np.zeros((6, 6), np.float32), n_ctx=512)
    fb.path = model
    calls = []

    def fake_measure(target, draft=None, progress=None, **kw):
        calls.append(1)
        if progress:
            progress(1, 1, "target pass with 1 rows")
        provisional = getattr(fb, "provisional", False)
        return calibrate.Calibration(Costs(tuple(T1 * k for k in range(1, 5))), "calibrated", provisional,
                                     {"doubts": ["busy"] if provisional else []})
    monkeypatch.setattr(calibrate, "measure", fake_measure)
    return fb, calls, tmp_path


def test_calibration_is_cached_and_invalidated_when_model_or_settings_change(cache):
    fb, calls, tmp_path = cache
    model = fb.path
    c1 = calibrate.load_or_measure(fb)
    c2 = calibrate.load_or_measure(fb)
    assert len(calls) == 1 and c1 == c2 and len(c1.verify) == 4
    assert calibrate.obtain(fb).source == "cached"
    fb.settings = {"n_ctx": 1024}                         # the context size alone: same figures
    calibrate.load_or_measure(fb)
    assert len(calls) == 1
    fb.settings = {"n_ctx": 512, "threads": 7}            # another setting: measure again
    calibrate.load_or_measure(fb)
    assert len(calls) == 2
    model.write_bytes(b"GGUF another model")              # another file: measure again
    calibrate.load_or_measure(fb)
    assert len(calls) == 3
    calibrate.load_or_measure(fb, force=True)             # `edgespec calibrate`
    assert len(calls) == 4
    files = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(files) == 3 and all("verify" in json.loads(f.read_text()) for f in files)


@pytest.mark.parametrize("content", [
    "[1]", "null", "{}", "", "not json", '{"verify": []}', '{"verify": [0.1, "x"], "draft_step": null}',
    '{"verify": [true, 0.2], "draft_step": null}', '{"verify": [NaN], "draft_step": null}',
    '{"verify": [0.1], "draft_step": -1}', '{"verify": {"1": 0.1}, "draft_step": null}',
])
def test_a_cache_file_of_any_shape_is_measured_again_never_a_crash(cache, content):
    fb, calls, _ = cache
    calibrate.load_or_measure(fb)
    path = next((cache[2] / "cache" / "calibration").glob("*.json"))
    if content.startswith("{") and content != "{}":
        data = json.loads(content)
        data["key"] = json.loads(path.read_text())["key"]  # right key, wrong figures
        content = json.dumps(data)
    path.write_text(content)
    assert calibrate.cached(fb) is None
    assert calibrate.obtain(fb, mode="never").source == "defaults"
    calibrate.load_or_measure(fb)
    assert len(calls) == 2


def test_an_unwritable_cache_logs_a_warning_and_goes_on(cache, monkeypatch, caplog):
    fb, calls, tmp_path = cache
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EDGESPEC_CACHE", str(blocker))   # a file where the folder should be
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        costs = calibrate.load_or_measure(fb)
        assert not calibrate.write_back(fb, None, costs)
    assert len(costs.verify) == 4
    assert "cannot write the calibration" in caplog.text


def test_a_provisional_calibration_is_measured_again_at_the_next_loads_then_kept(cache):
    fb, calls, _ = cache
    fb.provisional = True
    for n in range(1, calibrate.REMEASURE + 1):
        cal = calibrate.obtain(fb)
        assert cal.provisional and len(calls) == n
    cal = calibrate.obtain(fb)                 # measured REMEASURE times: kept, corrected online
    assert len(calls) == calibrate.REMEASURE and cal.source == "cached" and cal.provisional
    fb.provisional = False
    assert not calibrate.obtain(fb, mode="now").provisional
    assert not calibrate.obtain(fb).provisional and len(calls) == calibrate.REMEASURE + 1


def test_corrections_are_written_back_unless_the_machine_was_busy(cache):
    fb, calls, _ = cache
    calibrate.load_or_measure(fb)
    corrected = Costs(tuple(T1 / 2 * k for k in range(1, 5)))
    assert not calibrate.write_back(fb, None, corrected, Meter([3.0]))   # others used 3 cores
    assert calibrate.obtain(fb).source == "cached"
    assert calibrate.write_back(fb, None, corrected, Meter([0.0]))
    cal = calibrate.obtain(fb)
    assert cal.source == "corrected online" and cal.costs == corrected and len(calls) == 1


def test_the_draft_models_step_and_catching_up_are_measured():
    clock = Clock()
    target = ClockedBackend(clock)

    class Draft(ClockedBackend):
        def eval(self, tokens, rows):  # 10 ms a step, 2 ms more per extra token in a batch
            self.clock.t += 0.010 + 0.002 * (len(tokens) - 1)
            return FakeBackend.eval(self, tokens, list(rows))
    draft = Draft(clock)
    cal = calibrate.measure(target, draft, clock=clock, meter=Meter(), sleep=lambda s: None)
    assert cal.costs.draft_step == pytest.approx(0.010)
    assert cal.costs.draft_prefill == pytest.approx(0.002)
