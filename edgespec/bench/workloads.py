"""Benchmark prompts: JSONL of {id, kind, prompt}."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError


def default_workloads() -> Path:
    from ..registry import workloads_path
    return workloads_path()


def read_jsonl(path, valid, expected: str, what: str = "workloads file") -> list[dict]:
    """The objects of a JSONL file's non-blank lines, each passing `valid`; a UsageError naming
    the file and the line (`expected`: what a line should hold) otherwise."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ok = isinstance(item, dict) and bool(valid(item))
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise UsageError(f"{path}:{n}: expected {expected}")
        out.append(item)
    return out


def first_per_group(items: list[dict], key: str, limit: int | None) -> list[dict]:
    """`items` in order, at most `limit` of each value of item[key]."""
    seen: dict = {}
    out = []
    for item in items:
        seen[item[key]] = seen.get(item[key], 0) + 1
        if limit is None or seen[item[key]] <= limit:
            out.append(item)
    return out


def load_workloads(path: str, kinds: str | None = None, limit: int | None = None) -> list[dict]:
    rows = read_jsonl(path, lambda it: (it["id"], it["kind"], it["prompt"]), "a JSON object with id, kind and prompt")
    wanted = set(kinds.split(",")) if kinds else None
    items = first_per_group([it for it in rows if not wanted or it["kind"] in wanted], "kind", limit)
    if not items:
        raise UsageError(f"no workloads selected from {path}")
    return items


