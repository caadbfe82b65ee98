"""edgespec.netdelay: the TCP delay proxy for one-machine RPC benchmarks, over real sockets.

Timing is checked only from below (a delay is at least what was asked): an upper bound would
flake on a loaded machine."""
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgespec.netdelay import DelayProxy

ROOT = Path(__file__).resolve().parent.parent


class EchoServer:
    """Echoes every byte back on each connection, in a thread per connection; `close_after` bytes
    received, it closes the connection instead (an upstream that goes away)."""

    def __init__(self, close_after: int | None = None) -> None:
        self.close_after = close_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        got = 0
        with conn:
            while data := _recv(conn):
                got += len(data)
                if self.close_after is not None and got >= self.close_after:
                    return
                conn.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _recv(sock: socket.socket, n: int = 1 << 16) -> bytes:
    try:
        return sock.recv(n)
    except ConnectionResetError:  # a reset, like a clean close, ends the connection
        return b""


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        data = sock.recv(min(1 << 16, n - got))
        assert data, f"connection closed after {got} of {n} bytes"
        parts.append(data)
        got += len(data)
    return b"".join(parts)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def test_bytes_arrive_intact_and_in_order(echo):
    payload = os.urandom(5 * 1024 * 1024)
    with DelayProxy(echo.address, latency_ms=10) as proxy, _connect(proxy.address) as sock:
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(_recv_exactly(sock, len(payload))))
        reader.start()
        pieces = [0, 1, 7, 1000, 65536, 65537, 300_000]
        pos = i = 0
        while pos < len(payload):  # pieces of many sizes, some split across the proxy's reads
            step = pieces[i % len(pieces)] or 1
            sock.sendall(payload[pos:pos + step])
            pos, i = pos + step, i + 1
        reader.join(120)
        assert received and received[0] == payload
        c = proxy.counters
        assert c.up_bytes == c.down_bytes == len(payload)
        assert c.connections == 1 and c.up_chunks >= 1 and c.down_chunks >= 1


def test_round_trips_and_byte_counts(echo):
    n, size = 12, 1000
    with DelayProxy(echo.address) as proxy, _connect(proxy.address) as sock:
        for k in range(n):
            message = bytes([k]) * size
            sock.sendall(message)
            assert _recv_exactly(sock, size) == message
        c = proxy.counters
        assert (c.round_trips, c.up_bytes, c.down_bytes, c.connections) == (n, n * size, n * size, 1)
        proxy.reset_counters()
        assert proxy.counters.round_trips == proxy.counters.up_bytes == 0
        sock.sendall(b"again")
        assert _recv_exactly(sock, 5) == b"again"
        assert (proxy.counters.round_trips, proxy.counters.up_bytes) == (1, 5)


def test_latency_is_added_to_each_round_trip(echo):
    with DelayProxy(echo.address, latency_ms=40) as proxy, _connect(proxy.address) as sock:
        for _ in range(3):
            start = time.monotonic()
            sock.sendall(b"ping")
            assert _recv_exactly(sock, 4) == b"ping"
            assert time.monotonic() - start >= 0.038


def test_chunks_in_flight_do_not_wait_for_each_other(echo):
    # 10 messages sent back to back: a pipeline delivers them all about one round trip later,
    # serialised delays would add up to 10; the bound checked is only the lower one
    with DelayProxy(echo.address, latency_ms=40) as proxy, _connect(proxy.address) as sock:
        start = time.monotonic()
        for k in range(10):
            sock.sendall(bytes([k]) * 10)
            time.sleep(0.002)
        assert _recv_exactly(sock, 100) == b"".join(bytes([k]) * 10 for k in range(10))
        assert time.monotonic() - start >= 0.038


def test_bandwidth_limit_adds_serialisation_time(echo):
    # 400 kB over 40 Mbit/s hold the link 80 ms (the echo overlaps the two directions, as TCP would)
    payload = os.urandom(400_000)
    with DelayProxy(echo.address, mbit=40) as proxy, _connect(proxy.address) as sock:
        start = time.monotonic()
        sock.sendall(payload)
        assert _recv_exactly(sock, len(payload)) == payload
        assert time.monotonic() - start >= 0.078


def test_upstream_closing_closes_the_client():
    server = EchoServer(close_after=3)
    try:
        with DelayProxy(server.address, latency_ms=10) as proxy, _connect(proxy.address) as sock:
            sock.sendall(b"bye")
            assert _recv(sock) == b""
    finally:
        server.close()


def test_client_closing_closes_the_upstream(echo):
    with DelayProxy(echo.address) as proxy:
        with _connect(proxy.address) as sock:
            sock.sendall(b"x")
            assert _recv_exactly(sock, 1) == b"x"
        deadline = time.monotonic() + 30
        while echo.conns and echo.conns[0].fileno() != -1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the echo thread closes its socket when the proxy's side ends
        assert echo.conns[0].fileno() == -1


def test_unreachable_upstream_closes_the_client(caplog):
    spare = socket.create_server(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()  # a port nobody listens on: connections to it are refused
    with DelayProxy(f"127.0.0.1:{port}", latency_ms=10) as proxy, _connect(proxy.address) as sock:
        assert _recv(sock) == b""
        assert proxy.counters.connections == 0
    assert f"cannot reach 127.0.0.1:{port}" in caplog.text


def test_stop_is_idempotent_and_closes_connections(echo, caplog):
    caplog.set_level(logging.WARNING)
    proxy = DelayProxy(echo.address, latency_ms=10)
    address = proxy.start()
    assert proxy.start() == address and address.startswith("127.0.0.1:")
    with _connect(address) as sock:
        sock.sendall(b"hi")
        assert _recv_exactly(sock, 2) == b"hi"
        proxy.stop()
        assert _recv(sock) == b""
    proxy.stop()
    with pytest.raises(OSError):
        _connect(address).close()
    with proxy, _connect(proxy.start()) as sock:  # a stopped proxy starts again
        sock.sendall(b"hi")
        assert _recv_exactly(sock, 2) == b"hi"
        assert proxy.counters.connections == 2
    assert proxy.counters.connections == 2  # the counters outlive the proxy
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text  # asyncio's complaints


@pytest.mark.parametrize("kwargs, words", [
    ({"upstream": "localhost"}, "HOST:PORT"),
    ({"upstream": ":50052"}, "HOST:PORT"),
    ({"upstream": "localhost:rpc"}, "not a number"),
    ({"upstream": "localhost:0"}, "1 to 65535"),
    ({"upstream": "localhost:70000"}, "1 to 65535"),
    ({"upstream": "localhost:50052", "latency_ms": -1}, "latency_ms"),
    ({"upstream": "localhost:50052", "latency_ms": float("nan")}, "latency_ms"),
    ({"upstream": "localhost:50052", "mbit": -5}, "mbit"),
    ({"upstream": "localhost:50052", "port": 70000}, "port"),
])
def test_bad_arguments_raise_value_error(kwargs, words):
    with pytest.raises(ValueError) as info:
        DelayProxy(**kwargs)
    message = str(info.value)
    assert words in message and "write" in message and "\n" not in message


def test_taken_port_raises_on_start(echo):
    with DelayProxy(echo.address) as proxy:
        port = int(proxy.address.rsplit(":", 1)[1])
        with pytest.raises(OSError):
            DelayProxy(echo.address, port=port).start()


@pytest.mark.parametrize("args", [
    ["localhost", "--latency-ms", "20"],
    ["localhost:50052", "--latency-ms", "-3"],
    ["localhost:50052"],
    ["localhost:50052", "--latency-ms", "fast"],
])
def test_cli_bad_arguments_exit_2_with_one_line(args):
    run = subprocess.run([sys.executable, "-m", "edgespec.cli.netdelay", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgespec netdelay: "), run.stderr


def test_cli_forwards_until_ctrl_c(echo):
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.netdelay", echo.address, "--latency-ms", "10"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        address = line.split()[2]
        assert line == f"edgespec netdelay: {address} -> {echo.address}, 10 ms round trip\n"
        with _connect(address) as sock:
            sock.sendall(b"ping")
            assert _recv_exactly(sock, 4) == b"ping"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (0, "", "")
    finally:
        proc.kill()
        proc.wait()
