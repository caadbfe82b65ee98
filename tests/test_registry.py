"""models.toml checks: every bad entry is one RegistryError naming the file and the key."""
import pytest

from edgespec.cli import main
from edgespec.errors import RegistryError
from edgespec.registry import BUILTIN, ModelSpec, load_registry, workloads_path

ROOT = BUILTIN.parent
GOOD = {"repo": '"acme/tiny-GGUF"', "file": '"tiny.gguf"'}


def models_file(tmp_path, **fields):
    body = "\n".join(f"{k} = {v}" for k, v in {**GOOD, **fields}.items())
    path = tmp_path / "mine.toml"
    path.write_text(f'[pairs."p".target]\n{body}\n')
    return path


def refused(path, match):
    with pytest.raises(RegistryError, match=match) as info:
        load_registry(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("name", ['"../../x"', '"/abs/x.gguf"', '"a/../../x.gguf"', '"..\\\\x.gguf"',
                                  '"C:/x.gguf"', '""', "5"])
def test_file_outside_the_cache_is_refused(tmp_path, name):
    refused(models_file(tmp_path, file=name), r"pairs\.p\.target\.file .*relative path inside the repository")


def test_file_in_a_subfolder_is_fine(tmp_path):
    assert load_registry(models_file(tmp_path, file='"Q4/x.gguf"')).get("p").target.file == "Q4/x.gguf"


@pytest.mark.parametrize("size", ['"big"', "0", "-3", "1.5", "true"])
def test_size_must_be_a_positive_integer(tmp_path, size):
    refused(models_file(tmp_path, size=size), r"pairs\.p\.target\.size .*positive whole number")


@pytest.mark.parametrize("sha", ["5", '"abc"', '"' + "g" * 64 + '"'])
def test_sha256_must_be_64_hex_digits(tmp_path, sha):
    refused(models_file(tmp_path, sha256=sha), r"pairs\.p\.target\.sha256 .*64 hexadecimal digits")


@pytest.mark.parametrize("repo", ['"no-owner"', '"a/b/c"', '"../x"', '"a/.."', '"/x"'])
def test_repo_must_be_owner_slash_name(tmp_path, repo):
    refused(models_file(tmp_path, repo=repo), r"pairs\.p\.target\.repo .*owner/name")


@pytest.mark.parametrize("rev", ["3", '"../../main"', '"/main"'])
def test_revision_must_be_a_plain_string(tmp_path, rev):
    refused(models_file(tmp_path, revision=rev), r"pairs\.p\.target\.revision .*branch, tag or commit")


def test_valid_entry_loads(tmp_path):
    path = models_file(tmp_path, revision='"v1.0"', size="12", sha256='"' + "AB" * 32 + '"')
    t = load_registry(path).get("p").target
    assert (t.repo, t.file, t.revision, t.size) == ("acme/tiny-GGUF", "tiny.gguf", "v1.0", 12)


def test_a_folder_is_not_a_models_file(tmp_path):
    refused(tmp_path, "is a folder, not a models.toml file")


def test_a_models_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('# café\n[pairs."p".target]\nrepo = "a/b"\nfile = "x.gguf"\n'.encode("latin-1"))
    refused(path, "is not valid UTF-8")


def test_missing_models_file(tmp_path):
    refused(tmp_path / "nope.toml", "does not exist")


def test_cli_says_it_in_one_line(tmp_path, capsys):
    try:
        code = main(["models", "--models", str(tmp_path)])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is a folder" in err


def test_a_pair_may_be_hidden_and_still_loads_by_name(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[pairs."t"]\nhidden = true\n[pairs."t".target]\nrepo = "a/b"\nfile = "t.gguf"\n')
    reg = load_registry(path)
    assert reg.get("t").hidden and not reg.get("smollm2-135m").hidden
    assert load_registry().get("gemma-3-270m").hidden  # the shipped pair that only tests use
    path.write_text('[pairs."t"]\nhidden = "yes"\n[pairs."t".target]\nrepo = "a/b"\nfile = "t.gguf"\n')
    refused(path, "pairs.t.hidden is 'yes'; it must be true or false")


def test_specs_built_in_code_are_checked_too():
    with pytest.raises(RegistryError, match="model file is '../x'"):
        ModelSpec(repo="a/b", file="../x")
    with pytest.raises(RegistryError, match="model size"):
        ModelSpec(repo="a/b", file="x", size="big")


def test_shipped_files_come_from_the_checkout():
    # in a checkout the top-level files are used (the wheel carries copies: tests/test_wheel.py)
    assert BUILTIN == ROOT / "models.toml" and (ROOT / "pyproject.toml").is_file()
    assert workloads_path() == ROOT / "workloads" / "prompts.jsonl" and workloads_path().is_file()
    assert "smollm2-135m" in load_registry().pairs  # every shipped entry passes the checks
