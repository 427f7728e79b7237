"""Running the app: uvicorn on one address, with a graceful stop.

The socket is bound here (or by the caller, `bind`, before it loads the model: a taken port is
said at once), before uvicorn starts, so that port 0 (any free port) can be told: `serve` prints
`minfer serve: listening on http://HOST:PORT` on stderr once bound. Bound to a loopback address
(or given `allowed_hosts`), a minfer app answers only Host headers naming a loopback address or
an allowed host (routes.py: DNS rebinding).

SIGTERM (or Ctrl-C) stops accepting connections at once; requests waiting for a worker get a
JSON 503 "shutting down" at once; requests in flight may finish for `grace_period` seconds, then
what is left is cancelled (its decoding stops within a step: a 503, or a last error event in a
stream); each of them logs one line; then `serve` returns: the process exits 0 after a SIGTERM.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import threading
from typing import Any, Sequence

from .limits import check_grace_period
from .middleware import host_names
from .routes import Service

# Seconds past the grace period for cancelled requests to send their last bytes, before
# uvicorn cancels their handlers itself (a beam search cannot stop within a step)
STOP_MARGIN = 5.0


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv4 or IPv6, as the host is written); OSError if the
    address is taken or not ours. Not listening yet: connections are refused until served."""
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


def is_loopback(sock: socket.socket) -> bool:
    """Whether the socket is bound to a loopback address (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    except ValueError:
        return False


def serve(application: Any, host: str = "127.0.0.1", port: int = 8000, *,
          sock: socket.socket | None = None, allowed_hosts: Sequence[str] = (),
          grace_period: float = 30.0, log_level: str = "info") -> None:
    """Serve `application` (from `minfer.serve.app`) until SIGTERM or Ctrl-C, on `sock` (from
    `bind`; it is closed at the end) or else on host:port."""
    import uvicorn

    host_names(allowed_hosts)   # a bad name or grace period is refused before anything is bound
    check_grace_period(grace_period)
    sock = sock if sock is not None else bind(host, port)
    try:
        service = getattr(getattr(application, "state", None), "service", None)
        if isinstance(service, Service) and (allowed_hosts or is_loopback(sock)):
            service.restrict_hosts(allowed_hosts)
        _log_to_stderr(log_level)
        print(f"minfer serve: listening on {url(sock)}", file=sys.stderr, flush=True)
        config = uvicorn.Config(application, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=grace_period + STOP_MARGIN)
        server = _uvicorn_server(config, service if isinstance(service, Service) else None,
                                 grace_period)
        # uvicorn raises the signal it stopped for again once it is done, under the handler
        # that was there before it: for SIGTERM, a handler that does nothing, so that the stop
        # it asked for ends the process normally (status 0) instead of killing it
        main = threading.current_thread() is threading.main_thread()   # (signals: main only)
        previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
        try:
            server.run(sockets=[sock])
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()


def _uvicorn_server(config: Any, service: Any, grace_period: float) -> Any:
    """uvicorn's Server, whose shutdown first drains the minfer service (queued requests: 503
    at once) and cancels what still runs once the grace period is over."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = None
            if service is not None:
                service.drain()
                timer = asyncio.get_running_loop().call_later(grace_period,
                                                              service.cancel_running)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()
    return Server(config)


def _log_to_stderr(level: str) -> None:
    """minfer.serve's own lines (a request during shutdown, a failure) on stderr, one line
    each, at uvicorn's level."""
    logger = logging.getLogger("minfer.serve")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("minfer serve: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
