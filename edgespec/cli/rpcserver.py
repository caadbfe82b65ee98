"""`python -m edgespec rpc-server`: llama.cpp's rpc-server, for the machine that holds a target.

It runs ggml's own server (`ggml_backend_rpc_start_server`) from the llama.cpp libraries this
edgespec's llama-cpp-python was built with, so both ends of a connection are always the same
llama.cpp: nothing else to build or to keep in step. It serves one client at a time.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from ..errors import UsageError

PROG = "edgespec rpc-server"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(sub) -> None:
    from ..rpc import DEFAULT_PORT
    p = sub.add_parser("rpc-server", help="serve this machine's CPU or GPU to another edgespec (--rpc)",
                       description="Run llama.cpp's rpc-server: another machine's `edgespec run/serve --rpc "
                       "HOST:PORT` then runs its target's layers here. RPC has no authentication and no "
                       "encryption: bind a non-loopback address only on a network you trust "
                       "(docs/distributed.md).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 for every interface)")
    p.add_argument("--port", "-p", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                   help="CPU threads for a CPU device (default: the physical cores)")
    p.add_argument("--device", "-d", action="append", default=None, metavar="NAME",
                   help="a device to serve, e.g. CUDA0 (repeatable; default: the GPUs, else the CPU)")
    p.add_argument("--cache", "-c", action="store_true", help="keep received tensors in ~/.cache/edgespec/rpc, so "
                   "a client that loads the same model again sends hashes instead of weights")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's own logs")
    p.set_defaults(func=cmd_rpc_server)


def _check_port(host: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise UsageError(f"--port {port}: give a port from 1 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise UsageError(f"--host {host!r}: not an address of this machine") from None
    fam, kind, proto, _, addr = infos[0]
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's server socket does
        try:
            s.bind(addr)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another rpc-server "
                             "there? pick another --port)") from None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def cmd_rpc_server(args) -> int:
    from .. import rpc
    from ..backend import default_threads, set_verbose
    from ..registry import cache_dir
    threads = args.threads or default_threads()
    if threads < 1:
        raise UsageError(f"--threads {threads}: give 1 or more")
    _check_port(args.host, args.port)
    set_verbose(args.verbose)
    if not rpc.available():
        print(f"{PROG}: error: this llama-cpp-python was built without llama.cpp's RPC backend: rebuild it with "
              "`make llama` (edgespec builds it with -DGGML_RPC=ON)", file=sys.stderr)
        return 1
    devices = rpc.server_devices(args.device)
    cache = None
    if args.cache:
        cache = cache_dir() / "rpc"
        cache.mkdir(parents=True, exist_ok=True)
    if args.host not in LOOPBACK:
        print(f"{PROG}: warning: listening on {args.host}:{args.port}: llama.cpp's RPC has no authentication and "
              "no encryption; whoever reaches this port can use this machine's memory and compute. Trusted "
              "networks only.", file=sys.stderr)
    for _, name, desc, free, total in devices:
        print(f"{PROG}: serving {name} ({desc}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free) on "
              f"{args.host}:{args.port}; Ctrl-C stops", file=sys.stderr)
    failed: list[BaseException] = []

    def run():
        try:
            rpc.serve(args.host, args.port, threads, args.device, str(cache) if cache else None)
        except BaseException as exc:  # it returns only when it could not listen
            failed.append(exc)
    t = threading.Thread(target=run, name="rpc-server", daemon=True)
    t.start()
    # Ctrl-C, and a service manager's stop, end it; SIGINT explicitly: a parent that ignores it (a
    # test runner's worker) hands that on, and Python then installs no KeyboardInterrupt
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while t.is_alive():
            t.join(0.5)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)  # ggml's server thread may be inside a client's call: nothing to tidy, no waiting for it
    if failed:
        raise failed[0]
    return 1
