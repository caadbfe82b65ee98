"""What a model's memory costs on *this* machine that GGUF metadata cannot say: measured once
per machine, Python and llama.cpp build, in a fresh child process, and cached.

- runtime: the resident memory of a fresh interpreter that has imported what an edgespec run
  imports (numpy, llama-cpp-python, edgespec, jinja2, gguf) and initialised llama.cpp. It differs
  between machines with the Python, numpy (and the BLAS it bundles), the llama.cpp build and the
  page size, so it is read from /proc, not fitted.
- copied (repacked) weight types: llama.cpp keeps a second, interleaved copy of some quantized
  weight types in an extra CPU buffer (CPU_REPACK on x86 and ARM, AMX on Xeons with AMX). Which
  types depends on the CPU features the build was compiled for (AVX2, AVX-512, NEON...) and on
  the llama.cpp version. The probe writes one tiny GGUF per weight type (a 1-block llama model,
  256-wide, a few hundred KiB, no vocabulary), loads it and reads from llama.cpp's own log which
  buffers the weights went to: a type is copied when any of its bytes land outside the mapped
  file ("CPU_Mapped"). That is the build's own rule, whatever its version or CPU.
- context overhead: what creating a context and decoding a batch adds besides the KV cache and
  the weights (thread pool, graph and work buffers, code pages of the CPU kernels), measured on
  the tiny model.

The child never writes to the terminal; the parent logs on the "edgespec" logger. When the cache
cannot be written the figures are kept for the life of the process; when the probe cannot run
the documented DEFAULTS stand in (x86 with AVX2, Python 3.11, numpy 2).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys
from pathlib import Path

from .cachefile import read_text

log = logging.getLogger("edgespec")

PROBE_VERSION = 1
MiB = 2**20
# Types the probe tries. Float types are never copied; everything a GGUF model ships its
# matrices in is here.
CANDIDATE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                   "IQ4_NL", "IQ4_XS", "MXFP4")
# Used when the probe cannot run (no llama_cpp, a child that fails or hangs): figures of an x86
# machine with AVX2 (llama.cpp's CPU_REPACK rule there: Q4_0, Q4_K, IQ4_NL, MXFP4), Python 3.11,
# numpy 2, llama-cpp-python 0.3.
DEFAULTS = {"runtime_bytes": 50 * MiB, "context_overhead_bytes": 4 * MiB,
            "repacked_types": ["Q4_0", "Q4_K", "IQ4_NL", "MXFP4"], "page_size": 4096, "source": "default"}
TIMEOUT_S = 30

_memo: dict[str, dict] = {}


# -- the child ------------------------------------------------------------------------------
def _status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
        out = {"VmRSS": peak, "VmHWM": peak}
    return out


def _thp() -> str | None:
    """The kernel's transparent huge page mode ("always" rounds touched anonymous memory up to
    2 MiB): recorded to explain a machine's figures, not used in the estimate."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            text = fh.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return None


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_tiny_gguf(path: str | os.PathLike, wtype: str, *, n_embd: int = 256, n_ff: int = 256,
                    n_vocab: int = 256, n_layer: int = 1) -> int:
    """A llama-architecture GGUF with every matrix in `wtype` and zero weights, no vocabulary
    (tokenizer model "none"). Returns the file size. Zero blocks are valid in every format."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    q = GGMLQuantizationType[wtype]
    f32 = GGMLQuantizationType.F32
    n_head, head_dim = 4, n_embd // 4
    tensors = [("token_embd.weight", (n_embd, n_vocab), q), ("output_norm.weight", (n_embd,), f32),
               ("output.weight", (n_embd, n_vocab), q)]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (n_embd,), f32), (p + "ffn_norm.weight", (n_embd,), f32),
                    (p + "attn_q.weight", (n_embd, n_embd), q), (p + "attn_k.weight", (n_embd, n_embd), q),
                    (p + "attn_v.weight", (n_embd, n_embd), q), (p + "attn_output.weight", (n_embd, n_embd), q),
                    (p + "ffn_gate.weight", (n_embd, n_ff), q), (p + "ffn_up.weight", (n_embd, n_ff), q),
                    (p + "ffn_down.weight", (n_ff, n_embd), q)]
    kv = [("general.architecture", 8, _gguf_string("llama")),
          ("llama.block_count", 4, struct.pack("<I", n_layer)),
          ("llama.context_length", 4, struct.pack("<I", 4096)),
          ("llama.embedding_length", 4, struct.pack("<I", n_embd)),
          ("llama.feed_forward_length", 4, struct.pack("<I", n_ff)),
          ("llama.attention.head_count", 4, struct.pack("<I", n_head)),
          ("llama.attention.head_count_kv", 4, struct.pack("<I", n_head)),
          ("llama.rope.dimension_count", 4, struct.pack("<I", head_dim)),
          ("llama.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", 1e-5)),
          ("llama.vocab_size", 4, struct.pack("<I", n_vocab)),
          ("tokenizer.ggml.model", 8, _gguf_string("none"))]
    align = 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, vtype, value in kv:
        head += _gguf_string(key) + struct.pack("<I", vtype) + value
    offset, sizes = 0, []
    for name, dims, t in tensors:
        block, type_size = GGML_QUANT_SIZES[t]
        nbytes = (dims[0] // block) * type_size
        for d in dims[1:]:
            nbytes *= d
        sizes.append(nbytes)
        head += _gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", int(t), offset)
        offset += -(-nbytes // align) * align
    head += b"\0" * (-len(head) % align)
    with open(path, "wb") as fh:
        fh.write(head)
        for nbytes in sizes:
            fh.write(b"\0" * nbytes + b"\0" * (-nbytes % align))
        return fh.tell()


# what an edgespec run imports; each may be missing (a partial install) without failing the probe
RUN_MODULES = ("numpy", "llama_cpp", "edgespec.cli", "edgespec.engine", "edgespec.assemble", "edgespec.backend",
               "edgespec.ggufinfo", "edgespec.memory", "jinja2", "gguf.constants")


def _child() -> dict:
    """Runs in a fresh interpreter: import, measure, load the tiny models, report."""
    import importlib
    for name in RUN_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    import llama_cpp as L
    lines: list[str] = []

    @L.llama_log_callback
    def _cb(level, text, user_data):
        lines.append(text.decode("utf-8", "replace"))

    L.llama_log_set(_cb, None)
    L.llama_backend_init()
    base = _status()  # before the probe's own imports below
    import tempfile
    import time
    t0 = time.monotonic()
    out = {"runtime_bytes": base["VmRSS"], "runtime_anon_bytes": base.get("RssAnon"),
           "runtime_file_bytes": base.get("RssFile"),
           "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip(),
           "page_size": os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096,
           "transparent_hugepages": _thp()}
    repacked, buffers = [], {}
    with tempfile.TemporaryDirectory(prefix="edgespec-probe-") as tmp:
        for wtype in CANDIDATE_TYPES:
            path = os.path.join(tmp, f"{wtype}.gguf")
            try:
                write_tiny_gguf(path, wtype)
            except (KeyError, ImportError):
                continue
            del lines[:]
            mp = L.llama_model_default_params()
            mp.n_gpu_layers = 0
            model = L.llama_model_load_from_file(path.encode(), mp)
            if not model:
                continue
            L.llama_model_free(model)
            bufs = _model_buffers(lines)
            buffers[wtype] = bufs
            if any(size > 0 for name, size in bufs.items() if name not in ("CPU_Mapped", "CPU")):
                repacked.append(wtype)
        if not buffers:
            raise RuntimeError("llama.cpp loaded none of the probe's models")
        if not any(buffers.values()):
            # the log said nothing about buffers (another llama.cpp version's wording): fall
            # back to the rule read from llama.cpp's source for the features it reports
            repacked, out["repacked_from"] = repack_rule(out["system_info"]), "system_info"
        else:
            out["repacked_from"] = "loaded"
        out["repacked_types"] = repacked
        out["buffers"] = buffers
        out.update(_context_overhead(L, tmp))
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def repack_rule(system_info: str) -> list[str]:
    """The types llama.cpp 0.3.x (ggml-cpu/repack.cpp) copies, from the features
    llama_print_system_info() reports; a fallback only, the probe loads models instead."""
    feats = {part.split("=")[0].strip() for part in system_info.replace("|", "\n").splitlines()
             if part.strip().endswith("= 1")}
    if "REPACK" not in feats:
        return []
    if "AVX2" in feats:
        return ["Q4_0", "Q4_K", "IQ4_NL", "MXFP4"] + (["Q2_K"] if "AVX512" in feats else [])
    if "NEON" in feats and ("DOTPROD" in feats or "MATMUL_INT8" in feats):
        return ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "MXFP4"]
    return []


def _model_buffers(lines: list[str]) -> dict:
    """'load_tensors:   CPU_REPACK model buffer size =     0.56 MiB' -> {'CPU_REPACK': bytes}."""
    bufs = {}
    for line in "".join(lines).splitlines():
        if "model buffer size" in line and "=" in line:
            name = line.split(":", 1)[-1].split("model buffer size")[0].strip()
            try:
                bufs[name] = bufs.get(name, 0) + int(float(line.rsplit("=", 1)[1].split()[0]) * MiB)
            except (ValueError, IndexError):
                continue
    return bufs


def _context_overhead(L, tmp: str) -> dict:
    """Resident memory a context and one decoded batch add besides the weights' file pages, the
    KV cache and the logits: measured on the tiny model in F16 (never copied)."""
    path = os.path.join(tmp, "ctx.gguf")
    size = write_tiny_gguf(path, "F16")
    before = _status()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        return {}
    cp = L.llama_context_default_params()
    n_ctx, n_tok = 256, 32
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = 64
    cp.n_seq_max = 1
    from .backend import default_threads
    cp.n_threads = cp.n_threads_batch = default_threads()
    cp.no_perf = True
    if hasattr(cp, "flash_attn_type"):
        cp.flash_attn_type = 0
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        L.llama_model_free(model)
        return {}
    batch = L.llama_batch_init(64, 0, 1)
    for j in range(n_tok):
        batch.token[j] = j
        batch.pos[j] = j
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = j == n_tok - 1
    batch.n_tokens = n_tok
    L.llama_decode(ctx, batch)
    batch.token[0], batch.pos[0], batch.logits[0] = 1, n_tok, True
    batch.n_tokens = 1
    L.llama_decode(ctx, batch)
    after = _status()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    kv = 1 * n_ctx * 256 * 2 * 2  # n_layer x n_ctx x (K + V) x f16
    grown = after["VmHWM"] - before["VmRSS"]
    return {"context_overhead_bytes": max(0, grown - kv - size), "context_probe": {"grown": grown, "kv": kv,
                                                                                      "file": size}}


# -- the parent -----------------------------------------------------------------------------
def _key() -> dict:
    """What the figures depend on: the interpreter, the llama.cpp build, the machine."""
    import platform
    from .backend import default_threads
    key = {"probe": PROBE_VERSION, "python": sys.executable, "python_version": sys.version,
           "machine": platform.machine(), "node": platform.node(), "platform": platform.platform(),
           "threads": default_threads()}  # the context the probe measures runs this many
    try:
        from importlib.metadata import version
        key["llama_cpp"] = version("llama_cpp_python")
        key["numpy"] = version("numpy")
    except Exception:
        pass
    try:  # a rebuild of the same version with other flags (CUDA, native) changes the library
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")
        lib = Path(spec.origin).parent / "lib"
        key["lib"] = sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in lib.glob("*")
                            if p.is_file() and not p.is_symlink())
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
        for line in text.splitlines():
            if line.startswith(("model name", "flags", "Features")):
                key.setdefault("cpu", []).append(line.split(":", 1)[1].strip())
                if len(key["cpu"]) >= 2:
                    break
    except OSError:
        pass
    return json.loads(json.dumps(key))  # as it reads back from the cache file


def _count(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def valid_figures(figures) -> bool:
    """Every figure the estimate uses, of the type and within the range a real machine gives:
    a cache file of the right key can still hold anything (an older format, a hand edit)."""
    if not isinstance(figures, dict):
        return False
    types = figures.get("repacked_types")
    return (_count(figures.get("runtime_bytes"), MiB, 16 * 2**30)
            and _count(figures.get("context_overhead_bytes"), 0, 4 * 2**30)
            and isinstance(types, list) and all(isinstance(t, str) and t in CANDIDATE_TYPES for t in types)
            and _count(figures.get("page_size", 4096), 512, 2**30))


def cache_path(key: dict) -> Path:
    import hashlib
    from .registry import cache_dir
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "probe" / f"{digest}.json"


def measure(timeout: float = TIMEOUT_S) -> dict:
    """Run the probe in a fresh interpreter; its figures, or raises RuntimeError."""
    import subprocess
    exe = sys.executable or ""
    if not os.path.basename(exe).lower().startswith(("python", "pypy")):
        # embedded or frozen: sys.executable is the application, not an interpreter to run
        raise RuntimeError(f"memory probe needs a Python interpreter, and sys.executable is {exe!r}")
    env = dict(os.environ)
    # the context probe decodes a few tokens; threads that sleep instead of spinning keep that
    # fast on a busy machine (memory is the same either way)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    # the child imports this same edgespec, also from a checkout that is not installed
    root = str(Path(__file__).resolve().parent.parent)
    if "site-packages" not in root and "dist-packages" not in root:
        env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([exe, "-m", "edgespec.probe"], capture_output=True, text=True,
                              timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"memory probe did not run: {exc}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"memory probe failed ({proc.returncode}): {tail[0]}")
    try:
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        figures = None
    if not isinstance(figures, dict):
        raise RuntimeError("memory probe printed no figures")
    return figures


def machine_figures(*, refresh: bool = False) -> dict:
    """This machine's figures: remembered by this process, read from the cache, measured now
    (and cached), or, when the probe cannot run, DEFAULTS. Never prints; `refresh` measures again."""
    if not refresh and "figures" in _memo:
        return _memo["figures"]
    key = _key()
    path = cache_path(key)
    figures = None
    if not refresh:
        text = read_text(path)  # a regular file of bounded size only: never a FIFO or a device
        try:
            cached = json.loads(text) if text is not None else None
        except (ValueError, RecursionError):
            cached = None
        if isinstance(cached, dict) and cached.get("key") == key and valid_figures(cached.get("figures")):
            figures = cached["figures"]
        elif cached is not None:
            log.debug("memory probe: the cached figures in %s are not usable: measuring again", path)
    if figures is None:
        try:
            figures = measure()
            for name in ("runtime_bytes", "context_overhead_bytes", "repacked_types"):
                figures.setdefault(name, DEFAULTS[name])  # a part the child could not measure
            if not valid_figures(figures):
                raise RuntimeError("memory probe reported figures of the wrong shape")
            figures["source"] = "measured"
        except RuntimeError as exc:
            log.warning("%s; memory estimates use default figures", exc)
            figures = dict(DEFAULTS)
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"key": key, "figures": figures}, indent=1))
                os.replace(tmp, path)
            except OSError as exc:
                log.debug("memory probe: cannot cache figures in %s (%s): measuring again in the next process",
                          path, exc)
    _memo["figures"] = figures
    return figures


if __name__ == "__main__":
    # the child: figures as one JSON line on stdout, nothing else anywhere
    sys.stdout.write(json.dumps(_child()) + "\n")
