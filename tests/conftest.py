import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/fakes.py


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
    from edgespec.registry import cache_dir
    dst = cache_dir() / "models" / "SmolLM2-135M-Instruct.first24.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "truncate_gguf.py"), str(smol), str(dst),
                        "--blocks", "24"], check=True, stdout=subprocess.DEVNULL)
    return dst


@pytest.fixture(scope="session")
def gemma() -> Path:
    return _model("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen_pair() -> tuple[Path, Path]:
    return _model("qwen2.5-coder-1.5b"), _model("qwen2.5-coder-1.5b", "draft")
