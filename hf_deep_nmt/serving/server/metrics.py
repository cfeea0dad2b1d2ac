"""The server's Prometheus metrics (`GET /metrics`), on a registry of its own: requests by status, errors by kind,
sentences and tokens translated, batch sizes, queue wait, batch and request latency, what is queued and in progress.
Written by prometheus_client, which also formats them."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hf_deep_nmt.serving.server.limits import ERROR_KINDS

PREFIX = "hf_deep_nmt_serve"
# seconds: a short sentence greedy on a GPU to a long paragraph with beams on one CPU core, and the request timeout
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The metrics of one server; safe to update from the decoding thread (prometheus_client locks its values)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests", "Translation requests answered, by HTTP status", ["status"], registry=registry
        )
        self.errors = Counter(
            f"{PREFIX}_errors", "Translation requests refused or failed, by kind", ["kind"], registry=registry
        )
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        self.sentences = Counter(f"{PREFIX}_sentences", "Sentences translated", registry=registry)
        self.source_tokens = Counter(f"{PREFIX}_source_tokens", "Source tokens translated", registry=registry)
        self.target_tokens = Counter(f"{PREFIX}_target_tokens", "Target tokens produced", registry=registry)
        self.batch_sentences = Histogram(
            f"{PREFIX}_batch_sentences", "Sentences per decoded batch", registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )  # fmt: skip
        self.batch_tokens = Histogram(
            f"{PREFIX}_batch_tokens", "Padded source tokens per decoded batch", registry=registry,
            buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384),
        )  # fmt: skip
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds", "Time a sentence waited for its batch", registry=registry, buckets=_SECONDS
        )
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_seconds", "Time to decode one batch", registry=registry, buckets=_SECONDS
        )
        self.latency = Histogram(
            f"{PREFIX}_request_seconds", "Time from a request's arrival to its answer", registry=registry,
            buckets=_SECONDS,
        )  # fmt: skip
        self.queued = Gauge(f"{PREFIX}_queued_sentences", "Sentences waiting for a batch", registry=registry)
        self.in_progress = Gauge(
            f"{PREFIX}_requests_in_progress", "Translation requests not yet answered", registry=registry
        )
        self.ready = Gauge(
            f"{PREFIX}_ready",
            "1 once the model is loaded and warmed up, 0 before and while draining",
            registry=registry,
        )

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
