"""The Batch API's routes (OpenAI's shapes): input files in, jobs run in the background
(batch_runner.py), output files out.

    POST /v1/files                  multipart: purpose "batch" and a JSON Lines file, one request
                                    a line ({"custom_id", "method": "POST", "url", "body"}),
                                    checked line by line -> the file object
    GET  /v1/files/{id}             the file object (input files; a job's output and error files
                                    once it has ended)
    GET  /v1/files/{id}/content     its bytes
    POST /v1/batches                {"input_file_id", "endpoint", "completion_window": "24h",
                                    "metadata"?} -> the batch object, queued
    GET  /v1/batches/{id}           the batch object: status, request_counts, output_file_id...
    POST /v1/batches/{id}/cancel    cancelling now, cancelled once its lines in flight stop
    GET  /v1/batches                newest first: ?limit= (1..100, default 20) &after=batch id

Without a batch folder (`minfer serve --batch-dir DIR`) each of them answers 404 saying how to
enable them. Every answer and error goes through the server's own handling (`handled`, from
routes.py): the API key, the JSON body limit for POST /v1/batches, one-line JSON errors. An
upload is bounded by its own limit (--max-batch-file-size, OpenAI's 200 MB by default: 413) and
spooled to disk as it comes, never held whole.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import InputError
from .batch_runner import Batches
from .batch_store import public
from .errors import APIError

Handler = Callable[[Request], Awaitable[Response]]
# Room for the multipart envelope around the file (boundaries, part headers, the purpose field)
FORM_BYTES = 64 << 10
LIST_LIMIT = (1, 100, 20)   # a batch list's limit: least, most, default (OpenAI's)
DISABLED = ("batch jobs are not enabled on this server: start it with --batch-dir DIR (minfer "
            "serve), a folder that keeps the files and the jobs' state")


def routes(service: Any, batches: Batches | None, max_file_bytes: int,
           handled: Callable[[Handler, str | None], Handler]) -> list[Route]:
    """The Batch API's routes for `service` (routes.Service); `handled(handler, param)` is the
    server's error handling around a handler (param: the field its errors name)."""
    def need() -> Batches:
        if batches is None:
            raise APIError(404, DISABLED, code="batches_disabled")
        return batches

    async def upload(request: Request) -> Response:
        store = need().store
        given = request.headers.get("content-type") or ""
        if given.split(";", 1)[0].strip().lower() != "multipart/form-data":
            raise APIError(415, "a file is uploaded as Content-Type: multipart/form-data (fields "
                           f"purpose and file), got {given[:60]!r}", code="unsupported_media_type")
        limit = max_file_bytes + FORM_BYTES
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(max_file_bytes)
        form = await Request(request.scope, _bounded(request.receive, limit,
                                                     max_file_bytes)).form(max_files=1,
                                                                           max_fields=4)
        try:
            purpose, file = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise APIError(400, f"purpose must be 'batch' (this server keeps batch input "
                               f"files only), got {purpose!r:.40}", param="purpose")
            if not isinstance(file, UploadFile):
                raise APIError(400, "file is required: the JSON Lines file, as a multipart file "
                               "field", param="file")
            if file.size is not None and file.size > max_file_bytes:
                raise _too_large(max_file_bytes)
            try:
                stored = await asyncio.to_thread(store.upload, file.file, file.filename)
            except InputError as e:   # a line that is no request: the file's fault
                raise APIError(400, str(e), param="file") from None
            return JSONResponse(public(stored))
        finally:
            await form.close()

    async def file(request: Request) -> Response:
        return JSONResponse(public(_file(need(), request)))

    async def content(request: Request) -> Response:
        store = need().store
        found = _file(need(), request)
        return FileResponse(store.content(found["id"]), media_type="application/octet-stream")

    async def create(request: Request) -> Response:
        jobs = need()
        body = await service.body(request)
        return JSONResponse(await asyncio.to_thread(
            jobs.create, body.get("input_file_id"), body.get("endpoint"),
            body.get("completion_window"), body.get("metadata")))

    async def batch(request: Request) -> Response:
        return JSONResponse(need().get(request.path_params["batch_id"]))

    async def cancel(request: Request) -> Response:
        jobs = need()
        return JSONResponse(await asyncio.to_thread(jobs.cancel,
                                                    request.path_params["batch_id"]))

    async def listing(request: Request) -> Response:
        jobs = need()
        query = request.query_params
        least, most, default = LIST_LIMIT
        raw = query.get("limit", str(default))
        if not raw.isdigit() or not least <= int(raw) <= most:
            raise APIError(400, f"limit must be an integer from {least} to {most}, got "
                           f"{raw!r:.40}", param="limit")
        return JSONResponse(jobs.page(int(raw), query.get("after")))

    return [Route("/v1/files", handled(upload, "file"), methods=["POST"]),
            Route("/v1/files/{file_id}", handled(file, "file_id"), methods=["GET"]),
            Route("/v1/files/{file_id}/content", handled(content, "file_id"), methods=["GET"]),
            Route("/v1/batches", handled(create, None), methods=["POST"]),
            Route("/v1/batches", handled(listing, None), methods=["GET"]),
            Route("/v1/batches/{batch_id}", handled(batch, "batch_id"), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", handled(cancel, "batch_id"),
                  methods=["POST"])]


def _file(batches: Batches, request: Request) -> dict:
    file_id = request.path_params["file_id"]
    found = batches.store.file(file_id)
    if found is None:
        raise APIError(404, f"no such file: {file_id!r:.80}", param="file_id")
    return found


def _too_large(max_file_bytes: int) -> APIError:
    return APIError(413, f"the file is more than this server's limit of {max_file_bytes} bytes "
                    "for a batch input file (serve --max-batch-file-size)")


def _bounded(receive: Callable[[], Awaitable[dict]], limit: int,
             max_file_bytes: int) -> Callable[[], Awaitable[dict]]:
    """`receive`, refusing (413) a body that grows past `limit` bytes as it comes."""
    size = 0

    async def bounded() -> dict:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise _too_large(max_file_bytes)
        return message
    return bounded
