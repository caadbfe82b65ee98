"""--parallel in the memory plan: N sequences' KV caches for target and draft, the most that fit
when N is not given (never at the cost of the draft model or the context), a one-line refusal
for an explicit N that does not fit, both backends loaded for the chosen N, and one sequence for
run, the chat, bench and calibrate."""
import json
import logging
import sys

import pytest

from edgespec import Engine, memory
from edgespec.assemble import Settings, check_context, parallel_for, plan_for
from edgespec.cli import build_parser, main
from edgespec.errors import UsageError
from edgespec.ggufinfo import read_info

MiB = 2**20


def _peaks(t, d, drafter: str, n_ctx: int = 4096, cheapest: bool = False) -> dict:
    """The planner's own peak for `drafter` at n_ctx, per number of sequences (1..4): in the
    default memory mode, or (`cheapest`) in the cheapest one a budget may trade to (q8_0 KV, no
    repacked weights)."""
    mode = memory.DEFAULT_MODE.cheaper(Settings.flash_attn)[-1] if cheapest else memory.DEFAULT_MODE
    return {n: memory.estimate_process(t, d, n_ctx=n_ctx, drafter=drafter, flash_attn=Settings.flash_attn,
                                       n_seq=n, mode=mode)["total"] for n in range(1, 5)}


def test_the_kv_part_of_the_peak_scales_with_the_sequences(qwen_pair):
    t, d = (read_info(p) for p in qwen_pair)
    one = memory.estimate_process(t, d, n_ctx=4096, drafter="model")
    for n in (2, 3, 4):
        est = memory.estimate_process(t, d, n_ctx=4096, drafter="model", n_seq=n)
        for part in ("target_parts", "draft_parts"):  # the draft model holds every sequence too
            assert est[part]["kv_cache"] == n * one[part]["kv_cache"] > 0, (part, n)
            assert est[part]["weights"] == one[part]["weights"]  # the weights are loaded once
        assert est["total"] - one["total"] >= (n - 1) * (one["target_parts"]["kv_cache"]
                                                         + one["draft_parts"]["kv_cache"])
    ngram = [memory.estimate_process(t, n_ctx=4096, drafter="ngram", n_seq=n)["ngram_index"] for n in (1, 3)]
    assert ngram[1] == 3 * ngram[0]  # an index over each sequence's context


@pytest.fixture
def qwen(qwen_pair):
    t_path, d_path = qwen_pair
    return t_path, d_path, read_info(t_path), read_info(d_path)


def test_auto_parallel_shrinks_when_the_budget_is_tight(qwen):
    t_path, d_path, t, d = qwen
    peak = _peaks(t, d, "model")
    assert peak[1] < peak[2] < peak[3] < peak[4]

    def chosen(budget, **kw):
        s = Settings(target=str(t_path), draft=str(d_path), memory_budget=budget, cache_ram=0, **kw).validate()
        r = plan_for(s, t, d)
        return r["parallel"], r["choice"].get("drafter"), r["choice"].get("n_ctx")
    assert chosen(peak[4] + MiB) == (4, "model", 4096)
    assert chosen(peak[4] * 4) == (4, "model", 4096)  # at most 4 without --parallel
    assert chosen((peak[2] + peak[3]) // 2) == (2, "model", 4096)
    assert chosen((peak[1] + peak[2]) // 2) == (1, "model", 4096)
    # not even one sequence fits in the asked mode: one, in a cheaper memory mode (the draft model kept)
    assert chosen(peak[1] - MiB) == (1, "model", 4096)
    # not even one sequence keeps the draft model in any mode: exactly the old fallback, for one sequence
    below = _peaks(t, d, "model", cheapest=True)[1] - MiB
    assert chosen(below) == chosen(below, parallel=1) == (1, "ngram", 4096)
    # the prompt cache's share is set aside first: 4 fit the whole budget, 2 what is left of it
    budget = (peak[2] + peak[3]) // 2 * 10 // 9
    assert budget > peak[4]
    s = Settings(target=str(t_path), draft=str(d_path), memory_budget=budget).validate()
    assert plan_for(s, t, d)["parallel"] == 2


def test_plan_names_the_sequences_and_their_kv(qwen, capsys):
    t_path, d_path, t, d = qwen
    peak = _peaks(t, d, "model")
    one = memory.estimate_process(t, d, n_ctx=4096, drafter="model")
    kv1 = one["target_parts"]["kv_cache"] + one["draft_parts"]["kv_cache"]
    base = ["plan", "--target", str(t_path), "--draft", str(d_path), "--cache-ram", "0",
            "--memory-budget", f"{(peak[2] + peak[3]) // 2}B"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["parallel"], out["parallel_auto"], out["choice"]["drafter"]) == (2, True, "model")
    assert main(base) == 0
    text = capsys.readouterr().out
    assert (f"Parallel: 2 sequences at once (auto: as many as fit, 3 would need about {peak[3] / 2**30:.2f} GiB): "
            f"KV {2 * kv1 / MiB:,.0f} MiB of the peak.") in text
    assert "All configurations for 2 sequences" in text
    # an explicit N is planned as given, and plan says which smaller N keeps the draft model (in the
    # cheapest memory mode: the planner tries the modes before it drops the draft model)
    cheap = _peaks(t, d, "model", cheapest=True)
    assert main([*base[:-1], f"{(cheap[2] + cheap[3]) // 2}B", "--parallel", "4"]) == 0
    text = capsys.readouterr().out
    assert "Fits: target + n-gram drafting at n_ctx 4096" in text
    assert "Parallel: 4 sequences at once (--parallel 4; --parallel 2 fits target + draft model at n_ctx 4096)" in text
    assert main([*base, "-np", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["parallel"], out["parallel_auto"]) == (1, False)


class Loaded(Exception):
    pass


class _Stub:
    can_truncate = True

    def close(self):
        pass


class Loads(list):
    """(path, keywords) of each LlamaBackend made; `draft_too`: the first (the target) is a stub
    and the second stops there, else the first stops there."""
    draft_too = False


@pytest.fixture
def loads(monkeypatch):
    seen = Loads()

    def fake(path, **kw):
        seen.append((str(path), kw))
        if len(seen) == 2 or not seen.draft_too:
            raise Loaded(str(path))
        return _Stub()
    monkeypatch.setattr("edgespec.backend.LlamaBackend", fake)
    return seen


def test_both_backends_are_loaded_for_the_chosen_sequences(smol, smol_draft, loads, monkeypatch):
    t, d = read_info(smol), read_info(smol_draft)
    peak = _peaks(t, d, "model", n_ctx=1024)
    loads.draft_too = True
    with pytest.raises(Loaded):
        Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, cache_ram=0,
                    memory_budget=(peak[2] + peak[3]) // 2)
    assert [kw["n_seq"] for _, kw in loads] == [2, 2] and [kw["n_ctx"] for _, kw in loads] == [1024, 1024]
    loads.clear()
    with pytest.raises(Loaded):  # given, without a budget: as given
        Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, parallel=3)
    assert [kw["n_seq"] for _, kw in loads] == [3, 3]
    loads.clear()
    # neither given: as many as fit the RAM available now
    monkeypatch.setattr(memory, "available_memory", lambda: (peak[3] + peak[4]) // 2)
    with pytest.raises(Loaded):
        Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, cache_ram=0)
    assert [kw["n_seq"] for _, kw in loads] == [3, 3]


def test_an_explicit_parallel_that_does_not_fit_is_refused_in_one_line(smol, loads):
    t = read_info(smol)
    peak = _peaks(t, None, "none", cheapest=True)  # a budget tries the memory modes first
    with pytest.raises(UsageError) as err:
        Engine.load(str(smol), drafter="none", cache_ram=0, memory_budget=peak[2] + MiB, parallel=4)
    msg = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in msg and not loads
    assert "with 4 sequences (--parallel 4) does not fit in" in msg
    assert "pass --parallel 2 (fits) or --ctx " in msg and "raise --memory-budget" in msg
    with pytest.raises(Loaded):  # the N it names fits
        Engine.load(str(smol), drafter="none", cache_ram=0, memory_budget=peak[2] + MiB, parallel=2)
    assert loads[0][1]["n_seq"] == 2


def test_an_explicit_parallel_that_costs_the_draft_model_says_which_keeps_it(smol, smol_draft, loads, caplog):
    t, d = read_info(smol), read_info(smol_draft)
    peak = _peaks(t, d, "model", n_ctx=1024, cheapest=True)  # the modes are tried before the draft model goes
    with caplog.at_level(logging.WARNING, logger="edgespec"), pytest.raises(Loaded):
        Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024, cache_ram=0,
                    memory_budget=(peak[2] + peak[3]) // 2, parallel=3)
    said = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(said) == 1 and "with 3 sequences (--parallel 3)" in said[0]
    assert "using ngram drafting instead (--parallel 2 keeps it)" in said[0]
    assert [(p, kw["n_seq"]) for p, kw in loads] == [(str(smol), 3)]  # the target, for the 3 asked for


@pytest.mark.parametrize("bad", [0, 65, True, "2", 2.0])
def test_parallel_is_a_checked_setting(bad):
    with pytest.raises(UsageError, match=r"parallel \(--parallel\) must be an integer in 1\.\.64"):
        Settings(parallel=bad).validate()
    assert Settings(parallel=64).validate().parallel == 64 and Settings().parallel is None


def test_plan_refuses_a_bad_parallel_in_one_line(smol, capsys):
    for n in ("65", "0"):
        assert main(["plan", "--target", str(smol), "--parallel", n]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "parallel (--parallel) must be an integer in 1..64" in err


def test_plan_explains_the_flag_as_llama_server_spells_it(capsys):
    assert build_parser().parse_args(["plan", "-np", "3"]).parallel == 3
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--parallel N, -np N" in out and "at most 4" in out and "KV caches grow N-fold" in out


def test_a_context_times_the_sequences_bigger_than_the_machine_is_refused(smol, monkeypatch):
    info = read_info(smol)
    monkeypatch.setattr(memory, "total_memory", lambda: 200 * MiB)
    check_context(Settings(target=str(smol), n_ctx=2048, parallel=1), info)
    with pytest.raises(UsageError, match=r"2048 x 64 sequences \(--parallel 64\) needs at least .* lower --parallel"):
        check_context(Settings(target=str(smol), n_ctx=2048, parallel=64), info)


# -- one conversation: run, the chat, bench and calibrate plan for one sequence -----------------
def test_run_and_the_chat_load_one_sequence_whatever_fits(smol, loads, monkeypatch):
    for extra in ([], ["--memory-budget", "64GiB"]):  # no budget, and one where 4 would fit
        loads.clear()
        with pytest.raises(Loaded):
            main(["run", "--target", str(smol), "--drafter", "none", "--prompt", "hi", *extra])
        assert loads[0][1]["n_seq"] == 1, extra

    class Terminal:
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdin", Terminal())
    loads.clear()
    with pytest.raises(Loaded):
        main(["run", "--target", str(smol), "--drafter", "none"])  # no prompt on a terminal: the chat
    assert loads[0][1]["n_seq"] == 1


def test_bench_and_calibrate_build_settings_for_one_sequence(smol, monkeypatch):
    from edgespec import bench
    seen = []

    def fake_main(settings, opts, progress=None):
        seen.append(settings)
        return 0
    monkeypatch.setattr(bench, "main", fake_main)
    assert main(["bench", "--target", str(smol)]) == 0

    def fake_from_settings(settings, **kw):
        seen.append(settings)
        raise Loaded
    monkeypatch.setattr(Engine, "from_settings", staticmethod(fake_from_settings))
    with pytest.raises(Loaded):
        main(["calibrate", "--target", str(smol)])
    assert [s.parallel for s in seen] == [1, 1]


def test_parallel_for_follows_the_settings(smol):
    t = read_info(smol)
    assert parallel_for(Settings(target=str(smol), parallel=5), t, None) == 5
    peak = _peaks(t, None, "ngram")
    s = Settings(target=str(smol), cache_ram=0, memory_budget=peak[3] + MiB).validate()
    assert parallel_for(s, t, None) == 3
