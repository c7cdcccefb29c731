"""Prometheus metrics of the registry, the router, the listener, the slot pool and the
bridge (the ``metrics`` extra: ``prometheus-client``).

An observer (``registry.core.observe``): the components publish what they do (the
``ScriptRunner``'s scripts, the Redis registry's reads, the argument checks,
``PrefixRouter``, ``AsyncPrefixRouter``, the eviction listener), and
:func:`enable_metrics` subscribes one :class:`Metrics` that counts it; no library module
imports this one. Off by default, and free when off: nothing here imports
``prometheus_client`` until :func:`enable_metrics` runs, and a component pays one read of
``observe.current`` and a ``None`` check. Once enabled, every registry, router and runner
of the process reports into one set of metrics, registered on one
``prometheus_client.CollectorRegistry`` (the library's default one unless another is
given)::

    from registry import metrics

    metrics.enable_metrics()               # or enable_metrics(my_registry, namespace_labels=True)
    metrics.register_owner(registry)       # its lease, read from Redis at scrape time
    metrics.register_pool(pool)            # gpu.MambaSlotPool.counts(), at scrape time
    metrics.register_listener(listener)    # gpu.EvictionListener.counts()
    metrics.register_bridge(bridge)        # registry.bridge.bridge.Bridge.counts()
    metrics.register_mirror(mirrored)      # registry.MirroredRegistry.counts() and lease
    metrics.register_view(view)            # registry.fleet.view.FleetView: counts, age
    prometheus_client.start_http_server(9100)

Labels take bounded values only: ``operation`` (the script and read names of this
project), ``outcome`` (``ok``, ``unavailable``, ``stale_epoch``, ``bad_input``,
``fault``); ``namespace`` appears only with ``namespace_labels=True`` and only on the
per-object metrics (lease, listener, pool, bridge); without it those are summed (the
lease: its minimum). The registered objects are read through their ``counts()`` (duck
typing: this module never imports ``gpu`` or torch) and held until :func:`unregister`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

from registry.core import observe
from registry.core.errors import RegistryError
from registry.core.scores import NodeScore
from registry.core.validation import prefix_hashes
from registry.namespace.admin import namespace_infos

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Seconds: one Redis round trip on loopback up to a call's bound (``CALL_BOUND``)."""

BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

POOL_GAUGES = ("slots", "in_use", "free")
"""``PoolCounts`` fields that are levels; the others are running totals."""

active: Metrics | None = None
"""The enabled metrics (subscribed to ``registry.core.observe``), or None."""

_lock = threading.Lock()


class Metrics:
    """The metric objects of one enabled set (see :func:`enable_metrics`): a
    ``registry.core.observe.Observer`` that counts what the components publish."""

    def __init__(self, registry: Any, namespace_labels: bool) -> None:
        from prometheus_client import Histogram

        self.registry = registry
        self.namespace_labels = namespace_labels
        self._operation_metrics(registry)
        self._router_metrics(registry)
        self.listener_lag_seconds = Histogram(
            "pcr_listener_lag_seconds",
            "Eviction notices: from publish (server clock) to the slot freed by a listener "
            "(its host's clock: their skew is included)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._decided = {o: self.decisions.labels(o) for o in ("hit", "fallback", "none")}
        self.objects = ObjectCollector(namespace_labels)
        registry.register(self.objects)
        self._children: dict[tuple[str, str, bool], tuple[Any, Any]] = {}

    def _operation_metrics(self, registry: Any) -> None:
        """Operations by outcome and their times; the prefix lookups' blocks and hits."""
        from prometheus_client import Counter, Histogram

        self.operations = Counter(
            "pcr_operations",
            "Registry operations (scripts, reads, rejected arguments) by outcome",
            ["operation", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "pcr_operation_duration_seconds",
            "Time of one registry operation that reached Redis (a script or a read)",
            ["operation", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queries = Counter(
            "pcr_prefix_cache_queries",
            "Blocks looked up by match_kv_prefix (after the prefix check)",
            registry=registry,
        )
        self.hits = Counter(
            "pcr_prefix_cache_hits",
            "Blocks of the cached prefix match_kv_prefix returned",
            registry=registry,
        )

    def _router_metrics(self, registry: Any) -> None:
        """The routers' score times, decisions and the chosen node's predicted prefix."""
        from prometheus_client import Counter, Histogram

        self.score_duration = Histogram(
            "pcr_router_score_duration_seconds",
            "Time of one PrefixRouter.score (live nodes and every node's score)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.decisions = Counter(
            "pcr_router_decisions",
            "PrefixRouter.best calls: hit (the chosen node holds a prefix), fallback "
            "(no live node holds any, chosen by load), none (no live node)",
            ["outcome"],
            registry=registry,
        )
        self.predicted = Histogram(
            "pcr_router_predicted_blocks",
            "Usable cached prefix (blocks) of the node PrefixRouter.best chose",
            buckets=BLOCK_BUCKETS,
            registry=registry,
        )
        self.ratio = Histogram(
            "pcr_router_hit_ratio",
            "Usable cached prefix of the chosen node over the prompt's blocks",
            buckets=RATIO_BUCKETS,
            registry=registry,
        )

    # -- the events (registry.core.observe.Observer) ------------------------------------

    def record(self, operation: str, outcome: str, seconds: float | None) -> None:
        """Count one ``operation`` with ``outcome`` (and its time, when it reached Redis)."""
        key = (operation, outcome, seconds is not None)
        children = self._children.get(key)
        if children is None:  # labels() takes a lock and builds a key: once per pair
            timer: Any = None if seconds is None else self.duration.labels(operation, outcome)
            children = self._children[key] = (self.operations.labels(operation, outcome), timer)
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)

    def listener_lag(self, seconds: float) -> None:
        """A listener freed a notice's slots ``seconds`` after the notice was published."""
        self.listener_lag_seconds.observe(seconds)

    def prefix_query(self, queried: int, hit: int) -> None:
        """``match_kv_prefix`` looked up ``queried`` blocks; ``hit`` of them were cached."""
        self.queries.inc(queried)
        self.hits.inc(hit)

    def score_took(self, seconds: float) -> None:
        """One router score took ``seconds``."""
        self.score_duration.observe(seconds)

    def routed(
        self, scores: Mapping[str, NodeScore], choice: str | None, hashes: Sequence[int]
    ) -> None:
        """One routing decision: ``choice`` among ``scores`` (``NodeScore`` by namespace;
        None: no live node) for a prompt of ``hashes``."""
        if choice is None:
            self._decided["none"].inc()
            return
        usable = scores[choice].usable
        self._decided["hit" if usable > 0 else "fallback"].inc()
        self.predicted.observe(usable)
        blocks = len(prefix_hashes(hashes))
        if blocks:
            self.ratio.observe(usable / blocks)


def enable_metrics(registry: Any = None, *, namespace_labels: bool = False) -> Metrics:
    """Switch the metrics on for this process, registered on ``registry`` (a
    ``prometheus_client.CollectorRegistry``; default: the library's global one).

    ``namespace_labels`` adds a ``namespace`` label to the lease, listener, slot pool and
    bridge metrics (one series per namespace: use it when namespaces are few and
    long-lived). Raises ``RuntimeError`` when already enabled (``disable_metrics`` first)
    and ``ImportError`` without prometheus-client."""
    global active
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(
            "metrics need prometheus-client: pip install 'prefix-cache-registry[metrics]'"
        ) from None
    with _lock:
        if active is not None:
            raise RuntimeError("metrics are already enabled; call disable_metrics() first")
        target = prometheus_client.REGISTRY if registry is None else registry
        enabled = Metrics(target, bool(namespace_labels))
        active = enabled
        observe.subscribe(enabled)
    return enabled


def disable_metrics() -> None:
    """Switch the metrics off and unregister them (no error when already off)."""
    global active
    with _lock:
        enabled, active = active, None
        if enabled is not None:
            observe.unsubscribe(enabled)
    if enabled is None:
        return
    for collector in (
        enabled.operations,
        enabled.duration,
        enabled.queries,
        enabled.hits,
        enabled.score_duration,
        enabled.decisions,
        enabled.predicted,
        enabled.ratio,
        enabled.listener_lag_seconds,
        enabled.objects,
    ):
        enabled.registry.unregister(collector)


# -- objects read at scrape time ------------------------------------------------------


def register_listener(listener: Any) -> bool:
    """Report ``listener.counts()`` (a ``gpu.EvictionListener``) at every scrape until
    ``unregister``; False (and nothing kept) when the metrics are off."""
    return _register("listener", listener)


def register_pool(pool: Any) -> bool:
    """Report ``pool.counts()`` (a ``gpu.MambaSlotPool``) at every scrape."""
    return _register("pool", pool)


def register_bridge(bridge: Any) -> bool:
    """Report ``bridge.counts()`` (a ``registry.bridge.bridge.Bridge``: per namespace) and the
    leases of its followers' namespaces."""
    return _register("bridge", bridge)


def register_mirror(mirror: Any) -> bool:
    """Report ``mirror.counts()`` (a ``registry.MirroredRegistry``: writes flushed,
    batches, retries, dropped, resyncs, errors, the queue and its lag) at every scrape;
    its lease is reported too (as ``register_owner`` would)."""
    return _register("mirror", mirror)


def register_view(view: Any) -> bool:
    """Report ``view`` (a ``registry.fleet.view.FleetView``: a router's copy of the
    fleet) at every scrape: what it did (``counts``: records applied, loads, gaps,
    reconnects, resyncs, errors), the distinct KV hashes it holds and its age (seconds
    since it last knew it followed Redis: past ``STALE_S`` its router scores from Redis).
    Whole views, never per namespace."""
    return _register("view", view)


def register_owner(registry: Any) -> bool:
    """Report the lease left of ``registry`` (a ``PrefixCacheRegistry``), read from
    Redis at every scrape while it holds an epoch (it claimed)."""
    return _register("owner", registry)


def unregister(obj: Any) -> None:
    """Stop reporting ``obj`` (no error if it was not registered)."""
    if active is not None:
        active.objects.remove(obj)


def _register(kind: str, obj: Any) -> bool:
    enabled = active
    if enabled is None:
        return False
    enabled.objects.add(kind, obj)
    return True


def _namespace_of(obj: Any) -> str:
    for path in (("namespace",), ("registry", "namespace")):
        value: Any = obj
        for name in path:
            value = getattr(value, name, None)
        if isinstance(value, str):
            return value
    return ""


class ObjectCollector:
    """A ``prometheus_client`` custom collector: reads the registered objects'
    ``counts()`` (and owners' leases) when scraped."""

    def __init__(self, namespace_labels: bool) -> None:
        self.namespace_labels = namespace_labels
        self._lock = threading.Lock()
        self._objects: dict[str, list[Any]] = {
            "listener": [],
            "pool": [],
            "bridge": [],
            "owner": [],
            "mirror": [],
            "view": [],
        }

    def add(self, kind: str, obj: Any) -> None:
        with self._lock:
            if not any(o is obj for o in self._objects[kind]):
                self._objects[kind].append(obj)

    def remove(self, obj: Any) -> None:
        with self._lock:
            for kind, objects in self._objects.items():
                self._objects[kind] = [o for o in objects if o is not obj]

    def describe(self) -> list[Any]:
        return []  # the names depend on what is registered: read at collect time

    def collect(self) -> Iterator[Any]:
        with self._lock:
            objects = {kind: list(found) for kind, found in self._objects.items()}
        yield from self._listeners(objects["listener"])
        yield from self._pools(objects["pool"])
        yield from self._bridges(objects["bridge"])
        yield from self._mirrors(objects["mirror"])
        yield from self._views(objects["view"])
        # A bridge's followers own their namespaces: their leases count too.
        followers = [f for b in objects["bridge"] for f in getattr(b, "followers", ())]
        owners = [*objects["owner"], *objects["mirror"], *(f.registry for f in followers)]
        yield from self._leases(owners)

    def _per_namespace(
        self, rows: list[tuple[str, dict[str, int]]], skip: tuple[str, ...] = ()
    ) -> dict[str, dict[str, float]]:
        """field -> label value ("" without namespace labels) -> value, summed."""
        table: dict[str, dict[str, float]] = {}
        for namespace, counts in rows:
            label = namespace if self.namespace_labels else ""
            for key, value in counts.items():
                if key in skip or not isinstance(value, int) or isinstance(value, bool):
                    continue
                column = table.setdefault(key, {})
                column[label] = column.get(label, 0) + value
        return table

    def _families(
        self, prefix: str, what: str, table: dict[str, dict[str, float]], gauges: tuple[str, ...]
    ) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["namespace"] if self.namespace_labels else []
        for key, column in table.items():
            family: Any
            if key in gauges:
                family = GaugeMetricFamily(f"{prefix}_{key}", f"{what}: {key}", labels=labels)
            else:
                family = CounterMetricFamily(
                    f"{prefix}_{key}", f"{what}: {key} (total)", labels=labels
                )
            for label, value in sorted(column.items()):
                family.add_metric([label] if self.namespace_labels else [], value)
            yield family

    def _listeners(self, listeners: list[Any]) -> Iterator[Any]:
        rows = [(_namespace_of(x), _as_dict(x.counts())) for x in listeners]
        if not rows:
            return
        # last_seq is a position, meaningful per namespace only.
        skip = () if self.namespace_labels else ("last_seq",)
        table = self._per_namespace(rows, skip)
        yield from self._families("pcr_listener", "Eviction listeners", table, ("last_seq",))

    def _pools(self, pools: list[Any]) -> Iterator[Any]:
        rows = [(_namespace_of(x), _as_dict(x.counts())) for x in pools]
        if rows:
            table = self._per_namespace(rows)
            renamed = {("slots" if k == "slots" else f"slots_{k}"): v for k, v in table.items()}
            gauges = ("slots", *(f"slots_{k}" for k in POOL_GAUGES if k != "slots"))
            yield from self._families("pcr_mamba", "Mamba slot pools", renamed, gauges)

    def _bridges(self, bridges: list[Any]) -> Iterator[Any]:
        rows: list[tuple[str, dict[str, int]]] = []
        for bridge in bridges:
            rows += [(ns, dict(c)) for ns, c in bridge.counts().items()]
        if rows:
            skip = ("applied_seq",)  # a position, not a count
            table = self._per_namespace(
                [(ns, {k: v for k, v in c.items() if ":" not in k}) for ns, c in rows], skip
            )
            yield from self._families("pcr_bridge", "pcr bridge followers", table, ())

    def _mirrors(self, mirrors: list[Any]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        rows = [(_namespace_of(x), x.counts()) for x in mirrors]
        if not rows:
            return
        table = self._per_namespace([(ns, _as_dict(c)) for ns, c in rows])
        yield from self._families("pcr_mirror", "Mirrored owners' write-behind", table, ("queued",))
        labels = ["namespace"] if self.namespace_labels else []
        lag = GaugeMetricFamily(
            "pcr_mirror_lag_seconds",
            "Age of the oldest unflushed write (the largest)",
            labels=labels,
        )
        worst: dict[str, float] = {}
        for namespace, counts in rows:
            label = namespace if self.namespace_labels else ""
            worst[label] = max(worst.get(label, 0.0), counts.lag_s)
        for label, value in sorted(worst.items()):
            lag.add_metric([label] if self.namespace_labels else [], value)
        yield lag

    def _views(self, views: list[Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not views:
            return
        counts = [_as_dict(v.counts) for v in views]
        for key in counts[0]:
            total = CounterMetricFamily(f"pcr_view_{key}", f"Fleet views: {key} (total)", labels=[])
            total.add_metric([], sum(c.get(key, 0) for c in counts))
            yield total
        hashes = GaugeMetricFamily("pcr_view_hashes", "Distinct KV block hashes the views hold")
        hashes.add_metric([], sum(len(v.blocks) for v in views))
        yield hashes
        age = GaugeMetricFamily(
            "pcr_view_age_seconds",
            "Seconds since a fleet view last knew it followed Redis (the oldest; +Inf "
            "before its first load)",
        )
        age.add_metric([], max(v.age() for v in views))
        yield age

    def _leases(self, owners: list[Any]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        left: dict[str, float] = {}
        groups: dict[tuple[int, str], tuple[Any, list[str]]] = {}
        for owner in owners:
            if getattr(owner, "epoch", None) is None:
                continue  # never claimed: no lease of its own
            key = (id(owner.client), owner.keys.key_prefix)
            groups.setdefault(key, (owner.client, []))[1].append(owner.namespace)
        for (_client_id, key_prefix), (client, namespaces) in groups.items():
            try:
                infos = namespace_infos(client, namespaces, key_prefix=key_prefix, memory=False)
            except RegistryError:
                continue  # Redis away: no figure rather than a failed scrape
            for info, _memory in infos:
                if info.lease_left_s is not None:
                    left[info.namespace] = info.lease_left_s
        owned = GaugeMetricFamily(
            "pcr_owned_namespaces", "Registered owners whose namespace has a lease"
        )
        owned.add_metric([], len(left))
        yield owned
        if not left:
            return
        minimum = GaugeMetricFamily(
            "pcr_lease_min_remaining_seconds",
            "The shortest lease left among the registered owners (negative: ran out)",
        )
        minimum.add_metric([], min(left.values()))
        yield minimum
        if self.namespace_labels:
            each = GaugeMetricFamily(
                "pcr_lease_remaining_seconds",
                "Lease left of each registered owner's namespace (negative: ran out)",
                labels=["namespace"],
            )
            for namespace, seconds in sorted(left.items()):
                each.add_metric([namespace], seconds)
            yield each


def _as_dict(counts: Any) -> dict[str, int]:
    if is_dataclass(counts) and not isinstance(counts, type):
        return asdict(counts)
    return dict(counts)
