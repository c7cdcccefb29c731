"""The gateway's metrics (``pcr.gateway.metrics``): counted in plain attributes, and
exported exactly as prometheus-client's own collectors export the same operations."""

from __future__ import annotations

import random
import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pcr.gateway.metrics import LATENCY_BUCKETS, Family, GatewayMetrics, _Collector


def _text(registry: CollectorRegistry) -> str:
    raw = prometheus_client.generate_latest(registry).decode()
    return re.sub(r"(_created(?:\{[^}]*\})?) \S+", r"\1 T", raw)


def test_the_exposition_is_prometheus_clients_for_the_same_operations() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    families = [
        Family("t_requests", "Requests", "counter", ["backend", "result"]),
        Family("t_up", "Up", "gauge", ["backend"]),
        Family("t_seconds", "Seconds", "histogram", ["backend"], LATENCY_BUCKETS),
        Family("t_plain", "Plain", "histogram", buckets=(0.001, 0.1)),
        Family("t_changed", "Changed", "counter"),
    ]
    ours.register(_Collector(prometheus_client, families))
    real = [
        Counter("t_requests", "Requests", ["backend", "result"], registry=theirs),
        Gauge("t_up", "Up", ["backend"], registry=theirs),
        Histogram("t_seconds", "Seconds", ["backend"], buckets=LATENCY_BUCKETS, registry=theirs),
        Histogram("t_plain", "Plain", buckets=(0.001, 0.1), registry=theirs),
        Counter("t_changed", "Changed", registry=theirs),
    ]
    rng = random.Random(3)
    for _ in range(3_000):
        n = rng.randrange(len(families))
        family, metric = families[n], real[n]
        labels = [rng.choice(["a", "b", "c"]) for _ in family.label_names]
        mine = family.labels(*labels)
        other = metric.labels(*labels) if labels else metric
        if family.kind == "counter":
            amount = rng.choice([1, 1, 5, 0.5])
            mine.inc(amount)
            other.inc(amount)
        elif family.kind == "gauge":
            how = rng.choice(["set", "inc", "dec"])
            value = rng.choice([0, 1, 3])
            getattr(mine, how)(value)
            getattr(other, how)(value)
        else:  # on a bucket's bound too: ``le`` includes it
            value = rng.choice([0.0, 0.001, 0.0011, 0.1, 0.5, 7.0, 30.0, 99.0, rng.random()])
            mine.observe(value)
            other.observe(value)
    assert _text(ours) == _text(theirs)


def test_a_family_refuses_the_wrong_labels() -> None:
    family = Family("t_x", "X", "counter", ["backend"])
    with pytest.raises(ValueError, match="takes labels"):
        family.labels("a", "b")


def test_the_gateways_own_series_are_served_on_the_default_registry() -> None:
    metrics = GatewayMetrics.get()
    assert metrics.on
    counted = metrics.backend("metrics-test-backend")
    counted.ok.inc()
    counted.latency.observe(0.003)
    text = prometheus_client.generate_latest().decode()
    assert 'pcr_gateway_requests_total{backend="metrics-test-backend",result="ok"} 1.0' in text
    assert (
        'pcr_gateway_request_duration_seconds_bucket{backend="metrics-test-backend",le="0.005"} 1.0'
        in text
    )
    assert 'pcr_gateway_routing_decisions_total{outcome="registry_away"}' in text
