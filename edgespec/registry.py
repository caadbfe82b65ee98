"""models.toml: named target/draft pairs, their Hub coordinates, checksums and mirrors."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import RegistryError

BUILTIN = Path(__file__).resolve().parent.parent / "models.toml"
if not BUILTIN.exists():  # installed as a package: the copy shipped inside it
    BUILTIN = Path(__file__).resolve().parent / "models.toml"
ENV_USER_FILE = "EDGESPEC_MODELS"


def cache_dir() -> Path:
    """Where edgespec keeps its own files (mirror downloads, calibration)."""
    root = os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec"
    return Path(root)


@dataclass(frozen=True)
class ModelSpec:
    repo: str
    file: str
    revision: str = "main"
    sha256: str | None = None
    size: int | None = None
    mirrors: tuple[dict, ...] = ()

    @property
    def mirror_path(self) -> Path:
        """Where a file fetched from a mirror is kept."""
        return cache_dir() / "models" / self.file


@dataclass(frozen=True)
class Pair:
    name: str
    target: ModelSpec
    draft: ModelSpec | None = None
    description: str = ""


@dataclass(frozen=True)
class Registry:
    default: str
    pairs: dict[str, Pair] = field(default_factory=dict)

    def get(self, name: str) -> Pair:
        try:
            return self.pairs[name]
        except KeyError:
            known = ", ".join(sorted(self.pairs)) or "(none)"
            raise RegistryError(f"unknown model pair {name!r}; known pairs: {known}") from None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise RegistryError(f"models file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"malformed models file {path}: {exc}") from None


def _model(path: Path, pair: str, role: str, raw: object) -> ModelSpec:
    where = f"{path}: pairs.{pair}.{role}"
    if not isinstance(raw, dict):
        raise RegistryError(f"{where} must be a table with repo and file")
    missing = [k for k in ("repo", "file") if not isinstance(raw.get(k), str)]
    if missing:
        raise RegistryError(f"{where} lacks {', '.join(missing)}")
    known = {"repo", "file", "revision", "sha256", "size", "mirrors"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RegistryError(f"{where} has unknown keys {unknown}; allowed: {sorted(known)}")
    mirrors = raw.get("mirrors", [])
    if not isinstance(mirrors, list) or not all(isinstance(m, dict) for m in mirrors):
        raise RegistryError(f"{where}.mirrors must be a list of tables")
    return ModelSpec(repo=raw["repo"], file=raw["file"], revision=str(raw.get("revision", "main")),
                     sha256=raw.get("sha256"), size=raw.get("size"), mirrors=tuple(mirrors))


def _merge(data: dict, path: Path, into: dict[str, Pair]) -> str | None:
    pairs = data.get("pairs", {})
    if not isinstance(pairs, dict):
        raise RegistryError(f"{path}: 'pairs' must be a table of named pairs")
    for name, raw in pairs.items():
        if not isinstance(raw, dict) or "target" not in raw:
            raise RegistryError(f"{path}: pair {name!r} needs a [pairs.\"{name}\".target] table")
        draft = _model(path, name, "draft", raw["draft"]) if "draft" in raw else None
        into[name] = Pair(name=name, target=_model(path, name, "target", raw["target"]),
                          draft=draft, description=str(raw.get("description", "")))
    return data.get("default")


def load_registry(user_file: str | os.PathLike | None = None) -> Registry:
    """The built-in pairs, extended or overridden by the user's file (argument or $EDGESPEC_MODELS)."""
    pairs: dict[str, Pair] = {}
    default = _merge(_read_toml(BUILTIN), BUILTIN, pairs)
    user = user_file or os.environ.get(ENV_USER_FILE)
    if user:
        default = _merge(_read_toml(Path(user)), Path(user), pairs) or default
    if default not in pairs:
        raise RegistryError(f"default pair {default!r} is not defined in any models file")
    return Registry(default=default, pairs=pairs)
