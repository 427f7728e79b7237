"""Running the app: uvicorn on one address, with a graceful stop.

The socket is bound here, before uvicorn starts, so that port 0 (any free port) can be told:
`serve` prints `minfer serve: listening on http://HOST:PORT` on stderr once bound. SIGTERM (or
Ctrl-C) stops accepting connections at once, lets requests in flight finish for at most
`grace_period` seconds, then cancels what is left (their decoding stops within a step) and
returns: the process exits 0 after a SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from typing import Any


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6, as the host is written)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(application: Any, host: str = "127.0.0.1", port: int = 8000, *,
          grace_period: float = 30.0, log_level: str = "info") -> None:
    """Serve `application` (from `minfer.serve.app`) until SIGTERM or Ctrl-C."""
    import uvicorn
    sock = bind(host, port)
    print(f"minfer serve: listening on {url(sock)}", file=sys.stderr, flush=True)
    config = uvicorn.Config(application, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=grace_period)
    server = uvicorn.Server(config)
    # uvicorn raises the signal it stopped for again once it is done, under the handler that
    # was there before it: for SIGTERM, a handler that does nothing, so that the stop it
    # asked for ends the process normally (status 0) instead of killing it
    main = threading.current_thread() is threading.main_thread()   # (signals: main thread only)
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        sock.close()
