"""`bench --host-cost`: edgespec's real rounds over a simulated device that returns logits rows recorded
from SmolLM2 (and its 24-block cut as the draft)."""
import json

import pytest

from edgespec.bench import hostcost

from test_cli import run_cli


@pytest.fixture(scope="module")
def rec(smol, smol_draft):
    return hostcost.recorded(hostcost.VOCABS["49k"])


@pytest.fixture(scope="module")
def vocab(rec):
    from edgespec.backend import LlamaBackend
    be = LlamaBackend(rec["draft_path"], n_ctx=256, n_batch=64)
    yield be
    be.close()


def test_the_recording_holds_a_target_and_a_draft_row_per_position(rec):
    assert rec["target"].shape == (hostcost.ROWS, 49152) and rec["draft"].shape == (hostcost.ROWS, 49152)
    assert len(rec["tokens"]) == rec["prompt_len"] + hostcost.ROWS - 1
    # the target's own rows lead to its recorded (greedy) answer
    assert [int(r.argmax()) for r in rec["target"][:-1]] == rec["tokens"][rec["prompt_len"]:]


@pytest.mark.parametrize("k", [0, 4])
def test_the_simulated_device_replays_the_targets_answer_at_t0(rec, vocab, k):
    """Over the simulation the engine gives the recorded greedy answer whatever it drafts (the rows
    are the target's at each position), and the device time is the passes' nominal time."""
    from edgespec.drafters.model import ModelDrafter
    from edgespec.engine import Engine
    off = rec["prompt_len"] - 1
    target = hostcost.SimBackend(vocab, rec["target"], 3.0, 0.1, offset=off)
    draft = hostcost.SimBackend(vocab, rec["draft"], 1.0, 0.0, offset=off)
    with Engine(target, ModelDrafter(draft, 49152, gamma=k) if k else None) as engine:
        r = engine.generate(rec["tokens"][:rec["prompt_len"]], max_tokens=hostcost.ROWS - 1)
    assert r.tokens == rec["tokens"][rec["prompt_len"]:]
    # a pass a round, and the prompt's: a pass a canonical piece (one forward counted for them all)
    assert target.passes == r.stats.target_forwards + (rec["prompt_len"] - 1) // target.canonical_piece
    if k:
        assert 0 < r.stats.accepted < r.stats.drafted  # the draft's rows are another model's
    assert target.busy == pytest.approx(sum(0.003 + 0.0001 * n for n in target.fed))


def test_bench_host_cost_reports_efficiency_and_rows_against_llama_cpp(smol, smol_draft, tmp_path, capsys):
    out = tmp_path / "h.json"
    code, stdout, err = run_cli(["bench", "--host-cost", "--vocabs", "49k", "--settings", "greedy,top-p",
                                 "--host-k", "0,2", "--host-parallel", "1,2", "--trials", "2", "-n", "8",
                                 "--out", str(out)], capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    got = {(r["setting"], r["k"], r["parallel"]) for r in report["runs"]}
    assert got == {(s, k, p) for s in ("T=0", "T=0.8 top-p 0.95") for k in (0, 2) for p in (1, 2)}
    assert all(0 < r["efficiency"] <= 1 and len(r["trials"]) == 2 for r in report["runs"])
    assert all(r["device_ms_per_token"] > 0 and r["wall_ms_per_token"] >= r["device_ms_per_token"]
               for r in report["runs"])
    assert {r["setting"] for r in report["rows"]} == {"T=0", "T=0.8 top-p 0.95"}
    assert all(r["edgespec_us"] > 0 and r["llama_cpp_us"] > 0 for r in report["rows"])
    assert "efficiency" in stdout and "llama.cpp" in stdout and "T=0.8 top-p 0.95" in stdout


@pytest.mark.parametrize("args, fragment", [
    (["--device-ms", "3"], "--device-ms takes A,B"),
    (["--vocabs", "99k"], "unknown vocabulary '99k'"),
    (["--settings", "hot"], "unknown setting 'hot'"),
    (["--host-k", "0,x"], "--host-k takes a comma-separated list"),
    (["--host-parallel", "0"], "--host-parallel takes 1..8"),
    (["--draft-ms", "0"], "--draft-ms must be > 0"),
])
def test_bench_host_cost_bad_arguments(args, fragment, capsys):
    code, _, err = run_cli(["bench", "--host-cost", *args], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and fragment in err and "Traceback" not in err
