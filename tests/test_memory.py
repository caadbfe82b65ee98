"""Memory estimates against measured peak RSS, the plan, budgets, and no growth over time."""
import json
import subprocess
import sys

import psutil
import pytest

from edgespec import Engine
from edgespec.errors import UsageError
from edgespec.ggufinfo import read_info
from edgespec.memory import estimate_process, parse_size, plan
from edgespec.sampling import SamplingParams

from conftest import ROOT


@pytest.mark.parametrize("text, value", [("2GiB", 2 * 2**30), ("1500MB", 1500 * 10**6), ("2g", 2 * 10**9),
                                         ("512 MiB", 512 * 2**20), ("3.5GB", 3_500_000_000), ("800k", 800_000)])
def test_sizes_parse_as_people_write_them(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "2 parsecs", "-1GB", "0", "GB"])
def test_bad_sizes_are_usage_errors(bad):
    with pytest.raises(UsageError, match="size"):
        parse_size(bad)


def _peak_rss(model, ctx, drafter="none"):
    prompt = json.loads((ROOT / "workloads" / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    out = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(model), "--drafter", drafter,
                          "--ctx", str(ctx), "--json", "--max-tokens", "24", "--prompt", prompt * 2],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["peak_rss_bytes"]


@pytest.mark.parametrize("which, ctx", [("smol", 2048), ("gemma", 4096)])
def test_estimate_is_within_10_percent_of_measured_peak_rss(request, which, ctx):
    # gemma-3-270m was not used to fit the estimator's constants: an out-of-sample check
    model = request.getfixturevalue(which)
    est = estimate_process(read_info(model), n_ctx=ctx)["total"]
    peak = _peak_rss(model, ctx)
    assert abs(est - peak) / peak < 0.10, (est / 2**20, peak / 2**20)


def test_plan_falls_back_from_draft_model_to_ngram_then_smaller_context(smol, smol_draft):
    t, d = read_info(smol), read_info(smol_draft)
    need = {m: estimate_process(t, d, n_ctx=4096, drafter=m)["total"] for m in ("model", "ngram", "none")}
    assert need["model"] > need["ngram"] > need["none"]
    r = plan(t, d, n_ctx=4096, budget=need["model"] + 1)
    assert r["choice"]["drafter"] == "model" and r["choice"]["n_ctx"] == 4096
    r = plan(t, d, n_ctx=4096, budget=need["ngram"] + 1)
    assert (r["choice"]["drafter"], r["choice"]["n_ctx"]) == ("ngram", 4096)
    assert "does not fit" in r["choice"]["reason"]
    small = estimate_process(t, d, n_ctx=1024, drafter="none")["total"] + 1
    r = plan(t, d, n_ctx=4096, budget=small)
    assert r["choice"]["n_ctx"] < 4096
    assert all({"drafter", "n_ctx", "estimated_bytes", "fits"} <= set(c) for c in r["configs"])


def test_plan_cli_json(smol, smol_draft, capsys):
    from edgespec.cli import main
    assert main(["plan", "--target", str(smol), "--draft", str(smol_draft), "--memory-budget", "2GiB",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_bytes"] == 2 * 2**30 and out["choice"]["drafter"] == "model"
    assert {c["drafter"] for c in out["configs"]} == {"model", "ngram", "none"}


def test_engine_drops_the_draft_model_when_it_does_not_fit(smol, smol_draft, capsys):
    t, d = read_info(smol), read_info(smol_draft)
    budget = estimate_process(t, d, n_ctx=1024, drafter="ngram")["total"] + 2**20
    with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, memory_budget=budget) as eng:
        assert eng.drafter is None and eng.mode == "ngram"
    err = capsys.readouterr().err
    assert err.count("does not fit") == 1
    with pytest.raises(UsageError, match="does not fit"):
        Engine.load(str(smol), drafter="none", n_ctx=1024, memory_budget="10MB")


def test_rss_stays_flat_over_500_generations(smol, smol_draft):
    proc = psutil.Process()
    with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=512, gamma=1) as eng:
        ptoks = eng.target.tokenize("List some fruits:")
        rss = []
        for i in range(500):
            list(eng.generate_tokens(ptoks, 4, SamplingParams(1.0), seed=i))
            if i in (49, 499):
                rss.append(proc.memory_info().rss)
    assert (rss[1] - rss[0]) / rss[0] < 0.02, [r / 2**20 for r in rss]
