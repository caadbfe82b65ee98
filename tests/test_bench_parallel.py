"""`bench --parallel-requests`: the several-requests benchmark runs end to end on SmolLM2 (2 short
prompts, 8 tokens) and writes the fields the docs describe. Nothing here asserts a speed."""
import json

import pytest
from test_cli import assert_usage_error, run_cli


@pytest.fixture(scope="module")
def report(smol, tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "p.json"
    from edgespec.cli import main
    code = main(["bench", "--target", str(smol), "--parallel-requests", "2", "--kinds", "code,chat",
                 "--max-tokens", "8", "--ctx", "1024", "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_report_has_both_modes_and_both_parts(report):
    assert report["parallel"] == 2 and report["requests"] == 2
    assert (report["max_tokens"], report["long_tokens"], report["short_tokens"]) == (8, 16, 2)
    assert set(report["modes"]) == {"auto", "none"}
    for name, m in report["modes"].items():
        assert [p["kind"] for p in m["prompts"]] == ["code", "chat"]
        for part in ("serial", "concurrent"):
            assert m[part]["tokens"] == sum(p[part]["generated"] for p in m["prompts"]) > 0
            assert m[part]["wall_s"] > 0 and m[part]["tps"] > 0
        assert m["ratio"] == pytest.approx(m["concurrent"]["tps"] / m["serial"]["tps"])
        for p in m["prompts"]:
            assert 0 < p["serial"]["generated"] <= 8 and 0 < p["concurrent"]["generated"] <= 8
            # the equality flag and where the answers parted say the same thing
            assert isinstance(p["identical"], bool)
            assert p["identical"] == (p["first_divergence"] is None)
        assert m["identical"] == all(p["identical"] for p in m["prompts"])
        lt = m["latency"]
        assert lt["long"]["id"] != lt["short"]["id"]
        assert 0 < lt["short"]["generated"] <= 2 and 0 < lt["long"]["generated"] <= 16
        assert lt["short_over_long"] == pytest.approx(lt["short"]["wall_s"] / lt["long"]["wall_s"])
        assert lt["goal"] == 0.3 and isinstance(lt["meets_goal"], bool)
        assert lt["short"]["alone_wall_s"] > 0 and lt["long"]["alone_wall_s"] > 0
        assert isinstance(lt["short"]["identical_to_alone"], bool)
    assert report["auto_concurrent_over_plain_serial"] > 0
    assert all(isinstance(p["serial_identical_to_plain"], bool) for p in report["modes"]["auto"]["prompts"])


def test_parallel_requests_runs_alone(smol, capsys):
    code, _, err = run_cli(["bench", "--target", str(smol), "--parallel-requests", "--trials", "2"], capsys)
    assert_usage_error(code, err, "--parallel-requests runs on its own")
    code, _, err = run_cli(["bench", "--target", str(smol), "--parallel-requests", "1"], capsys)
    assert_usage_error(code, err, "2..64")
    code, _, err = run_cli(["bench", "--target", str(smol), "--parallel-requests", "3", "--kinds", "edit,code"],
                           capsys)
    assert_usage_error(code, err, "needs 3 prompts", "--limit")
