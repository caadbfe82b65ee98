"""The budget sweep's fallback order on a fake estimate, the GPU layer counts that every entry point
gives the planner, and the checks that refuse an impossible context or thread count before
anything is loaded."""
import json

import pytest

from edgespec import Engine, memory
from edgespec.assemble import Settings, check_context, offloaded_layers
from edgespec.bench import budgets
from edgespec.cli import main
from edgespec.errors import UsageError
from edgespec.ggufinfo import read_info

MiB = 2**20
BASE = {"model": 2000 * MiB, "ngram": 1000 * MiB, "none": 999 * MiB}


def fake_estimate(target_info, draft_info=None, *, n_ctx, drafter="none", **kw):
    """A process that needs a fixed part per configuration and 0.1 MiB per context token."""
    total = BASE[drafter] + n_ctx * MiB // 10
    return {"total": total, "runtime": 0, "target": total, "target_parts": {}, "runtime_parts": {}}


@pytest.fixture
def fake_sizes(monkeypatch):
    monkeypatch.setattr(memory, "estimate_process", fake_estimate)


def test_the_sweep_falls_back_from_the_pair_to_ngram_to_a_smaller_context(fake_sizes, smol, smol_draft):
    settings = Settings(target=str(smol), draft=str(smol_draft), n_ctx=4096).validate()
    t, d = read_info(smol), read_info(smol_draft)
    got = budgets.choices(settings, t, d, [3 * 2**30, 1536 * MiB, 1229 * MiB, 512 * MiB])
    assert [(c["drafter"], c["n_ctx"]) for c in got] == [("model", 4096), ("ngram", 4096), ("ngram", 2048),
                                                         (None, None)]
    assert "does not fit" in got[1]["reason"] and "nothing fits" in got[3]["reason"]


def test_the_sweep_runs_each_budget_in_its_own_process_with_its_choice(fake_sizes, smol, smol_draft):
    settings = Settings(target=str(smol), draft=str(smol_draft), n_ctx=4096, flash_attn="on").validate()
    commands = []

    def runner(cmd):
        commands.append(cmd)
        ctx = int(cmd[cmd.index("--ctx") + 1])
        return {"stats": {"tokens_per_second": 10.0, "acceptance_rate": 0.5, "drafter": "x"},
                "peak_rss_bytes": ctx * 1000}
    prompts = [{"id": "a", "kind": "code", "prompt": "def f():"}, {"id": "b", "kind": "chat", "prompt": "Hi"}]
    report = budgets.sweep(settings, [3 * 2**30, 1229 * MiB, 512 * MiB], prompts, max_tokens=8, runner=runner)
    assert len(commands) == 4  # two budgets fit, two prompts each; nothing is run for the third
    first, second = commands[0], commands[2]
    assert first[first.index("--memory-budget") + 1] == str(3 * 2**30) and "--draft" in first
    assert second[second.index("--ctx") + 1] == "2048"
    assert second[second.index("--memory-budget") + 1] == str(1229 * MiB)
    assert all(c[c.index("--flash-attn") + 1] == "on" for c in commands)
    rows = report["rows"]
    assert rows[0]["peak_rss_bytes"] == 4096 * 1000 and rows[1]["peak_rss_bytes"] == 2048 * 1000
    assert "peak_rss_bytes" not in rows[2] and rows[2]["drafter"] is None
    table = budgets.format_table(report)
    assert "pair (draft model)" in table and "n-gram only" in table and "nothing fits" in table


def test_bench_takes_a_list_of_budgets_and_refuses_a_bad_one(smol, capsys):
    with pytest.raises(UsageError, match="size"):
        budgets.parse_budgets("1GiB,lots")
    assert budgets.parse_budgets("1GiB, 512MiB") == [2**30, 512 * MiB]
    assert main(["bench", "--target", str(smol), "--memory-budget", "1GiB,nope"]) == 2
    assert "cannot read the size 'nope'" in capsys.readouterr().err


# -- GPU layers reach the planner from every entry point ----------------------------------------
class Planned(Exception):
    pass


@pytest.fixture
def spy(monkeypatch):
    """memory.plan records what it was given and stops there (nothing is loaded); a build that
    offloads (gpu_offload_supported) as a CUDA or Metal one would."""
    seen = []

    def fake_plan(t, d=None, **kw):
        seen.append(kw)
        raise Planned
    monkeypatch.setattr(memory, "plan", fake_plan)
    monkeypatch.setattr("edgespec.backend.gpu_offload_supported", lambda: True)
    return seen


def test_gpu_layers_reach_the_planner_from_engine_load(spy, smol, smol_draft):
    with pytest.raises(Planned):
        Engine.load(str(smol), draft=str(smol_draft), drafter="auto", n_ctx=1024, n_gpu_layers=7,
                    draft_n_gpu_layers=3, memory_budget="4GiB")
    assert (spy[0]["gpu_layers"], spy[0]["draft_gpu_layers"]) == (7, 3)


def test_gpu_layers_reach_the_planner_from_plan_and_run(spy, smol, smol_draft, capsys):
    base = ["--target", str(smol), "--draft", str(smol_draft), "--ctx", "1024", "--n-gpu-layers", "5",
            "--draft-n-gpu-layers", "-1"]
    for verb in (["plan"], ["run", "--memory-budget", "3GiB", "--prompt", "hi"]):
        with pytest.raises(Planned):
            main(verb + base)
    from edgespec.backend import ALL_GPU_LAYERS
    assert [(s["gpu_layers"], s["draft_gpu_layers"]) for s in spy] == [(5, ALL_GPU_LAYERS)] * 2


def test_gpu_layers_reach_the_planner_from_the_benchmarks(spy, smol, smol_draft):
    from edgespec.bench.memory import memory_bench
    s = Settings(target=str(smol), draft=str(smol_draft), n_ctx=1024, n_gpu_layers=9, draft_n_gpu_layers=0,
                 memory_budget="2GiB").validate()
    with pytest.raises(Planned):
        budgets.sweep(s, [2**30], [])
    with pytest.raises(Planned):
        memory_bench(s, None, [])
    assert [(x["gpu_layers"], x["draft_gpu_layers"]) for x in spy] == [(9, 0)] * 2


def test_a_cpu_only_build_offloads_nothing_whatever_is_asked(monkeypatch):
    monkeypatch.setattr("edgespec.backend.gpu_offload_supported", lambda: False)
    assert offloaded_layers(-1) == offloaded_layers(12) == 0


def test_offloaded_layers_leave_the_estimate_for_the_gpu(smol):
    info = read_info(smol)
    cpu = memory.estimate_process(info, n_ctx=2048, gpu_layers=0)
    half = memory.estimate_process(info, n_ctx=2048, gpu_layers=15)
    full = memory.estimate_process(info, n_ctx=2048, gpu_layers=2**31 - 1)
    assert cpu["target_parts"]["kv_cache"] == 2 * half["target_parts"]["kv_cache"] > 0
    assert full["target_parts"]["kv_cache"] == 0 and full["total"] < half["total"] < cpu["total"]


# -- contexts and threads that cannot work are refused before loading ---------------------------
def test_a_context_beyond_the_trained_one_is_refused_before_loading(smol, capsys, monkeypatch):
    import edgespec.backend as backend

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(backend, "LlamaBackend", no_load)
    with pytest.raises(UsageError, match=r"more than the 8192 tokens .* was trained for: pass --ctx 8192 or less"):
        Engine.load(str(smol), drafter="none", n_ctx=10**9)
    assert main(["run", "--target", str(smol), "--ctx", "16384", "--prompt", "hi", "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--ctx 8192" in err


def test_a_context_bigger_than_the_machine_is_refused(smol, monkeypatch):
    info = read_info(smol)
    monkeypatch.setattr(memory, "total_memory", lambda: 200 * MiB)  # a small board
    check_context(Settings(target=str(smol), n_ctx=512), info)  # weights + a small KV cache: fine
    with pytest.raises(UsageError, match=r"n_ctx \(--ctx\) 8192 needs at least .* GiB .* more than this machine"):
        check_context(Settings(target=str(smol), n_ctx=8192), info)


def test_more_threads_than_cpus_are_refused(monkeypatch, smol, capsys):
    import edgespec.assemble as assemble
    monkeypatch.setattr(assemble, "cpu_count", lambda: 4)
    Settings(threads=4).validate()
    with pytest.raises(UsageError, match="threads .* 1000 is more than the 4 CPUs"):
        Settings(threads=1000).validate()
    assert main(["run", "--target", str(smol), "--threads", "5", "--prompt", "hi"]) == 2
    assert "more than the 4 CPUs" in capsys.readouterr().err


def test_flash_attn_is_a_checked_setting(smol, capsys):
    with pytest.raises(UsageError, match="flash_attn .* must be one of on, off, auto"):
        Settings(flash_attn="maybe").validate()
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--target", str(smol), "--flash-attn", "maybe", "--prompt", "hi"])
    assert exit_.value.code == 2 and "invalid choice: 'maybe'" in capsys.readouterr().err
    assert main(["plan", "--target", str(smol), "--flash-attn", "on", "--ctx", "2048", "--drafter", "none",
                 "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["choice"]["estimated_bytes"]
    assert main(["plan", "--target", str(smol), "--flash-attn", "off", "--ctx", "2048", "--drafter", "none",
                 "--json"]) == 0
    off = json.loads(capsys.readouterr().out)["choice"]["estimated_bytes"]
    assert off > on  # the planner follows the setting: scores for every cached position without it


def test_plan_explains_every_registered_drafter_in_words(smol, smol_draft, capsys):
    from edgespec.assemble import REGISTRY
    for name, kind in REGISTRY.items():  # copy plans as an n-gram index: explain looked up "copy", crashed
        draft = ["--draft", str(smol_draft)] if kind.model == "needs" else []
        assert main(["plan", "--target", str(smol), *draft, "--ctx", "1024", "--drafter", name]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith("Budget: ") and "Wanted: " in out, (name, out)
