"""The ASGI middleware around the routes: the API key, the Host check (DNS rebinding) and the
count of every request answered (routes.py's docstring says what each does for a client).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import time
from typing import Any, Iterable

from ..errors import InputError
from . import responses
from .errors import APIError, error_response, shutting_down

log = logging.getLogger("minfer.serve")
OUTCOME = "minfer.outcome"   # scope key: the status a streamed response's events reached

# the `endpoint` label of minfer_requests_total, by path (anything else: "other", so that the
# label's values stay few whatever paths clients ask for)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat/completions",
             "/v1/embeddings": "embeddings", "/v1/encode": "encode", "/v1/models": "models",
             "/health": "health",
             "/metrics": "metrics", "/tokenize": "tokenize", "/detokenize": "detokenize",
             "/v1/score": "score", "/v1/rerank": "rerank", "/rerank": "rerank"}
# paths below these (an id, then maybe an action) take the label of the collection
ENDPOINT_PREFIXES = {"/v1/files": "files", "/v1/batches": "batches"}
# what answers without the API key: load balancers' and scrapers' paths
OPEN_PATHS = ("/health", "/metrics")


def endpoint_label(path: str) -> str:
    """The `endpoint` label of a request's path: a route's, its collection's, or "other"."""
    if path in ENDPOINTS:
        return ENDPOINTS[path]
    return next((label for prefix, label in ENDPOINT_PREFIXES.items()
                 if path == prefix or path.startswith(prefix + "/")), "other")


class RequireKey:
    """ASGI middleware: requests (but to OPEN_PATHS) without `Authorization: Bearer KEY` get 401
    (the scheme in any case, as HTTP's are; the key compared in constant time)."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.expected = key.encode("ascii")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(given.strip(), self.expected)
                    and scheme.lower() == b"bearer"):
                await error_response(APIError(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                    code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_names(names: Iterable[str]) -> frozenset[str]:
    """Host names as a Host header is matched against them: lower case, no trailing dot, IPv6
    without brackets; "*" stands for any. A name with a port, a path or spaces is refused
    (InputError naming it): the port is never compared."""
    out = set()
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"allowed host {name!r:.40} is not a string")
        clean = name.strip().lower().rstrip(".")
        if clean.startswith("[") and clean.endswith("]"):
            clean = clean[1:-1]
        bad = not clean or any(c in clean for c in "/@ \t\r\n?#")
        if not bad and ":" in clean:   # only an IPv6 address may hold colons
            try:
                ipaddress.IPv6Address(clean)
            except ValueError:
                bad = True
        if bad:
            raise InputError(f"allowed host {name!r:.60} is not a host name (give the name "
                             "alone, without scheme, port or path; '*' for any)")
        out.add(clean)
    return frozenset(out)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a Host header (with or without a port) names a loopback address (localhost,
    127.x.x.x, ::1) or a host in `allowed` ("*": any). No Host header (HTTP/1.0) is allowed:
    browsers, the only clients DNS rebinding can use, always send one."""
    if header is None or "*" in allowed:
        return True
    host = header.strip().lower()
    if host.startswith("["):   # [IPv6]:port
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":")[0]
    host = host.rstrip(".")
    if host == "localhost" or host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CheckHost:
    """ASGI middleware: while the service has a host list, a request whose Host header is not
    on it (nor a loopback name) gets 421, whatever its path."""

    def __init__(self, app: Any, service: Any):   # routes.Service
        self.app, self.service = app, service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        allowed = self.service.allowed_hosts
        if scope["type"] == "http" and allowed is not None:
            raw = dict(scope["headers"]).get(b"host")
            header = None if raw is None else raw.decode("latin-1")
            if not host_allowed(header, allowed):
                await error_response(APIError(
                    421, f"this server does not answer for host {header!r:.80} (serve "
                    "--allowed-host NAME allows it)", code="host_not_allowed"))(
                        scope, receive, send)
                return
        await self.app(scope, receive, send)


class Count:
    """ASGI middleware, the outermost of minfer's: every HTTP request answered is counted once
    in minfer_requests_total (endpoint, status) and timed, whoever answered it (a route, the
    key or host check, a 404 or 405, a bug); a stream by the status its events reached. While
    the server drains, each request logs one line. A request cancelled by the ASGI server
    (its own shutdown timeout) still gets OpenAI's 503, or a last error event if its stream
    had begun, instead of a traceback and a plain-text 500."""

    def __init__(self, app: Any, service: Any):   # routes.Service
        self.app, self.service = app, service

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        outcome: dict[str, Any] = {"start": time.monotonic()}
        scope[OUTCOME] = outcome
        sent: dict[str, Any] = {}

        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                sent["events"] = any(k.lower() == b"content-type" and
                                     v.startswith(b"text/event-stream")
                                     for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent["complete"] = True
            await send(message)
        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            error = shutting_down("cancelled when the server stopped")
            outcome["status"] = error.status
            await _answer_cancelled(error, sent, scope, receive, send)
        finally:
            status = outcome.get("status") or sent.get("status") or 500
            self.service.metrics.answered(endpoint_label(scope["path"]), status,
                                          time.monotonic() - outcome["start"])
            if self.service.draining:
                log.warning("%s %s: %d, while shutting down", scope["method"], scope["path"],
                            status)


async def _answer_cancelled(error: APIError, sent: dict, scope: dict, receive: Any,
                            send: Any) -> None:
    """The last thing a cancelled request sends: the error, as a response or as a stream's
    last event (nothing if its response was complete)."""
    with contextlib.suppress(Exception):   # the connection may be gone already
        if "status" not in sent:
            await error_response(error)(scope, receive, send)
        elif sent.get("events") and not sent.get("complete"):
            await send({"type": "http.response.body", "body": responses.event(error.body()),
                        "more_body": False})
