"""`bench --peer llama-server`: its command lines, its table, and its errors (the benchmark itself
needs a llama-server build and minutes: it is run by hand, figures in docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edgespec.bench.llama_server import PEERS, commands, format_table


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
    assert "| edit-1 (edit, 128 tok) | 1.00 (10.0 tok/s) | 2.00 = | 3.00 ≠ | 4.00 = | 5.00 = |" in table


def test_a_missing_llama_server_binary_is_a_one_line_error(smol, smol_draft, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "--target", str(smol), "--draft", str(smol_draft),
                        "--peer", "llama-server", "--llama-server", str(tmp_path / "nope"), "--kinds", "chat"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no executable there" in r.stderr
    r = subprocess.run([sys.executable, "-m", "edgespec", "bench", "--target", str(smol), "--peer", "llama-server",
                        "--modes", "auto,lookup-peer"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "runs on its own" in r.stderr
