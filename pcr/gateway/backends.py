"""``pcr gateway``'s backends: the engines it sends requests to, and what it knows of them.

Each ``Backend`` carries its load (``pcr.gateway.balance.BackendLoad``) and whether it
takes connections: one that refused is passed over for ``REFUSED_FOR`` seconds. The
table of backends is the configured ones plus those announced in Redis
(``merge_announced``). An announced backend whose announcement is gone is kept (the
last known set): Redis restarted empty forgets every announcement until the bridges
make theirs again, and a gateway that dropped them would have nothing to send
requests to. It goes only once its namespace's own lease (in its ``meta``) has run out
(``pcr.gateway.exchange.ended_leases``); while Redis holds no lease for it at all, it
stays, and ``/health`` lists it under ``kept``. ``engine_load`` reads an engine's queue
and KV-cache usage from its Prometheus text. Nothing here does I/O (``pcr.gateway.state``
and ``pcr.gateway.exchange`` fetch).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pcr.gateway.balance import BackendLoad
from pcr.gateway.metrics import BackendMetrics, GatewayMetrics

log = logging.getLogger(__name__)

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
    kept_since: float | None = None
    """Announced, its announcement gone since then (wall clock, s): kept, not dropped."""
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


def merge_announced(
    backends: dict[str, Backend], table: Mapping[str, str], ended: Collection[str] = ()
) -> None:
    """Bring ``backends`` in line with the engine table in Redis (namespace -> URL): new
    namespaces added, announced ones moved; configured ones kept as they are. An
    announced one missing from the table is kept (``kept_since``) unless its namespace
    is in ``ended`` (its namespace's lease has run out): then it is dropped."""
    for namespace, url in table.items():
        known = backends.get(namespace)
        if known is None:
            backends[namespace] = Backend(namespace, url, "announced")
        elif known.source == "announced":
            known.url = url
            if known.kept_since is not None:
                known.kept_since = None
                log.warning("backend %s is announced again", namespace)
    for namespace in gone_from(backends, table):
        backend = backends[namespace]
        if namespace in ended:
            del backends[namespace]
            log.warning("backend %s dropped: not announced and its lease has run out", namespace)
        elif backend.kept_since is None:
            backend.kept_since = time.time()
            log.warning(
                "backend %s is no longer announced; kept until its lease runs out", namespace
            )


def gone_from(backends: Mapping[str, Backend], table: Mapping[str, str]) -> list[str]:
    """The announced backends missing from the engine table ``table``."""
    return [n for n, b in backends.items() if b.source == "announced" and n not in table]


def kept_backends(backends: Iterable[Backend]) -> dict[str, str]:
    """Each kept backend (announced, announcement gone) and since when, for ``/health``."""
    return {
        b.namespace: "announcement gone since "
        + datetime.fromtimestamp(b.kept_since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        + "; kept until its lease runs out"
        for b in backends
        if b.kept_since is not None
    }


_ENGINE_SERIES = {
    "vllm:num_requests_running": 0,
    "vllm:num_requests_waiting": 1,
    "vllm:kv_cache_usage_perc": 2,
    "vllm:gpu_cache_usage_perc": 2,
}
"""The series ``engine_load`` reads: requests running (0), waiting (1), KV-cache usage (2)."""


def _series_values(text: str, name: str) -> Iterator[float]:
    """The finite values of every sample of ``name`` in an exposition ``text`` (any
    labels; a timestamp after the value ignored), found by ``str.find``: vLLM's
    ``/metrics`` runs to a thousand lines and more, histograms mostly, read every second,
    and three series of it are wanted."""
    if text.startswith(name):
        at = 0
    elif (at := text.find("\n" + name) + 1) == 0:
        return
    while True:
        end = text.find("\n", at)
        line = text[at + len(name) : end if end >= 0 else len(text)]
        if line[:1] == "{":
            line = line[line.rfind("}") + 1 :]
        if line[:1] in (" ", "\t"):
            parts = line.split()
            try:
                value = float(parts[0]) if parts else math.nan
            except ValueError:
                value = math.nan
            if math.isfinite(value):
                yield value
        if end < 0 or (at := text.find("\n" + name, end) + 1) == 0:
            return


def engine_load(text: str) -> tuple[float, float, float]:
    """(running, waiting, KV-cache usage) from a vLLM engine's ``/metrics`` text: the
    requests summed over every label set, the usage the highest one reported; a value
    that is not a finite number is left out."""
    found = [0.0, 0.0, 0.0]
    for name, slot in _ENGINE_SERIES.items():
        for value in _series_values(text, name):
            found[slot] = max(found[slot], value) if slot == 2 else found[slot] + value
    return found[0], found[1], found[2]
