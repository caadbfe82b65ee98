"""llama.cpp's RPC backend: a target model's layers on `rpc-server`s of other machines.

llama.cpp ships the distributed engine (ggml-rpc): an rpc-server per machine holds tensors and
computes graphs for a client. edgespec uses it as it is and adds what speculation needs: the
target runs remote, the draft model, the n-gram and copy drafters and the sampling stay here,
and each verifying pass pays the network's round trip once for k + 1 rows.

What this module does around llama.cpp (docs/distributed.md says it for people):
- `parse_servers` reads llama-server's `--rpc host:port,...`;
- `check_servers` greets each server in Python before any weight moves (a TCP connect and the
  protocol's HELLO): an unreachable server, a busy one (a server serves one client at a time)
  or another protocol version is one line, where llama.cpp would abort the process;
- `devices` gives each server's devices for a model's `devices` list: only the target gets
  them; the servers are not registered globally, so every other model stays on this machine;
- `watch`: a connection lost mid-pass makes ggml-rpc call GGML_ABORT. ggml lets a process hook
  that (ggml_set_abort_callback): the hook blocks the thread that met the loss for good, marks
  the servers lost, tells the listeners (the engine fails its generations with `RemoteLost`,
  the server answers 503 and reconnects), and the process goes on. The models on the lost
  connection are never touched again (their memory here is left, not freed: freeing sends);
- `serve`: the server itself, ggml's own `ggml_backend_rpc_start_server` from the libraries
  the client uses, so both sides are always the same llama.cpp (the handshake refuses another
  protocol major).
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Callable, Optional

from .errors import BackendError, UsageError

log = logging.getLogger("edgespec")

DEFAULT_PORT = 50052
# RPC_PROTO_MAJOR/MINOR_VERSION of ggml-rpc.h in the llama.cpp that llama-cpp-python 0.3.36 vendors
# (tests/test_rpc.py greets a server of this build: a new llama.cpp with another version fails there)
PROTOCOL = (7, 0)
_HELLO = 14            # RPC_CMD_HELLO (fixed by the protocol)
_CAPS = 24             # RPC_CONN_CAPS_SIZE: zero caps ask for plain TCP
_DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL"}


class RemoteError(BackendError):
    """An rpc-server that cannot be used: unreachable, busy, another protocol, or lost mid-answer."""

    def __init__(self, message: str, endpoint: str = ""):
        super().__init__(message)
        self.endpoint = endpoint


class RemoteLost(RemoteError):
    """The connection to an rpc-server broke while a model used it: that model is gone."""


# -- addresses and the handshake ----------------------------------------------------------------------
def parse_servers(text: str) -> list[str]:
    """`host:port[,host:port...]` (llama-server's --rpc) -> endpoints; a port may be left out (50052)."""
    out = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, str(DEFAULT_PORT)
        if not host or ":" in host or host.startswith("["):
            raise UsageError(f"--rpc {part!r}: write HOST:PORT with a name or an IPv4 address, like "
                             f"192.168.1.20:{DEFAULT_PORT} (llama.cpp's RPC client takes no IPv6 addresses)")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(f"--rpc {part!r}: {port!r} is not a port; write HOST:PORT, like big-box:{DEFAULT_PORT}")
        out.append(f"{host}:{int(port)}")
    if not out:
        raise UsageError(f"--rpc needs at least one HOST:PORT, like 192.168.1.20:{DEFAULT_PORT}")
    if len(set(out)) != len(out):
        raise UsageError(f"--rpc {text!r} names a server twice")
    return out


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed the connection")
        buf += chunk
    return buf


def hello(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """Connect and greet: the server's protocol (major, minor, patch). Raises RemoteError."""
    host, _, port = endpoint.rpartition(":")
    start = (f"no rpc-server answers at {endpoint}", "start one there with `python -m edgespec rpc-server "
             "--host 0.0.0.0` (or check the address and the firewall)")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.gaierror:
        raise RemoteError(f"--rpc {endpoint}: cannot resolve the host name {host!r}", endpoint) from None
    except OSError as exc:
        why = "refused" if isinstance(exc, ConnectionRefusedError) else "timed out" \
            if isinstance(exc, (socket.timeout, TimeoutError)) else (exc.strerror or str(exc))
        raise RemoteError(f"{start[0]} ({why}): {start[1]}", endpoint) from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            size = struct.unpack("<Q", _recv(sock, 8))[0]
            if size != 4 + _CAPS:
                raise ConnectionError(f"answered HELLO with {size} bytes")
            major, minor, patch = _recv(sock, 4)[:3]
        except (socket.timeout, TimeoutError):
            raise RemoteError(f"the rpc-server at {endpoint} accepted but did not answer within {timeout:g} s: "
                              "it serves one client at a time (is another edgespec or llama.cpp using it?)",
                              endpoint) from None
        except (OSError, ConnectionError) as exc:
            raise RemoteError(f"{endpoint} did not answer as an rpc-server does ({exc}): is that "
                              "port an rpc-server of another llama.cpp, or another program?", endpoint) from None
    return major, minor, patch


def check_servers(endpoints: list[str], timeout: float = 5.0) -> dict[str, tuple[int, int, int]]:
    """Greet every server; one line for the first that cannot serve this client."""
    seen = {}
    for ep in endpoints:
        v = hello(ep, timeout)
        if v[0] != PROTOCOL[0] or v[1] > PROTOCOL[1]:
            raise RemoteError(f"the rpc-server at {ep} speaks RPC protocol {v[0]}.{v[1]}.{v[2]}, this client "
                              f"{PROTOCOL[0]}.{PROTOCOL[1]}: run the same edgespec (and llama-cpp-python) on "
                              "both machines (`python -m edgespec rpc-server` there)", ep)
        seen[ep] = v
    return seen


# -- ggml through ctypes ------------------------------------------------------------------------------
class _Ggml:
    """The few ggml calls llama-cpp-python does not bind, from the libraries it loaded."""

    def __init__(self):
        import llama_cpp  # loads libllama and, through it, libggml*
        self._libs = [ctypes.CDLL(str(p)) for p in _loaded_ggml(Path(llama_cpp.__file__).parent / "lib")]
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        self.reg_by_name = self._fn("ggml_backend_reg_by_name", vp, [cp])
        self.reg_proc = self._fn("ggml_backend_reg_get_proc_address", vp, [vp, cp])
        self.reg_dev_count = self._fn("ggml_backend_reg_dev_count", sz, [vp])
        self.reg_dev_get = self._fn("ggml_backend_reg_dev_get", vp, [vp, sz])
        self.dev_count = self._fn("ggml_backend_dev_count", sz, [])
        self.dev_get = self._fn("ggml_backend_dev_get", vp, [sz])
        self.dev_by_name = self._fn("ggml_backend_dev_by_name", vp, [cp])
        self.dev_name = self._fn("ggml_backend_dev_name", cp, [vp])
        self.dev_description = self._fn("ggml_backend_dev_description", cp, [vp])
        self.dev_type = self._fn("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_memory = self._fn("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self.dev_buffer_type = self._fn("ggml_backend_dev_buffer_type", vp, [vp])
        self.set_abort_callback = self._fn("ggml_set_abort_callback", vp, [vp])

    def _fn(self, name, restype, argtypes):
        for lib in self._libs:
            f = getattr(lib, name, None)
            if f is not None:
                f.restype, f.argtypes = restype, argtypes
                return f
        raise BackendError(f"llama-cpp-python's libraries lack {name}: rebuild it with `make llama`")

    def rpc_reg(self):
        reg = self.reg_by_name(b"RPC")
        if not reg:
            raise RemoteError("this llama-cpp-python was built without llama.cpp's RPC backend: rebuild it "
                              "with `make llama` (edgespec builds it with -DGGML_RPC=ON)")
        return reg

    def memory(self, dev) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)


def _loaded_ggml(lib: Path) -> list[Path]:
    """The ggml libraries libllama was linked against, as the process mapped them. A wheel stores
    `libggml-base.so`, `.so.0` and `.so.0.25.3` as three files (wheels keep no links): opening
    another name than the one mapped would load a second ggml, with its own abort hook and registry."""
    names = ("libggml-base", "libggml.", "libggml-rpc")
    try:
        with open("/proc/self/maps") as fh:
            mapped = {line.split(None, 5)[-1].strip() for line in fh if "libggml" in line}
    except OSError:
        mapped = set()
    found = [Path(m) for n in names for m in sorted(mapped) if Path(m).name.startswith(n)]
    if found:
        return list(dict.fromkeys(found))
    out = []  # elsewhere (macOS, Windows): the names the loader uses, the versioned ones first
    for n in ("libggml-base", "libggml", "ggml-base", "ggml"):
        cands = sorted(lib.glob(n + ".*"), key=lambda p: (-p.name.count("."), p.name))
        cands = [p for p in cands if p.suffix in (".dylib", ".dll") or ".so" in p.name]
        if cands:
            out.append(cands[0])
    return out


_ggml: Optional[_Ggml] = None
_ggml_lock = threading.Lock()


def ggml() -> _Ggml:
    global _ggml
    with _ggml_lock:
        if _ggml is None:
            _ggml = _Ggml()
        return _ggml


def available() -> bool:
    """Whether the installed llama-cpp-python has the RPC backend."""
    try:
        return bool(ggml().reg_by_name(b"RPC"))
    except Exception:
        return False


# -- the devices of the servers -----------------------------------------------------------------------
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
# a reconnect after a loss must open a new connection: llama.cpp keeps one per endpoint string for
# as long as a model holds it, and the lost models are held for good. "host:050052" names the same
# port in another string (llama.cpp reads the port with stoi), so each generation of connections
# gets its own.
_generation = 0


def _spelled(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{'0' * _generation}{port}"


def devices(endpoints: list[str]) -> list[dict]:
    """Each server's devices: [{"endpoint", "handle", "name", "description", "free", "total"}].
    Call `check_servers` first: a server that does not answer here makes llama.cpp abort."""
    g = ggml()
    add = _ADD_SERVER(g.reg_proc(g.rpc_reg(), b"ggml_backend_rpc_add_server"))
    out = []
    for ep in endpoints:
        reg = add(_spelled(ep).encode())
        if not reg:
            raise RemoteError(f"the rpc-server at {ep} offers no device", ep)
        for i in range(g.reg_dev_count(reg)):
            dev = g.reg_dev_get(reg, i)
            free, total = g.memory(dev)
            out.append({"endpoint": ep, "handle": dev, "name": (g.dev_name(dev) or b"").decode(),
                        "description": (g.dev_description(dev) or b"").decode(), "free": free, "total": total})
    return out


def device_list(handles: list) -> ctypes.Array:
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices (keep it alive)."""
    arr = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    return arr


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# the output layer and its norm (a tied model's output is its token embedding, kept on the CPU as
# the input layer anyway): llama.cpp counts the output as the last "layer" of n_gpu_layers, so
# "every repeating layer remote, the output here" is said with a buffer-type override (llama-server's -ot)
OUTPUT_TENSORS = rb"^(output|output_norm|token_embd)\."


def output_here() -> ctypes.Array:
    """A NULL-terminated llama_model_tensor_buft_override array putting the output layer in this
    machine's CPU memory (for llama_model_params.tensor_buft_overrides; keep it alive)."""
    g = ggml()
    cpu = next((g.dev_get(i) for i in range(g.dev_count()) if _DEVICE_TYPES.get(g.dev_type(g.dev_get(i))) == "CPU"),
               None)
    if cpu is None:
        raise RemoteError("llama.cpp reports no CPU device here for the output layer: use --rpc-output remote")
    buft = g.dev_buffer_type(cpu)
    return (_BuftOverride * 2)(_BuftOverride(OUTPUT_TENSORS, buft), _BuftOverride(None, None))


def local_devices() -> list:
    """This machine's accelerators (GPU, integrated GPU): what a local model offloads to when RPC
    devices exist in the process (llama.cpp would otherwise offer every device to every model)."""
    g = ggml()
    out = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        if _DEVICE_TYPES.get(g.dev_type(dev)) in ("GPU", "IGPU"):
            out.append(dev)
    return out


# -- a lost server ------------------------------------------------------------------------------------
_ABORT = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_hook = None            # the installed ctypes callback (kept alive)
_previous = None
_lost: Optional[RemoteLost] = None
_listeners: list[Callable[[RemoteLost], None]] = []
_parkers: list[Callable[[RemoteLost], None]] = []
_state = threading.Lock()
_in_use: set[str] = set()   # the endpoints of loaded remote models (named in the loss's message)


def _on_abort(message: bytes) -> None:
    text = (message or b"").decode(errors="replace").strip()
    if "ggml-rpc" not in text and "RPC" not in text:
        os.write(2, (text + "\n").encode())  # not ours: as ggml's default (abort() follows)
        return
    global _lost
    with _state:
        where = ", ".join(sorted(_in_use)) or "the rpc-server"
        err = RemoteLost(f"lost the rpc-server at {where} mid-answer (it stopped, or the network did): "
                         "start it again; `serve` reconnects by itself", where)
        first = _lost is None
        _lost = err
        listeners = list(_parkers) + list(_listeners)
    log.info("llama.cpp: %s", text.rpartition(": ")[2] or text)
    if first:
        for fn in listeners:  # first what frees llama.cpp's thread (backend._compute.abandon)
            try:
                fn(err)
            except Exception:
                log.exception("a listener of the rpc-server's loss failed")
    threading.Event().wait()  # this thread never returns into llama.cpp: abort() would end the process


def watch(endpoints: list[str], park: Optional[Callable[[RemoteLost], None]] = None) -> None:
    """Install the abort hook (once) and note the endpoints in use; `park(error)` is called first
    of all on a loss (the backend hands the llama.cpp thread that waits for good over to a new one)."""
    global _hook, _previous
    with _state:
        _in_use.update(endpoints)
        if park is not None and park not in _parkers:
            _parkers.append(park)
        if _hook is None:
            _hook = _ABORT(_on_abort)
            _previous = ggml().set_abort_callback(ctypes.cast(_hook, ctypes.c_void_p))


def lost() -> Optional[RemoteLost]:
    """The loss met since the last `reconnected()`, if any."""
    return _lost


def on_lost(fn: Callable[[RemoteLost], None]) -> Callable[[], None]:
    """Call `fn(error)` (from llama.cpp's thread that met it: set flags, compute nothing) when a
    server is lost; returns the function that removes it."""
    with _state:
        _listeners.append(fn)

    def remove():
        with _state:
            if fn in _listeners:
                _listeners.remove(fn)
    return remove


def reconnected() -> None:
    """Forget the loss: the next models connect anew (a new connection per endpoint)."""
    global _lost, _generation
    with _state:
        _lost = None
        _generation += 1
        _in_use.clear()


# -- the server ---------------------------------------------------------------------------------------
_START = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_void_p))


def server_devices(names: Optional[list[str]] = None) -> list[tuple]:
    """(handle, name, description, free, total) of the devices an rpc-server offers: those named,
    else this machine's GPUs, else its CPU (llama.cpp's rpc-server's rule)."""
    g = ggml()
    every = [g.dev_get(i) for i in range(g.dev_count())]
    info = {(g.dev_name(d) or b"").decode(): d for d in every}
    if names:
        chosen = []
        for n in names:
            if n not in info:
                raise UsageError(f"--device {n!r}: this machine has {', '.join(info) or 'no devices'}")
            chosen.append(info[n])
    else:
        chosen = [d for d in every if _DEVICE_TYPES.get(g.dev_type(d)) not in ("CPU", "ACCEL")] or \
                 [d for d in every if _DEVICE_TYPES.get(g.dev_type(d)) == "CPU"][:1]
    return [(d, (g.dev_name(d) or b"").decode(), (g.dev_description(d) or b"").decode(), *g.memory(d))
            for d in chosen]


def serve(host: str, port: int, threads: int, device_names: Optional[list[str]] = None,
          cache_dir: Optional[str] = None) -> None:
    """Run ggml's rpc-server here until the process ends (it never returns on its own)."""
    g = ggml()
    start = _START(g.reg_proc(g.rpc_reg(), b"ggml_backend_rpc_start_server"))
    devs = server_devices(device_names)
    arr = (ctypes.c_void_p * len(devs))(*[d[0] for d in devs])
    start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, threads, len(devs), arr)
    raise RemoteError(f"the rpc-server could not listen on {host}:{port} (is the port in use?)")
