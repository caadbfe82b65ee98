"""A real `edgespec serve` process for tests: started on a free port, stopped with SIGINT."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

STARTUP_TIMEOUT = 180  # generous: other jobs share this machine's two cores


class ServerProcess:
    def __init__(self, args: list[str], tmp: Path, *, key: Optional[str] = None, env: Optional[dict] = None):
        self.log = tmp / "server.log"
        self.key = key  # sent to /health, which shows its counters only to those who hold it
        self._fh = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "edgespec.server", *args, "--port", "0"],
                                     stdout=self._fh, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+) ", self.log.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"the server did not start:\n{self.log.read_text()}")

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", headers=self._auth(), timeout=30)

    def metrics(self) -> dict:
        """/metrics, parsed by prometheus_client: {sample name with its labels: (family type, value)}."""
        from prometheus_client.parser import text_string_to_metric_families
        r = httpx.get(self.url + "/metrics", headers=self._auth(), timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        out = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
                out[key] = (family.type, s.value)
        return out

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if self.health().status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"the server exited:\n{self.log.read_text()}"
            time.sleep(0.1)
        pytest.fail(f"the server did not become ready:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return self.proc.returncode
