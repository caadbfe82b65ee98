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
    settings = Settings(target=str(smol), draft=str(smol_draft), n_ctx=4096, cache_ram=0).validate()
    t, d = read_info(smol), read_info(smol_draft)
    got = budgets.choices(settings, t, d, [3 * 2**30, 1536 * MiB, 1229 * MiB, 512 * MiB])
    assert [(c["drafter"], c["n_ctx"]) for c in got] == [("model", 4096), ("ngram", 4096), ("ngram", 2048),
                                                         (None, None)]
    assert "does not fit" in got[1]["reason"] and "nothing fits" in got[3]["reason"]


def test_the_sweep_runs_each_budget_in_its_own_process_with_its_choice(fake_sizes, smol, smol_draft):
    settings = Settings(target=str(smol), draft=str(smol_draft), n_ctx=4096, flash_attn="on",
                        cache_ram=0).validate()
    commands, plain = [], []

    def runner(cmd):
        ctx = int(cmd[cmd.index("--ctx") + 1])
        if "--memory-budget" not in cmd:  # plain f16 decoding, what the speeds are a ratio to
            plain.append(cmd)
            return {"stats": {"tokens_per_second": 4.0 if len(plain) <= 2 else 6.0, "acceptance_rate": 0.0},
                    "peak_rss_bytes": 1}
        commands.append(cmd)
        return {"stats": {"tokens_per_second": 10.0, "acceptance_rate": 0.5, "drafter": "x"},
                "peak_rss_bytes": ctx * 1000}
    prompts = [{"id": "a", "kind": "code", "prompt": "def f():"}, {"id": "b", "kind": "chat", "prompt": "Hi"}]
    report = budgets.sweep(settings, [3 * 2**30, 1229 * MiB, 512 * MiB], prompts, max_tokens=8, runner=runner)
    assert len(commands) == 4  # two budgets fit, two prompts each; nothing is run for the third
    # plain decoding of each prompt before and after the budgets: default mode, no budget, the wanted context
    assert len(plain) == 4 and all(c[c.index("--drafter") + 1] == "none" and "--draft" not in c for c in plain)
    assert all(c[c.index("--ctx") + 1] == "4096" and not {"--no-repack", "-ctk", "-ctv"} & set(c) for c in plain)
    assert report["plain_tokens_per_second"] == {"a": [4.0, 6.0], "b": [4.0, 6.0]}
    assert report["rows"][0]["speed_vs_plain"] == pytest.approx(2.0)  # 10 tok/s against a mean of 5
    first, second = commands[0], commands[2]
    assert first[first.index("--memory-budget") + 1] == f"{3 * 2**30}B" and "--draft" in first
    assert second[second.index("--ctx") + 1] == "2048"
    assert second[second.index("--memory-budget") + 1] == f"{1229 * MiB}B"
    assert all(c[c.index("--cache-ram") + 1] == "0" for c in commands)  # the child plans as the sweep did
    assert all(c[c.index("--flash-attn") + 1] == "on" for c in commands)
    rows = report["rows"]
    assert rows[0]["peak_rss_bytes"] == 4096 * 1000 and rows[1]["peak_rss_bytes"] == 2048 * 1000
    assert "peak_rss_bytes" not in rows[2] and rows[2]["drafter"] is None
    table = budgets.format_table(report)
    assert "pair (draft model)" in table and "n-gram only" in table and "nothing fits" in table
    assert "| default | " in table and "| 2.00 |" in table and "x plain f16" in table


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


# -- one budget rule: plan, run, the library and the sweep give the same answer -----------------
class Loaded(Exception):
    pass


@pytest.fixture
def no_load(monkeypatch):
    """Stop at the first model load: what was decided before it (the fit) is all that is asked."""
    def refuse(path, **kw):
        raise Loaded(str(path))
    monkeypatch.setattr("edgespec.backend.LlamaBackend", refuse)


def _needs(smol, smol_draft, capsys) -> dict:
    """plan's estimate per drafter at n_ctx 1024 for SmolLM2 + its cut-down draft, one sequence
    (what `run` plans for; without a budget `plan` would choose up to 4 by the RAM available)."""
    assert main(["plan", "--target", str(smol), "--draft", str(smol_draft), "--ctx", "1024", "--parallel", "1",
                 "--json"]) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    return {c["drafter"]: c["estimated_bytes"] for c in configs if c["n_ctx"] == 1024}


def _fit(budget: int) -> str:
    """The figure both verbs print: the budget less its default prompt-cache share (a tenth), in the
    unit that shows it (memory.size_words: 277.3 MiB, not 0.27 GiB)."""
    from edgespec.memory import size_words
    return size_words(budget - budget // 10)


def test_plan_run_and_the_library_drop_the_draft_model_at_the_same_budget(smol, smol_draft, capsys, no_load):
    from edgespec.assemble import fit_budget
    need = _needs(smol, smol_draft, capsys)
    budget = need["model"] + MiB  # the pair fits the budget, but not once the prompt cache has its share
    assert budget - budget // 10 < need["model"] and budget - budget // 10 > need["ngram"]
    base = ["--target", str(smol), "--draft", str(smol_draft), "--ctx", "1024", "--memory-budget", f"{budget}B"]
    assert main(["plan", *base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["drafter"] == "ngram"  # it said "model" before
    assert main(["plan", *base]) == 0
    out = capsys.readouterr().out
    assert "Fits: target + n-gram drafting at n_ctx 1024" in out and f"{_fit(budget)} for the models" in out
    assert "kept for the prompt cache (--cache-ram" in out
    with pytest.raises(Loaded, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        main(["run", *base, "--drafter", "model", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert f"the model drafter does not fit in {_fit(budget)} (" in err and "using ngram drafting" in err
    settings = Settings(target=str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024,
                        memory_budget=budget).validate()
    assert fit_budget(settings, read_info(smol), read_info(smol_draft))[:3] == ("ngram", False, 1)
    # with the cache share given back, all three keep the draft model
    assert main(["plan", *base, "--cache-ram", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["choice"]["drafter"] == "model"
    from dataclasses import replace
    assert fit_budget(replace(settings, cache_ram=0), read_info(smol), read_info(smol_draft))[:3] == ("model", True, 1)


def test_plan_run_and_the_library_refuse_the_same_budget_with_the_same_figure(smol, smol_draft, capsys, no_load):
    need = _needs(smol, smol_draft, capsys)
    budget = need["ngram"] + MiB  # n-gram drafting fitted the whole budget: plan said yes, run said no
    assert budget - budget // 10 < need["none"]
    base = ["--target", str(smol), "--ctx", "1024", "--memory-budget", f"{budget}B"]
    assert main(["plan", *base]) == 0
    out = capsys.readouterr().out
    assert f"Nothing fits: nothing fits in {_fit(budget)}," in out
    assert main(["run", *base, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"does not fit in {_fit(budget)} (" in err
    assert "lower --cache-ram" in err
    with pytest.raises(UsageError, match=f"does not fit in {_fit(budget)}"):
        Engine.load(str(smol), n_ctx=1024, memory_budget=budget)
    with pytest.raises(Loaded):  # without the cache's share it fits, for run as for plan
        main(["run", *base, "--cache-ram", "0", "--prompt", "hi"])


def test_a_sweep_records_a_budget_that_fits_nothing_and_goes_on(smol, smol_draft, capsys, tmp_path, monkeypatch,
                                                                  no_load):
    need = _needs(smol, smol_draft, capsys)
    fits = need["model"] * 2
    children = []

    def child(cmd):  # the run the sweep starts: its own plan must accept what the sweep chose
        if "--memory-budget" in cmd:  # not plain decoding's runs
            children.append(cmd)
        with pytest.raises(Loaded):
            main(cmd[3:])  # [python, -m, edgespec, run, ...]
        return {"stats": {"tokens_per_second": 5.0, "acceptance_rate": 0.5}, "peak_rss_bytes": need["model"]}
    monkeypatch.setattr(budgets, "run_child", child)
    out = tmp_path / "bench.json"
    assert main(["bench", "--target", str(smol), "--draft", str(smol_draft), "--ctx", "1024", "--kinds", "code",
                 "--memory-budget", f"1MiB,{fits}B,2MiB", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "budgets.json").read_text())  # written, though two budgets fit nothing
    rows = report["rows"]
    assert [r["drafter"] for r in rows] == [None, "model", None] and len(children) == 1
    assert "nothing fits in" in rows[0]["reason"] and "peak_rss_bytes" in rows[1]
    assert rows[1]["cache_bytes"] == fits // 10 and rows[1]["fit_bytes"] == fits - fits // 10
    cmd = children[0]
    assert cmd[cmd.index("--cache-ram") + 1] == f"{fits // 10}B"
    table = capsys.readouterr().out
    assert table.count("nothing fits") == 2 and "pair (draft model)" in table


def test_a_sweep_goes_on_when_one_budgets_run_fails(fake_sizes, smol, smol_draft):
    settings = Settings(target=str(smol), draft=str(smol_draft), n_ctx=4096, cache_ram=0).validate()

    def runner(cmd):
        if "--memory-budget" in cmd and cmd[cmd.index("--memory-budget") + 1] == f"{3 * 2**30}B":
            raise UsageError("the run for this budget failed: out of memory")
        return {"stats": {"tokens_per_second": 10.0, "acceptance_rate": 0.5}, "peak_rss_bytes": 1}
    report = budgets.sweep(settings, [3 * 2**30, 4 * 2**30], [{"id": "a", "kind": "code", "prompt": "x"}],
                           runner=runner)
    failed, ok = report["rows"]
    assert "out of memory" in failed["error"] and "peak_rss_bytes" not in failed
    assert ok["peak_rss_bytes"] == 1
    assert "run failed" in budgets.format_table(report) and "run failed" in budgets.describe(failed)


@pytest.mark.parametrize("budget", ["300MB", "400MB", "600MB", "1GB"])
def test_plan_says_what_run_and_the_library_do_over_a_grid(smol, budget, monkeypatch, capsys):
    """Issue 35: `plan` and `run` (and Engine.load, and serve, which load through the same
    assemble.decide) make the same decision for the same flags: refused with the same one line,
    or the same drafter, sequences and KV types at the context asked (never a lowered one)."""
    loads = []

    def record(path, **kw):
        loads.append(kw)
        raise Loaded(str(path))
    monkeypatch.setattr("edgespec.backend.LlamaBackend", record)
    for ctx in (1024, 4096):
        for np_ in (1, 2, 8):
            flags = ["--target", str(smol), "--ctx", str(ctx), "-np", str(np_), "--memory-budget", budget]
            assert main(["plan", *flags, "--json"]) == 0
            said = json.loads(capsys.readouterr().out)["decision"]
            loads.clear()
            run = flags[:4] + flags[6:]  # run answers one prompt: one sequence, no -np
            if not said["ok"]:
                if np_ == 1:
                    assert main(["run", *run, "--prompt", "hi"]) == 2
                    err = capsys.readouterr().err.strip()
                    assert len(err.splitlines()) == 1 and said["error"] in err, (ctx, np_, err)
                with pytest.raises(UsageError) as refused:
                    Engine.load(str(smol), n_ctx=ctx, parallel=np_, memory_budget=budget)
                assert str(refused.value) == said["error"]
                continue
            if np_ == 1:
                with pytest.raises(Loaded):
                    main(["run", *run, "--prompt", "hi"])
                capsys.readouterr()
            with pytest.raises(Loaded):
                Engine.load(str(smol), n_ctx=ctx, parallel=np_, memory_budget=budget)
            for kw in loads:  # the run's load, then the library's: both as plan said
                assert kw["n_ctx"] == said["n_ctx"] == ctx and kw["n_seq"] == said["parallel"] == np_
                quantized = "q8_0" in said["memory_mode"]
                assert kw["type_k"] == ("q8_0" if quantized else "f16")
                assert kw.get("repack", True) == ("no repack" not in said["memory_mode"])


@pytest.mark.parametrize("value", ["two", "0", "1000"])
def test_a_bad_edgespec_threads_is_a_one_line_error(monkeypatch, smol, capsys, value):
    """$EDGESPEC_THREADS is --threads' default (the test workers share the cores with it)."""
    from edgespec.backend import default_threads
    monkeypatch.setenv("EDGESPEC_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("EDGESPEC_THREADS", value)
    with pytest.raises(UsageError, match="EDGESPEC_THREADS"):
        default_threads()
    assert main(["run", "--target", str(smol), "--prompt", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "EDGESPEC_THREADS" in err and "from 1 to its" in err and len(err.splitlines()) == 1
