"""``pcr gateway``'s backends: the engines it sends requests to, and what it knows of them.

Each ``Backend`` carries its load (``pcr.gateway_balance.BackendLoad``) and whether it
takes connections: one that refused is passed over for ``REFUSED_FOR`` seconds. The
table of backends is the configured ones plus those announced in Redis
(``merge_announced``); ``engine_load`` reads an engine's queue and KV-cache usage from
its Prometheus text. Nothing here does I/O (``pcr.gateway_app`` fetches).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pcr.gateway_balance import BackendLoad
from pcr.gateway_metrics import BackendMetrics, GatewayMetrics

REFUSED_FOR = 2.0
"""Seconds a backend that refused a connection is passed over (then tried again)."""


@dataclass
class Backend:
    """One engine the gateway sends requests to."""

    namespace: str
    url: str
    source: str  # "config" or "announced"
    load: BackendLoad = field(default_factory=BackendLoad)
    refused_until: float = 0.0
    up: bool = True
    _metrics: BackendMetrics | None = None

    def metrics(self, metrics: GatewayMetrics) -> BackendMetrics:
        """This backend's labelled collectors (looked up once, not per request)."""
        if self._metrics is None:
            self._metrics = metrics.backend(self.namespace)
        return self._metrics

    def mark(self, metrics: GatewayMetrics, *, up: bool) -> None:
        """Whether this backend took a connection just now: one that refused is passed
        over for ``REFUSED_FOR`` seconds, one that answered (its /metrics) is a candidate
        again at once (an engine back from a restart gets requests from its next scrape)."""
        self.up = up
        self.refused_until = 0.0 if up else time.monotonic() + REFUSED_FOR
        if metrics.on:
            metrics.backend_up.labels(self.namespace).set(1 if up else 0)


def merge_announced(backends: dict[str, Backend], table: Mapping[str, str]) -> None:
    """Bring ``backends`` in line with the engine table in Redis (namespace -> URL): new
    namespaces added, announced ones moved or dropped; configured ones kept as they are."""
    for namespace, url in table.items():
        known = backends.get(namespace)
        if known is None:
            backends[namespace] = Backend(namespace, url, "announced")
        elif known.source == "announced":
            known.url = url
    for namespace in [n for n, b in backends.items() if b.source == "announced"]:
        if namespace not in table:
            del backends[namespace]


def engine_load(text: str) -> tuple[float, float, float]:
    """(running, waiting, KV-cache usage) from a vLLM engine's ``/metrics`` text: the
    requests summed over every label set, the usage the highest one reported."""
    running = waiting = usage = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        with contextlib.suppress(ValueError, IndexError):
            value = float(line.rsplit(" ", 1)[1])
            if name == "vllm:num_requests_running":
                running += value
            elif name == "vllm:num_requests_waiting":
                waiting += value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage = max(usage, value)
    return running, waiting, usage
