"""The HTTP routes and the app factory: `app(model, **limits)` is a Starlette (ASGI) application
any ASGI server can run or mount (`minfer serve` runs it with uvicorn: server.py).

    POST /v1/completions        prompt (a string or a list), streamed or not
    POST /v1/chat/completions   messages, made one prompt by the chat rule (chat.py)
    POST /v1/embeddings         input (a string or a list) -> model.embed (dimensions: cut)
    POST /v1/encode             input -> per-token encoder states (pipeline presets: encode.py)
    POST /tokenize              prompt or messages -> the ids the model sees (vLLM's shape)
    POST /detokenize            token ids -> text
    POST /v1/score              text_1 x text_2 -> log-likelihoods (seq2seq) or cosines (vLLM's)
    POST /v1/rerank, /rerank    query + documents -> best first: monoT5's P(true), or cosines
    /v1/files, /v1/batches      OpenAI's Batch API (batches.py), with a batch folder (batch_dir)
    GET  /v1/models             the served model
    GET  /health                200 once the model is warmed up, 503 before
    GET  /metrics               Prometheus text format (metrics.py)

A request's body must be `Content-Type: application/json` (415 otherwise: a web page can POST
text/plain or form bodies to a local server without a CORS preflight, never JSON); it is read (at
most max_body_bytes: 413), checked (schema.py: 400 naming the field; at most max_inputs inputs),
then run in a worker thread (workers.py: 429 when the queue is full) by jobs.py, which calls
model.generate / generation.run / model.embed. While it runs the handler watches for the client
going away and for the request's deadline: either cancels the job, whose decoding stops within a
step and gives its arena memory back. Every failure is OpenAI's error object (errors.py), also
for unknown paths, wrong methods, refused hosts and bugs; the server stays up.

With an API key, requests need `Authorization: Bearer KEY` (compared in constant time);
/health and /metrics stay open for load balancers and scrapers. CORS headers only for the origins
given. With a host list (`allowed_hosts`; `serve` sets one when bound to a loopback address),
a request whose Host header names another host gets 421: a page whose own name an attacker's
DNS re-points at 127.0.0.1 (DNS rebinding) still sends that name.

Every request answered is counted once in minfer_requests_total, by endpoint and status (a
stream by how its events ended). On SIGTERM (`drain`): requests waiting for a worker get a 503
"shutting down" at once, requests running finish within the grace period, then `cancel_running`
stops what is left (a 503, or a last error event in a stream); each such request logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import Cancelled, InputError, MinferError
from ..generation.batcher import batcher_of
from ..io.limits import is_integer
from . import batches as batch_routes, encode, jobs, responses
from .batch_runner import Batches
from .batch_store import MAX_FILE_BYTES, Store
from .encode_passes import EncodePasses
from .errors import APIError, error_response, from_exception, shutting_down
from .limits import Limits, clean_api_key
from .middleware import OUTCOME, CheckHost, Count, RequireKey, host_names
from .metrics import CONTENT_TYPE, Metrics
from .schema import (GenerationRequest, chat_request, check_model, completion_request,
                     detokenize_request, embedding_request, field_of, parse_body,
                     rerank_request, score_request, settle, tokenize_request)
from .workers import Workers

log = logging.getLogger("minfer.serve")
CLIENT_GONE = 499   # the status metrics record for a request whose client left (nginx's)


class _ClientGone(Exception):
    pass


class Service:
    """What the routes share: the model, its name, the limits, the workers, /v1/encode's queue,
    the metrics, the jobs in flight, the hosts allowed (None: any) and whether the server is
    draining."""

    def __init__(self, model: Any, name: str, limits: Limits):
        self.model, self.name, self.limits = model, name, limits
        self.workers = Workers(model, limits.max_running, limits.max_waiting)
        self.encode_passes = EncodePasses(model)   # /v1/encode's shared encoder passes
        self.metrics = Metrics(model.backend.arena, batcher_of(model), self.workers.running,
                               self.workers.waiting, getattr(model, "encode_cache", None),
                               self.encode_passes)
        self.created = int(time.time())
        self.ready = threading.Event()
        self.allowed_hosts: frozenset[str] | None = None
        self.draining = False
        self.batches: Batches | None = None   # with a batch folder (app's batch_dir)
        self.max_batch_file_bytes = MAX_FILE_BYTES
        self._jobs: set[jobs.Job] = set()

    def restrict_hosts(self, names: Iterable[str] = ()) -> None:
        """From now on only Host headers naming a loopback address or one of `names` ("*":
        any) are served; others get 421."""
        self.allowed_hosts = (self.allowed_hosts or frozenset()) | host_names(names)

    def job(self, deadline: float) -> jobs.Job:
        """A new request's job, known to `cancel_running` until `finished(job)`."""
        job = jobs.Job(self.model, deadline, self.timed_out())
        self._jobs.add(job)
        return job

    def finished(self, job: jobs.Job) -> None:
        self._jobs.discard(job)

    def drain(self) -> None:
        """SIGTERM: no new work; requests waiting for a worker get 503 now (their futures are
        dropped); those running go on."""
        self.draining = True
        if self.batches is not None:   # no new lines; those in flight end as requests do
            self.batches.stop()
        self.workers.shutdown()

    def cancel_running(self) -> None:
        """The grace period is over: stop every request still running (503, or a last error
        event in a stream), within a step."""
        for job in list(self._jobs):
            job.cancel(shutting_down("cancelled at the end of the grace period"))

    def warm_up(self) -> None:
        """One short run, so that the first request does not pay for compiling or paging in."""
        try:
            text = warm_up_text(self.model.tokenizer)
            if self.model.can_generate:
                self.model.generate(text, max_new_tokens=2)
            else:   # a model that cannot generate is an encoder alone
                self.model.embed([text])
        except MinferError as e:   # a model that cannot run this still serves what it can
            log.warning("warm-up failed: %s", e)
        finally:
            self.ready.set()

    async def body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object: sent as application/json (415 otherwise), at most
        max_body_bytes (413), valid JSON (400); _ClientGone if the client leaves before all
        of it came."""
        given = request.headers.get("content-type")
        if given is None or given.split(";", 1)[0].strip().lower() != "application/json":
            shown = "none" if given is None else repr(given[:60])
            raise APIError(415, f"the request body must be sent as Content-Type: "
                           f"application/json (got {shown})", code="unsupported_media_type")
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {declared} bytes, more than this server's "
                           f"limit of {limit} (serve --max-body-size)")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body is more than this server's limit "
                                   f"of {limit} bytes (serve --max-body-size)")
                chunks.append(chunk)
        except ClientDisconnect:   # it left during the upload: as a client gone later (499)
            raise _ClientGone() from None
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
                raise shutting_down("refused while waiting for a worker")
            return task.result()
        job.cancel()
        task.cancel()
        if gone in done:
            raise _ClientGone()
        raise self.timed_out()

    def timed_out(self) -> APIError:
        return APIError(504, f"the request ran longer than {self.limits.request_timeout:g} s "
                        "(serve --request-timeout)")


# Vocabulary ids tried for a warm-up text (the first ones are often specials or bytes)
WARM_UP_TRIES = 1000


def warm_up_text(tokenizer: Any) -> str:
    """A short text the tokenizer takes: the first vocabulary entry that decodes to a word (a
    letter or digit in it) and encodes again ("warm up" is no text a word-level vocabulary without <unk> takes)."""
    for i in range(min(tokenizer.vocab_size, WARM_UP_TRIES)):
        if i in tokenizer.special_ids:
            continue
        try:
            text = tokenizer.decode([i]).strip()
            if any(c.isalnum() for c in text) and tokenizer.encode(text):
                return text
        except MinferError:   # an id that is no text alone (a byte piece, a control id)
            continue
    return "warm up"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- generation ---------------------------------------------------------------------------------------
async def _generation(service: Service, request: Request, chat: bool) -> Response:
    start = _arrival(request)
    deadline = start + service.limits.request_timeout
    job = None
    try:
        body = await service.body(request)
        check_model(body, service.name)
        # off the event loop: a response_format's first check against a vocabulary builds the
        # grammar engine's view of it (0.4 s for 32k tokens, seconds for mT5's 250k)
        req = await asyncio.to_thread(_generation_request, service, body, chat)
        job = service.job(deadline)
        if req.stream:
            answer = responses.Answer(chat, service.name)
            response = await _start_stream(service, request, job, req, answer, start, deadline)
            job = None   # the response's own now: it lets go of the job when it ends
            return response
        work, args, respond = _completion(service, req, chat)
        future = service.workers.submit(work, job, *args)
        return respond(await service.wait(request, job, asyncio.wrap_future(future), deadline))
    except _ClientGone:
        return _client_gone(request)
    except Exception as e:
        return error_response(_api_error(e, "messages" if chat else "prompt"))
    finally:
        if job is not None:
            service.finished(job)


def _generation_request(service: Service, body: dict, chat: bool) -> GenerationRequest:
    """A completion's or chat completion's checked request, settled against the model."""
    limits = service.limits
    make = chat_request if chat else completion_request
    return settle(service.model, make(body, limits.max_tokens, limits.max_input_tokens,
                                      limits.max_inputs), limits.max_tokens, limits.max_inputs)


def _completion(service: Service, req: GenerationRequest, chat: bool) -> Plan:
    """A non-streamed (chat) completion: one generation.run in a worker -> the whole answer."""
    answer = responses.Answer(chat, service.name)

    def respond(got: tuple[list, list]) -> Response:
        results, logprobs = got
        choices = [(i * req.n + j, r.text, r.finish_reason, logprobs[i][j])
                   for i, row in enumerate(results) for j, r in enumerate(row)]
        use = responses.usage(sum(row[0].prompt_tokens for row in results),
                              sum(r.new_tokens for row in results for r in row))
        return JSONResponse(answer.whole(choices, use))
    return jobs.complete, (req, service.metrics.tokens, chat), respond


def _batched_completion(service: Service, body: dict, chat: bool) -> Plan:
    """A batch line's (chat) completion: as a direct one; a stream has nobody to read it."""
    req = _generation_request(service, body, chat)
    if req.stream:
        raise APIError(400, "stream is not available in a batch job: each line's answer is "
                       "written whole to the output file", param="stream")
    return _completion(service, req, chat)


def _arrival(request: Request) -> float:
    """When the request arrived (time.monotonic(): set by the counting middleware)."""
    return request.scope.get(OUTCOME, {}).get("start", time.monotonic())


def _client_gone(request: Request) -> Response:
    """The answer to a client that has left: nobody reads it; the metrics record 499."""
    request.scope.get(OUTCOME, {})["status"] = CLIENT_GONE
    return Response(status_code=CLIENT_GONE)


def _api_error(e: BaseException, prompt_field: str = "prompt") -> APIError:
    """The client's view of a request's failure; `prompt_field` names the prompts in `param`."""
    if isinstance(e, Cancelled):   # (only the server cancels without saying why: shutting down)
        return shutting_down()
    error = from_exception(e, field_of(str(e), prompt_field))
    if error.code == "internal_error":   # a bug: its traceback
        log.error("request failed", exc_info=e)
    elif error.status == 500:   # known (non-finite outputs): one line
        log.error("request failed: %s", error.message)
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
    def dropped(future: Any) -> None:   # (any thread) never run: the pool was shut down
        if future.cancelled():
            emit(jobs.Failed(shutting_down("refused while waiting for a worker")))
    service.workers.submit(jobs.stream, job, req, emit, service.metrics.tokens, answer.chat) \
        .add_done_callback(dropped)
    first = await service.wait(request, job, queue.get(), deadline)
    if isinstance(first, jobs.Failed):
        raise first.error
    return _EventStream(service, job, req, answer, queue, start, deadline,
                        request.scope.setdefault(OUTCOME, {}))


class _EventStream(StreamingResponse):
    """A streamed request's response. However it ends (all sent, the client gone, cancelled at
    shutdown, even before its first event), its job is cancelled (nothing, if it is done), and
    `outcome["status"]` says what its events reached (499 until they end), for the metrics."""

    def __init__(self, service: Service, job: jobs.Job, req: GenerationRequest,
                 answer: responses.Answer, queue: asyncio.Queue, start: float, deadline: float,
                 outcome: dict):
        self.service, self.job = service, job
        outcome["status"] = CLIENT_GONE
        super().__init__(_events(service, req, answer, queue, start, deadline, outcome),
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.service.finished(self.job)


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
            yield responses.event(answer.chunk(item.index, item.text, logprobs=item.logprobs))
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


# -- embeddings ---------------------------------------------------------------------------------------
def _embedding(service: Service, body: dict) -> Plan:
    """POST /v1/embeddings -> the vectors (a list of floats or base64), usage."""
    req = embedding_request(body, service.limits.max_inputs)

    def answer(got: tuple[Any, int]) -> Response:
        vectors, tokens = got
        service.metrics.tokens(tokens, 0)   # its prompt tokens, as its usage reports them
        return Response(responses.embeddings(vectors, service.name, tokens, req.base64),
                        media_type="application/json")
    return jobs.embed, (req, service.limits.max_input_tokens), answer


# The endpoints a batch job may name, and the field their errors name: each line's body runs
# through the plan of the direct request (one declaration: a new endpoint adds its line here)
BATCH_ENDPOINTS: dict[str, tuple[Callable[["Service", dict], "Plan"], str]] = {
    "/v1/completions": (lambda service, body: _batched_completion(service, body, False),
                        "prompt"),
    "/v1/chat/completions": (lambda service, body: _batched_completion(service, body, True),
                             "messages"),
    "/v1/embeddings": (lambda service, body: _embedding(service, body), "input"),
    "/v1/encode": (encode.plan, "input"),
}


# -- tokenize, detokenize, score, rerank ------------------------------------------------------------
# What such a request runs: from its checked body, the job function, its arguments after the
# job, and how its result becomes the answer
Plan = tuple[Callable[..., Any], tuple, Callable[[Any], Response]]


async def _in_worker(service: Service, request: Request, plan: Callable[[dict], Plan],
                     prompt_field: str = "prompt") -> Response:
    """A request that runs one job in a worker thread, as every request does (limits, deadline,
    429 when the queue is full, disconnects), answered by its plan."""
    deadline = _arrival(request) + service.limits.request_timeout
    job = None
    try:
        body = await service.body(request)
        check_model(body, service.name)
        work, args, answer = plan(body)
        job = service.job(deadline)
        future = service.workers.submit(work, job, *args)
        return answer(await service.wait(request, job, asyncio.wrap_future(future), deadline))
    except _ClientGone:
        return _client_gone(request)
    except Exception as e:
        return error_response(_api_error(e, prompt_field))
    finally:
        if job is not None:
            service.finished(job)


def _tokenize(service: Service, body: dict) -> Plan:
    """POST /tokenize -> {tokens, count, max_model_len}."""
    return (jobs.tokenize, tokenize_request(body),
            lambda ids: JSONResponse({"tokens": ids, "count": len(ids),
                                      "max_model_len": service.limits.max_input_tokens}))


def _detokenize(service: Service, body: dict) -> Plan:
    """POST /detokenize -> {prompt}."""
    return (jobs.detokenize, (detokenize_request(body, service.model.config.vocab_size),),
            lambda text: JSONResponse({"prompt": text}))


def _score(service: Service, body: dict) -> Plan:
    """POST /v1/score -> {data: [{index, score}], usage}."""
    def answer(got: tuple[list[float], int]) -> Response:
        service.metrics.tokens(got[1], 0)
        return JSONResponse(responses.scores(got[0], service.name, service.created, got[1]))
    return (jobs.score, (score_request(body, service.limits.max_inputs),
                         service.limits.max_input_tokens), answer)


def _rerank(service: Service, body: dict) -> Plan:
    """POST /v1/rerank, /rerank -> {results: [{index, relevance_score, document?}], usage}."""
    req = rerank_request(body, service.limits.max_inputs, service.limits.max_input_tokens)

    def answer(got: tuple[list, int]) -> Response:
        service.metrics.tokens(got[1], 0)
        return JSONResponse(responses.ranking(got[0], req.documents, req.return_documents,
                                              service.name, got[1]))
    return jobs.rerank, (req, service.limits.max_input_tokens), answer


def _routes(service: Service) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await _generation(service, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generation(service, request, chat=True)


    async def models(request: Request) -> Response:
        return JSONResponse(responses.model_list(service.name, service.created))

    def in_worker(plan: Callable[[Service, dict], Plan], prompt_field: str = "prompt"):
        async def endpoint(request: Request) -> Response:
            return await _in_worker(service, request, lambda body: plan(service, body),
                                    prompt_field)
        return endpoint

    async def health(request: Request) -> Response:
        if not service.ready.is_set():
            return error_response(APIError(503, "the model is warming up"))
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    def handled(handler: Callable[[Request], Awaitable[Response]], param: str | None):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except (_ClientGone, ClientDisconnect):
                return _client_gone(request)
            except HTTPException as e:   # Starlette's: a malformed multipart body
                return await _http_error(request, e)
            except Exception as e:
                return error_response(_api_error(e, param))
        return endpoint

    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", in_worker(_embedding, "input"), methods=["POST"]),
            Route("/v1/encode", in_worker(encode.plan, "input"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", in_worker(_tokenize), methods=["POST"]),
            Route("/detokenize", in_worker(_detokenize), methods=["POST"]),
            Route("/v1/score", in_worker(_score, "text_1"), methods=["POST"]),
            Route("/v1/rerank", in_worker(_rerank, "documents"), methods=["POST"]),
            Route("/rerank", in_worker(_rerank, "documents"), methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *batch_routes.routes(service, service.batches, service.max_batch_file_bytes,
                                 handled)]


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
        cors_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
        warmup: bool = True, batch_dir: str | os.PathLike | None = None,
        max_batch_file_bytes: int = MAX_FILE_BYTES, **limits: Any) -> Starlette:
    """The OpenAI-compatible ASGI app serving `model` (from minfer.load).

    name: the model name clients send and /v1/models lists (default: the name or folder it
        was loaded from). api_key: required as `Authorization: Bearer KEY` on every path but
        /health and /metrics (surrounding whitespace stripped; empty, control or non-ASCII characters: InputError).
    cors_origins: origins allowed by CORS (none by default: no CORS headers).
    allowed_hosts: if given, only requests whose Host header names a loopback address or one
        of these ("*": any) are served, others get 421 (default: any host; `serve` restricts
        an app it binds to a loopback address).
    warmup: run one short request in a background thread at once; /health answers 503 until
        it is done.
    batch_dir: the folder of the Batch API's files and jobs (created if missing); a job left
        unfinished there by an earlier server is resumed. None: the batch routes answer 404.
    max_batch_file_bytes: the largest batch input file an upload may hold (413 beyond).
    limits: max_running, max_waiting, max_body_bytes, max_tokens, max_inputs,
        max_input_tokens, request_timeout (limits.py)."""
    if getattr(model, "tokenizer", None) is None:
        raise InputError(f"{getattr(model, 'folder', model)} has no tokenizer: the server "
                         "takes text and needs one")
    known = [f.name for f in dataclasses.fields(Limits)]
    unknown = sorted(set(limits) - set(known))
    if unknown:
        raise InputError(f"unknown serving limit {unknown[0]!r} (known: {', '.join(known)})")
    api_key = clean_api_key(api_key)
    settled = Limits(**limits).checked(model)
    recipe = getattr(model, "load_recipe", None) or {}
    service = Service(model, name or str(recipe.get("model") or model.folder), settled)
    if allowed_hosts is not None:
        service.restrict_hosts(allowed_hosts)
    if not is_integer(max_batch_file_bytes) or max_batch_file_bytes < 1:
        raise InputError(f"max_batch_file_bytes must be a positive integer, got "
                         f"{max_batch_file_bytes!r:.40}")
    service.max_batch_file_bytes = max_batch_file_bytes
    if batch_dir is not None:
        service.batches = Batches(Store(batch_dir), service, BATCH_ENDPOINTS, _api_error)
    if warmup:
        threading.Thread(target=service.warm_up, name="minfer-serve-warmup", daemon=True).start()
    else:
        service.ready.set()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if service.batches is not None:
            service.batches.stop()
        service.workers.shutdown()

    middleware = [Middleware(Count, service=service), Middleware(CheckHost, service=service)]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        middleware.append(Middleware(RequireKey, key=api_key))
    application = Starlette(routes=_routes(service), middleware=middleware, lifespan=lifespan,
                            exception_handlers={HTTPException: _http_error,
                                                Exception: _server_error})
    # a path with a trailing slash is no endpoint: a JSON 404, not Starlette's bodiless 307 to
    # the path without it (which clients do not follow for a POST)
    application.router.redirect_slashes = False
    application.state.service = service
    return application
