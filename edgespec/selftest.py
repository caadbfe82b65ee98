"""Does this llama.cpp build compute right on this machine? A self-test in a child process.

A build can crash on its first decode (AMX kernels miscompiled by GCC < 13: a fault at
`ldtilecfg`; a wheel built for instructions this CPU lacks: SIGILL) or answer garbage. The test
writes a tiny llama-architecture GGUF with random weights in the quantized types real models use
(Q4_K, Q6_K, Q4_0, Q8_0), decodes it through edgespec's own backend in a child process (a crash
kills the child, not the caller), and compares every row of logits with a numpy forward pass over
the same dequantized weights: all finite, close, and the same greedy tokens.

`ensure()` runs it once per llama.cpp build (keyed by the installed library files) and remembers a
pass under the cache folder; `run`, `serve` and `Engine.load` call it before their first load.
Set EDGESPEC_SELFTEST=off to skip it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BackendError
from .progress import log

# the tiny model: 2 layers, 4 query heads over 2 KV heads (grouped), a 259-token byte vocabulary
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_VOCAB = 256, 4, 2, 512, 2, 259
EPS, ROPE_BASE = 1e-5, 10000.0
PROMPT_LEN, DECODE_STEPS = 24, 8
# the logit error allowed, root-mean-square in standard deviations of the reference logits: llama.cpp
# quantizes activations to 8 bits for quantized matmuls, 0.02-0.04 measured here (largest single
# error 0.2-0.4); a broken kernel gives 1 and more (reversed logits: 1.3-1.4)
TOLERANCE = 0.15
CLEAR = 1.0  # greedy tokens are compared where the reference's top two are this many sd apart
TIMEOUT_S = 180

_lock = threading.Lock()
_passed: set[str] = set()


@dataclass
class Result:
    ok: bool
    line: str                            # "self-test ok ..." or the one-line cause and fix
    details: dict = field(default_factory=dict)


# -- the model and its reference ---------------------------------------------------------------
# byte offsets of the f16 scale fields of one block, per type (ggml's block layouts)
_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
_INT8 = {"Q8_0": ((2, 34),), "Q6_K": ((192, 208),)}  # the int8 quants of Q8_0, the int8 scales of Q6_K
# per layer the types a Q4_K_M file mixes, and the legacy types in the second layer
_TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
          {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
           "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}]


def _quantized(rng, rows: int, cols: int, qtype: str, std: float):
    """Random blocks of `qtype` whose dequantized values have about `std`: (raw bytes, values)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    t = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # int8 fields as ggml's quantizers write them, in -127..127 (its kernels may assume -128 never comes)
    for lo, hi in _INT8.get(qtype, ()):
        raw[:, :, lo:hi] = rng.integers(-127, 128, size=(rows, cols // block, hi - lo)).astype(np.int8).view(np.uint8)
    for off in _SCALES[qtype]:
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    scale = np.float16(std / float(dequantize(raw.reshape(rows, -1), t).std()))
    for off in _SCALES[qtype]:
        raw[:, :, off:off + 2] = np.frombuffer(scale.tobytes(), np.uint8)
    raw = raw.reshape(rows, -1)
    return raw, dequantize(raw, t).astype(np.float64)


def write_model(path: Path, seed: int = 0) -> dict:
    """Write the test GGUF to `path`; returns its weights, dequantized, for the reference."""
    import numpy as np
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("edgespec-selftest")
    w.add_context_length(512)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([2, 3, 3] + [6] * 256)  # unknown, control, control, bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    head = N_EMBD // N_HEAD
    ref: dict = {"layers": []}

    def put(name, rows, cols, qtype, std):
        raw, val = _quantized(rng, rows, cols, qtype, std)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        return val

    def norm(name, n):
        val = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(name, val)
        return val.astype(np.float64)

    ref["embd"] = put("token_embd.weight", N_VOCAB, N_EMBD, "Q8_0", 1.0)
    for i in range(N_LAYER):
        ty, s = _TYPES[i], 1.0 / np.sqrt(N_EMBD)
        ref["layers"].append({
            "attn_norm": norm(f"blk.{i}.attn_norm.weight", N_EMBD),
            "q": put(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD, ty["attn_q"], s),
            "k": put(f"blk.{i}.attn_k.weight", N_HEAD_KV * head, N_EMBD, ty["attn_k"], s),
            "v": put(f"blk.{i}.attn_v.weight", N_HEAD_KV * head, N_EMBD, ty["attn_v"], s),
            "o": put(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD, ty["attn_output"], s),
            "ffn_norm": norm(f"blk.{i}.ffn_norm.weight", N_EMBD),
            "gate": put(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD, ty["ffn_gate"], s),
            "up": put(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD, ty["ffn_up"], s),
            "down": put(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF, ty["ffn_down"], 1.0 / np.sqrt(N_FF)),
        })
    ref["out_norm"] = norm("output_norm.weight", N_EMBD)
    ref["out"] = put("output.weight", N_VOCAB, N_EMBD, "Q6_K", 4.0 / np.sqrt(N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def reference_logits(ref: dict, tokens):
    """Float64 logits of every position: llama's forward pass (RMSNorm, RoPE in llama.cpp's
    'normal' mode on adjacent pairs, grouped-query causal attention, SwiGLU)."""
    import numpy as np
    head, group, n = N_EMBD // N_HEAD, N_HEAD // N_HEAD_KV, len(tokens)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g

    pos = np.arange(n)[:, None]
    theta = pos * ROPE_BASE ** (-np.arange(0, head, 2) / head)  # (n, head/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def rope(x):  # (n, heads, head)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    x = ref["embd"][np.asarray(tokens)]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for lay in ref["layers"]:
        h = rms(x, lay["attn_norm"])
        q = rope((h @ lay["q"].T).reshape(n, N_HEAD, head))
        k = rope((h @ lay["k"].T).reshape(n, N_HEAD_KV, head))
        v = (h @ lay["v"].T).reshape(n, N_HEAD_KV, head)
        att = np.empty((n, N_HEAD, head))
        for hh in range(N_HEAD):
            s = q[:, hh] @ k[:, hh // group].T / np.sqrt(head) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, hh // group]
        x = x + att.reshape(n, N_EMBD) @ lay["o"].T
        h = rms(x, lay["ffn_norm"])
        g = h @ lay["gate"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ lay["up"].T)) @ lay["down"].T
    return rms(x, ref["out_norm"]) @ ref["out"].T


# -- the child: decode through edgespec's backend, compare -------------------------------------
def child(workdir: str, flash_attn: str = "auto") -> dict:
    import numpy as np
    from . import backend
    path = Path(workdir) / "selftest.gguf"
    ref = write_model(path)
    L = backend._llama()
    backend.set_verbose(bool(os.environ.get("EDGESPEC_SELFTEST_VERBOSE")))
    # said before the first decode, so that a crash still leaves the build's features behind
    sys.stderr.write("system_info: " + L.llama_print_system_info().decode(errors="replace") + "\n")
    sys.stderr.flush()
    if os.environ.get("EDGESPEC_SELFTEST_FAULT") == "segv":  # for the tests: a crash, as AMX's
        os.kill(os.getpid(), signal.SIGSEGV)
    b = backend.LlamaBackend(path, n_ctx=256, flash_attn=flash_attn)
    try:
        rng = np.random.default_rng(1)
        tokens = [int(t) for t in rng.integers(3, N_VOCAB, PROMPT_LEN)]
        rows = [b.eval(tokens, list(range(PROMPT_LEN)))]  # a batch: llama.cpp's matrix kernels
        for _ in range(DECODE_STEPS):  # one token at a time: its vector kernels
            tokens.append(int(np.argmax(rows[-1][-1])))
            rows.append(b.eval(tokens[-1:], [0]))
    finally:
        b.close()
    got = np.concatenate(rows).astype(np.float64)
    if os.environ.get("EDGESPEC_SELFTEST_FAULT") == "garbage":
        got = got[:, ::-1]
    want = reference_logits(ref, tokens)
    finite = bool(np.isfinite(got).all())
    sd = want.std()
    err = float(np.sqrt(((got - want) ** 2).mean()) / sd) if finite else float("inf")
    worst = float(np.abs(got - want).max() / sd) if finite else float("inf")
    # the greedy answer: llama.cpp's argmax where the reference's top two are not a near-tie
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > CLEAR * sd
    agree = bool((np.argmax(got, -1) == np.argmax(want, -1))[clear].all())
    result = {"finite": finite, "error": err, "largest_error": worst, "greedy_agrees": agree,
              "positions": len(tokens), "clear_positions": int(clear.sum())}
    (Path(workdir) / "result.json").write_text(json.dumps(result))  # for the parent, in check()
    return result


# -- the parent --------------------------------------------------------------------------------
def _checkout() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    return root if (root / "Makefile").exists() and (root / "scripts" / "build_llama.py").exists() else None


def rebuild_hint(amx_off: bool = False) -> str:
    """The command that rebuilds llama-cpp-python for this machine: make in a checkout, else pip."""
    from . import buildflags
    root = _checkout()
    if root:  # FORCE=1: the same flags built again, not the cached wheel reinstalled
        return f"make -C {root} llama FORCE=1" + (" AMX=off" if amx_off else "")
    try:
        return buildflags.choose("auto", "off" if amx_off else "auto").pip_command()
    except buildflags.BuildError:
        return "pip install --force-reinstall --no-cache-dir llama-cpp-python"


def build_key() -> str | None:
    """Names the installed llama.cpp build on this machine: its library files' names and contents,
    and the CPU (a home folder shared between machines must not carry one machine's pass to another).
    By content, not file times: the same wheel installed again (a new venv, a clean clone) is the
    same build, and keeps its self-test and calibrations."""
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(list(spec.submodule_search_locations)[0])
    from .buildflags import cpu_flags
    import platform
    h = hashlib.sha256(f"{platform.machine()} {' '.join(sorted(cpu_flags()))} "
                       f"{os.environ.get('LLAMA_CPP_LIB_PATH', '')}\n".encode())
    for f in sorted(pkg.rglob("*")):
        if f.suffix in (".so", ".dylib", ".dll") or ".so." in f.name:
            st = f.stat()
            h.update(f"{f.relative_to(pkg)}:{_content_digest(str(f), st.st_size, st.st_mtime_ns)}\n".encode())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=64)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    """A library file's sha256, read once per process while its size and time stay the same."""
    d = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            d.update(chunk)
    return f"{size}:{d.hexdigest()}"


def _has_amx(system_info: str) -> bool:
    """llama.cpp's system info names AMX_INT8 (or AMX) = 1 when its AMX kernels are in the build."""
    return "AMX_INT8 = 1" in system_info or "AMX = 1" in system_info


def _explain(rc: int, stderr: str) -> str:
    info = next((ln for ln in stderr.splitlines() if ln.startswith("system_info:")), "")
    amx = _has_amx(info)
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        if name == "SIGKILL":
            return ("self-test failed: the test process was killed (SIGKILL: out of memory?); free memory and "
                    "run `edgespec doctor` again")
        if name == "SIGILL":
            cause = "the build uses instructions this CPU lacks (a wheel built on another machine?)"
        elif amx:
            cause = "its AMX kernels fault (GCC < 13 builds their tile setup wrong, llama.cpp #20824)"
        else:
            cause = "the build does not run on this machine"
        return (f"self-test failed: llama.cpp crashed ({name}) on its first decode: {cause}; "
                f"rebuild it: {rebuild_hint(amx_off=amx)}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {rc}"
    if "llama_cpp" in stderr and ("No module named" in last or "Error" in last):
        return f"self-test failed: llama-cpp-python cannot be loaded ({last}); reinstall it: {rebuild_hint()}"
    return f"self-test failed: the test process stopped with {last}; rebuild llama-cpp-python if it persists: " \
           f"{rebuild_hint()}"


def check(timeout: float = TIMEOUT_S) -> Result:
    """Run the self-test now in a child process (nothing cached)."""
    try:
        workdir = tempfile.TemporaryDirectory(prefix="edgespec-selftest-")
    except OSError as exc:
        return Result(False, f"self-test failed: no writable temporary folder ({exc.strerror or exc}): set TMPDIR "
                      "to one")
    with workdir as tmp:
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-c", "import sys; from edgespec.selftest import child; child(sys.argv[1])", tmp]
        try:
            # run in the empty folder: the working directory comes first on a child's sys.path, and a
            # gguf.py or numpy.py there must not stand in for the real ones
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            return Result(False, f"self-test failed: a decode of a 2-layer test model took over {timeout:.0f} s "
                          f"(llama.cpp hangs on this machine?); rebuild it: {rebuild_hint()}")
        if out.returncode != 0:
            return Result(False, _explain(out.returncode, out.stderr), {"returncode": out.returncode,
                                                                         "stderr": out.stderr[-2000:]})
        try:
            d = json.loads((Path(tmp) / "result.json").read_text())
        except (OSError, ValueError):
            return Result(False, "self-test failed: the test process wrote no result; rebuild: " + rebuild_hint())
    info = next((ln[13:] for ln in out.stderr.splitlines() if ln.startswith("system_info:")), "").strip()
    d["system_info"] = info
    if not d["finite"]:
        return Result(False, "self-test failed: llama.cpp returned NaN or infinite logits on a test model; "
                      f"rebuild it: {rebuild_hint(amx_off=_has_amx(info))}", d)
    if d["error"] > TOLERANCE or not d["greedy_agrees"]:
        return Result(False, f"self-test failed: llama.cpp's logits differ from the reference by {d['error']:.2f} "
                      f"standard deviations (allowed {TOLERANCE}) on a test model: wrong results on this CPU; "
                      f"rebuild it: {rebuild_hint(amx_off=_has_amx(info))}", d)
    return Result(True, f"self-test ok: {d['positions']} positions of a Q4_K/Q6_K/Q4_0/Q8_0 test model match "
                  f"the reference (error {d['error']:.3f} sd, greedy tokens equal)", d)


def _stamp(key: str) -> Path:
    from .registry import cache_dir
    return cache_dir() / "selftest" / f"{key}.json"


def cached(key: str | None) -> bool:
    return key is not None and (key in _passed or _stamp(key).is_file())


def ensure() -> None:
    """Raise BackendError with the cause and the fix unless this llama.cpp build passed the
    self-test on this machine (run now, once per build; a pass is remembered)."""
    if os.environ.get("EDGESPEC_SELFTEST", "").lower() in ("0", "off", "no", "false", "skip"):
        return
    with _lock:
        key = build_key()
        if key is None:
            raise BackendError("llama-cpp-python is not installed: " + rebuild_hint())
        if cached(key):
            _passed.add(key)
            return
        log.info("checking this llama.cpp build once (a small self-test)")
        result = check_and_remember(key)
        if not result.ok:
            raise BackendError(result.line)


def check_and_remember(key: str | None = None) -> Result:
    """Run the self-test now (as `doctor` does); a pass is remembered for this build."""
    result = check()
    key = key or build_key()
    if result.ok and key:
        _passed.add(key)
        remember(key, result)
    return result


def remember(key: str, result: Result) -> None:
    stamp = _stamp(key)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"line": result.line, **result.details}))
        os.replace(tmp, stamp)
    except OSError as exc:  # an unwritable cache only means the test runs again next time
        log.info("could not remember the self-test in %s: %s", stamp.parent, exc.strerror or exc)
