"""The memory modes the planner trades (issue 26): the flags of every verb reach Settings and
both backends; bad types and a quantized V without flash attention are refused in one line; the
plan counts each mode (KV bytes per element type, target and draft apart, no copied weights
without repacking); and under a budget the modes are tried before the draft model is dropped or
the context lowered, on the real Qwen pair's GGUF headers. Nothing here is timed."""
import json
import logging

import pytest

from edgespec import memory
from edgespec.assemble import Settings, fit_budget, load_parts, plan_for
from edgespec.cli import build_parser, main
from edgespec.errors import UsageError
from edgespec.frontend import settings_from_args
from edgespec.ggufinfo import read_info
from edgespec.memory import DEFAULT_MODE, MemoryMode, estimate_model, estimate_process

MiB = 2**20
MODE_ARGS = ["--no-repack", "-ctk", "q8_0", "-ctv", "q4_0", "-ctkd", "f16", "-ctvd", "q8_0"]
LONG_ARGS = ["--no-repack", "--cache-type-k", "q8_0", "--cache-type-v", "q4_0", "--cache-type-k-draft", "f16",
             "--cache-type-v-draft", "q8_0"]


@pytest.fixture(autouse=True)
def _library_logger():
    """The "edgespec" logger as the library leaves it (a CLI main() run attaches a handler)."""
    log = logging.getLogger("edgespec")
    handlers, level = list(log.handlers), log.level
    yield
    log.handlers[:] = handlers
    log.setLevel(level)


@pytest.fixture
def qwen(qwen_pair):
    t_path, d_path = qwen_pair
    return t_path, d_path, read_info(t_path), read_info(d_path)


# -- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", [["run", "--prompt", "hi"], ["serve"], ["plan"], ["bench"], ["calibrate"]])
@pytest.mark.parametrize("flags", [MODE_ARGS, LONG_ARGS], ids=["short", "long"])
def test_the_mode_flags_parse_on_every_verb_and_reach_settings(verb, flags):
    args = build_parser().parse_args(verb[:1] + flags + verb[1:])
    s = settings_from_args(args, drafter="auto")
    assert (s.repack, s.cache_type_k, s.cache_type_v, s.cache_type_k_draft, s.cache_type_v_draft) == \
        (False, "q8_0", "q4_0", "f16", "q8_0")
    assert s.memory_mode() == MemoryMode(False, "q8_0", "q4_0", "f16", "q8_0")
    assert s.flash_attn == "on"  # a quantized V cache: auto became on
    plain = settings_from_args(build_parser().parse_args(verb), drafter="auto")
    assert plain.memory_mode() == DEFAULT_MODE and plain.cache_type_k_draft is None  # the draft follows the target
    assert plain.flash_attn == "auto"


def test_the_draft_follows_the_targets_kv_types_unless_told():
    s = Settings(cache_type_k="q8_0", cache_type_v="q8_0").validate()
    assert (s.memory_mode().draft_type_k, s.memory_mode().draft_type_v) == ("q8_0", "q8_0")
    s = Settings(cache_type_k="q8_0", cache_type_k_draft="q4_0").validate()
    assert s.memory_mode() == MemoryMode(True, "q8_0", "f16", "q4_0", "f16")


def test_help_describes_the_mode_flags(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--no-repack", "--cache-type-k", "-ctk", "--cache-type-v", "-ctv", "--cache-type-k-draft", "-ctkd",
                 "--cache-type-v-draft", "-ctvd"):
        assert flag in out, flag
    assert "repacked copy" in out and "needs flash attention" in out


@pytest.mark.parametrize("flag", ["-ctk", "-ctv", "-ctkd", "--cache-type-v-draft"])
def test_a_bad_kv_type_exits_2_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", flag, "q5_1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "invalid choice: 'q5_1'" in err and "q8_0" in err


@pytest.mark.parametrize("field", ["cache_type_k", "cache_type_v", "cache_type_k_draft", "cache_type_v_draft"])
def test_the_library_refuses_a_bad_kv_type_in_one_line(field):
    with pytest.raises(UsageError, match=rf"{field} \(-ctk?v?d?\) must be one of f16, q8_0, q4_0, got 'q5_1'") as e:
        Settings(**{field: "q5_1"}).validate()
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="repack must be True or False"):
        Settings(repack="no").validate()


@pytest.mark.parametrize("flags", [["-ctv", "q8_0"], ["-ctvd", "q4_0"], ["-ctk", "q8_0", "-ctv", "q8_0"]])
def test_a_quantized_v_without_flash_attention_is_refused_in_one_line(smol, flags, capsys):
    assert main(["plan", "--target", str(smol), *flags, "--flash-attn", "off"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs flash attention: drop --flash-attn off" in err
    assert main(["run", "--target", str(smol), *flags, "-fa", "off", "--prompt", "hi"]) == 2
    assert "needs flash attention: drop --flash-attn off" in capsys.readouterr().err
    # a quantized K alone needs no flash attention
    assert Settings(cache_type_k="q8_0", flash_attn="off").validate().flash_attn == "off"


def test_auto_flash_attention_becomes_on_for_a_quantized_v_and_plan_says_so(smol, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="edgespec"):
        s = Settings(cache_type_v="q8_0").validate()
    assert s.flash_attn == "on" and "flash attention on, not auto" in caplog.text
    assert Settings(cache_type_v="q8_0", flash_attn="on").validate().flash_attn == "on"
    assert main(["plan", "--target", str(smol), "-ctv", "q8_0", "--parallel", "1"]) == 0
    assert "Flash attention: on, not auto: a quantized V cache" in capsys.readouterr().out
    assert main(["plan", "--target", str(smol), "-ctv", "q8_0", "--parallel", "1", "--json"]) == 0
    assert "flash_attn_note" in json.loads(capsys.readouterr().out)


# -- what the plan counts ---------------------------------------------------------------------
def test_the_kv_bytes_follow_the_element_type(qwen):
    _, _, t, d = qwen
    for info in (t, d):
        f16 = estimate_model(info, 8192, repacked_types=()).kv_cache
        q8 = estimate_model(info, 8192, repacked_types=(), type_k="q8_0", type_v="q8_0").kv_cache
        q4 = estimate_model(info, 8192, repacked_types=(), type_k="q4_0", type_v="q4_0").kv_cache
        mixed = estimate_model(info, 8192, repacked_types=(), type_k="q8_0").kv_cache
        assert f16 > 0 and q8 * 64 == f16 * 34 and q4 * 64 == f16 * 18
        assert mixed * 128 == f16 * (34 + 64)  # K in q8_0, V in f16
    # Qwen2.5-Coder-1.5B: 28 layers x 2 KV heads x 128 x (K + V) x 8192 cells, f16: 224 MiB; q8_0: 119 MiB
    assert estimate_model(t, 8192, repacked_types=()).kv_cache == 224 * MiB
    assert estimate_model(t, 8192, repacked_types=(), type_k="q8_0", type_v="q8_0").kv_cache == 119 * MiB


def test_target_and_draft_kv_types_are_counted_apart(qwen):
    _, _, t, d = qwen
    base = estimate_process(t, d, n_ctx=8192, drafter="model", flash_attn="on")
    mode = MemoryMode(type_k="q8_0", type_v="q8_0")  # the draft's stay f16
    est = estimate_process(t, d, n_ctx=8192, drafter="model", flash_attn="on", mode=mode)
    assert est["target_parts"]["kv_cache"] * 64 == base["target_parts"]["kv_cache"] * 34
    assert est["draft_parts"]["kv_cache"] == base["draft_parts"]["kv_cache"]
    both = estimate_process(t, d, n_ctx=8192, drafter="model", flash_attn="on",
                            mode=MemoryMode(draft_type_k="q4_0", draft_type_v="q4_0"))
    assert both["draft_parts"]["kv_cache"] * 64 == base["draft_parts"]["kv_cache"] * 18
    assert both["target_parts"]["kv_cache"] == base["target_parts"]["kv_cache"]


FIGURES = {"runtime_bytes": 50 * MiB, "context_overhead_bytes": 4 * MiB, "repacked_types": ["Q4_0", "Q4_K"],
           "page_size": 4096, "source": "test"}


def test_no_repack_counts_no_copied_weights_and_plan_drops_the_line(qwen, monkeypatch, capsys):
    t_path, _, t, _ = qwen
    monkeypatch.setattr(memory, "machine_figures", lambda: FIGURES)  # a machine that copies Q4_K
    on = estimate_process(t, n_ctx=8192, drafter="none", flash_attn="on")
    off = estimate_process(t, n_ctx=8192, drafter="none", flash_attn="on", mode=MemoryMode(repack=False))
    assert on["target_parts"]["repacked"] > 500 * MiB and off["target_parts"]["repacked"] == 0
    assert on["total"] - off["total"] == on["target_parts"]["repacked"]  # nothing else changes
    base = ["plan", "--target", str(t_path), "--ctx", "8192", "--drafter", "none", "--parallel", "1"]

    def peak_line(extra):
        assert main(base + extra) == 0
        return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Where the peak goes"))
    assert "copied weights" in peak_line([])
    assert "copied weights" not in peak_line(["--no-repack"])


def test_the_modes_the_planner_tries_and_their_order():
    assert DEFAULT_MODE.cheaper("auto") == [DEFAULT_MODE, MemoryMode(True, "q8_0", "q8_0", "q8_0", "q8_0"),
                                            MemoryMode(False), MemoryMode(False, "q8_0", "q8_0", "q8_0", "q8_0")]
    assert [m.name for m in DEFAULT_MODE.cheaper("on")] == ["default", "KV q8_0", "no repack", "KV q8_0 + no repack"]
    # without flash attention only the K caches may be quantized
    assert [m.name for m in DEFAULT_MODE.cheaper("off")] == ["default", "K q8_0 V f16", "no repack",
                                                              "K q8_0 V f16 + no repack"]
    # what is asked is kept (q4_0 stays q4_0) and a mode is not tried twice
    asked = MemoryMode(False, "q4_0", "q4_0", "f16", "f16")
    assert asked.cheaper("on") == [asked, MemoryMode(False, "q4_0", "q4_0", "q8_0", "q8_0")]
    assert Settings().memory_modes() == [DEFAULT_MODE]  # without a budget: no trades
    assert len(Settings(memory_budget="4GiB").memory_modes()) == 4


# -- under a budget: the modes before the draft model or the context ----------------------------
def _mode_peaks(t, d, drafter="model", n_ctx=8192):
    return {m.name: estimate_process(t, d, n_ctx=n_ctx, drafter=drafter, flash_attn="auto", mode=m)["total"]
            for m in DEFAULT_MODE.cheaper("auto")}


def _chosen(t_path, d_path, t, d, budget, **kw):
    s = Settings(target=str(t_path), draft=str(d_path), n_ctx=8192, memory_budget=budget, cache_ram=0,
                 parallel=1, **kw).validate()
    ch = plan_for(s, t, d)["choice"]
    return ch.get("drafter"), ch.get("n_ctx"), ch.get("memory_mode", {}).get("name")


def test_a_budget_between_the_default_and_the_cheapest_peak_keeps_the_context_and_the_draft(qwen):
    t_path, d_path, t, d = qwen
    peak = _mode_peaks(t, d)
    assert peak["default"] > peak["KV q8_0"] > peak["no repack"] > peak["KV q8_0 + no repack"]
    assert peak["default"] - peak["KV q8_0"] == (224 + 96 - 119 - 51) * MiB  # both KV caches at 34/64
    # the planner's order at n_ctx 8192: fastest first there (a q8_0 KV cache prefills at 0.24x f16's
    # at depth 4,096: it comes last); at a short context it comes first
    order = [m.name for m in Settings(n_ctx=8192, memory_budget="4GiB").memory_modes()]
    assert order == ["default", "no repack", "KV q8_0 + no repack", "KV q8_0"]
    assert [m.name for m in Settings(n_ctx=512, memory_budget="4GiB").memory_modes()][:2] == ["default", "KV q8_0"]
    # every budget in between keeps n_ctx 8192 and the draft model, in the first mode of that order that fits
    for budget in [peak["default"] + 1, peak["default"] - 1, peak["KV q8_0"] + 1, peak["KV q8_0"] - 1,
                   peak["no repack"] + 1, peak["no repack"] - 1, peak["KV q8_0 + no repack"] + 1,
                   (peak["default"] + peak["KV q8_0 + no repack"]) // 2]:
        mode = next(m for m in order if peak[m] <= budget)
        assert _chosen(t_path, d_path, t, d, budget) == ("model", 8192, mode), (budget / MiB, mode)
    # below the cheapest mode's peak the draft model goes (n-gram drafting, at the same context)
    drafter, n_ctx, mode = _chosen(t_path, d_path, t, d, peak["KV q8_0 + no repack"] - 1)
    assert (drafter, n_ctx) == ("ngram", 8192)
    ngram = _mode_peaks(t, d, "ngram")
    assert mode == next(m for m in order if ngram[m] <= peak["KV q8_0 + no repack"] - 1)


def test_fit_budget_returns_the_mode_and_says_what_it_costs(qwen, caplog):
    t_path, d_path, t, d = qwen
    peak = _mode_peaks(t, d)
    # at n_ctx 8192 no repacking is the faster trade (a q8_0 KV cache prefills slowly that deep)
    s = Settings(target=str(t_path), draft=str(d_path), n_ctx=8192, memory_budget=peak["KV q8_0"] + 1,
                 cache_ram=0, parallel=1).validate()
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        drafter, keep, n, mode = fit_budget(s, t, d)
    assert (drafter, keep, n, mode.name) == ("auto", True, 1, "no repack")
    assert "in memory mode default: using memory mode no repack" in caplog.text
    # at a short one, the q8_0 KV cache is
    caplog.clear()
    short = _mode_peaks(t, d, n_ctx=512)
    s = Settings(target=str(t_path), draft=str(d_path), n_ctx=512, memory_budget=short["KV q8_0"] + 1,
                 cache_ram=0, parallel=1).validate()
    with caplog.at_level(logging.WARNING, logger="edgespec"):
        assert fit_budget(s, t, d)[3].name == "KV q8_0"
    assert "in memory mode default: using memory mode KV q8_0" in caplog.text
    # the asked mode is kept when it fits, and its warning is not given
    caplog.clear()
    roomy = Settings(target=str(t_path), draft=str(d_path), n_ctx=8192, memory_budget=peak["default"] + 1,
                     cache_ram=0, parallel=1).validate()
    assert fit_budget(roomy, t, d)[3] == DEFAULT_MODE and "memory mode" not in caplog.text


def test_plan_lists_each_modes_peak_and_the_choice(qwen, capsys):
    t_path, d_path, t, d = qwen
    peak = _mode_peaks(t, d)
    assert main(["plan", "--target", str(t_path), "--draft", str(d_path), "--ctx", "8192", "--parallel", "1",
                 "--cache-ram", "0", "--memory-budget", f"{peak['no repack'] + 1}B"]) == 0
    out = capsys.readouterr().out
    assert "Fits: target + draft model at n_ctx 8192 in memory mode no repack" in out
    line = next(x for x in out.splitlines() if x.startswith("Memory modes"))
    for name, p in peak.items():
        assert f"{name} {p / 2**30:.2f} GiB" in line, line
    assert "chosen: no repack" in line
    assert main(["plan", "--target", str(t_path), "--draft", str(d_path), "--ctx", "8192", "--parallel", "1",
                 "--cache-ram", "0", "--memory-budget", f"{peak['no repack'] + 1}B", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["choice"]["memory_mode"]["name"] == "no repack" and r["choice"]["memory_mode"]["repack"] is False
    order = Settings(n_ctx=8192, memory_budget="4GiB").memory_modes()
    assert [m["name"] for m in r["modes"]] == [m.name for m in order]
    assert {c["mode"] for c in r["configs"]} == {"default"}
    assert {c["mode"] for c in r["mode_configs"]} == set(list(peak)[1:])


# -- the backends get the mode ------------------------------------------------------------------
class Stop(Exception):
    pass


@pytest.fixture
def backends(monkeypatch):
    """LlamaBackend records its arguments; the second one stops the load (nothing is loaded)."""
    seen = []

    class Fake:
        can_truncate = True

        def __init__(self, path, **kw):
            seen.append(kw)
            if len(seen) == 2:
                raise Stop

        def close(self):
            pass
    monkeypatch.setattr("edgespec.backend.LlamaBackend", Fake)
    return seen


def test_load_parts_gives_both_backends_their_mode(smol, smol_draft, backends):
    s = Settings(target=str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, parallel=1, repack=False,
                 cache_type_k="q8_0", cache_type_v="q4_0", cache_type_k_draft="f16")
    with pytest.raises(Stop):
        load_parts(s, download=False, calibrate="never")
    target, draft = backends
    assert (target["repack"], target["type_k"], target["type_v"], target["flash_attn"]) == (False, "q8_0", "q4_0", "on")
    assert (draft["repack"], draft["type_k"], draft["type_v"], draft["flash_attn"]) == (False, "f16", "q4_0", "on")


def test_load_parts_loads_the_mode_the_budget_chose(smol, smol_draft, backends):
    t, d = read_info(smol), read_info(smol_draft)
    # at a short context a q8_0 KV cache is the first trade (memory.by_speed)
    peak = {m.name: estimate_process(t, d, n_ctx=512, drafter="model", flash_attn="auto", mode=m)["total"]
            for m in DEFAULT_MODE.cheaper("auto")}
    assert peak["KV q8_0"] < peak["default"]
    s = Settings(target=str(smol), draft=str(smol_draft), drafter="model", n_ctx=512, parallel=1, cache_ram=0,
                 memory_budget=peak["KV q8_0"] + 1)
    with pytest.raises(Stop):
        load_parts(s, download=False, calibrate="never")
    for kw in backends:  # q8_0 KV for both, and the flash attention a quantized V needs
        assert (kw["repack"], kw["type_k"], kw["type_v"], kw["flash_attn"]) == (True, "q8_0", "q8_0", "on")
