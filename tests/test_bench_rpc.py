"""`bench --rpc-latency-ms`: plain and auto with the target on a real loopback rpc-server the benchmark
starts itself, behind delay proxies (edgespec/bench/rpc.py); llama-server's command lines over RPC
(timing it needs a llama-server build: run by hand)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec import rpc
from edgespec.assemble import Settings
from edgespec.bench import Options
from edgespec.bench.rpc import PEER_MODES, check, format_table, parse_latencies, peer_commands, summarize
from edgespec.errors import UsageError

# an edit whose answer copies its prompt: auto's copy and n-gram drafts are taken, and greedy
# decoding meets no near-tie that a batched pass could tip the other way (answers must be equal)
COPY_EDIT = {"id": "edit-copy-list", "kind": "edit",
             "prompt": "Return this list exactly as it is, nothing else:\n\n1. apples\n2. bread\n3. cheese\n"
                       "4. dates\n5. eggs\n6. flour\n7. grapes\n8. honey"}


def _bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", "bench", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(not rpc.available(), reason="llama-cpp-python built without GGML_RPC: make llama")
def test_the_network_bench_runs_plain_and_auto_over_its_own_rpc_server(smol, smol_draft, tmp_path, own_tables):
    workloads = tmp_path / "w.jsonl"
    workloads.write_text(json.dumps(COPY_EDIT) + "\n")
    out = tmp_path / "x.json"

    def network_keyed():  # calibrations keyed by rpc endpoints (a user's own runs may have left some)
        return {f.name for f in (own_tables / "calibration").glob("*.json") if '"rpc"' in f.read_text()}
    before = network_keyed()
    r = _bench("--target", smol, "--draft", smol_draft, "--rpc-latency-ms", "0,5", "--workloads", workloads,
               "--kinds", "edit", "--limit", 1, "--trials", 1, "--bench-tokens", 16, "--ctx", 512, "--out", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [lv["latency_ms"] for lv in report["latencies"]] == [0, 5]
    assert report["own_server"] and len(report["rpc_servers"]) == 1
    ports = set()
    for lv in report["latencies"]:
        ports.update(lv["proxies"])
        s = lv["summary"]
        assert s["identical"], lv["edgespec"]["rows"]
        plain, auto = s["modes"]["plain"], s["modes"]["auto"]
        assert plain["round_trips_per_token"] > 0 and plain["kb_per_token"] > 0
        # a verifying pass takes several tokens for one round trip; plain decoding, one
        assert plain["round_trips_per_token"] >= auto["round_trips_per_token"] > 0, s
        assert plain["tok_s"] > 0 and auto["tok_s"] > 0 and s["ratio"] > 0
        assert lv["edgespec"]["calibration"] and lv["edgespec"]["calibration_record"]["source"] == "calibrated"
        row = lv["edgespec"]["rows"][0]
        assert row["modes"]["plain"]["decode_tokens"] == row["modes"]["plain"]["generated"] - 1 == 15
    assert len(ports) == 2  # a proxy, and a load, per latency
    table = r.stdout
    assert "| 0 |" in table and "| 5 |" in table and "RT/tok plain" in table and f"JSON: {out}" in table
    # the calibrations keyed by the proxies' passing ports are not left in the cache
    assert network_keyed() == before
    assert "stopped" in (tmp_path / "rpc-logs" / "rpc-server.log").read_text()  # its own server, stopped


@pytest.mark.parametrize("given, words", [("-1", "'-1' is not a number"), ("2,fast", "'fast' is not a number")])
def test_bad_latencies_are_one_line_usage_errors(smol, given, words):
    r = _bench("--target", smol, "--rpc-latency-ms", given, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and words in r.stderr and "0,2,10,30" in r.stderr, r.stderr


def test_latencies_are_read_as_milliseconds():
    assert parse_latencies("0, 2,10,30") == (0.0, 2.0, 10.0, 30.0)
    assert parse_latencies("0.5") == (0.5,)
    for bad in ("", "1,,2", "nan", "inf", "1,1"):
        with pytest.raises(UsageError):
            parse_latencies(bad)


def test_it_runs_on_its_own_at_t0_with_auto():
    with pytest.raises(UsageError, match="runs on its own"):
        check(Settings(), Options(modes=("auto", "ngram"), rpc_latency_ms=(0.0,)))
    with pytest.raises(UsageError, match="T = 0"):
        from edgespec.sampling import SamplingParams
        check(Settings(), Options(rpc_latency_ms=(0.0,), sampling=SamplingParams(0.8)))
    with pytest.raises(UsageError, match="not drafter ngram"):
        check(Settings(drafter="ngram"), Options(rpc_latency_ms=(0.0,)))
    check(Settings(), Options(rpc_latency_ms=(0.0,), peer="llama-server"))


def test_llama_server_runs_its_target_through_the_proxies_and_its_draft_here():
    cmds = peer_commands(Path("/bin/llama-server"), Path("t.gguf"), Path("d.gguf"), 4096, 2,
                         ["127.0.0.1:4001", "127.0.0.1:4002"])
    assert list(cmds) == list(PEER_MODES)
    for cmd in cmds.values():
        text = " ".join(cmd)
        assert "-m t.gguf" in text and "-c 4096" in text and "-t 2" in text
        assert "--rpc 127.0.0.1:4001,127.0.0.1:4002 -ngl 99" in text and "--port" not in text
    ds = " ".join(cmds["llama-server draft-simple"])
    assert "-md d.gguf --spec-type draft-simple" in ds and ds.endswith("-devd none")
    ng = " ".join(cmds["llama-server ngram-mod"])
    assert "--spec-type ngram-mod" in ng and "-md" not in ng and "-devd" not in ng
    gpu = peer_commands(Path("/bin/llama-server"), Path("t.gguf"), Path("d.gguf"), 4096, 2, ["h:1"], "CUDA0")
    assert gpu["llama-server draft-simple"][-4:] == ["-devd", "CUDA0", "-ngld", "99"]


def _mode(tok_s, rt, up, down, tokens=15, **more):
    return {"tok_s": tok_s, "decode_tokens": tokens, "decode_round_trips": rt, "decode_up_bytes": up,
            "decode_down_bytes": down, **more}


def test_the_table_gives_speeds_ratios_and_traffic_per_decoded_token_with_the_peers():
    rows = [{"id": "p", "kind": "edit", "identical": True, "ratio": 2.0, "answer": "same",
             "modes": {"plain": _mode(10.0, 15, 15_000, 3_000_000), "auto": _mode(20.0, 5, 30_000, 3_000_000)}}]
    peers = {n: {"rows": [{**_mode(8.0 * (i + 1), 6 + i, 0, 1_500_000), "id": "p", "wall_tok_s": 5.0,
                           "answer": "same" if i else "other"}]} for i, n in enumerate(PEER_MODES)}
    level = {"latency_ms": 10.0, "edgespec": {"rows": rows, "calibration": [0.025]}, "peers": peers}
    level["summary"] = summarize(level)
    s = level["summary"]
    assert s["modes"]["plain"]["round_trips_per_token"] == 1.0 and s["modes"]["auto"]["round_trips_per_token"] == 0.333
    assert s["modes"]["auto"]["kb_per_token"] == 202.0  # (30 KB + 3 MB) / 15
    ds, ng = (s["peers"][n] for n in PEER_MODES)
    assert ds["auto_ratio"] == 2.5 and ng["auto_ratio"] == 1.25 and ds["same_text_as_plain"] == 0
    assert ng["same_text_as_plain"] == 1 and ng["round_trips_per_token"] == 0.467
    table = format_table({"bench_tokens": 16, "trials": 1, "prompts": 1, "latencies": [level]})
    assert "| 10 | 25.0 | 10.0 | 20.0 | 2.00 | 1.00 | 0.33 | 201.0 | 202.0 | yes | 8.0 | 2.50 | 16.0 | 1.25 |" in table
    assert "| 10 | llama-server ngram-mod | 16.0 | 5.0 | 0.47 | 100.0 | 1/1 |" in table
