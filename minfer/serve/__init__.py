"""minfer's OpenAI-compatible HTTP server (`minfer serve`; install with the [serve] extra).

The HTTP layer only: it calls the same `model.generate` / `generation.run` / `model.embed` a
Python user calls, and the continuous batcher (generation/batcher.py) decodes concurrent
requests together.

- routes.py     the routes and the app factory `app(model, **limits)` (a Starlette app)
- schema.py     OpenAI request fields: checks, and their mapping onto generate's options
- chat.py       the chat rule: messages -> one prompt for a seq2seq model
- responses.py  OpenAI response bodies and server-sent-event chunks
- jobs.py       what a request runs in its worker thread, and how it is cancelled
- workers.py    the bounded worker pool and its admission rule (429)
- limits.py     the serving limits and their defaults
- metrics.py    the Prometheus metrics
- errors.py     OpenAI's error object; minfer's errors mapped to statuses
- batches.py    the Batch API's routes (/v1/files, /v1/batches), with a batch folder
- batch_runner.py  batch jobs' states and the thread that runs their lines
- batch_store.py   the batch folder: files, their objects, job states on disk
- server.py     running it with uvicorn (port 0, graceful SIGTERM)

    import minfer, minfer.serve
    application = minfer.serve.app(minfer.load("google/flan-t5-base"), max_running=32)
    minfer.serve.serve(application, "127.0.0.1", 8000)    # or mount it in your own ASGI app
"""

from __future__ import annotations

from typing import Any

from .limits import Limits

__all__ = ["app", "serve", "Limits"]


def __getattr__(name: str) -> Any:
    """`app` and `serve` import the HTTP stack when first asked for, so that `minfer.serve.limits`
    (the CLI's defaults) needs none, and a missing [serve] extra is said in one line."""
    if name not in ("app", "serve"):
        raise AttributeError(f"module 'minfer.serve' has no attribute {name!r}")
    try:
        from .routes import app
        from .server import serve
    except ImportError as e:   # the [serve] extra is not installed
        raise ImportError(f"minfer.serve needs the [serve] extra ({e.name} is missing): "
                          "pip install 'minfer[serve]'") from e
    return {"app": app, "serve": serve}[name]
