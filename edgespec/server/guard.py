"""Who may talk to a local server: the checks that keep web pages out of it.

A server on 127.0.0.1 is reachable by every page the user's browser opens. Two attacks follow:
a page sends requests across sites (a "simple" request needs no CORS preflight), and DNS
rebinding points a name the attacker owns at 127.0.0.1 so that the page may read the answers
too. Browsers mark the first with an `Origin` header and the second with a foreign `Host`, so:
- a request with an `Origin` is refused unless that origin was allowed (`--cors-origin`);
- the `Host` must name this server: its loopback names (127.0.0.1, localhost, [::1]) with its
  port, the address it listens on, or names allowed with `--allowed-host`;
- bodies must be sent as application/json (app.py), which a page can only do after a preflight.
Refusals are 403 in OpenAI's error shape (Anthropic's under /v1/messages), before any route runs.
"""
from __future__ import annotations

import ipaddress
from typing import Iterable, Optional, Sequence

from starlette.responses import JSONResponse

from .schemas import ApiError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def split_host(value: str) -> tuple[str, Optional[int]]:
    """'Host' header value -> (lower-case name without brackets, port or None); ('', None) when
    it cannot be parsed."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        if end < 0:
            return "", None
        name, rest = value[1:end], value[end + 1:]
        if not rest:
            return name, None
        if not rest.startswith(":"):
            return "", None
        port = rest[1:]
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:  # a bare IPv6 address (not a valid Host, but unambiguous)
        return value, None
    else:
        return value, None
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return "", None
    return name, int(port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostRule:
    """Which Host header values name this server.

    `allowed`: entries NAME or NAME:PORT (an IPv6 address in brackets), '*' for any; None: the
    loopback names at any port (in-process use). `port`: the port the server listens on, which
    a loopback name must carry. `any_address`: the server listens on every interface (0.0.0.0,
    ::), so it may be reached by any of the machine's IP addresses: IP literals are accepted
    too (a literal cannot be rebound; only names can)."""

    def __init__(self, allowed: Optional[Iterable[str]] = None, *, port: Optional[int] = None,
                 any_address: bool = False, listen: Optional[str] = None):
        self.port, self.any_address = port, any_address
        self.any = False
        self.names: set[str] = set(LOOPBACK_NAMES)
        if listen:
            self.names.add(split_host(listen)[0] or listen.strip("[]").lower())
        self.extra: set[tuple[str, Optional[int]]] = set()
        for entry in allowed or ():
            if entry.strip() == "*":
                self.any = True
                continue
            name, p = split_host(entry)
            if name:
                self.extra.add((name, p))

    def allows(self, value: Optional[str]) -> bool:
        if self.any:
            return True
        if not value:  # HTTP/1.0 without Host: no browser sends that
            return True
        name, port = split_host(value)
        if not name:
            return False
        if (name, None) in self.extra or (name, port) in self.extra:
            return True
        port_ok = self.port is None or port is None or port == self.port
        if name in self.names:
            return port_ok
        return self.any_address and _is_ip(name) and port_ok


def _origin(value: str) -> str:
    return value.strip().rstrip("/").lower()


class Guard:
    """ASGI middleware: 403 for a foreign Origin or Host (see the module's docstring)."""

    def __init__(self, app, hosts: HostRule, origins: Sequence[str] = ()):
        self.app, self.hosts = app, hosts
        self.any_origin = "*" in origins
        self.origins = {_origin(o) for o in origins if o != "*"}

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1")
            origin = headers.get(b"origin")
            error = None
            if not self.hosts.allows(host):
                error = (f"Host {host[:100]!r} does not name this server: requests through another name are "
                         "refused (DNS rebinding); start the server with --allowed-host NAME to allow it")
            elif origin is not None and not self.any_origin and _origin(origin.decode("latin-1")) not in self.origins:
                shown = origin.decode("latin-1")[:100]
                error = (f"requests from web pages at {shown!r} are refused: start the server with "
                         f"--cors-origin {shown} to let that page use it")
            if error is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                response = JSONResponse(ApiError(403, error, code="forbidden").body_for(scope.get("path", "")),
                                        status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
