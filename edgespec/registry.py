"""models.toml: named target/draft pairs, their Hub coordinates, checksums and mirrors."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import RegistryError

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent
_PACKAGED = _PACKAGE / "_data"  # setup.py copies the top-level files here when it builds a wheel


def _shipped(relative: str) -> Path:
    """A file kept at the repository's top level: that one in a checkout (and in an editable
    install), else the copy inside the installed package."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / relative).is_file():
        return _CHECKOUT / relative
    return _PACKAGED / relative


BUILTIN = _shipped("models.toml")
ENV_USER_FILE = "EDGESPEC_MODELS"


def workloads_path() -> Path:
    """The default benchmark prompts (workloads/prompts.jsonl)."""
    return _shipped("workloads/prompts.jsonl")


def cache_dir() -> Path:
    """Where edgespec keeps its own files (mirror downloads, calibration)."""
    root = os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec"
    return Path(root)


_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _inside(path: str) -> bool:
    """True for a non-empty relative path that stays where it is put: no root, drive or '..'."""
    win = PureWindowsPath(path)  # splits on both separators, knows drives: the strictest reading
    return bool(path) and not (win.drive or win.root) and ".." not in win.parts


def _problem(key: str, value: object) -> str | None:
    """What is wrong with one field of a model entry, or None."""
    if key == "repo" and not (isinstance(value, str) and _REPO.fullmatch(value) and ".." not in value):
        return f"is {value!r}; it must be a Hub repository id of the form owner/name"
    if key == "file" and not (isinstance(value, str) and _inside(value)):
        # the file name becomes a path under the model caches: it must not lead out of them
        return f"is {value!r}; it must be a relative path inside the repository, without '..'"
    if key == "revision" and not (isinstance(value, str) and _inside(value)):
        return f"is {value!r}; it must be a branch, tag or commit name (a string, without '..')"
    if key == "sha256" and value is not None and not (isinstance(value, str) and _SHA256.fullmatch(value)):
        return f"is {value!r}; it must be a string of 64 hexadecimal digits"
    if key == "size" and value is not None and (type(value) is not int or value <= 0):
        return f"is {value!r}; it must be a positive whole number of bytes"
    return None


@dataclass(frozen=True)
class ModelSpec:
    repo: str
    file: str
    revision: str = "main"
    sha256: str | None = None
    size: int | None = None
    mirrors: tuple[dict, ...] = ()

    def __post_init__(self):
        # also checked here, not only when reading a models file: `file` and `revision` become
        # cache paths, so a spec built in code must not point outside the caches either
        for key in ("repo", "file", "revision", "sha256", "size"):
            problem = _problem(key, getattr(self, key))
            if problem:
                raise RegistryError(f"model {key} {problem}")

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
    hidden: bool = False  # meant for tests: `models` leaves it out (unless --all); still loadable by name


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
    if path.is_dir():  # checked first: opening a folder fails differently on each system
        raise RegistryError(f"models file {path} is a folder, not a models.toml file: "
                            "name the file itself")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise RegistryError(f"models file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise RegistryError(f"models file {path} is not valid UTF-8 text (byte {exc.start}): "
                            "save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"malformed models file {path}: {exc}") from None
    except OSError as exc:
        raise RegistryError(f"cannot read models file {path}: {exc.strerror}") from None


def _model(path: Path, pair: str, role: str, raw: object) -> ModelSpec:
    where = f"{path}: pairs.{pair}.{role}"
    if not isinstance(raw, dict):
        raise RegistryError(f"{where} must be a table with repo and file")
    missing = [k for k in ("repo", "file") if k not in raw]
    if missing:
        raise RegistryError(f"{where} lacks {', '.join(missing)}")
    known = {"repo", "file", "revision", "sha256", "size", "mirrors"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RegistryError(f"{where} has unknown keys {unknown}; allowed: {sorted(known)}")
    for key in ("repo", "file", "revision", "sha256", "size"):
        problem = _problem(key, raw.get(key, "main" if key == "revision" else None))
        if problem:
            raise RegistryError(f"{where}.{key} {problem}; fix it in that file")
    mirrors = raw.get("mirrors", [])
    if not isinstance(mirrors, list) or not all(isinstance(m, dict) for m in mirrors):
        raise RegistryError(f"{where}.mirrors must be a list of tables")
    return ModelSpec(repo=raw["repo"], file=raw["file"], revision=raw.get("revision", "main"),
                     sha256=raw.get("sha256"), size=raw.get("size"), mirrors=tuple(mirrors))


def _merge(data: dict, path: Path, into: dict[str, Pair]) -> str | None:
    pairs = data.get("pairs", {})
    if not isinstance(pairs, dict):
        raise RegistryError(f"{path}: 'pairs' must be a table of named pairs")
    for name, raw in pairs.items():
        if not isinstance(raw, dict) or "target" not in raw:
            raise RegistryError(f"{path}: pair {name!r} needs a [pairs.\"{name}\".target] table")
        draft = _model(path, name, "draft", raw["draft"]) if "draft" in raw else None
        hidden = raw.get("hidden", False)
        if not isinstance(hidden, bool):
            raise RegistryError(f"{path}: pairs.{name}.hidden is {hidden!r}; it must be true or false")
        into[name] = Pair(name=name, target=_model(path, name, "target", raw["target"]),
                          draft=draft, description=str(raw.get("description", "")), hidden=hidden)
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
