"""A local HTTP server that speaks the part of the Hugging Face Hub protocol hf_hub_download
uses: HEAD and GET on /{repo}/resolve/{revision}/{file}, with X-Repo-Commit, ETag and
Content-Length, Range requests, and the Hub's 404 error codes. Faults can be injected."""
from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}   # (repo, filename) -> content
        self.truncate_next_gets = 0                      # close the connection halfway this many times
        self.corrupt = False                             # serve flipped bytes (same length)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _lookup(self):
                m = re.match(r"^/(.+?/.+?)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
                if not m:
                    return None
                return server.files.get((m.group(1), m.group(3)))

            def _not_found(self):
                body = b'{"error": "Entry not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Error-Message", "Entry not found")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def _headers(self, data: bytes, status=200, length=None, extra=()):
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) if length is None else length))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self):
                server.requests.append(("HEAD", self.path, None))
                data = self._lookup()
                if data is None:
                    return self._not_found()
                self._headers(data)

            def do_GET(self):
                rng = self.headers.get("Range")
                server.requests.append(("GET", self.path, rng))
                data = self._lookup()
                if data is None:
                    return self._not_found()
                if server.corrupt:
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                start = 0
                if rng and (m := re.match(r"bytes=(\d+)-", rng)):
                    start = int(m.group(1))
                body = data[start:]
                if start:
                    self._headers(data, 206, len(body),
                                  [("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")])
                else:
                    self._headers(data)
                if server.truncate_next_gets > 0:
                    server.truncate_next_gets -= 1
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
