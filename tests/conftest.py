import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/fakes.py

# `make test` runs the suite in worker processes (pytest-xdist, one per core): each worker's
# llama.cpp then gets its share of the cores, and the servers and CLIs it starts inherit it.
# More threads than cores would wait on each other (a token costs seconds, see calibrate.py).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and not os.environ.get("EDGESPEC_THREADS"):
    from edgespec.backend import default_threads
    from edgespec.defaults import cpu_count
    share = min(default_threads(), cpu_count()) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["EDGESPEC_THREADS"] = str(max(1, share))


@pytest.fixture
def own_tables(tmp_path_factory, monkeypatch):
    """A private copy of edgespec's cache for one test (its calibrations, probe and self-test
    records; the models stay where they are): no other test worker measures, corrects or writes a
    cost table while this test's engines decide on one."""
    from edgespec.registry import cache_dir
    src, dst = cache_dir(), tmp_path_factory.mktemp("edgespec-cache")
    for name in ("calibration", "probe", "selftest"):
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
    monkeypatch.setenv("EDGESPEC_CACHE", str(dst))
    return dst


def pytest_collection_modifyitems(config, items):
    """The longest tests (the Qwen pair's, then those marked slow) start first, shared out among
    the workers of `make test`: xdist's work stealing hands worker i the i-th contiguous share of
    this order at the start and steals only from the ends of the shares, so each share begins with
    its part of the long tests (dealt in turn) and no worker is left with all of them."""
    def rank(item):
        return 0 if item.get_closest_marker("qwen") else 1 if item.get_closest_marker("slow") else 2
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    long = sorted((i for i in items if rank(i) < 2), key=rank)
    rest = [i for i in items if rank(i) == 2]
    shares = [long[w::workers] for w in range(workers)]
    order, left = [], len(items)
    for w, share in enumerate(shares):  # xdist's split: what is left, over the workers left
        size = left // (workers - w)
        take = max(0, size - len(share))
        order += share + rest[:take]
        rest = rest[take:]
        left -= len(share) + take
    items[:] = order + rest


def _model(pair: str, role: str = "target") -> Path:
    from edgespec.hub import local_path
    from edgespec.registry import load_registry
    spec = getattr(load_registry().get(pair), role)
    path = local_path(spec)
    if path is None:
        pytest.fail(f"{spec.file} is not downloaded: run `make test-models` (fetches the test models)")
    return path


@pytest.fixture(scope="session")
def smol() -> Path:
    return _model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_draft(smol) -> Path:
    """SmolLM2 cut to its first 24 of 30 blocks: same tokenizer, different predictions."""
    from edgespec.bench.hostcost import truncated
    return truncated(smol, 24)


@pytest.fixture(scope="session")
def gemma() -> Path:
    return _model("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    return _model("qwen2.5-coder-1.5b"), _model("qwen2.5-coder-1.5b", "draft")
