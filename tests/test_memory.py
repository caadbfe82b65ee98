"""Memory estimates against measured peak RSS, the plan, budgets, no growth over time, and
the machine probe that measures what varies between machines."""
import json
import logging
import platform
import subprocess
import sys

import pytest

from edgespec import Engine, probe
from edgespec.assemble import Settings
from edgespec.errors import UsageError
from edgespec.ggufinfo import _tensor_bytes, read_info
from edgespec.memory import estimate_process, parse_size, plan

from conftest import ROOT


@pytest.fixture(autouse=True)
def _library_logger():
    """The "edgespec" logger as the library leaves it: without the stderr handler that a CLI
    main() run earlier in the session attached (it would write to a closed capture stream),
    restored afterwards."""
    log = logging.getLogger("edgespec")
    handlers, level = list(log.handlers), log.level
    for h in handlers:
        if getattr(h, "_edgespec_cli", False):
            log.removeHandler(h)
    yield
    log.handlers[:] = handlers
    log.setLevel(level)


@pytest.mark.parametrize("text, value", [("2GiB", 2 * 2**30), ("1500MB", 1500 * 10**6), ("2g", 2 * 10**9),
                                         ("512 MiB", 512 * 2**20), ("3.5GB", 3_500_000_000), ("800k", 800_000)])
def test_sizes_parse_as_people_write_them(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "2 parsecs", "-1GB", "0", "GB"])
def test_bad_sizes_are_usage_errors(bad):
    with pytest.raises(UsageError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize("bare", ["10", "2", " 1.5 ", "2147483648"])
def test_a_number_without_a_unit_is_refused_not_read_as_bytes(bare):
    # "--memory-budget 10" was 10 bytes: the message says what to write instead, in one line
    with pytest.raises(UsageError, match=r"'[\d.]+' has no unit: .*like .*2GiB") as info:
        parse_size(bare, "--memory-budget")
    assert str(info.value).startswith("--memory-budget ") and "\n" not in str(info.value)
    assert parse_size(bare.strip() + "B") == int(float(bare))  # bytes, said so
    with pytest.raises(UsageError, match=r"memory_budget \(--memory-budget\) '10' has no unit"):
        Settings(memory_budget="10").validate()  # the library reads budgets the same way
    with pytest.raises(UsageError, match=r"cache_ram \(--cache-ram\) '10' has no unit"):
        Settings(cache_ram="10").validate()
    assert Settings(memory_budget=10 * 2**30, cache_ram="0").validate().cache_bytes() == 0  # ints are bytes


def _peak_rss(model, ctx, drafter="none"):
    prompt = json.loads((ROOT / "workloads" / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    out = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(model), "--drafter", drafter,
                          "--ctx", str(ctx), "--json", "--max-tokens", "24", "--prompt", prompt * 2],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["peak_rss_bytes"]


@pytest.mark.slow
def test_estimate_is_within_10_percent_of_measured_peak_rss(gemma):
    # gemma-3-270m was not used to fit the estimator's constants: an out-of-sample check
    est = estimate_process(read_info(gemma), n_ctx=4096, flash_attn=Settings.flash_attn)["total"]
    peak = _peak_rss(gemma, 4096)
    assert abs(est - peak) / peak < 0.10, (est / 2**20, peak / 2**20)


def _prompt_of(model, n_tokens: int) -> str:
    """Text that the model's tokenizer turns into about n_tokens tokens (BOS included)."""
    import llama_cpp
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    text = "The quick brown fox jumps over the lazy dog while the compiler checks every line. " * (n_tokens // 8)
    toks = llm.tokenize(text.encode(), add_bos=True)[:n_tokens]
    return llm.detokenize(toks[1:]).decode("utf-8", "ignore")


def _run_peak(model, ctx, prompt, *flags):
    out = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(model), "--ctx", str(ctx),
                          "--drafter", "none", "--raw", "--max-tokens", "16", "--json", "--prompt", prompt, *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["peak_rss_bytes"]


@pytest.mark.slow
def test_estimate_bounds_the_peak_of_short_and_near_full_prompts(smol):
    """The issue-20 bands, with the default flash attention: within -3%..+8% of the peak of a
    prompt filling 90% of the context, at most 15% above (never 3% below) a short prompt's."""
    ctx = 1024
    est = estimate_process(read_info(smol), n_ctx=ctx, flash_attn=Settings.flash_attn)["total"]
    short = _run_peak(smol, ctx, "Say hi.")
    full = _run_peak(smol, ctx, _prompt_of(smol, int(0.9 * ctx)))
    assert full > short  # a full micro-batch touches activations that a short prompt does not
    # +8%, not +5%: on these VMs the kernel pages cold memory out as a process runs (DAMON, action
    # pageout: /sys/kernel/mm/damon/admin/kdamonds), which measured the same peak at 212 MiB one
    # hour and 210.4 MiB the next, at the same commit; the estimate must still never fall under it
    assert -0.03 <= (est - full) / full <= 0.08, (est / 2**20, full / 2**20)
    assert -0.03 <= (est - short) / short <= 0.15, (est / 2**20, short / 2**20)


@pytest.mark.slow
def test_estimate_bounds_the_near_full_peak_without_flash_attention(smol):
    """Flash attention off: the scores of a micro-batch against every cached position grow with
    the prompt; the estimate is the worst case, a full context."""
    ctx = 1024
    est = estimate_process(read_info(smol), n_ctx=ctx, flash_attn="off")["total"]
    assert est > estimate_process(read_info(smol), n_ctx=ctx, flash_attn="on")["total"]
    full = _run_peak(smol, ctx, _prompt_of(smol, ctx - 24), "--flash-attn", "off")
    assert 0 <= (est - full) / full <= 0.15, (est / 2**20, full / 2**20)


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


def test_engine_drops_the_draft_model_when_it_does_not_fit(smol, smol_draft, capfd, caplog):
    t, d = read_info(smol), read_info(smol_draft)
    budget = estimate_process(t, d, n_ctx=1024, drafter="ngram")["total"] + 2**20
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, cache_ram=0,
                         memory_budget=budget) as eng:  # all of the budget for the models
            assert eng.mode == "ngram"  # the draft model was not loaded: n-gram drafting instead
    said = [r for r in caplog.records if r.name == "edgespec" and "does not fit" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert capfd.readouterr().err == ""  # the library logs; it does not print
    with pytest.raises(UsageError, match="does not fit"):
        Engine.load(str(smol), drafter="none", n_ctx=1024, memory_budget="10MB")


# -- the machine probe ----------------------------------------------------------------------
@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    """An empty probe cache of its own, and no figures remembered by this process."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "_memo", {})
    return tmp_path / "cache" / "probe"


def _figures(**over):
    f = {"runtime_bytes": 50 * 2**20, "context_overhead_bytes": 4 * 2**20, "repacked_types": ["Q4_K"],
         "source": "test"}
    f.update(over)
    return f


def test_probe_measures_once_then_reads_its_cache_keyed_by_interpreter_and_build(fresh_probe, monkeypatch):
    real_measure, calls = probe.measure, []
    monkeypatch.setattr(probe, "measure", lambda: calls.append(1) or real_measure())
    first = probe.machine_figures()
    assert calls == [1] and first["source"] == "measured"
    # a fresh interpreter with numpy and llama.cpp: tens of MiB, not a guess of zero or of GiBs
    assert 20 * 2**20 < first["runtime_bytes"] < 300 * 2**20
    assert 0 <= first["context_overhead_bytes"] < 100 * 2**20
    files = list(fresh_probe.glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["key"] == probe._key() and stored["figures"] == first
    key = stored["key"]
    assert key["python"] == sys.executable and key["machine"] == platform.machine() and "llama_cpp" in key

    # another process (no memo) reads the file instead of measuring again
    monkeypatch.setattr(probe, "_memo", {})
    monkeypatch.setattr(probe, "measure", lambda: pytest.fail("measured again despite the cache"))
    assert probe.machine_figures() == first

    # another llama.cpp build (or interpreter, or machine) is another key: measured afresh
    monkeypatch.setattr(probe, "_memo", {})
    monkeypatch.setattr(probe, "_key", lambda: dict(key, llama_cpp="0.0.0-other"))
    monkeypatch.setattr(probe, "measure", lambda: _figures(runtime_bytes=77 * 2**20))
    assert probe.machine_figures()["runtime_bytes"] == 77 * 2**20
    assert len(list(fresh_probe.glob("*.json"))) == 2


def test_a_cache_file_for_another_key_is_not_trusted(fresh_probe, monkeypatch):
    key = probe._key()
    path = probe.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": dict(key, python="/elsewhere/python"), "figures": _figures()}))
    monkeypatch.setattr(probe, "measure", lambda: _figures(runtime_bytes=61 * 2**20))
    assert probe.machine_figures()["runtime_bytes"] == 61 * 2**20


def test_probe_tolerates_an_unwritable_cache_and_never_prints(tmp_path, monkeypatch, capfd, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("EDGESPEC_CACHE", str(blocker))
    monkeypatch.setattr(probe, "_memo", {})
    calls = []
    monkeypatch.setattr(probe, "measure", lambda: calls.append(1) or _figures(runtime_bytes=66 * 2**20))
    with caplog.at_level(logging.DEBUG, logger="edgespec"):
        assert probe.machine_figures()["runtime_bytes"] == 66 * 2**20
        assert probe.machine_figures()["runtime_bytes"] == 66 * 2**20  # remembered, not measured again
    assert calls == [1]
    assert "cannot cache" in caplog.text
    assert capfd.readouterr() == ("", "")


def test_a_probe_that_fails_falls_back_to_documented_defaults(fresh_probe, monkeypatch, caplog):
    def broken():
        raise RuntimeError("memory probe failed (1): boom")
    monkeypatch.setattr(probe, "measure", broken)
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        f = probe.machine_figures()
    assert f["source"] == "default" and f["runtime_bytes"] == probe.DEFAULTS["runtime_bytes"]
    assert "default figures" in caplog.text and "boom" in caplog.text
    assert not list(fresh_probe.glob("*.json"))  # a default is not cached as if measured


def test_probe_child_writes_one_json_line_and_nothing_else():
    out = subprocess.run([sys.executable, "-m", "edgespec.probe"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    f = json.loads(lines[0])
    assert {"runtime_bytes", "context_overhead_bytes", "repacked_types", "system_info"} <= set(f)


def test_probe_finds_the_copied_weight_types_by_loading_tiny_models(fresh_probe):
    f = probe.machine_figures()
    # every tiny model loaded: each type reports where its weights went
    assert set(f["buffers"]) == set(probe.CANDIDATE_TYPES)
    assert all(b.get("CPU_Mapped", 0) > 0 for b in f["buffers"].values())
    info = f["system_info"]
    if platform.machine() not in ("x86_64", "AMD64") or "REPACK = 1" not in info:
        pytest.skip("the expected types below are llama.cpp's x86 rule")
    copied = set(f["repacked_types"])
    # never copied on x86
    assert not copied & {"Q4_1", "Q5_0", "Q8_0", "Q6_K"}
    if "AVX2 = 1" in info:
        assert {"Q4_0", "Q4_K", "IQ4_NL"} <= copied
    else:
        assert not copied & {"Q4_0", "Q4_K", "IQ4_NL"}
    # Q2_K has an interleaved kernel only with AVX-512: the difference between the two kinds of
    # x86 machine the estimate must hold on
    assert ("Q2_K" in copied) == ("AVX512 = 1" in info)


def test_estimate_takes_runtime_and_copied_types_from_the_probe(gemma, monkeypatch):
    info = read_info(gemma)
    q4k_blocks = sum(_tensor_bytes(dims, t) for name, (dims, t) in info.fields["_tensors"].items()
                     if name.startswith("blk.") and t == 12)  # 12: Q4_K
    assert q4k_blocks > 0
    monkeypatch.setattr(probe, "machine_figures", lambda: _figures(repacked_types=["Q4_K"]))
    a = estimate_process(info, n_ctx=2048)
    monkeypatch.setattr(probe, "machine_figures", lambda: _figures(repacked_types=[], runtime_bytes=90 * 2**20))
    b = estimate_process(info, n_ctx=2048)
    assert a["target_parts"]["repacked"] == q4k_blocks and b["target_parts"]["repacked"] == 0
    assert b["runtime"] - a["runtime"] == 40 * 2**20
    assert a["total"] - b["total"] == q4k_blocks - 40 * 2**20
    assert a["runtime_parts"]["source"] == "test"
    # a draft model is a second context
    monkeypatch.setattr(probe, "machine_figures", lambda: _figures())
    one = estimate_process(info, n_ctx=2048, drafter="none")
    two = estimate_process(info, info, n_ctx=2048, drafter="model")
    assert two["runtime"] - one["runtime"] == 4 * 2**20


def test_estimate_follows_the_measured_figures_on_this_machine(smol, fresh_probe):
    f = probe.machine_figures()
    est = estimate_process(read_info(smol), n_ctx=2048)
    assert est["runtime_parts"]["interpreter"] == f["runtime_bytes"]
    assert est["runtime_parts"]["context"] == f["context_overhead_bytes"]


def test_probe_agrees_with_llama_cpps_repack_rule_and_reads_its_log(fresh_probe):
    f = probe.machine_figures()
    if platform.machine() in ("x86_64", "AMD64"):
        # what loading found is what repack.cpp's rule says for the features the build reports
        assert f["repacked_from"] == "loaded"
        assert sorted(f["repacked_types"]) == sorted(probe.repack_rule(f["system_info"]))
    avx2 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 | REPACK = 1 |"
    assert "Q2_K" not in probe.repack_rule(avx2) and "Q4_K" in probe.repack_rule(avx2)
    assert "Q2_K" in probe.repack_rule(avx2.replace("FMA = 1", "FMA = 1 | AVX512 = 1"))
    assert probe.repack_rule(avx2.replace(" | REPACK = 1", "")) == []
    log_lines = ["load_tensors: loading model tensors\n",
                 "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n",
                 "load_tensors:   CPU_REPACK model buffer size =     0.56 MiB\n"]
    assert probe._model_buffers(log_lines) == {"CPU_Mapped": int(92.10 * 2**20), "CPU_REPACK": int(0.56 * 2**20)}


def test_tiny_gguf_is_a_model_llama_cpp_loads(tmp_path):
    import llama_cpp
    path = tmp_path / "tiny.gguf"
    size = probe.write_tiny_gguf(path, "Q8_0")
    assert size == path.stat().st_size and 100_000 < size < 2_000_000
    from edgespec.backend import set_verbose
    set_verbose(False)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    assert model
    try:
        assert llama_cpp.llama_model_n_embd(model) == 256
    finally:
        llama_cpp.llama_model_free(model)
