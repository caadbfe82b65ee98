"""Build llama-cpp-python for this machine and install it into a virtual environment.

    python scripts/build_llama.py --python .venv/bin/python [--backend auto|cpu|cuda|metal] [--amx auto|on|off]
    python scripts/build_llama.py --print          # what would be built, and why

The flags come from edgespec/buildflags.py (the CPU's instruction sets named one by one, no
-march=native, AMX only where the compiler builds it right). Wheels are kept in
~/.cache/edgespec/wheels/<backend>-<hash of the flags>/, so a later venv reuses the build for the
same flags and never gets a CPU build for a CUDA request (pip's own wheel cache is keyed by the
source archive only, not by CMAKE_ARGS, so it is not used for the build). With --check, the
installed build runs edgespec's self-test; a build with AMX that fails it is rebuilt without AMX.
Standard library only.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edgespec import buildflags  # noqa: E402  (standard library only)


def cache_dir() -> Path:  # registry.cache_dir's rule; registry itself needs tomli on Python 3.10
    return Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec")


def say(msg: str) -> None:
    print(f"build_llama: {msg}", flush=True)


def wheel_for(plan, python: str, version: str, force: bool = False) -> Path:
    """The cached wheel for this plan, built first when there is none (or when `force`)."""
    home = cache_dir() / "wheels" / plan.key(version)
    if force and home.is_dir():
        shutil.rmtree(home)
    found = sorted(home.glob(f"llama_cpp_python-{version}-*.whl")) if home.is_dir() else []
    if found:
        say(f"reusing {found[-1]}")
        return found[-1]
    home.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=plan.cmake_string, FORCE_CMAKE="1",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2), **plan.env)
    say(f"building llama-cpp-python {version} ({plan.backend}; a few minutes on 2 cores, "
        f"longer for CUDA)\n  CMAKE_ARGS=\"{plan.cmake_string}\"")
    with tempfile.TemporaryDirectory(prefix=".build-", dir=home.parent) as tmp:
        # --no-cache-dir: pip would otherwise hand back a wheel it built earlier with other flags
        cmd = [python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
               "-w", tmp, f"llama-cpp-python=={version}"]
        if subprocess.run(cmd, env=env).returncode != 0:
            raise SystemExit("build_llama: the build failed (see above); for another backend run "
                             "make setup BACKEND=cpu")
        built = sorted(Path(tmp).glob("llama_cpp_python-*.whl"))
        if not built:
            raise SystemExit("build_llama: pip reported success but wrote no wheel")
        staged = Path(tmp) / "done"
        staged.mkdir()
        shutil.move(str(built[0]), staged / built[0].name)
        try:
            os.rename(staged, home)  # whole or not at all: a killed build leaves no half directory
        except OSError:
            if not home.is_dir():
                raise
    return sorted(home.glob("llama_cpp_python-*.whl"))[-1]


def install(python: str, wheel: Path) -> None:
    cmd = [python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"build_llama: could not install {wheel}")
    # its own dependencies (numpy, typing-extensions, diskcache, jinja2) from the index as usual
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True)


def self_test(python: str) -> tuple[bool, str]:
    out = subprocess.run([python, "-m", "edgespec", "doctor", "--self-test"], cwd=ROOT,
                         capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    return out.returncode == 0, (text[-1] if text else f"exit {out.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the venv's python (default: this one)")
    ap.add_argument("--backend", default=os.environ.get("BACKEND") or "auto", choices=buildflags.BACKENDS)
    ap.add_argument("--amx", default=os.environ.get("AMX") or "auto", choices=("auto", "on", "off"))
    ap.add_argument("--version", default=buildflags.LLAMA_CPP_VERSION, help="llama-cpp-python version")
    ap.add_argument("--force", action="store_true", help="build again even when a wheel for these flags is cached")
    ap.add_argument("--print", action="store_true", help="print the chosen flags and the reasons, build nothing")
    ap.add_argument("--check", action="store_true",
                    help="run the self-test on what is installed; rebuild without AMX if AMX fails it")
    args = ap.parse_args()
    try:
        plan = buildflags.choose(args.backend, args.amx)
    except buildflags.BuildError as exc:
        print(f"build_llama: {exc}", file=sys.stderr)
        return 2
    for r in plan.reasons:
        say(r)
    if args.print:
        print(plan.pip_command(args.version))
        return 0
    if args.check:
        ok, line = self_test(args.python)
        say(line)
        if ok or not plan.amx:
            return 0 if ok else 1
        say("rebuilding without AMX")
        plan = buildflags.choose(args.backend, "off")
        install(args.python, wheel_for(plan, args.python, args.version))
        ok, line = self_test(args.python)
        say(line)
        return 0 if ok else 1
    install(args.python, wheel_for(plan, args.python, args.version, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
