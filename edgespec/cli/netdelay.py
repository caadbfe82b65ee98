"""`python -m edgespec.cli.netdelay UPSTREAM --latency-ms X`: the delay proxy (edgespec/netdelay.py)
on a terminal, for trying llama.cpp's RPC over a slower network on one machine (docs/distributed.md).
The command line lives here: the library module never prints."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import NoReturn

from ..netdelay import DelayProxy


def main(argv: list[str] | None = None) -> int:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:  # one line, not usage + error
            print(f"edgespec netdelay: {message} (see --help)", file=sys.stderr)
            sys.exit(2)

    p = Parser(prog="python -m edgespec.cli.netdelay",
               description="A TCP proxy adding network latency, for one-machine benchmarks of llama.cpp RPC.")
    p.add_argument("upstream", help="HOST:PORT to forward to, e.g. the rpc-server's 127.0.0.1:50052")
    p.add_argument("--latency-ms", type=float, required=True, help="round-trip time to add, in milliseconds")
    p.add_argument("--mbit", type=float, default=0.0, help="bandwidth limit in Mbit/s (0, the default: unlimited)")
    p.add_argument("--port", type=int, default=0, help="port to listen on at 127.0.0.1 (default: any free one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="edgespec %(message)s")
    # explicitly: a parent that ignores SIGINT (a test runner's worker) hands that on, and Python
    # then installs no KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with DelayProxy(args.upstream, args.latency_ms, args.mbit, port=args.port) as proxy:
            bandwidth = f", {args.mbit:g} Mbit/s" if args.mbit else ""
            print(f"edgespec netdelay: {proxy.address} -> {args.upstream}, {args.latency_ms:g} ms round trip"
                  f"{bandwidth}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
    except (ValueError, OSError) as e:
        print(f"edgespec netdelay: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the with block has stopped the proxy
        return 0


if __name__ == "__main__":
    sys.exit(main())
