"""What a newcomer reaches for first: --version, a bare command, `run MODEL PROMPT`, llama-server's
short flags, defaults in --help, one token limit name, no absurd rate for one token."""
import json

import pytest

from edgespec.cli import build_parser, main


def run_cli(args, capsys):
    try:
        code = main(args)
    except SystemExit as e:  # argparse: --version, --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    import edgespec
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.startswith(f"edgespec {edgespec.__version__}") and "llama-cpp-python" in out


def test_bare_command_prints_help_and_succeeds(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 0 and "usage: edgespec" in out and "doctor" in out and not err


def test_run_takes_the_prompt_positionally(smol, capsys):
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "none", "-n", "6", "--json",
                              "Name a colour."], capsys)
    assert code == 0, err
    assert json.loads(out)["stats"]["generated"] == 6


def test_a_lone_prompt_with_spaces_goes_to_the_default_pair():
    import edgespec.cli as cli
    parser = build_parser()
    args = parser.parse_args(["run", "Write a haiku about caches"])
    cli._positional_prompt(args)
    assert (args.pair, args.prompt) == (None, "Write a haiku about caches")
    args = parser.parse_args(["run", "smollm2-135m", "hi"])  # a pair name and a prompt: both kept
    cli._positional_prompt(args)
    assert (args.pair, args.prompt) == ("smollm2-135m", "hi")
    args = parser.parse_args(["run", "smollm2-135m"])  # a pair name alone is a pair name
    cli._positional_prompt(args)
    assert (args.pair, args.prompt) == ("smollm2-135m", None)


def test_prompt_given_twice_is_a_usage_error(smol, capsys):
    code, _, err = run_cli(["run", "--target", str(smol), "hello there", "--prompt", "again"], capsys)
    assert code == 2 and "give the prompt once" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("short, dest, value", [
    (["-m", "x.gguf"], "target", "x.gguf"), (["-md", "d.gguf"], "draft", "d.gguf"), (["-c", "512"], "ctx", 512),
    (["-n", "7"], "max_tokens", 7), (["-t", "1"], "threads", 1), (["-ngl", "0"], "n_gpu_layers", 0),
    (["--temp", "0.7"], "temperature", 0.7), (["-s", "3"], "seed", 3), (["-fa", "on"], "flash_attn", "on"),
    (["-ngld", "0"], "draft_n_gpu_layers", 0),
])
def test_llama_server_short_flags(short, dest, value):
    args = build_parser().parse_args(["run", *short])
    assert getattr(args, dest) == value


def test_bench_and_run_share_the_token_limit_name():
    p = build_parser()
    assert p.parse_args(["bench", "--max-tokens", "9"]).bench_tokens == 9
    assert p.parse_args(["bench", "-n", "9"]).bench_tokens == 9
    assert p.parse_args(["bench", "--bench-tokens", "9"]).bench_tokens == 9  # the old name still works
    assert p.parse_args(["run", "--max-tokens", "9"]).max_tokens == 9


@pytest.mark.parametrize("verb", ["run", "serve", "bench", "plan", "calibrate"])
def test_every_default_is_shown_in_help(verb, capsys):
    code, out, _ = run_cli([verb, "--help"], capsys)
    assert code == 0
    assert "(default" in out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, [], "==SUPPRESS==") and action.nargs != 0:
            assert "default" in sub.formatter_class(verb)._get_help_string(action), (verb, action.option_strings)


def test_one_token_reports_no_rate(smol, capsys):
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "none", "-n", "1", "--json", "Hi"], capsys)
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["generated"] == 1 and stats["tokens_per_second"] == 0
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "none", "-n", "1", "Hi"], capsys)
    assert code == 0 and "no decode rate from one token" in err and "tok/s" not in err


def test_with_target_the_positional_is_the_prompt_even_when_a_file_has_that_name(smol, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello\n")
    code, out, err = run_cli(["run", "--target", str(smol), "--drafter", "none", "-n", "3", "--json", "notes.txt"],
                             capsys)
    assert code == 0, err
    assert json.loads(out)["stats"]["generated"] == 3


@pytest.mark.parametrize("flags, words", [
    (["--memory-budget", "1GiB", "--cache-ram", "4GiB"], "leaves nothing of memory_budget"),
    (["--memory-budget", "2"], "like 2GiB or 2MB (2B for bytes)"),
])
def test_budget_mistakes_are_one_line(smol, capsys, flags, words):
    code, _, err = run_cli(["plan", "--target", str(smol), *flags], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_cache_ram_zero_with_a_unit_is_off(smol, capsys):
    code, out, err = run_cli(["plan", "--target", str(smol), "--memory-budget", "1GiB", "--cache-ram", "0B"], capsys)
    assert code == 0, err
    assert "none of it kept for a prompt cache" in out
