"""The target on llama.cpp's RPC backend (edgespec/rpc.py): a real rpc-server on loopback
(`python -m edgespec rpc-server`, ggml's own server from this build), the answers it gives,
what a lost or absent server does to `run`, `serve` and the library."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgespec import rpc
from edgespec.bench.llama_server import _free_port
from edgespec.bench.rpc import LocalRpcServer
from edgespec.errors import UsageError
from serverproc import ServerProcess

pytestmark = pytest.mark.skipif(not rpc.available(), reason="llama-cpp-python built without GGML_RPC: make llama")


def rpc_server(tmp: Path, port: int | None = None) -> LocalRpcServer:
    """`python -m edgespec rpc-server` (one thread) on a loopback port, its log in `tmp`."""
    return LocalRpcServer(1, tmp / f"rpc-{port or 'free'}-{time.monotonic_ns()}.log", port)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = rpc_server(tmp_path_factory.mktemp("rpc"))
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


# -- addresses and the handshake ----------------------------------------------------------------------
@pytest.mark.parametrize("text, endpoints", [("big:50052", ["big:50052"]), ("10.0.0.2", ["10.0.0.2:50052"]),
                                             (" a:1 , b:65535 ", ["a:1", "b:65535"])])
def test_servers_are_read_as_llama_server_writes_them(text, endpoints):
    assert rpc.parse_servers(text) == endpoints


@pytest.mark.parametrize("text, words", [("", "at least one"), ("big:0", "is not a port"), ("big:http", "not a port"),
                                         ("[::1]:50052", "IPv6"), ("a:1,a:1", "twice"), (":50052", "HOST:PORT")])
def test_bad_server_addresses_are_one_line_usage_errors(text, words):
    with pytest.raises(UsageError, match=words):
        rpc.parse_servers(text)


def test_the_server_speaks_the_protocol_this_client_was_built_for(server):
    major, minor, _ = rpc.hello(server.endpoint)
    assert (major, minor) == rpc.PROTOCOL
    assert rpc.check_servers([server.endpoint])[server.endpoint][:2] == rpc.PROTOCOL


def test_no_server_and_another_program_are_told_apart():
    with pytest.raises(rpc.RemoteError, match=r"no rpc-server answers at 127\.0\.0\.1:\d+ \(refused\)"):
        rpc.check_servers([f"127.0.0.1:{_free_port()}"])
    with socket.socket() as s:  # a program that answers with something else, then hangs up
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        def answer():
            c, _ = s.accept()
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            c.close()
        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(rpc.RemoteError, match="did not answer as an rpc-server does"):
            rpc.check_servers([f"127.0.0.1:{port}"])


def test_rpc_server_refuses_a_port_in_use_in_one_line(server):
    out = subprocess.run([sys.executable, "-m", "edgespec", "rpc-server", "--port", str(server.port)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "cannot listen on 127.0.0.1" in out.stderr, out.stderr


# -- answers --------------------------------------------------------------------------------------------
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _answer(smol, smol_draft, drafter, **kw):
    from edgespec import Engine
    with Engine.load(str(smol), draft=str(smol_draft) if drafter in ("model", "auto") else None, drafter=drafter,
                     n_ctx=512, calibrate="never", cache_ram=0, **kw) as eng:
        target = eng.target
        r = eng.generate(PROMPT, max_tokens=48, temperature=0)
        return r.tokens, getattr(target, "remote_devices", [])


@pytest.mark.parametrize("drafter", ["none", "model"])
def test_t0_answers_over_rpc_equal_local_ones(server, smol, smol_draft, drafter):
    local, _ = _answer(smol, smol_draft, drafter)
    remote, devices = _answer(smol, smol_draft, drafter, rpc=server.endpoint)
    assert devices and devices[0]["endpoint"] == server.endpoint  # the target's layers went there
    assert remote == local


def test_the_output_layer_can_stay_here(server, smol, smol_draft):
    """--rpc-output local: the same answer, and a row's hidden state comes back, not its logits."""
    from edgespec.backend import LlamaBackend
    from edgespec.netdelay import DelayProxy
    local, _ = _answer(smol, smol_draft, "none")
    remote, _ = _answer(smol, smol_draft, "none", rpc=server.endpoint, rpc_output="local")
    assert remote == local
    down = {}
    for output in ("remote", "local"):
        with DelayProxy(server.endpoint) as proxy:
            b = LlamaBackend(smol, n_ctx=256, rpc=[proxy.address], rpc_output=output)
            try:
                b.eval(b.tokenize("Hello there, how are"), [0])
                proxy.reset_counters()
                for t in (100, 200, 300, 400):
                    b.eval([t], [0])
                down[output] = proxy.counters.down_bytes / 4
            finally:
                b.close()
    row = 4 * 49152  # a logits row of SmolLM2's vocabulary, float32
    assert down["remote"] >= row and down["local"] < row / 20, down


# -- faults: each in a process of its own (a fault that escaped the hook would end it) -------------------
def test_run_without_its_server_says_so_in_one_line(smol):
    port = _free_port()
    out = subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(smol), "--drafter", "none",
                          "--rpc", f"127.0.0.1:{port}", "--prompt", "hi", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"no rpc-server answers at 127.0.0.1:{port}" in lines[0], out.stderr


KILL_SCRIPT = r"""
import sys, time, threading, os, signal
from edgespec import Engine
from edgespec.rpc import RemoteLost
eng = Engine.load(sys.argv[1], drafter="none", n_ctx=512, calibrate="never", cache_ram=0, rpc=sys.argv[2])
print("loaded", flush=True)
t0 = None
try:
    for i, ev in enumerate(eng.stream("Count from one to a thousand in words:", max_tokens=400, temperature=0)):
        if i == 1:  # mid-answer: a stream nobody reads computes nothing meanwhile
            print("started", flush=True)
            sys.stdin.readline()  # the test has killed the server
            t0 = time.monotonic()
    print("finished without error", flush=True)
except RemoteLost as exc:
    print(f"RemoteLost after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
try:
    eng.generate("again", max_tokens=2)
except RemoteLost:
    print("refused afterwards", flush=True)
eng.close()
print("closed", flush=True)
"""


def test_a_server_killed_mid_answer_ends_the_answer_with_an_error_not_the_process(tmp_path, smol):
    srv = rpc_server(tmp_path)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(smol), srv.endpoint], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "loaded", p.stderr.read()
        assert p.stdout.readline().strip() == "started", p.stderr.read()
        srv.kill()
        out, err = p.communicate("killed\n", timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert "RemoteLost after" in out and f"lost the rpc-server at {srv.endpoint}" in out, out + err
    assert float(out.split("RemoteLost after ")[1].split(" s")[0]) < 60
    assert "refused afterwards" in out and "closed" in out, out + err


def test_serve_answers_503_while_its_server_is_away_and_serves_again_when_it_is_back(tmp_path, smol):
    srv = rpc_server(tmp_path)
    # one sequence and the prompt cache on: the first conversation is saved to the cache when the
    # second takes its sequence, and it must come back from there after the loss
    app = ServerProcess(["--target", str(smol), "--drafter", "none", "--ctx", "512", "--parallel", "1",
                         "--cache-ram", "64MiB", "--rpc", srv.endpoint], tmp_path)
    # counting on: at T = 0 a small model goes on to max_tokens (seconds), so the kill lands mid-answer
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 440, "temperature": 0}
    # long enough for the cache (whole 128-token pieces of it are saved: slots.py)
    town = ("The town by the sea waited all winter for the boats to come back; the harbour was quiet, the nets "
            "were mended twice, and the children counted the days on the wall of the school. ") * 4
    short = {"messages": [{"role": "user", "content": town + "Say hi to them in one friendly sentence."}],
             "max_tokens": 6, "temperature": 0}
    try:
        app.wait_ready()
        with httpx.Client(base_url=app.url, timeout=120) as c:
            before = c.post("/v1/chat/completions", json=short)
            assert before.status_code == 200, before.text
            result = {}

            def long_request():
                result["r"] = c.post("/v1/completions", json=body)
            t = threading.Thread(target=long_request)
            t.start()
            time.sleep(1.5)
            srv.kill()
            t0 = time.monotonic()
            t.join(90)
            r = result["r"]
            assert time.monotonic() - t0 < 60
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "remote_unavailable" and srv.endpoint in err["message"], err
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "remote_down", health.text
            assert srv.endpoint in health.json()["error"]
            refused = c.post("/v1/messages", json={"model": "m", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and refused.json()["type"] == "error", refused.text  # Anthropic's shape
            back = rpc_server(tmp_path, port=srv.port)
            try:
                deadline = time.monotonic() + 180
                while c.get("/health").status_code != 200:
                    assert time.monotonic() < deadline, app.log.read_text()
                    time.sleep(0.5)
                after = c.post("/v1/chat/completions", json=short)
                assert after.status_code == 200, after.text
                assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
                # from the prompt cache kept across the loss, not prefilled again
                stats = after.json()["edgespec"]
                assert stats["restored_prompt_tokens"] > 0, (stats, app.log.read_text())
                code = app.stop()  # while the server is up: it frees what it holds there
                assert code == 0, app.log.read_text()
                assert "Client connection closed" in back.log.read_text()
            finally:
                back.stop()
    finally:
        srv.kill()
        code = app.stop()
    assert code == 0, app.log.read_text()


def test_serve_stops_at_once_when_its_server_went_away_unnoticed(tmp_path, smol):
    """Nothing computed since the server left: the shutdown's frees meet the loss, and do not hang."""
    srv = rpc_server(tmp_path)
    app = ServerProcess(["--target", str(smol), "--drafter", "none", "--ctx", "512", "--cache-ram", "0",
                         "--rpc", srv.endpoint], tmp_path)
    try:
        app.wait_ready()
        srv.kill()
        t0 = time.monotonic()
        code = app.stop()
        assert time.monotonic() - t0 < 30
    finally:
        srv.kill()
    assert code == 0, app.log.read_text()


def test_run_whose_server_is_killed_mid_answer_exits_1_with_one_line(tmp_path, smol):
    srv = rpc_server(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "edgespec", "run", "--target", str(smol), "--drafter", "none",
                          "--ctx", "512", "--rpc", srv.endpoint, "--raw", "--max-tokens", "440",
                          "--prompt", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.read(1), p.stderr.read()  # the answer has begun
        srv.kill()
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert p.returncode == 1, err
    assert len(lines) == 1 and f"lost the rpc-server at {srv.endpoint}" in lines[0], err
