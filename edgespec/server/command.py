"""`edgespec serve`: the command. The only part of the server that writes to the terminal.

Imports nothing of the web stack at module level, so that `edgespec.cli` can register the verb
on an install without the `server` extra; running it there says what to install.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import socket
import tempfile
import threading
from pathlib import Path

from ..errors import EdgespecError, UsageError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 8
API_KEY_ENV = "EDGESPEC_API_KEY"

DESCRIPTION = ("Serve one model pair over HTTP for desktop apps, agents and scripts: OpenAI's API (/v1/models, "
               "/v1/chat/completions, /v1/completions, /v1/responses), Anthropic's Messages API (/v1/messages), "
               "Ollama's API (/api/tags, /api/show, /api/chat, /api/generate ...), /health, and Prometheus metrics "
               "(/metrics). Up to --parallel requests are answered at once, batched together; more wait in arrival "
               "order. A conversation's next turn reuses the KV cache of the prefix it shares with an earlier "
               "request. The model's name is the pair's name, or the GGUF file's name without .gguf, as "
               "/v1/models and /api/tags list it (NAME:latest is the same): Ollama's routes answer another name "
               "with 404, OpenAI's and Anthropic's answer any name with the served model and name it in every "
               "answer.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` verb on the CLI's subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible local HTTP server", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=cmd_serve)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..frontend import PARALLEL_FLAGS
    from ..frontend import _add_model_args
    _add_model_args(p)
    p.add_argument("--host", default=DEFAULT_HOST, metavar="ADDR",
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                   help=f"port (default {DEFAULT_PORT}; 0 = any free port, printed at start)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1, /api and /metrics (default ${API_KEY_ENV}, "
                   "which keeps the key out of the process list)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let a web page or an app's webview from ORIGIN (e.g. http://localhost:5173) call the "
                   "API; repeatable, '*' for any. By default a request that carries an Origin header (every "
                   "request a browser page makes) is refused with 403")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also accept requests whose Host header is NAME or NAME:PORT (a name this machine "
                   "has on the network, or a proxy's); repeatable, '*' for any. By default only 127.0.0.1, "
                   "localhost, [::1] and the --host address are accepted, which keeps DNS-rebinding pages out")
    # --cache-ram comes with the model flags (_add_model_args), the same on every verb
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="also keep the conversations' KV caches in DIR, so that a restart with the same long "
                   "system prompt skips its prefill (entries of another model file or llama.cpp build are refused)")
    p.add_argument("--context-overflow", choices=("error", "drop-oldest"), default="error",
                   help="a conversation longer than the context: 400 context_length_exceeded (default), or "
                   "drop-oldest: keep the system message and drop the oldest turns until it fits")
    for flags, kw in PARALLEL_FLAGS.items():  # --parallel N, -np N: as `plan` takes it
        p.add_argument(*flags, **kw)
    p.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE, metavar="N",
                   help="requests that may wait while --parallel ones are answered; beyond that, 503 "
                   f"(default {DEFAULT_QUEUE})")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="append the JSON body of every request to the API (OpenAI's, Anthropic's and Ollama's "
                        "routes) to FILE, one line each: a session of an agent to replay with `bench --kinds agent "
                        "--agent-session FILE`. It holds your prompts: it is created readable by you alone (0600)")
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="do not serve GET /metrics (Prometheus text in llama.cpp's names; on by default, behind "
                   "the same --api-key and Origin/Host checks as the API)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may well be reachable from elsewhere
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket. Bound here rather than by uvicorn, to report a busy port in one line
    and to learn the port that --port 0 got before anything is printed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # connections made while the model loads wait in the backlog, not refused
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                         "(another server there? pick another --port)") from None
    sock.set_inheritable(True)
    return sock


def model_id(settings) -> str:
    """The name /v1/models and /api/tags list: the pair's name, or the target file's without .gguf."""
    from ..hub import _looks_like_path
    name = settings.target_name()
    if not _looks_like_path(name):
        return name
    file = Path(name).name
    return file[:-len(".gguf")] if file.lower().endswith(".gguf") and len(file) > len(".gguf") else file


def check_model(settings) -> None:
    """Refuse a misspelt pair name or a missing file before listening: loading itself happens
    only once the server listens, and its failures would come after the address is printed."""
    from ..errors import ModelFileError
    from ..hub import _looks_like_path
    from ..registry import load_registry
    name = settings.target_name()
    if not _looks_like_path(name):
        load_registry(settings.models_file).get(name)  # RegistryError naming the known pairs
    for path in (name if _looks_like_path(name) else None, settings.draft):
        if path is not None and not Path(path).is_file():
            raise ModelFileError(f"model file {path} does not exist: check the path, or pull a pair by name")


def check_folder(flag: str, path: str) -> None:
    """`path` is a folder this process can write files in (made when missing), or a UsageError."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({exc.strerror or exc}): give a folder you can "
                         "write") from None


class _Stopped(Exception):
    pass


def _stopped(signum, frame):
    raise _Stopped()


def cmd_serve(args) -> int:
    from ..frontend import ProgressBar, notice, settings_from_args
    # every flag checked before anything binds
    settings = settings_from_args(args, cache_ram=args.cache_ram, cache_dir=args.cache_dir,
                                  parallel=args.parallel)  # None: as many as the memory plan allows
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.queue_size < 0:
        raise UsageError(f"--queue-size must be >= 0, got {args.queue_size}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.api_key is not None and args.api_key != args.api_key.strip():
        raise UsageError("--api-key begins or ends with whitespace, which no client sends: remove it")
    try:
        import uvicorn

        from .app import create_app
        from .guard import HostRule, split_host
    except ImportError as exc:
        raise UsageError(f"the server needs packages that are not installed ({exc.name}): "
                         "pip install 'edgespec[server]'") from None
    for origin in args.cors_origin:
        if origin not in ("*", "null") and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+/?", origin):
            raise UsageError(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port], "
                             "e.g. http://localhost:5173")
    for name in args.allowed_host:
        if name.strip() != "*" and not split_host(name)[0]:
            raise UsageError(f"--allowed-host {name!r} is not a host name: give NAME or NAME:PORT")
    # the paths written to, refused now (one line, exit 2) rather than once loading or every request fails
    if args.record is not None:
        from .schemas import Recorder
        try:
            Recorder(args.record).check()
        except OSError as exc:
            raise UsageError(f"--record {args.record}: cannot write there ({exc.strerror or exc}): give a file in a "
                             "folder you can write") from None
    if args.cache_dir is not None:
        check_folder("--cache-dir", args.cache_dir)
    from ..engine import Engine

    check_model(settings)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    name = model_id(settings)
    if not is_loopback(args.host) and not args.api_key:
        notice(f"warning: listening on {args.host} without --api-key: anyone who can reach this "
               "machine can use the model")
    cache = settings.cache_bytes()
    notice(f"listening on http://{shown}:{port} (loading {name}; /health says 503 until ready); prompt cache "
           + (f"{cache / 2**20:,.0f} MiB of host RAM (--cache-ram)" if cache else "off"))

    failed: list[BaseException] = []
    server = None

    def on_ready():
        n = app.state.scheduler.parallel
        notice(f"ready: {name} at http://{shown}:{port}/v1 ({n} request{'s' if n != 1 else ''} at once, "
               f"{args.queue_size} may wait)")

    def on_load_error(exc):
        failed.append(exc)
        server.should_exit = True

    hosts = HostRule(args.allowed_host, port=port, listen=args.host,
                     any_address=args.host in ("0.0.0.0", "::", "[::]", ""))
    app = create_app(lambda: Engine.from_settings(settings, progress=ProgressBar()), model_id=name,
                     api_key=args.api_key,
                     cors_origins=args.cors_origin, hosts=hosts, queue_size=args.queue_size,
                     context_overflow=args.context_overflow, metrics=args.metrics, record=args.record,
                     on_ready=on_ready, on_load_error=on_load_error)
    config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                            lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again for
        # whoever handled it before: make that a plain, successful stop rather than a traceback
        # (SIGINT) or a death by signal (SIGTERM)
        previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Stopped):
        notice("stopped")
    finally:
        sock.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if failed:
        exc = failed[0]
        if isinstance(exc, EdgespecError):
            raise exc
        raise EdgespecError(f"loading failed: {type(exc).__name__}: {exc}") from exc
    return 0
