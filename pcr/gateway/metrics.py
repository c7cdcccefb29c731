"""``pcr gateway``'s Prometheus metrics (on the process' default registry, so ``/metrics``
serves them beside the registry's own). Without prometheus-client every call is a no-op.

Label values are bounded: ``backend`` is a configured or announced namespace, ``outcome``
and ``kind`` come from the fixed sets below.
"""

from __future__ import annotations

import importlib
from typing import Any

ROUTING_OUTCOMES = ("prefix", "load", "registry_away")
"""``prefix``: some backend held a cached prefix of the prompt and the rule weighed it;
``load``: none did, or the prompt could not be tokenized, or the policy ignores prefixes;
``registry_away``: Redis did not answer in time, so the choice was by load alone."""
ERROR_KINDS = ("connect", "timeout", "protocol", "status", "cancelled")
"""``connect``: the backend refused or could not be reached; ``timeout``: it did not
answer in time; ``protocol``: the connection broke mid-reply; ``status``: it answered
5xx; ``cancelled``: the client went away first."""

REQUEST_RESULTS = ("ok", "error", "client_closed")
"""``pcr_gateway_requests_total``'s ``result``: ``ok``, the backend's reply (below 500)
passed on whole; ``error``, the backend failed (``ERROR_KINDS`` but ``cancelled``) or
answered 5xx; ``client_closed``, the client went away before the reply's end (no fault
of the backend; ``pcr_gateway_errors_total{kind="cancelled"}`` counts it too)."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    """The gateway's collectors, made once per process."""

    _made: GatewayMetrics | None = None

    def __init__(self) -> None:
        try:
            prometheus: Any = importlib.import_module("prometheus_client")
        except ImportError:
            self.on = False
            return
        self.on = True
        self.requests = prometheus.Counter(
            "pcr_gateway_requests", "Requests sent to a backend, by result", ["backend", "result"]
        )
        self.errors = prometheus.Counter(
            "pcr_gateway_errors", "Failed exchanges with a backend, by kind", ["backend", "kind"]
        )
        self.retries = prometheus.Counter(
            "pcr_gateway_retries",
            "Requests retried on the next backend after this one failed before a byte",
            ["backend"],
        )
        self.routed = prometheus.Counter(
            "pcr_gateway_routing_decisions", "Routing decisions, by outcome", ["outcome"]
        )
        self.prompt_tokens = prometheus.Counter(
            "pcr_gateway_prompt_tokens", "Prompt tokens routed (tokenized here)", ["backend"]
        )
        self.predicted = prometheus.Counter(
            "pcr_gateway_predicted_cached_tokens",
            "Prompt tokens the chosen backend was predicted to serve from its cache",
            ["backend"],
        )
        self.first_byte = prometheus.Histogram(
            "pcr_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the backend's first body byte",
            ["backend"],
            buckets=LATENCY_BUCKETS,
        )
        self.latency = prometheus.Histogram(
            "pcr_gateway_request_duration_seconds",
            "From the request's arrival to the reply's last byte",
            ["backend"],
            buckets=LATENCY_BUCKETS,
        )
        self.overhead = prometheus.Histogram(
            "pcr_gateway_overhead_seconds",
            "The gateway's own time before it sends a request upstream (parse, tokenize, "
            "score, choose)",
            buckets=OVERHEAD_BUCKETS,
        )
        self.registry_up = prometheus.Gauge(
            "pcr_gateway_registry_up", "1 while Redis answers the gateway's scoring, else 0"
        )
        self.backend_up = prometheus.Gauge(
            "pcr_gateway_backend_up", "1 while a backend accepts connections", ["backend"]
        )
        self.in_flight = prometheus.Gauge(
            "pcr_gateway_in_flight", "Requests this gateway has in flight", ["backend"]
        )
        self.pending_blocks = prometheus.Gauge(
            "pcr_gateway_pending_blocks",
            "Blocks of the requests this gateway sent that count as arriving at a backend "
            "(its engine's events not yet in the fleet view)",
            ["backend"],
        )
        self.pending_changed = prometheus.Counter(
            "pcr_gateway_pending_decisions",
            "Routing decisions whose first choice the pending prefixes changed (ranked "
            "without them, another backend would have come first)",
        )
        self.registry_up.set(1)
        self.routed_as = {outcome: self.routed.labels(outcome) for outcome in ROUTING_OUTCOMES}

    def backend(self, name: str) -> BackendMetrics:
        """The collectors labelled with backend ``name``."""
        return BackendMetrics(self, name)

    @classmethod
    def get(cls) -> GatewayMetrics:
        """The process' collectors (prometheus-client refuses a name registered twice)."""
        if cls._made is None:
            cls._made = cls()
        return cls._made


class BackendMetrics:
    """One backend's labelled collectors, looked up once (``labels`` per request costs
    more than the increment)."""

    def __init__(self, metrics: GatewayMetrics, name: str) -> None:
        self.ok = metrics.requests.labels(name, "ok")
        self.failed = metrics.requests.labels(name, "error")
        self.closed = metrics.requests.labels(name, "client_closed")
        self.errors = {kind: metrics.errors.labels(name, kind) for kind in ERROR_KINDS}
        self.retries = metrics.retries.labels(name)
        self.prompt_tokens = metrics.prompt_tokens.labels(name)
        self.predicted = metrics.predicted.labels(name)
        self.first_byte = metrics.first_byte.labels(name)
        self.latency = metrics.latency.labels(name)
        self.in_flight = metrics.in_flight.labels(name)
        self.pending_blocks = metrics.pending_blocks.labels(name)
