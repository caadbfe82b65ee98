"""How llama-cpp-python should be built on this machine: CMake flags from what the machine reports.

Standard library only (the Makefile runs it before anything is installed). Decisions:

- x86 CPUs get their instruction sets named one by one from /proc/cpuinfo, never `-march=native`:
  a native build compiles llama.cpp's AMX kernels wherever the CPU reports AMX, and GCC before 13
  builds their tile setup wrong (a general-protection fault at `ldtilecfg` on the first decode;
  llama.cpp #20824, Ollama #17205). AMX is named only where the compiler is GCC >= 13 or clang, and
  the self-test (edgespec/selftest.py) decides whether it stays.
- CUDA when asked, or by default where `nvcc` and a GPU are both present (architectures from the GPU:
  nvidia-smi's compute capability; Jetson Orin: 87); Metal on Apple Silicon (llama.cpp's default).
- Other CPUs (ARM, POWER) keep llama.cpp's native detection: the AMX fault is x86-only.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python the Makefile builds (pyproject allows >=0.3.16,<0.4)
BACKENDS = ("auto", "cpu", "cuda", "metal")

# /proc/cpuinfo flag(s) -> ggml option; GGML_AVX512 is ggml's -mavx512{f,cd,vl,dq,bw}
_X86 = [
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
]
_AMX = [("GGML_AMX_TILE", "amx_tile"), ("GGML_AMX_INT8", "amx_int8"), ("GGML_AMX_BF16", "amx_bf16")]


class BuildError(Exception):
    """A build that cannot be chosen as asked (e.g. CUDA without nvcc)."""


@dataclass
class Plan:
    backend: str                     # cpu | cuda | metal
    cmake_args: list[str]
    reasons: list[str] = field(default_factory=list)
    amx: bool = False                # AMX kernels compiled in
    env: dict[str, str] = field(default_factory=dict)  # CUDACXX for Jetson, for example

    @property
    def cmake_string(self) -> str:
        return " ".join(self.cmake_args)

    def key(self, version: str = LLAMA_CPP_VERSION) -> str:
        """The wheel cache key: a CPU wheel is never handed to a CUDA request, nor AVX2 to AVX-512."""
        text = "\n".join([version, platform.machine(), platform.system(), compiler_version() or "",
                          self.cmake_string, *sorted(f"{k}={v}" for k, v in self.env.items())])
        return f"{self.backend}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def pip_command(self, version: str = LLAMA_CPP_VERSION) -> str:
        """The one command that rebuilds llama-cpp-python this way, for people outside the Makefile."""
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return (f"{env + ' ' if env else ''}CMAKE_ARGS=\"{self.cmake_string}\" pip install --force-reinstall "
                f"--no-cache-dir --no-deps llama-cpp-python=={version}")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def compiler_version(cc: str | None = None) -> str | None:
    """'gcc 12.2.0' or 'clang 17.0.6' for the C++ compiler CMake will pick (CXX, else c++): llama.cpp's
    AMX kernels are C++."""
    cc = cc or os.environ.get("CXX") or "c++"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.splitlines()[0] if out else ""
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", first)
    if not m:
        return None
    kind = "clang" if "clang" in out.lower() else "gcc" if ("gcc" in out.lower() or "free software" in out.lower()) \
        else "cc"
    return f"{kind} {m.group(1)}"


def amx_safe_compiler(version: str | None) -> bool:
    """GCC >= 13 or clang builds llama.cpp's AMX tile setup correctly; GCC 12 and older do not."""
    if not version:
        return False
    kind, _, ver = version.partition(" ")
    major = int(ver.split(".")[0])
    return kind == "clang" or (kind == "gcc" and major >= 13)


def _nvcc() -> str | None:
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx and Path(cudacxx).exists():
        return cudacxx
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def _jetson() -> bool:
    return Path("/etc/nv_tegra_release").exists() or "tegra" in platform.release().lower()


def gpu_archs() -> list[str]:
    """CUDA architectures of the GPUs here ('90' for an H100/H200), from nvidia-smi; [] if none seen."""
    if _jetson():
        return ["87"]  # Orin; Xavier (72) users set CUDA_ARCHS
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.strip().replace(".", "") for line in out.splitlines() if re.fullmatch(r"\d+\.\d+",
                                                                                              line.strip())})


def cuda_archs(text: str) -> str:
    """CUDA_ARCHS as people write it ("89", "8.9", "sm_89", "89,90", "89 90", "native") -> CMake's "89;90"."""
    parts = [p for p in re.split(r"[\s,;]+", text.strip()) if p]
    out = []
    for p in parts:
        q = p.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not (re.fullmatch(r"\d{2,3}[af]?", q) or q in ("native", "all", "all-major")):
            raise BuildError(f"CUDA_ARCHS: cannot read {p!r}: write compute capabilities like 87, 8.9 or 89,90")
        out.append(q)
    return ";".join(out)


def _on(name: str, on: bool) -> str:
    return f"-D{name}={'ON' if on else 'OFF'}"


def choose(backend: str = "auto", amx: str = "auto", *, cpuinfo: str | None = None, machine: str | None = None,
           system: str | None = None, compiler: str | None = "detect", nvcc: str | None = "detect",
           archs: list[str] | None = None) -> Plan:
    """Pick the build for this machine (arguments other than backend/amx are for tests)."""
    if backend not in BACKENDS:
        raise BuildError(f"BACKEND must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if amx not in ("auto", "on", "off"):
        raise BuildError(f"AMX must be auto, on or off, got {amx!r}")
    machine = (machine or platform.machine()).lower()
    system = system or platform.system()
    compiler = compiler_version() if compiler == "detect" else compiler
    nvcc = _nvcc() if nvcc == "detect" else nvcc
    reasons: list[str] = []
    if backend == "auto":
        if system == "Darwin" and machine in ("arm64", "aarch64"):
            backend, why = "metal", "Apple Silicon"
        elif nvcc and (archs if archs is not None else gpu_archs()):
            backend, why = "cuda", f"nvcc at {nvcc} and an NVIDIA GPU"
        else:
            backend = "cpu"
            why = "nvcc found but no NVIDIA GPU visible" if nvcc else "no nvcc, not Apple Silicon"
        reasons.append(f"backend {backend}: {why}")
    args: list[str] = ["-DGGML_RPC=ON"]  # the RPC client: --rpc (docs/distributed.md)
    env: dict[str, str] = {}
    if backend == "cuda":
        if not nvcc:
            raise BuildError("BACKEND=cuda needs nvcc (the CUDA toolkit): put it on PATH or set CUDACXX")
        found = archs if archs is not None else gpu_archs()
        wanted = cuda_archs(os.environ.get("CUDA_ARCHS", "")) or ";".join(found)
        if not wanted:
            raise BuildError("BACKEND=cuda: no GPU visible to read its architecture from; set CUDA_ARCHS "
                             "(e.g. CUDA_ARCHS=87 for Jetson Orin, 89 for an RTX 40xx, 90 for an H100)")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={wanted}"]
        if nvcc != shutil.which("nvcc"):
            env["CUDACXX"] = nvcc
        reasons.append(f"CUDA architectures {wanted}")
    elif backend == "metal":
        if system != "Darwin":
            raise BuildError("BACKEND=metal is for macOS on Apple Silicon")
        args += ["-DGGML_METAL=ON"]
    elif system == "Darwin":
        args += ["-DGGML_METAL=OFF"]
    # the CPU part of every build (a CUDA build still runs what it does not offload on the CPU)
    if machine in ("x86_64", "amd64", "i686", "i386"):
        flags = cpu_flags(cpuinfo) if (cpuinfo is not None or system == "Linux") else set()
        if not flags:
            reasons.append("CPU flags unreadable: llama.cpp's native detection")
            return Plan(backend, args, reasons, False, env)
        args.append("-DGGML_NATIVE=OFF")
        named = []
        for opt, need in _X86:
            on = all(f in flags for f in need)
            args.append(_on(opt, on))
            if on:
                named.append(opt[5:])
        has_amx = all(f in flags for _, f in _AMX[:2])
        use_amx = has_amx and (amx == "on" or (amx == "auto" and amx_safe_compiler(compiler)))
        for opt, f in _AMX:
            args.append(_on(opt, use_amx and f in flags))
        reasons.append("CPU instruction sets named: " + (", ".join(named) or "none beyond x86-64"))
        if has_amx and not use_amx:
            reasons.append("AMX off: " + ("AMX=off" if amx == "off" else
                                          "the C++ compiler could not be identified (set CXX, or AMX=on)"
                                          if not compiler else
                                          f"{compiler} miscompiles llama.cpp's AMX kernels "
                                          "(GCC >= 13 does not; llama.cpp #20824)"))
        elif use_amx:
            reasons.append("AMX on (the self-test decides whether it stays)")
        return Plan(backend, args, reasons, use_amx, env)
    reasons.append(f"{machine}: llama.cpp's native CPU detection")
    return Plan(backend, args, reasons, False, env)
