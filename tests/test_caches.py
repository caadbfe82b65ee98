"""Cache files that cannot take the CLI down (issue 16, item 5): a probe cache with the right key
and wrong-shaped figures, and a FIFO, /dev/zero or a directory where a probe or calibration
cache file should be. Each case runs the real CLI in-process twice in a row: both runs work,
and whatever sat at the path is measured again instead of trusted."""
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from edgespec import calibrate, cachefile, probe

from conftest import ROOT
from test_cli import run_cli as cli


def finishes(fn, *args, seconds=60):
    """Runs fn in a thread; (finished, result). A read that blocks on a FIFO never finishes."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), box.get("r")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty edgespec cache of its own and no probe figures remembered by this process."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "_memo", {})
    return tmp_path / "cache"


def _plant(path, what, tmp_path):
    """Put `what` at `path`: a FIFO, a symlink to /dev/zero, a directory, an oversized file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "dev-zero":
        os.symlink("/dev/zero", path)
    elif what == "fifo-link":
        os.mkfifo(tmp_path / "elsewhere.fifo")
        os.symlink(tmp_path / "elsewhere.fifo", path)
    elif what == "directory":
        path.mkdir()
    elif what == "huge":
        with open(path, "wb") as fh:
            fh.truncate(cachefile.MAX_BYTES + 1)  # sparse: costs no disk
    else:
        raise AssertionError(what)


PLANTS = ["fifo", "dev-zero", "fifo-link", "directory", "huge"]


@pytest.mark.parametrize("what", PLANTS)
def test_read_text_returns_none_at_once_for_anything_but_a_small_regular_file(tmp_path, what):
    path = tmp_path / "entry.json"
    _plant(path, what, tmp_path)
    done, text = finishes(cachefile.read_text, path)
    assert done and text is None
    ok = tmp_path / "ok.json"
    ok.write_text('{"a": 1}')
    assert cachefile.read_text(ok) == '{"a": 1}'
    assert cachefile.read_text(tmp_path / "missing.json") is None


BAD_FIGURES = [
    {"repacked_types": 5},
    {"runtime_bytes": "big"},
    {"runtime_bytes": -5},
    {"context_overhead_bytes": -1},
    {"runtime_bytes": True},
    {"runtime_bytes": 2.5e9},
    {"repacked_types": ["Q4_K", 3]},
    {"repacked_types": ["NOT_A_TYPE"]},
    {"page_size": "4k"},
]


def _good_figures():
    return {"runtime_bytes": 50 * 2**20, "context_overhead_bytes": 4 * 2**20, "repacked_types": ["Q4_K"]}


@pytest.mark.parametrize("bad", BAD_FIGURES, ids=lambda b: json.dumps(b))
def test_wrong_shaped_probe_figures_are_measured_again(cache, monkeypatch, bad):
    calls = []
    monkeypatch.setattr(probe, "measure", lambda: calls.append(1) or _good_figures())
    key = probe._key()
    path = probe.cache_path(key)
    path.parent.mkdir(parents=True)
    figures = _good_figures() | bad
    path.write_text(json.dumps({"key": key, "figures": figures}))
    assert not probe.valid_figures(figures)
    assert probe.machine_figures()["runtime_bytes"] == 50 * 2**20
    assert calls == [1]
    assert probe.valid_figures(json.loads(path.read_text())["figures"])  # rewritten, usable


def _bad_probe_cache(what, tmp_path):
    path = probe.cache_path(probe._key())
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    if what == "figures":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": probe._key(), "figures": {"repacked_types": 5, "runtime_bytes": "big",
                                                                      "context_overhead_bytes": -3}}))
    else:
        _plant(path, what, tmp_path)
    return path


@pytest.mark.parametrize("what", ["figures", "fifo", "dev-zero"])
def test_plan_and_run_with_a_memory_budget_survive_a_bad_probe_cache_twice(cache, tmp_path, smol, capsys, what):
    for _ in range(2):  # twice in a row, each a fresh process as far as the probe knows
        _bad_probe_cache(what, tmp_path)
        probe._memo.clear()
        code, out, err = cli(["plan", "--target", str(smol), "--ctx", "512", "--drafter", "none", "--json"], capsys)
        assert code == 0, err
        assert "Traceback" not in err
        plan = json.loads(out)
        assert plan["choice"]["drafter"] == "none" and plan["choice"]["estimated_bytes"] > 0
        _bad_probe_cache(what, tmp_path)
        probe._memo.clear()
        code, out, err = cli(["run", "--target", str(smol), "--ctx", "512", "--drafter", "none", "--raw", "--json",
                              "--max-tokens", "2", "--prompt", "Hello", "--memory-budget", "2GiB"], capsys)
        assert code == 0, err
        assert json.loads(out)["stats"]["generated"] >= 1
        st = os.lstat(probe.cache_path(probe._key()))
        assert stat.S_ISREG(st.st_mode)  # measured again and written over what was there


@pytest.mark.parametrize("what", ["fifo", "dev-zero", "directory"])
def test_run_survives_a_fifo_or_device_at_its_calibration_path_twice(cache, tmp_path, smol, capsys, monkeypatch,
                                                                      what):
    """The real CLI's auto drafter reads its calibration; measuring is faked (30 s otherwise)."""
    from edgespec.backend import LlamaBackend
    from edgespec.costs import Costs
    measured = []

    def fake_measure(target, draft=None, **kw):
        measured.append(1)
        return calibrate.Calibration(Costs(tuple(0.01 * k for k in range(1, calibrate.MAX_ROWS + 1))), "calibrated")
    monkeypatch.setattr(calibrate, "measure", fake_measure)
    from edgespec.assemble import Settings
    b = LlamaBackend(smol, n_ctx=512, threads=1, flash_attn=Settings.flash_attn)  # the key the run below will have
    try:
        path = calibrate._key_path(calibrate.calibration_key(b))
    finally:
        b.close()
    args = ["run", "--target", str(smol), "--ctx", "512", "--threads", "1", "--drafter", "auto", "--raw", "--json",
            "--max-tokens", "4", "--prompt", "Count: one two three"]
    for i in range(2):
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)
        if not os.path.lexists(path):
            _plant(path, what, tmp_path)
        code, out, err = cli(args, capsys)
        assert code == 0, err
        assert "Traceback" not in err and "MemoryError" not in err
        assert json.loads(out)["stats"]["generated"] >= 1
    assert len(measured) == 2  # what sat there was never taken for a calibration


def test_a_fifo_at_the_calibration_path_does_not_hang_a_real_subprocess(cache, tmp_path):
    """The read itself in a fresh interpreter, as a user's `run` would do it (no threads)."""
    fifo = tmp_path / "cal.json"
    os.mkfifo(fifo)
    code = ("import sys; from pathlib import Path; from edgespec import calibrate; "
            "print(calibrate._read(Path(sys.argv[1]), {}))")
    out = subprocess.run([sys.executable, "-c", code, str(fifo)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
