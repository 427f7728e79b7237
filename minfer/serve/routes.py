"""The HTTP routes and the app factory: `app(model, **limits)` is a Starlette (ASGI) application
any ASGI server can run or mount (`minfer serve` runs it with uvicorn: server.py).

    POST /v1/completions        prompt (a string or a list), streamed or not
    POST /v1/chat/completions   messages, made one prompt by the chat rule (chat.py)
    POST /v1/embeddings         input (a string or a list) -> model.embed
    GET  /v1/models             the served model
    GET  /health                200 once the model is warmed up, 503 before
    GET  /metrics               Prometheus text format (metrics.py)

A request's body is read (at most max_body_bytes: 413), checked (schema.py: 400 naming the
field), then run in a worker thread (workers.py: 429 when the queue is full) by jobs.py, which
calls model.generate / generation.run / model.embed. While it runs the handler watches for the
client going away and for the request's deadline: either cancels the job, whose decoding stops
within a step and gives its arena memory back. Every failure is OpenAI's error object
(errors.py), also for unknown paths, wrong methods and bugs; the server stays up.

With an API key, /v1/* requests need `Authorization: Bearer KEY` (compared in constant time);
/health and /metrics stay open for load balancers and scrapers. CORS headers only for the origins
given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import Cancelled, InputError, MinferError
from ..generation.batcher import batcher_of
from . import jobs, responses
from .errors import APIError, from_exception
from .limits import Limits
from .metrics import CONTENT_TYPE, Metrics
from .schema import (GenerationRequest, chat_request, check_model, completion_request,
                     embedding_request, field_of, parse_body, settle)
from .workers import Workers

log = logging.getLogger("minfer.serve")
CLIENT_GONE = 499   # the status metrics record for a request whose client left (nginx's)


class _ClientGone(Exception):
    pass


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Service:
    """What the routes share: the model, its name, the limits, the workers, the metrics."""

    def __init__(self, model: Any, name: str, limits: Limits):
        self.model, self.name, self.limits = model, name, limits
        self.workers = Workers(model, limits.max_running, limits.max_waiting)
        self.metrics = Metrics(model.backend.arena, batcher_of(model), self.workers.running,
                               self.workers.waiting)
        self.created = int(time.time())
        self.ready = threading.Event()

    def warm_up(self) -> None:
        """One short run, so that the first request does not pay for compiling or paging in."""
        try:
            if getattr(self.model, "can_generate", False):
                self.model.generate("warm up", max_new_tokens=2)
            elif hasattr(self.model, "embed"):
                self.model.embed(["warm up"])
        except MinferError as e:   # a model that cannot run this still serves what it can
            log.warning("warm-up failed: %s", e)
        finally:
            self.ready.set()

    async def body(self, request: Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes, more than this server's "
                           f"limit of {limit} (serve --max-body-size)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is more than this server's limit of "
                               f"{limit} bytes (serve --max-body-size)")
            chunks.append(chunk)
        return parse_body(b"".join(chunks))

    async def wait(self, request: Request, job: jobs.Job, work: Awaitable[Any],
                   deadline: float) -> Any:
        """`work`'s result, unless the client leaves (_ClientGone) or the deadline passes
        (504) first: then the job is cancelled. Also cancelled when this task is."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=max(deadline - time.monotonic(), 0),
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            job.cancel()
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task in done:
            if task.cancelled():   # its worker's future was dropped: the pool is shut down
                raise APIError(503, "the server is shutting down")
            return task.result()
        job.cancel()
        task.cancel()
        if gone in done:
            raise _ClientGone()
        raise self.timed_out()

    def timed_out(self) -> APIError:
        return APIError(504, f"the request ran longer than {self.limits.request_timeout:g} s "
                        "(serve --request-timeout)")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- generation ---------------------------------------------------------------------------------------
async def _generation(service: Service, request: Request, chat: bool) -> Response:
    endpoint = "chat/completions" if chat else "completions"
    start = time.monotonic()
    deadline = start + service.limits.request_timeout
    limits = service.limits
    status, streamed = 500, False
    try:
        body = await service.body(request)
        check_model(body, service.name)
        make = chat_request if chat else completion_request
        req = settle(service.model, make(body, limits.max_tokens, limits.max_input_tokens),
                     limits.max_tokens)
        answer = responses.Answer(chat, service.name)
        job = jobs.Job(service.model)
        if req.stream:
            response = await _start_stream(service, request, job, req, answer, start, deadline)
            streamed = True   # its events record the request when the stream ends
            return response
        future = service.workers.submit(jobs.complete, job, req, service.metrics.tokens)
        results = await service.wait(request, job, asyncio.wrap_future(future), deadline)
        choices = [(i * req.n + j, r.text, r.finish_reason)
                   for i, row in enumerate(results) for j, r in enumerate(row)]
        use = responses.usage(sum(row[0].prompt_tokens for row in results),
                              sum(r.new_tokens for row in results for r in row))
        status = 200
        return JSONResponse(answer.whole(choices, use))
    except _ClientGone:
        status = CLIENT_GONE
        return Response(status_code=CLIENT_GONE)
    except Exception as e:
        error = _api_error(e, "messages" if chat else "prompt")
        status = error.status
        return error_response(error)
    finally:
        if not streamed:
            service.metrics.answered(endpoint, status, time.monotonic() - start)


def _api_error(e: BaseException, prompt_field: str = "prompt") -> APIError:
    """The client's view of a request's failure; `prompt_field` names the prompts in `param`."""
    if isinstance(e, Cancelled):   # (only the server cancels: shutting down)
        return APIError(503, "the server is shutting down")
    error = from_exception(e, field_of(str(e), prompt_field))
    if error.status == 500:
        log.error("request failed", exc_info=e)
    return error


async def _start_stream(service: Service, request: Request, job: jobs.Job,
                        req: GenerationRequest, answer: responses.Answer, start: float,
                        deadline: float) -> Response:
    """Start the request's streams in a worker; once they are made (the prompts checked), the
    response streams their pieces as server-sent events. A failure before that is an error
    response with its status."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def emit(item: Any) -> None:   # (worker thread)
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:       # the loop is closed: nobody is listening any more
            job.cancel()
    service.workers.submit(jobs.stream, job, req, emit, service.metrics.tokens)
    first = await service.wait(request, job, queue.get(), deadline)
    if isinstance(first, jobs.Failed):
        raise first.error
    return _EventStream(service, job, req, answer, queue, start, deadline)


class _EventStream(StreamingResponse):
    """A streamed request's response. However it ends (all sent, the client gone, cancelled at
    shutdown, even before its first event), its job is cancelled (nothing, if it is done) and
    the request is recorded with the status its events reached (499 until they end)."""

    def __init__(self, service: Service, job: jobs.Job, req: GenerationRequest,
                 answer: responses.Answer, queue: asyncio.Queue, start: float, deadline: float):
        self.service, self.job, self.start = service, job, start
        self.endpoint = "chat/completions" if answer.chat else "completions"
        self.outcome = {"status": CLIENT_GONE}
        super().__init__(_events(service, req, answer, queue, start, deadline, self.outcome),
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.service.metrics.answered(self.endpoint, self.outcome["status"],
                                          time.monotonic() - self.start)


async def _events(service: Service, req: GenerationRequest, answer: responses.Answer,
                  queue: asyncio.Queue, start: float, deadline: float,
                  outcome: dict) -> AsyncIterator[bytes]:
    """The stream's events: each piece as it comes, each choice's end, usage if asked, then
    [DONE]; a failure or the deadline is an error event and the end (`outcome["status"]` says
    which)."""
    total = len(req.prompts) * req.n
    ended = prompt_tokens = new_tokens = 0
    first_piece = True
    if answer.chat:   # each choice's first chunk says who speaks (OpenAI's, vLLM's order)
        for index in range(total):
            yield responses.event(answer.chunk(index, "", first=True))
    while ended < total:
        try:
            item = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            item = jobs.Failed(service.timed_out())
        if isinstance(item, jobs.Piece):
            if first_piece:
                service.metrics.first_token.observe(time.monotonic() - start)
                first_piece = False
            yield responses.event(answer.chunk(item.index, item.text))
        elif isinstance(item, jobs.Ended):
            ended += 1
            new_tokens += item.new_tokens
            prompt_tokens += item.prompt_tokens if item.index % req.n == 0 else 0
            yield responses.event(answer.chunk(item.index, None if answer.chat else "",
                                               reason=item.reason))
        elif isinstance(item, jobs.Failed):
            error = _api_error(item.error, "messages" if answer.chat else "prompt")
            outcome["status"] = error.status
            yield responses.event(error.body())
            return
    if req.include_usage:
        yield responses.event(answer.usage_chunk(responses.usage(prompt_tokens, new_tokens)))
    yield responses.DONE
    outcome["status"] = 200


# -- embeddings, models, health, metrics --------------------------------------------------------------
async def _embeddings(service: Service, request: Request) -> Response:
    start = time.monotonic()
    status = 500
    try:
        body = await service.body(request)
        check_model(body, service.name)
        req = embedding_request(body)
        job = jobs.Job(service.model)
        future = service.workers.submit(jobs.embed, job, req, service.limits.max_input_tokens)
        vectors, tokens = await service.wait(request, job, asyncio.wrap_future(future),
                                             start + service.limits.request_timeout)
        if req.dimensions is not None and req.dimensions != vectors.shape[1]:
            raise APIError(400, f"dimensions {req.dimensions}: this model's embeddings have "
                           f"{vectors.shape[1]} (minfer does not shorten them)",
                           param="dimensions")
        status = 200
        return JSONResponse(responses.embeddings(vectors, service.name, tokens, req.base64))
    except _ClientGone:
        status = CLIENT_GONE
        return Response(status_code=CLIENT_GONE)
    except Exception as e:
        error = _api_error(e)
        status = error.status
        return error_response(error)
    finally:
        service.metrics.answered("embeddings", status, time.monotonic() - start)


def _routes(service: Service) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await _generation(service, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generation(service, request, chat=True)

    async def embeddings(request: Request) -> Response:
        return await _embeddings(service, request)

    async def models(request: Request) -> Response:
        return JSONResponse(responses.model_list(service.name, service.created))

    async def health(request: Request) -> Response:
        if not service.ready.is_set():
            return error_response(APIError(503, "the model is warming up"))
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]


class _RequireKey:
    """ASGI middleware: /v1/* requests without `Authorization: Bearer KEY` get 401."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(APIError(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                    code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    message = {404: f"no such endpoint: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
                   e.status_code, str(e.detail))
    return error_response(APIError(e.status_code, message, headers=dict(e.headers or {})))


async def _server_error(request: Request, e: Exception) -> Response:
    log.error("unexpected error", exc_info=e)
    return error_response(APIError(500, f"{type(e).__name__}: {e}", code="internal_error"))


def app(model: Any, *, name: str | None = None, api_key: str | None = None,
        cors_origins: Sequence[str] = (), warmup: bool = True, **limits: Any) -> Starlette:
    """The OpenAI-compatible ASGI app serving `model` (from minfer.load).

    name: the model name clients send and /v1/models lists (default: the name or folder it
        was loaded from). api_key: required as `Authorization: Bearer KEY` on /v1/*.
    cors_origins: origins allowed by CORS (none by default: no CORS headers).
    warmup: run one short request in a background thread at once; /health answers 503 until
        it is done.
    limits: max_running, max_waiting, max_body_bytes, max_tokens, max_input_tokens,
        request_timeout (limits.py)."""
    if getattr(model, "tokenizer", None) is None:
        raise InputError(f"{getattr(model, 'folder', model)} has no tokenizer: the server "
                         "takes text and needs one")
    known = [f.name for f in dataclasses.fields(Limits)]
    unknown = sorted(set(limits) - set(known))
    if unknown:
        raise InputError(f"unknown serving limit {unknown[0]!r} (known: {', '.join(known)})")
    settled = Limits(**limits).checked(model)
    recipe = getattr(model, "load_recipe", None) or {}
    service = Service(model, name or str(recipe.get("model") or model.folder), settled)
    if warmup:
        threading.Thread(target=service.warm_up, name="minfer-serve-warmup", daemon=True).start()
    else:
        service.ready.set()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        service.workers.shutdown()

    middleware = []
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        middleware.append(Middleware(_RequireKey, key=api_key))
    application = Starlette(routes=_routes(service), middleware=middleware, lifespan=lifespan,
                            exception_handlers={HTTPException: _http_error,
                                                Exception: _server_error})
    application.state.service = service
    return application
