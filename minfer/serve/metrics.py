"""The server's Prometheus metrics (GET /metrics, text format), one registry per app.

    minfer_requests_running            gauge: requests being decoded or embedded now
    minfer_requests_waiting            gauge: accepted requests waiting for a worker or for arena
                                       memory
    minfer_requests_total              counter, by endpoint and HTTP status (429s included)
    minfer_prompt_tokens_total         counter: prompt tokens run, each prompt once (not once
                                       per sequence): a non-streamed completion's or
                                       embedding's as its usage reports them, when it succeeds;
                                       a stream's however it ends (also cut short, cancelled or
                                       failed before any usage was sent: the prompts of the
                                       streams made)
    minfer_generated_tokens_total      counter: tokens generated, counted likewise (a stream
                                       cut short: what it made)
    minfer_request_duration_seconds    histogram by endpoint: arrival to the last byte
    minfer_time_to_first_token_seconds histogram: arrival to the first streamed piece
    minfer_arena_used_bytes            gauge: the model's arena bytes in use (weights under a
                                       memory limit, decode states, scratch)
    minfer_arena_capacity_bytes        gauge: the arena's size
    minfer_decode_steps_total          counter: decode steps the continuous batcher took
    minfer_decode_step_requests_total  counter: requests stepped, summed over those steps
                                       (divided by the steps: the mean batch)
    minfer_encode_passes_total         counter: encoder passes (model.encode calls) /v1/encode
                                       ran, each shared by the concurrent requests it served
    minfer_encode_pass_requests_total  counter: /v1/encode requests summed over those passes
                                       (divided by the passes: the mean sharing)
    minfer_encode_cache_hits_total     counter: encoder rows (or /v1/encode's rendered answers
                                       of them) answered from the encode cache
    minfer_encode_cache_misses_total   counter: encoder rows looked up and not found there
    minfer_encode_cache_evictions_total  counter: rows and kept answers dropped to stay within its budget
    minfer_encode_cache_bytes          gauge: bytes it holds (of minfer_encode_cache_budget_bytes)
    minfer_encode_cache_entries        gauge: rows it holds
                                       (the encode_cache lines only with `--encode-cache`)
    minfer_batches_total               counter, by status: batch jobs that ended (completed,
                                       cancelled, failed)
    minfer_batch_lines_total           counter, by outcome: batch lines answered (completed: in
                                       the output file; failed: in the error file)

Gauges are read when scraped (callbacks), so they cannot drift from what they describe.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FIRST_TOKEN = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _BatcherCounts:
    """The batcher's step counters, read when scraped (a collector: counters cannot be set)."""

    def __init__(self, batcher: Any):
        self.batcher = batcher

    def collect(self) -> Any:
        yield CounterMetricFamily("minfer_decode_steps", "Decode steps the continuous batcher "
                                  "took", value=self.batcher.steps)
        yield CounterMetricFamily("minfer_decode_step_requests", "Requests stepped, summed over "
                                  "the decode steps (/ steps: the mean batch)",
                                  value=self.batcher.stepped)


class _EncodePassCounts:
    """/v1/encode's queue counters (encode_passes.py), read when scraped."""

    def __init__(self, passes: Any):
        self.passes = passes

    def collect(self) -> Any:
        yield CounterMetricFamily("minfer_encode_passes", "Encoder passes /v1/encode ran "
                                  "(shared by concurrent requests)", value=self.passes.passes)
        yield CounterMetricFamily("minfer_encode_pass_requests", "/v1/encode requests summed "
                                  "over the encoder passes (/ passes: the mean sharing)",
                                  value=self.passes.requests)


class _EncodeCacheCounts:
    """The encode cache's counters and sizes, read when scraped."""

    def __init__(self, cache: Any):
        self.cache = cache

    def collect(self) -> Any:
        s = self.cache.stats()
        yield CounterMetricFamily("minfer_encode_cache_hits", "Encoder rows answered from the "
                                  "encode cache", value=s.hits)
        yield CounterMetricFamily("minfer_encode_cache_misses", "Encoder rows not found in the "
                                  "encode cache", value=s.misses)
        yield CounterMetricFamily("minfer_encode_cache_evictions", "Encoder rows and kept "
                                  "answers evicted from the encode cache", value=s.evicted)
        yield GaugeMetricFamily("minfer_encode_cache_bytes", "Bytes the encode cache holds",
                                value=s.bytes)
        yield GaugeMetricFamily("minfer_encode_cache_budget_bytes", "The encode cache's budget",
                                value=s.budget)
        yield GaugeMetricFamily("minfer_encode_cache_entries", "Rows the encode cache holds",
                                value=s.entries)


class Metrics:
    def __init__(self, arena: Any, batcher: Any, running: Callable[[], int],
                 waiting: Callable[[], int], encode_cache: Any = None,
                 encode_passes: Any = None):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_BatcherCounts(batcher))
        if encode_passes is not None:
            r.register(_EncodePassCounts(encode_passes))
        if encode_cache is not None:
            r.register(_EncodeCacheCounts(encode_cache))
        Gauge("minfer_requests_running", "Requests being decoded or embedded now",
              registry=r).set_function(running)
        Gauge("minfer_requests_waiting", "Accepted requests waiting for a worker or for arena "
              "memory", registry=r).set_function(waiting)
        Gauge("minfer_arena_used_bytes", "Arena bytes in use", registry=r).set_function(
            lambda: arena.used)
        Gauge("minfer_arena_capacity_bytes", "Arena size in bytes", registry=r).set_function(
            lambda: arena.capacity)
        self.requests = Counter("minfer_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("minfer_prompt_tokens", "Prompt tokens of generations and "
                                     "embeddings",
                                     registry=r)
        self.generated_tokens = Counter("minfer_generated_tokens", "Tokens generated",
                                        registry=r)
        self.duration = Histogram("minfer_request_duration_seconds", "Request latency, arrival "
                                  "to last byte", ["endpoint"], buckets=_LATENCY, registry=r)
        self.batches = Counter("minfer_batches", "Batch jobs that ended, by status", ["status"],
                               registry=r)
        self.batch_lines = Counter("minfer_batch_lines", "Batch lines answered, by outcome",
                                   ["outcome"], registry=r)
        self.first_token = Histogram("minfer_time_to_first_token_seconds", "Arrival to the "
                                     "first streamed piece", buckets=_FIRST_TOKEN, registry=r)

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)

    def batch_ended(self, status: str) -> None:
        self.batches.labels(status).inc()

    def batch_line(self, ok: bool) -> None:
        self.batch_lines.labels("completed" if ok else "failed").inc()

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
