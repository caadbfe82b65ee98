"""`bench --peer llama-server`: its command lines, its table, and its errors (the benchmark itself
needs a llama-server build and minutes: it is run by hand, figures in docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edgespec.bench.llama_server import PEERS, REFERENCE, Answer, commands, format_table, summarize


def test_the_five_servers_share_the_model_threads_and_context():
    cmds = commands(Path("/bin/llama-server"), Path("t.gguf"), Path("d.gguf"), 4096, 2)
    assert list(cmds) == list(PEERS)
    for name, cmd in cmds.items():
        text = " ".join(cmd)
        assert "t.gguf" in text and "4096" in text and " 2 " in text + " "
    assert cmds["llama-server draft-simple"][-4:] == ["-md", "d.gguf", "--spec-type", "draft-simple"]
    assert cmds["llama-server ngram-mod"][-2:] == ["--spec-type", "ngram-mod"]
    assert cmds["edgespec auto"][-2:] == ["--drafter", "auto"] and cmds["edgespec none"][-1] == "none"


def test_the_table_gives_ratios_and_equality():
    peers = {n: {"tok_s": 10.0 * (i + 1), "ratio": float(i + 1), "tokens": 128, "same_as_plain": i != 2}
             for i, n in enumerate(PEERS)}
    table = format_table({"trials": 2, "max_tokens": 128, "rows": [{"id": "edit-1", "kind": "edit", "peers": peers}]})
    assert "| edit-1 (edit, 128 tok) | 1.00 (10.0 tok/s) = | 2.00 = | 3.00 ≠ | 4.00 = | 5.00 = |" in table
    assert "decoding alone" not in table  # no server timings: no second table


def _answer(text, wall, prompt_ms=None, predicted_ms=None):
    return Answer(text, 5, wall, prompt_ms, predicted_ms)


def test_answers_are_compared_with_the_prompt_evaluated_whole_and_decoding_is_split_out():
    """The reference is llama-server plain's untimed answer with nothing cached, trial by trial:
    its own timed answer may part from it (a prefix reused from the previous prompt), and then it
    is marked so; a server whose answers equal the reference in every trial is marked equal."""
    items = [{"id": "p", "kind": "chat"}]
    runs = {"p": {REFERENCE: [_answer("cached", 1.0, 100, 400), _answer("whole", 2.0, 100, 400)],
                  "edgespec none": [_answer("whole", 0.5, 50, 200), _answer("whole", 1.0, 50, 100)],
                  "edgespec auto": [_answer("whole", 1.0), _answer("other", 1.0)]}}
    rows = summarize(items, runs, {"p": ["whole", "whole"]})
    peers = rows[0]["peers"]
    assert peers[REFERENCE]["same_as_plain"] is False and peers[REFERENCE]["same_trials"] == 1
    assert peers["edgespec none"]["same_as_plain"] is True and peers["edgespec none"]["stable"]
    assert peers["edgespec auto"]["same_as_plain"] is False and not peers["edgespec auto"]["stable"]
    # medians: reference 5/1 and 5/2 tok/s -> 3.75; none 10 and 5 -> 7.5; ratio 2
    assert peers["edgespec none"]["ratio"] == 2.0
    # decoding alone: 4 tokens over 400 ms = 10 tok/s; none: 20 and 40 -> 30
    assert peers[REFERENCE]["decode_tok_s"] == 10.0 and peers["edgespec none"]["decode_ratio"] == 3.0
    assert peers["edgespec auto"]["decode_ratio"] is None and peers["edgespec none"]["answer"] == "whole"
    table = format_table({"trials": 2, "max_tokens": 5, "rows": rows})
    assert "1.00 (3.8 tok/s) ≠" in table and "decoding alone" in table and "| 3.00 = |" in table


def test_a_missing_llama_server_binary_is_a_one_line_error(smol, smol_draft, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "--target", str(smol), "--draft", str(smol_draft),
                        "--peer", "llama-server", "--llama-server", str(tmp_path / "nope"), "--kinds", "chat"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no executable there" in r.stderr
    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "--target", str(smol), "--peer", "llama-server",
                        "--modes", "auto,lookup-peer"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "runs on its own" in r.stderr
