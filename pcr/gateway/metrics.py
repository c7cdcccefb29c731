"""``pcr gateway``'s Prometheus metrics (on the process' default registry, so ``/metrics``
serves them beside the registry's own). Without prometheus-client every call is a no-op.

Counted in plain attributes by the event loop (a request counts about a dozen things:
prometheus-client's lock and checks cost 1-2 us each, an attribute increment a tenth
of that) and turned into Prometheus families when ``/metrics`` is read
(``_Collector``): the same names, types, labels and series as prometheus-client's own
collectors would write.

Label values are bounded: ``backend`` is a configured or announced namespace, ``outcome``
and ``kind`` come from the fixed sets below.
"""

from __future__ import annotations

import bisect
import importlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
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

VIEW_EVENTS = ("records", "loads", "gaps", "reconnects", "resyncs", "errors", "skipped")
"""``pcr_gateway_view_events_total``'s ``event`` (``registry.fleet.holders.ViewCounts``):
change records applied; namespaces loaded from their maps; records out of order or of a
new incarnation (the namespace loaded again); subscriptions made again; rounds of loading
every namespace again; Redis faults waited out; messages that were not records."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)


class Count:
    """A counter's value (one label set)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Level:
    """A gauge's value (one label set)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class Spread:
    """A histogram's buckets and sum (one label set): ``counts[i]`` observations in
    ``(bounds[i-1], bounds[i]]``, the last past every bound."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Family:
    """One metric: its name, help, type and label names, and a child per label set."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.kind = kind  # counter, gauge, histogram
        self.label_names = tuple(labels)
        self.buckets = tuple(buckets)
        self.children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        """The child of these label values (made on first use, exported from then on)."""
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}")
        child = self.children.get(values)
        if child is None:
            if self.kind == "counter":
                child = Count()
            elif self.kind == "gauge":
                child = Level()
            else:
                child = Spread(self.buckets)
            self.children[values] = child
        return child

    def plain(self) -> Any:
        """The one child of a family without labels."""
        return self.labels()


class _Collector:
    """The families, in prometheus-client's shape when ``/metrics`` is read."""

    def __init__(
        self,
        prometheus: Any,
        families: Sequence[Family],
        before: Callable[[], None] | None = None,
    ) -> None:
        self.core = importlib.import_module("prometheus_client.core")
        self.go_float = importlib.import_module("prometheus_client.utils").floatToGoString
        self.families = families
        self.before = before  # fills what is read when collected

    def describe(self) -> Iterator[Any]:
        for family in self.families:
            yield self._empty(family)

    def _empty(self, family: Family) -> Any:
        make = {
            "counter": self.core.CounterMetricFamily,
            "gauge": self.core.GaugeMetricFamily,
            "histogram": self.core.HistogramMetricFamily,
        }[family.kind]
        return make(family.name, family.documentation, labels=family.label_names)

    def collect(self) -> Iterator[Any]:
        if self.before is not None:
            self.before()
        for family in self.families:
            out = self._empty(family)
            for values, child in list(family.children.items()):
                if family.kind == "counter":
                    out.add_metric(values, child.value, created=child.created)
                elif family.kind == "gauge":
                    out.add_metric(values, child.value)
                else:
                    total = 0
                    buckets = []
                    counts = list(child.counts)
                    for bound, count in zip(child.bounds, counts, strict=False):
                        total += count
                        buckets.append((self.go_float(bound), total))
                    buckets.append(("+Inf", total + counts[-1]))
                    out.add_metric(values, buckets, child.sum)
                    labels = dict(zip(family.label_names, values, strict=True))
                    out.add_sample(f"{family.name}_created", labels, child.created)
            yield out


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
        requests = Family(
            "pcr_gateway_requests",
            "Requests sent to a backend, by result",
            "counter",
            ["backend", "result"],
        )
        errors = Family(
            "pcr_gateway_errors", "Failed exchanges with a backend, by kind", "counter",
            ["backend", "kind"],
        )  # fmt: skip
        retries = Family(
            "pcr_gateway_retries",
            "Requests retried on the next backend after this one failed before a byte",
            "counter",
            ["backend"],
        )
        routed = Family(
            "pcr_gateway_routing_decisions", "Routing decisions, by outcome", "counter",
            ["outcome"],
        )  # fmt: skip
        prompt_tokens = Family(
            "pcr_gateway_prompt_tokens", "Prompt tokens routed (tokenized here)", "counter",
            ["backend"],
        )  # fmt: skip
        predicted = Family(
            "pcr_gateway_predicted_cached_tokens",
            "Prompt tokens the chosen backend was predicted to serve from its cache",
            "counter",
            ["backend"],
        )
        first_byte = Family(
            "pcr_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the backend's first body byte",
            "histogram",
            ["backend"],
            LATENCY_BUCKETS,
        )
        latency = Family(
            "pcr_gateway_request_duration_seconds",
            "From the request's arrival to the reply's last byte",
            "histogram",
            ["backend"],
            LATENCY_BUCKETS,
        )
        overhead = Family(
            "pcr_gateway_overhead_seconds",
            "The gateway's own time before it sends a request upstream, from its head's "
            "arrival (HTTP parse, body, tokenize, score, choose)",
            "histogram",
            buckets=OVERHEAD_BUCKETS,
        )
        registry_up = Family(
            "pcr_gateway_registry_up",
            "1 while Redis answers the gateway's scoring, else 0",
            "gauge",
        )
        backend_up = Family(
            "pcr_gateway_backend_up", "1 while a backend accepts connections", "gauge",
            ["backend"],
        )  # fmt: skip
        in_flight = Family(
            "pcr_gateway_in_flight", "Requests this gateway has in flight", "gauge", ["backend"]
        )
        pending_blocks = Family(
            "pcr_gateway_pending_blocks",
            "Blocks of the requests this gateway sent that count as arriving at a backend "
            "(its engine's events not yet in the fleet view)",
            "gauge",
            ["backend"],
        )
        pending_changed = Family(
            "pcr_gateway_pending_decisions",
            "Routing decisions whose first choice the pending prefixes changed (ranked "
            "without them, another backend would have come first)",
            "counter",
        )
        view_entries = Family(
            "pcr_gateway_view_entries",
            "Entries the gateway's fleet view holds for a backend's namespace, by map (kv, "
            "mamba): the registry's own counts once the view has caught up",
            "gauge",
            ["backend", "map"],
        )
        view_events = Family(
            "pcr_gateway_view_events", "What the gateway's fleet view did, by event", "counter",
            ["event"],
        )  # fmt: skip
        view_age = Family(
            "pcr_gateway_view_age_seconds",
            "Seconds since the fleet view last knew it followed Redis (past 3: not fresh, "
            "routing by load)",
            "gauge",
        )
        families = [
            requests, errors, retries, routed, prompt_tokens, predicted, first_byte, latency,
            overhead, registry_up, backend_up, in_flight, pending_blocks, pending_changed,
            view_entries, view_events, view_age,
        ]  # fmt: skip
        self.view_entries, self.view_events, self.view_age = view_entries, view_events, view_age
        self.view: tuple[Any, Callable[[], Iterable[str]]] | None = None
        self.pending: tuple[Callable[[str], int], Callable[[], Iterable[str]]] | None = None
        prometheus.REGISTRY.register(_Collector(prometheus, families, self._read_state))
        self.requests, self.errors, self.retries = requests, errors, retries
        self.prompt_tokens, self.predicted = prompt_tokens, predicted
        self.first_byte, self.latency, self.in_flight = first_byte, latency, in_flight
        self.backend_up, self.pending_blocks = backend_up, pending_blocks
        self.overhead: Spread = overhead.plain()
        self.registry_up: Level = registry_up.plain()
        self.pending_changed: Count = pending_changed.plain()
        self.registry_up.set(1)
        self.routed_as = {outcome: routed.labels(outcome) for outcome in ROUTING_OUTCOMES}

    def backend(self, name: str) -> BackendMetrics:
        """The collectors labelled with backend ``name``."""
        return BackendMetrics(self, name)

    def follow_view(self, view: Any, namespaces: Callable[[], Iterable[str]]) -> None:
        """Export ``view``'s counts (a ``registry.fleet.view.FleetView``) for the backends
        ``namespaces()`` names, read each time ``/metrics`` is."""
        if self.on:
            self.view = (view, namespaces)

    def follow_pending(
        self, blocks: Callable[[str], int], namespaces: Callable[[], Iterable[str]]
    ) -> None:
        """Export ``blocks(name)`` (``PendingPrefixes.blocks``) as each backend's
        ``pcr_gateway_pending_blocks``, read each time ``/metrics`` is: exact when read,
        and nothing to set as each request starts and ends."""
        if self.on:
            self.pending = (blocks, namespaces)

    def _read_state(self) -> None:
        """What is read of the gateway's state, not counted as it goes, as ``/metrics``
        is read: the pending blocks and the fleet view's figures."""
        if self.pending is not None:
            blocks, namespaces = self.pending
            for name in namespaces():
                self.pending_blocks.labels(name).set(blocks(name))
        self._read_view()

    def _read_view(self) -> None:
        """The view's figures into their families."""
        if self.view is None:
            return
        view, namespaces = self.view
        children: dict[tuple[str, ...], Any] = {}
        for name in namespaces():
            held = view.entries(name)
            for kind, count in zip(("kv", "mamba"), held or (0, 0), strict=True):
                children[name, kind] = level = Level()
                level.set(count)
        self.view_entries.children = children  # whole: backends gone are dropped
        counts = view.counts
        for event in VIEW_EVENTS:
            self.view_events.labels(event).value = float(getattr(counts, event))
        self.view_age.plain().set(view.age())  # +Inf while it has not loaded

    @classmethod
    def get(cls) -> GatewayMetrics:
        """The process' collectors (one set per process: ``/metrics`` serves one)."""
        if cls._made is None:
            cls._made = cls()
        return cls._made


class BackendMetrics:
    """One backend's labelled values, looked up once."""

    def __init__(self, metrics: GatewayMetrics, name: str) -> None:
        self.ok: Count = metrics.requests.labels(name, "ok")
        self.failed: Count = metrics.requests.labels(name, "error")
        self.closed: Count = metrics.requests.labels(name, "client_closed")
        self.errors: dict[str, Count] = {k: metrics.errors.labels(name, k) for k in ERROR_KINDS}
        self.retries: Count = metrics.retries.labels(name)
        self.prompt_tokens: Count = metrics.prompt_tokens.labels(name)
        self.predicted: Count = metrics.predicted.labels(name)
        self.first_byte: Spread = metrics.first_byte.labels(name)
        self.latency: Spread = metrics.latency.labels(name)
        self.in_flight: Level = metrics.in_flight.labels(name)
