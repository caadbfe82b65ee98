"""The wheel carries models.toml and the workloads, and works installed outside the checkout."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout():
    proc = subprocess.run([str(ROOT / ".ci" / "wheel-check")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "wheel-check: ok" in proc.stdout
