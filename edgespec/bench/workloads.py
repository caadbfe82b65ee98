"""Benchmark prompts: JSONL of {id, kind, prompt}."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError


def default_workloads() -> Path:
    from ..registry import workloads_path
    return workloads_path()


def load_workloads(path: str, kinds: str | None = None, limit: int | None = None) -> list[dict]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read workloads file {path}: {exc.strerror}") from None
    items, per_kind = [], {}
    wanted = set(kinds.split(",")) if kinds else None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            item["id"], item["kind"], item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{path}:{n}: expected a JSON object with id, kind and prompt") from None
        if wanted and item["kind"] not in wanted:
            continue
        per_kind[item["kind"]] = per_kind.get(item["kind"], 0) + 1
        if limit is None or per_kind[item["kind"]] <= limit:
            items.append(item)
    if not items:
        raise UsageError(f"no workloads selected from {path}")
    return items


