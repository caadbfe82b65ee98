"""A TCP proxy adding network latency (and optionally a bandwidth limit) on one machine.

For one-machine benchmarks of llama.cpp's RPC backend (docs/distributed.md): the client talks to the
proxy, the proxy to a `ggml rpc-server`, and each chunk reaches the other side half the round trip
after the proxy read it. Chunks in flight do not wait for each other's delay: each direction is an
ordered pipeline, like a real link. With `mbit` set, a chunk of n bytes also holds the link for
n * 8 / (mbit * 1e6) s after the previous chunk's turn. The TCP handshake is not delayed (a persistent
RPC connection pays it once). Counters tell the bytes each way and the round trips (replies).

`with DelayProxy("127.0.0.1:50052", latency_ms=20) as proxy:` then point the client at proxy.address,
or `python -m edgespec.cli.netdelay 127.0.0.1:50052 --latency-ms 20 [--mbit 1000] [--port P]`.
The library never prints; it logs to the "edgespec" logger.
"""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
from dataclasses import dataclass, replace

from .errors import UsageError

log = logging.getLogger("edgespec")
_CHUNK = 1 << 16          # bytes read at a time
_QUEUE = 1024             # chunks in flight per direction (<= 64 MiB), then the reader waits
_CONNECT_TIMEOUT = 10.0   # seconds to reach the upstream before giving the client up


@dataclass
class Counters:
    """Traffic through the proxy since it started or since reset_counters()."""

    up_bytes: int = 0     # client -> server
    down_bytes: int = 0   # server -> client
    up_chunks: int = 0
    down_chunks: int = 0
    round_trips: int = 0  # turns from client->server to server->client traffic (replies to requests)
    connections: int = 0  # connections the upstream accepted


def _non_negative(name: str, value: float, meaning: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise UsageError(f"{name} {value!r} is not a number >= 0: write {meaning}")
    return float(value)


def parse_hostport(text: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port); UsageError (a ValueError) saying what to write."""
    host, colon, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not colon or not host:
        raise UsageError(f"upstream {text!r} is not HOST:PORT: write e.g. 127.0.0.1:50052")
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"upstream port {port!r} is not a number: write HOST:PORT, e.g. 127.0.0.1:50052") from None
    if not 1 <= number <= 65535:
        raise UsageError(f"upstream port {number} is out of range: write a port from 1 to 65535, e.g. 127.0.0.1:50052")
    return host, number


class DelayProxy:
    """Listens on host:port, forwards each connection to `upstream` with `latency_ms` round trip."""

    def __init__(self, upstream: str, latency_ms: float = 0.0, mbit: float = 0.0, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.upstream = upstream
        self._up_host, self._up_port = parse_hostport(upstream)
        self.latency_ms = _non_negative("latency_ms", latency_ms, "the round-trip time in milliseconds, e.g. 20")
        self.mbit = _non_negative("mbit", mbit, "the link's bandwidth in Mbit/s, e.g. 1000, or 0 for unlimited")
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise UsageError(f"port {port!r} is out of range: write a port from 1 to 65535, or 0 for any free one")
        self.host, self.port = host, port
        self.address = ""
        self._lock = threading.Lock()
        self._counts = Counters()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._conns: set[asyncio.Task | None] = set()

    @property
    def counters(self) -> Counters:
        """A snapshot, safe to read from any thread."""
        with self._lock:
            return replace(self._counts)

    def reset_counters(self) -> None:
        with self._lock:
            self._counts = Counters()

    def start(self) -> str:
        """Starts listening (its own asyncio loop in a daemon thread); returns "HOST:PORT"."""
        if self._thread is not None:
            return self.address
        ready, failure = threading.Event(), []

        def run() -> None:
            try:
                asyncio.run(self._main(ready))
            except BaseException as e:  # handed to start(): the port is taken, the host unknown...
                failure.append(e)
            finally:
                ready.set()
        self._thread = threading.Thread(target=run, name="edgespec-netdelay", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread = None
            raise failure[0]
        return self.address

    def stop(self) -> None:
        """Closes the listener and every connection and joins the thread; idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive() and self._loop and self._stopping:
            self._loop.call_soon_threadsafe(self._stopping.set)
            thread.join()

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _main(self, ready: threading.Event) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._serve, self.host, self.port)
        self.address = "{}:{}".format(*server.sockets[0].getsockname()[:2])
        ready.set()
        await self._stopping.wait()
        server.close()
        for task in self._conns:
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        await asyncio.sleep(0)  # lets the transports' connection_lost run before the loop closes

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One connection: reaches the upstream, then forwards both ways until both directions end."""
        self._conns.add(task := asyncio.current_task())
        writers = [client_w]
        try:
            try:
                server_r, server_w = await asyncio.wait_for(
                    asyncio.open_connection(self._up_host, self._up_port), _CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("netdelay: cannot reach %s (%s); closing the client's connection", self.upstream, e)
                return
            writers.append(server_w)
            for w in writers:
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._counts.connections += 1
            last_up = [False]  # this connection's last chunk went up: a chunk down now is a reply, a round trip
            up: asyncio.Queue = asyncio.Queue(_QUEUE)  # (due time, bytes), None at the end
            down: asyncio.Queue = asyncio.Queue(_QUEUE)
            await asyncio.gather(self._read(client_r, up, True, last_up), self._write(up, server_w),
                                 self._read(server_r, down, False, last_up), self._write(down, client_w))
        except asyncio.CancelledError:  # stop(): ends quietly (3.11 logs a connection task ending cancelled)
            for w in writers:
                w.transport.abort()  # at once, not after the bytes close() would still send
        finally:
            for w in writers:
                w.close()
            self._conns.discard(task)

    async def _read(self, src: asyncio.StreamReader, queue: asyncio.Queue, is_up: bool, last_up: list[bool]) -> None:
        """Reads chunks and queues each with the time it is due at the other end; None at the end."""
        loop, delay, link_free = asyncio.get_running_loop(), self.latency_ms / 2000, 0.0
        try:
            while data := await src.read(_CHUNK):
                sent = loop.time()
                if self.mbit:
                    link_free = max(sent, link_free) + len(data) * 8 / (self.mbit * 1e6)
                    sent = link_free
                with self._lock:
                    c = self._counts
                    if is_up:
                        c.up_bytes, c.up_chunks = c.up_bytes + len(data), c.up_chunks + 1
                    else:
                        c.down_bytes, c.down_chunks = c.down_bytes + len(data), c.down_chunks + 1
                        c.round_trips += last_up[0]
                    last_up[0] = is_up
                await queue.put((sent + delay, data))
        except OSError:  # reset by the peer: the same as its end
            pass
        await queue.put(None)

    async def _write(self, queue: asyncio.Queue, dst: asyncio.StreamWriter) -> None:
        """Delivers each queued chunk when due, then closes `dst` (which ends the other direction)."""
        loop, failed = asyncio.get_running_loop(), False
        while (item := await queue.get()) is not None:
            if failed:
                continue  # keeps the reader from blocking on a full queue
            due, data = item
            try:
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                dst.write(data)
                await dst.drain()
            except OSError:
                failed = True
                dst.close()
        dst.close()
