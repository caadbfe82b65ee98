"""The build edgespec asks for (buildflags) and the self-test that proves a build on this machine."""
import subprocess
import sys

import pytest

from edgespec import buildflags, selftest
from edgespec.errors import BackendError

from conftest import ROOT

SAPPHIRE = "flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw " \
           "avx512vbmi avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX2_ONLY = "processor : 0\nflags : fpu sse4_2 avx avx2 fma f16c bmi2\n"


def _args(plan) -> dict:
    return dict(a[2:].split("=", 1) for a in plan.cmake_args)


def test_amx_cpu_with_gcc12_names_avx512_and_leaves_amx_out():
    plan = buildflags.choose("auto", cpuinfo=SAPPHIRE, machine="x86_64", system="Linux", compiler="gcc 12.2.0",
                             nvcc=None)
    a = _args(plan)
    assert plan.backend == "cpu" and not plan.amx
    assert a["GGML_NATIVE"] == "OFF"  # -march=native would compile the AMX kernels GCC 12 gets wrong
    for opt in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI",
                "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"):
        assert a[opt] == "ON", opt
    assert a["GGML_AMX_TILE"] == a["GGML_AMX_INT8"] == a["GGML_AMX_BF16"] == "OFF"
    assert any("AMX off" in r and "gcc 12.2.0" in r for r in plan.reasons)


def test_amx_only_with_a_compiler_that_builds_it_and_never_when_asked_off():
    on = buildflags.choose("auto", cpuinfo=SAPPHIRE, machine="x86_64", system="Linux", compiler="gcc 13.1.0",
                           nvcc=None)
    assert on.amx and _args(on)["GGML_AMX_INT8"] == "ON"
    assert buildflags.choose("auto", cpuinfo=SAPPHIRE, machine="x86_64", system="Linux", compiler="clang 17.0.6",
                             nvcc=None).amx
    off = buildflags.choose("auto", "off", cpuinfo=SAPPHIRE, machine="x86_64", system="Linux",
                            compiler="gcc 13.1.0", nvcc=None)
    assert not off.amx and _args(off)["GGML_AMX_TILE"] == "OFF"
    assert on.key() != off.key()


def test_avx2_machine_gets_no_avx512():
    a = _args(buildflags.choose("cpu", cpuinfo=AVX2_ONLY, machine="x86_64", system="Linux", compiler="gcc 12.2.0",
                                nvcc=None))
    assert a["GGML_AVX2"] == "ON" and a["GGML_AVX512"] == "OFF" and a["GGML_AVX_VNNI"] == "OFF"


def test_cuda_needs_nvcc_and_an_architecture(monkeypatch):
    monkeypatch.delenv("CUDA_ARCHS", raising=False)
    common = dict(cpuinfo=AVX2_ONLY, machine="x86_64", system="Linux", compiler="gcc 12.2.0")
    # nvcc without a GPU (this machine kind has one): auto stays on the CPU
    assert buildflags.choose("auto", nvcc="/usr/local/bin/nvcc", archs=[], **common).backend == "cpu"
    cuda = buildflags.choose("auto", nvcc="/usr/local/bin/nvcc", archs=["90"], **common)
    assert cuda.backend == "cuda" and _args(cuda)["CMAKE_CUDA_ARCHITECTURES"] == "90"
    cpu = buildflags.choose("cpu", nvcc="/usr/local/bin/nvcc", archs=["90"], **common)
    assert cpu.key() != cuda.key()  # the wheel cache never hands a CPU build to a CUDA request
    with pytest.raises(buildflags.BuildError, match="nvcc"):
        buildflags.choose("cuda", nvcc=None, archs=["90"], **common)
    with pytest.raises(buildflags.BuildError, match="CUDA_ARCHS"):
        buildflags.choose("cuda", nvcc="/usr/local/bin/nvcc", archs=[], **common)
    monkeypatch.setenv("CUDA_ARCHS", "87")
    assert _args(buildflags.choose("cuda", nvcc="/usr/local/bin/nvcc", archs=[], **common))[
        "CMAKE_CUDA_ARCHITECTURES"] == "87"


def test_apple_silicon_is_metal():
    plan = buildflags.choose("auto", machine="arm64", system="Darwin", compiler="clang 15.0.0", nvcc=None)
    assert plan.backend == "metal" and "-DGGML_METAL=ON" in plan.cmake_args


def test_build_script_prints_its_choice_and_refuses_a_bad_backend():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llama.py"), "--print", "--backend", "cpu"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "CMAKE_ARGS=" in out.stdout and "-march=native" not in out.stdout


def test_doctor_prints_the_build_flags_and_refuses_a_bad_backend(monkeypatch, capsys):
    from edgespec.cli import main
    monkeypatch.setenv("BACKEND", "cpu")
    assert main(["doctor", "--build-flags"]) == 0
    out = capsys.readouterr().out
    assert "pip install" in out and "-DGGML_NATIVE" in out and "-march=native" not in out
    monkeypatch.setenv("BACKEND", "vulkan")
    assert main(["doctor", "--build-flags"]) == 2
    assert "vulkan" in capsys.readouterr().err


# -- the self-test, on the llama.cpp this suite runs with ------------------------------------------
def test_self_test_passes_on_this_build():
    r = selftest.check()
    assert r.ok, r.line
    assert r.line.startswith("self-test ok")
    assert r.details["error"] < selftest.TOLERANCE and r.details["greedy_agrees"]
    assert r.details["positions"] == selftest.PROMPT_LEN + selftest.DECODE_STEPS


@pytest.mark.parametrize("fault,words", [("segv", "crashed (SIGSEGV)"), ("garbage", "differ from the reference")])
def test_self_test_reports_a_crash_or_wrong_numbers_in_one_line(monkeypatch, fault, words):
    monkeypatch.setenv("EDGESPEC_SELFTEST_FAULT", fault)
    r = selftest.check()
    assert not r.ok
    assert words in r.line and "rebuild" in r.line and "make -C" in r.line
    assert "\n" not in r.line


def test_an_amx_crash_names_amx_and_the_fix():
    line = selftest._explain(-11, "system_info: CPU : AVX512 = 1 | AMX_INT8 = 1 |\n")
    assert "SIGSEGV" in line and "AMX" in line and "AMX=off" in line


def test_engine_load_refuses_a_failing_build_and_remembers_a_passing_one(monkeypatch, tmp_path, smol):
    from edgespec import Engine
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(selftest, "_passed", set())
    monkeypatch.setenv("EDGESPEC_SELFTEST_FAULT", "segv")
    with pytest.raises(BackendError, match="self-test failed: llama.cpp crashed"):
        Engine.load(str(smol), drafter="none", n_ctx=256)
    assert not list((tmp_path / "cache").glob("selftest/*.json"))  # a failure is not remembered
    monkeypatch.delenv("EDGESPEC_SELFTEST_FAULT")
    with Engine.load(str(smol), drafter="none", n_ctx=256) as eng:
        assert eng.generate("Hi", max_tokens=2).tokens
    assert len(list((tmp_path / "cache").glob("selftest/*.json"))) == 1
    # remembered: a build that passed once is not tested again (the fault would show otherwise)
    monkeypatch.setattr(selftest, "_passed", set())
    monkeypatch.setenv("EDGESPEC_SELFTEST_FAULT", "segv")
    with Engine.load(str(smol), drafter="none", n_ctx=256):
        pass


def test_doctor_prints_the_self_test_and_fails_with_it(monkeypatch, capsys):
    from edgespec.cli import main
    assert main(["doctor", "--self-test"]) == 0
    assert capsys.readouterr().out.startswith("self-test ok")
    monkeypatch.setenv("EDGESPEC_SELFTEST_FAULT", "garbage")
    assert main(["doctor"]) == 1
    assert "self-test failed" in capsys.readouterr().out


def test_cuda_archs_as_people_write_them(monkeypatch):
    assert buildflags.cuda_archs("8.9") == "89"
    assert buildflags.cuda_archs("sm_89, 9.0") == "89;90"
    assert buildflags.cuda_archs("89 90") == "89;90"
    assert buildflags.cuda_archs("native") == "native"
    with pytest.raises(buildflags.BuildError, match="CUDA_ARCHS"):
        buildflags.cuda_archs("ampere")


def test_amx_check_reads_the_cxx_compiler(monkeypatch):
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert buildflags.compiler_version() is None  # the C++ compiler decides, and it cannot be identified
    plan = buildflags.choose("cpu", cpuinfo=SAPPHIRE, machine="x86_64", system="Linux", nvcc=None)
    assert not plan.amx and any("could not be identified" in r for r in plan.reasons)


def test_the_remembered_pass_is_of_this_cpu(monkeypatch):
    key = selftest.build_key()
    monkeypatch.setattr(buildflags, "cpu_flags", lambda cpuinfo=None: {"sse4_2", "avx"})
    assert selftest.build_key() != key  # a home folder shared with another machine does not carry a pass


def test_a_module_in_the_working_directory_does_not_break_the_self_test(tmp_path, monkeypatch):
    (tmp_path / "gguf.py").write_text('raise ImportError("a stray gguf.py")\n')
    (tmp_path / "numpy.py").write_text('raise ImportError("a stray numpy.py")\n')
    monkeypatch.chdir(tmp_path)
    r = selftest.check()
    assert r.ok, r.line


def test_no_temporary_folder_is_one_line(monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", "/proc/nonexistent")
    r = selftest.check()
    assert not r.ok and "TMPDIR" in r.line and "\n" not in r.line


def test_doctor_says_what_is_calibrated_and_skips_damaged_files(monkeypatch, tmp_path, capsys):
    from edgespec.cli import main
    cal = tmp_path / "calibration"
    cal.mkdir()
    (cal / "a.json").write_text('{"key": {"target": {"path": "/m/t.gguf", "threads": 2}, '
                                '"draft": {"path": "/m/d.gguf"}}, "verify": [0.033]}')
    (cal / "b.json").write_text("not json")
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "calibrated (1;" in out and "t.gguf + d.gguf, 2 threads: a target step 33 ms" in out
