"""`minfer serve`: an OpenAI-compatible HTTP server for one model (minfer.serve), run by uvicorn.

Checks the flags and binds --host/--port first (a taken port or a bad key is said before the
model loads), then loads the model with the shared model options, builds `minfer.serve.app`
with the serving limits and serves it (127.0.0.1 unless told otherwise; port 0: any free port,
printed on stderr) until SIGTERM or Ctrl-C. Needs the [serve] extra.
"""

from __future__ import annotations

import click

from minfer.encoding.cache import EncodeCache
from minfer.errors import ConfigError, InputError
from minfer.serve.limits import Limits, check_grace_period, clean_api_key

from .common import EXIT_USAGE, command_flags, fail, load_model, with_flags, with_model_options

_DEFAULTS = Limits()


@click.command()
@with_model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; put a proxy with TLS in front).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free port, printed on stderr).")
@click.option("--api-key", envvar="MINFER_API_KEY", default=None, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every path but /health and /metrics "
                   "(or set MINFER_API_KEY).")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="The model name clients send and /v1/models lists  [default: --model].")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header is NAME (repeatable; '*' for any). "
                   "Bound to a loopback address, the server answers only localhost, 127.x.x.x "
                   "and [::1] otherwise (DNS rebinding); elsewhere, given, it restricts to them.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow browser requests from this origin (repeatable; '*' for any). No CORS "
                   "headers without it.")
@click.option("--max-running", type=click.IntRange(min=1), default=_DEFAULTS.max_running,
              show_default=True, help="Requests decoded at once (their steps are batched together).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=_DEFAULTS.max_waiting,
              show_default=True, help="Requests queued beyond those; one more gets 429.")
@click.option("--max-body-size", default="4MiB", show_default=True, metavar="SIZE",
              help="Largest request body; larger gets 413.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=_DEFAULTS.max_tokens,
              show_default=True, help="Largest max_tokens a request may ask for (and the cap of "
                                      "the checkpoint's default).")
@click.option("--max-inputs", type=click.IntRange(min=1), default=_DEFAULTS.max_inputs,
              show_default=True, help="Inputs per request at most: embedding inputs, prompts, "
                                      "and sequences (prompts x n); more gets 400.")
@click.option("--max-input-tokens", type=click.IntRange(min=1), default=None,
              help="Prompt tokens at most; longer gets 400  [default: the longest prompt the "
                   "workspace holds alone, at most 16384].")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True),
              default=_DEFAULTS.request_timeout, show_default=True,
              help="Seconds a request may take; then it is cancelled (504).")
@click.option("--grace-period", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds for requests in flight to finish.")
@click.option("--encode-cache", default=None, metavar="SIZE",
              help="Keep encoder outputs up to SIZE (e.g. 1GiB) on the host: a repeated input "
                   "of /v1/encode, /v1/embeddings or a generation skips the encoder.")
@click.option("--batch-dir", default=None, metavar="DIR",
              help="Enable OpenAI's Batch API (/v1/files, /v1/batches): its files and jobs are "
                   "kept in DIR (created if missing); a restart with the same DIR resumes "
                   "unfinished jobs where they stopped.")
@click.option("--max-batch-file-size", default="200MiB", show_default=True, metavar="SIZE",
              help="Largest batch input file an upload may hold; larger gets 413.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="uvicorn's log level (info logs each request).")
def serve(load, host, port, api_key, served_model_name, allowed_hosts, cors_origins, max_running,
          max_waiting, max_body_size, max_tokens, max_inputs, max_input_tokens, request_timeout,
          grace_period, encode_cache, batch_dir, max_batch_file_size, log_level) -> None:
    """Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions,
    /v1/embeddings, /v1/encode, /v1/models, vLLM's /tokenize, /detokenize and /v1/score,
    /v1/rerank, /health and /metrics; with --batch-dir, the Batch API (/v1/files, /v1/batches).
    Concurrent requests are decoded together (continuous batching)."""
    from minfer.arena import parse_bytes
    try:
        from minfer.serve import app, serve as run_server
        from minfer.serve.middleware import host_names
        from minfer.serve.server import bind
    except ImportError as e:   # without the [serve] extra: say how to get it
        fail(str(e))
    try:
        api_key = clean_api_key(api_key, "--api-key (or MINFER_API_KEY)")
        host_names(allowed_hosts)
    except InputError as e:
        fail(str(e).replace("allowed host", "--allowed-host"), EXIT_USAGE)
    try:   # every serving limit before the port and the model: a usage error naming its flag
        max_body_bytes = parse_bytes(max_body_size, "--max-body-size")
        max_batch_file_bytes = parse_bytes(max_batch_file_size, "--max-batch-file-size")
        if max_batch_file_bytes < 1:
            raise InputError(f"--max-batch-file-size must be at least 1 byte, got "
                             f"{max_batch_file_size!r}")
        Limits(max_running=max_running, max_waiting=max_waiting, max_body_bytes=max_body_bytes,
               max_tokens=max_tokens, max_inputs=max_inputs, max_input_tokens=max_input_tokens,
               request_timeout=request_timeout).check_values()
        check_grace_period(grace_period)
        cache = None if encode_cache is None else EncodeCache(encode_cache)
    except (ConfigError, InputError) as e:
        fail(with_flags(str(e), command_flags(max_body_bytes="max_body_size")), EXIT_USAGE)
    if batch_dir is not None:   # a folder it cannot use is said before the model loads
        from minfer.serve.batch_store import Store
        try:
            Store(batch_dir).close()
        except InputError as e:
            fail(f"--batch-dir: {e}", EXIT_USAGE)
    try:   # before the model loads: a taken port is said at once, not after minutes of loading
        sock = bind(host, port)
    except OSError as e:   # the address is taken, or not ours to bind
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    try:
        model = load_model(load)
        model.encode_cache = cache if cache is not None else model.encode_cache
        application = app(model, name=served_model_name or load.model, api_key=api_key,
                          cors_origins=cors_origins, max_running=max_running,
                          max_waiting=max_waiting, max_body_bytes=max_body_bytes,
                          max_tokens=max_tokens, max_inputs=max_inputs,
                          max_input_tokens=max_input_tokens, request_timeout=request_timeout,
                          batch_dir=batch_dir, max_batch_file_bytes=max_batch_file_bytes)
        run_server(application, sock=sock, allowed_hosts=allowed_hosts,
                   grace_period=grace_period, log_level=log_level)
    finally:
        sock.close()
