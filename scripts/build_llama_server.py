"""Build llama.cpp's own llama-server from the llama.cpp that llama-cpp-python vendors, with the
CMake flags edgespec's build uses (edgespec/buildflags.py), for the peer benchmark
(`python -m edgespec bench --peer llama-server`).

    python scripts/build_llama_server.py            # prints the binary's path (builds it first if needed)
    python scripts/build_llama_server.py --print    # the path it would have, and the flags

The source is llama-cpp-python's sdist (pip download, so the same version as the installed
bindings); the binary is kept in ~/.cache/edgespec/llama-server/<backend>-<hash of the flags>/
(staged, then renamed: a killed build leaves nothing half-built). About 12 minutes on 2 cores.
Standard library only.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edgespec import buildflags  # noqa: E402  (standard library only)


def say(msg: str) -> None:
    print(f"build_llama_server: {msg}", file=sys.stderr, flush=True)


def home(plan, version: str) -> Path:
    base = Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec")
    return base / "llama-server" / plan.key(version)


def build(plan, version: str, python: str) -> Path:
    dest = home(plan, version)
    binary = dest / "llama-server"
    if binary.is_file():
        return binary
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        say(f"fetching the llama-cpp-python {version} source")
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(tmp)], check=True)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name]
            tf.extractall(tmp, members=members, filter="data") if sys.version_info >= (3, 12) else \
                tf.extractall(tmp, members=members)
        src = next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))
        out = tmp / "build"
        flags = plan.cmake_string.split() + ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                                             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
                                             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                                             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
        say(f"building llama-server ({plan.backend}; ~12 minutes on 2 cores)\n  {' '.join(flags)}")
        env = dict(os.environ, **plan.env)
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *flags], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(out), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        staged = tmp / "done"
        staged.mkdir()
        shutil.copy2(next(out.glob("bin/llama-server")), staged / "llama-server")
        os.rename(staged, dest)
    return binary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="a python with pip (default: this one)")
    ap.add_argument("--backend", default=os.environ.get("BACKEND") or "auto", choices=buildflags.BACKENDS)
    ap.add_argument("--version", default=buildflags.LLAMA_CPP_VERSION, help="llama-cpp-python version")
    ap.add_argument("--print", action="store_true", help="print where the binary goes and the flags")
    args = ap.parse_args()
    try:
        plan = buildflags.choose(args.backend, "off")  # AMX off: GCC < 13 miscompiles it (the first-contact issue)
    except buildflags.BuildError as exc:
        say(str(exc))
        return 2
    if args.print:
        print(home(plan, args.version) / "llama-server")
        print(plan.cmake_string)
        return 0
    try:
        print(build(plan, args.version, args.python))
    except subprocess.CalledProcessError as exc:
        say(f"the build failed ({exc.cmd[0]} exited {exc.returncode}): cmake and a C++ compiler are needed")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
