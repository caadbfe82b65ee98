"""Issue 50, item 9 on the command line: a negative size gets words rather than argparse's
"expected one argument", `bench --kinds` names the kinds there are, a tiny --memory-budget is
said in a unit that shows it; and item 1's start check of --cache-dir beside --record. The CLI
is run in-process and asserted on its exit code and its one line."""
from __future__ import annotations

import json

import pytest

from edgespec.cli import main
from edgespec.ggufinfo import read_info
from edgespec.memory import plan


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgespec: error: "), err
    return err


@pytest.mark.parametrize("argv, said", [
    (["serve", "--cache-ram", "-5MiB"], "--cache-ram -5MiB: a size cannot be negative; give 0 to turn the prompt "
                                        "cache off, or a size like 512MiB"),
    (["run", "-p", "hi", "--cache-ram=-0.5GiB"], "--cache-ram -0.5GiB: a size cannot be negative"),
    (["plan", "--memory-budget", "-2GiB"], "--memory-budget -2GiB: a size cannot be negative; give a size like 2GiB"),
])
def test_a_negative_size_is_refused_in_words(smol, capsys, argv, said):
    assert main([*argv, "--target", str(smol)]) == 2
    err = _one_line(capsys)
    assert said in err and "expected one argument" not in err


def test_bench_kinds_lists_the_kinds_there_are(smol, tmp_path, capsys):
    workloads = tmp_path / "w.jsonl"
    workloads.write_text("".join(json.dumps({"id": i, "kind": k, "prompt": "hi"}) + "\n"
                                 for i, k in enumerate(["chat", "code", "chat"])))
    assert main(["bench", "--target", str(smol), "--workloads", str(workloads), "--kinds", "code,bogus"]) == 2
    err = _one_line(capsys)
    assert "no workloads of kind 'bogus'" in err and "its kinds are chat, code" in err
    assert "structured and agent" in err


def test_a_tiny_memory_budget_is_said_in_a_unit_that_shows_it(smol):
    reason = plan(read_info(smol), budget=1024, n_ctx=1024)["choice"]["reason"]
    assert reason.startswith("nothing fits in 1 KiB,") and "0.00 GiB" not in reason
    reason = plan(read_info(smol), budget=260 * 2**20, n_ctx=4096, drafter="ngram")["choice"]["reason"]
    assert reason == "ngram at n_ctx 4096 does not fit in 260 MiB", reason


def test_serve_checks_cache_dir_at_start(smol, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["serve", "--target", str(smol), "--cache-dir", str(afile / "cache"), "--port", "0"]) == 2
    assert f"--cache-dir {afile / 'cache'}: cannot write there" in _one_line(capsys)


def test_run_with_a_tiny_budget_says_it_in_a_unit_that_shows_it(smol, capsys):
    """`run --memory-budget 1KiB` refuses in one line, and says the budget as 1 KiB-ish, not 0.00 GiB."""
    from edgespec.cli import main
    try:
        code = main(["run", "--target", str(smol), "--memory-budget", "1KiB", "-p", "hi"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "0.00 GiB" not in err and "KiB" in err, err
