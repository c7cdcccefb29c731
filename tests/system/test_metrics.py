"""Prometheus metrics (``registry.metrics``): exact values after known operations on
fakeredis and a real redis-server, the scrape-time collectors, the lease, ``pcr simulate
--metrics-port``, the Grafana dashboard's queries, and no cost when off."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fakeredis
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from registry import (
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryUnavailable,
    RegistryWrongType,
    StaleEpochError,
    metrics,
)
from registry.bridge.bridge import FollowerCounts
from tests.support import REPO_ROOT as ROOT
from tests.support.servers import RedisServer, free_port, refused_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

H = [101, 102, 103, 104]


@pytest.fixture
def collectors() -> Iterator[CollectorRegistry]:
    """Metrics switched on for the test, on a registry of their own."""
    target = CollectorRegistry()
    metrics.enable_metrics(target)
    try:
        yield target
    finally:
        metrics.disable_metrics()


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "fakeredis":
        yield fakeredis.FakeRedis()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    real = server.client()
    real.flushall()
    yield real
    real.close()


def scraped(target: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The exposition text of ``target``, parsed back: (sample name, labels) -> value."""
    text = generate_latest(target).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(target: CollectorRegistry, name: str, **labels: str) -> float:
    return scraped(target).get((name, tuple(sorted(labels.items()))), 0.0)


def ops(target: CollectorRegistry, operation: str, outcome: str = "ok") -> float:
    return value(target, "pcr_operations_total", operation=operation, outcome=outcome)


def timed(target: CollectorRegistry, operation: str, outcome: str = "ok") -> float:
    return value(
        target, "pcr_operation_duration_seconds_count", operation=operation, outcome=outcome
    )


def test_operations_by_outcome(collectors: CollectorRegistry, client: Any) -> None:
    """Each script run and read is counted and timed once, by outcome."""
    owner = PrefixCacheRegistry(client, "node-a")
    owner.claim(lease_ttl=30)
    owner.register_kv([1, 2, 3], H[:3])
    assert owner.match_kv_prefix([H[0], H[1], H[3], H[2]]) == ([1, 2], H[1])
    assert owner.match_kv_prefix(H[:3]) == ([1, 2, 3], H[2])
    with pytest.raises(TypeError):
        owner.register_kv([True], [H[0]])  # bad input: never sent
    with pytest.raises(ValueError, match="hash"):
        owner.match_kv_prefix([-5])
    PrefixCacheRegistry(client, "node-a").claim()  # another owner: node-a's epoch is stale
    with pytest.raises(StaleEpochError):
        owner.register_kv([4], [H[3]])
    client.set(owner.keys.mamba, "not a hash")
    with pytest.raises(RegistryWrongType):
        owner.match_mamba_farthest(H)

    assert ops(collectors, "claim") == 2
    assert ops(collectors, "announce") == 2  # each claim announces its lease
    assert ops(collectors, "register_kv") == 1
    assert ops(collectors, "register_kv", "bad_input") == 1
    assert ops(collectors, "register_kv", "stale_epoch") == 1
    assert ops(collectors, "match_kv_prefix") == 2
    assert ops(collectors, "match_kv_prefix", "bad_input") == 1
    assert ops(collectors, "match_mamba_farthest", "fault") == 1
    # Bad input never reaches Redis: counted, not timed.
    assert timed(collectors, "register_kv") == 1
    assert timed(collectors, "register_kv", "stale_epoch") == 1
    assert timed(collectors, "register_kv", "bad_input") == 0
    assert timed(collectors, "match_mamba_farthest", "fault") == 1
    # Queries: 4 + 3 blocks looked up, 2 + 3 found.
    assert value(collectors, "pcr_prefix_cache_queries_total") == 7
    assert value(collectors, "pcr_prefix_cache_hits_total") == 5


def test_unavailable_outcome(collectors: CollectorRegistry) -> None:
    with refused_port() as port:
        away = PrefixCacheRegistry.from_url(f"redis://127.0.0.1:{port}/0", "node-a")
        with pytest.raises(RegistryUnavailable):
            away.match_kv_prefix(H)
        with pytest.raises(RegistryUnavailable):
            away.register_kv([1], [H[0]])
    assert ops(collectors, "match_kv_prefix", "unavailable") == 1
    assert ops(collectors, "register_kv", "unavailable") == 1
    assert timed(collectors, "register_kv", "unavailable") == 1
    assert value(collectors, "pcr_prefix_cache_queries_total") == 0


def test_router_decisions(collectors: CollectorRegistry, client: Any) -> None:
    a, b = PrefixCacheRegistry(client, "node-a"), PrefixCacheRegistry(client, "node-b")
    a.claim(lease_ttl=30)
    b.claim(lease_ttl=30)
    a.register_kv([1, 2, 3], H[:3])
    router = PrefixRouter(client, hybrid=False, live_cache_ttl=3600)
    assert router.best(H) == "node-a"  # 3 of 4 blocks
    assert router.best([7, 8]) == "node-a"  # nobody has it: a fallback, by name
    assert router.best(H, namespaces=[]) is None  # no node to choose from
    assert router.score(H[:1]) == router.score(H[:1], namespaces=["node-a", "node-b"])

    assert value(collectors, "pcr_router_decisions_total", outcome="hit") == 1
    assert value(collectors, "pcr_router_decisions_total", outcome="fallback") == 1
    assert value(collectors, "pcr_router_decisions_total", outcome="none") == 1
    assert value(collectors, "pcr_router_score_duration_seconds_count") == 5
    assert value(collectors, "pcr_router_predicted_blocks_count") == 2
    assert value(collectors, "pcr_router_predicted_blocks_sum") == 3
    assert value(collectors, "pcr_router_predicted_blocks_bucket", le="2.0") == 1  # the 0
    assert value(collectors, "pcr_router_predicted_blocks_bucket", le="4.0") == 2
    assert value(collectors, "pcr_router_hit_ratio_sum") == 0.75
    assert value(collectors, "pcr_router_hit_ratio_bucket", le="0.0") == 1
    assert value(collectors, "pcr_router_hit_ratio_bucket", le="0.7") == 1
    assert value(collectors, "pcr_router_hit_ratio_bucket", le="0.8") == 2
    assert ops(collectors, "score") == 4  # one pipeline per score with namespaces
    assert ops(collectors, "live_nodes") == 1  # listed once, kept for live_cache_ttl


@dataclass
class FakeListener:
    namespace: str
    applied: int
    last_seq: int

    def counts(self) -> dict[str, int]:
        return {"applied": self.applied, "gaps": 1, "last_seq": self.last_seq}


@dataclass
class FakePool:
    namespace: str

    def counts(self) -> dict[str, int]:
        return {"slots": 8, "in_use": 3, "free": 5, "stored": 10, "evicted": 2}


class FakeBridge:
    def counts(self) -> dict[str, dict[str, int]]:
        one = FollowerCounts(batches=4, blocks_stored=9, applied_seq=12)
        one.bad_kinds["weird"] = 2
        return {"engine-a": one.as_dict(), "engine-b": FollowerCounts(batches=1).as_dict()}


def register_fakes() -> None:
    assert metrics.register_listener(FakeListener("node-a", 5, 40))
    assert metrics.register_listener(FakeListener("node-b", 7, 41))
    assert metrics.register_pool(FakePool("node-a"))
    assert metrics.register_pool(FakePool("node-b"))
    assert metrics.register_bridge(FakeBridge())


def test_collectors_sum_without_namespace_labels(collectors: CollectorRegistry) -> None:
    register_fakes()
    assert value(collectors, "pcr_listener_applied_total") == 12
    assert value(collectors, "pcr_listener_gaps_total") == 2
    assert not any(name.startswith("pcr_listener_last_seq") for name, _ in scraped(collectors))
    assert value(collectors, "pcr_mamba_slots") == 16
    assert value(collectors, "pcr_mamba_slots_in_use") == 6
    assert value(collectors, "pcr_mamba_slots_free") == 10
    assert value(collectors, "pcr_mamba_slots_stored_total") == 20
    assert value(collectors, "pcr_mamba_slots_evicted_total") == 4
    assert value(collectors, "pcr_bridge_batches_total") == 5
    assert value(collectors, "pcr_bridge_blocks_stored_total") == 9
    names = {name for name, _ in scraped(collectors)}
    assert not any("applied_seq" in n or "weird" in n for n in names)
    assert value(collectors, "pcr_owned_namespaces") == 0


def test_collectors_per_namespace_and_leases(client: Any) -> None:
    target = CollectorRegistry()
    metrics.enable_metrics(target, namespace_labels=True)
    try:
        register_fakes()
        owner = PrefixCacheRegistry(client, "node-a")
        owner.claim(lease_ttl=30)
        reader = PrefixCacheRegistry(client, "node-b")  # never claims: no lease reported
        assert metrics.register_owner(owner)
        assert metrics.register_owner(reader)
        assert value(target, "pcr_listener_applied_total", namespace="node-b") == 7
        assert value(target, "pcr_listener_last_seq", namespace="node-a") == 40
        assert value(target, "pcr_mamba_slots_in_use", namespace="node-a") == 3
        assert value(target, "pcr_bridge_batches_total", namespace="engine-a") == 4
        assert value(target, "pcr_owned_namespaces") == 1
        left = value(target, "pcr_lease_remaining_seconds", namespace="node-a")
        assert 25 < left <= 30
        assert 25 < value(target, "pcr_lease_min_remaining_seconds") <= 30
        metrics.unregister(owner)
        assert value(target, "pcr_owned_namespaces") == 0
    finally:
        metrics.disable_metrics()
    assert list(target.collect()) == []  # everything unregistered


def test_a_fleet_view_is_reported_whole(
    collectors: CollectorRegistry, redis_server: RedisServer
) -> None:
    """A registered ``FleetView`` (a router's) reports the records it applied, the
    namespaces it loaded, the KV hashes it holds and its age, read at each scrape, with
    no namespace label; unregistered, nothing."""
    from registry.fleet.view import STALE_S, FleetView

    client = redis_server.client()
    client.flushall()
    owner = PrefixCacheRegistry(client, "viewed-a")
    owner.claim(lease_ttl=30)
    view = FleetView(client).start()
    try:
        assert metrics.register_view(view)
        records = value(collectors, "pcr_view_records_total")
        owner.register_kv([1, 2, 3, 4], H)
        owner.evict_kv(H[3:])
        applied = lambda: value(collectors, "pcr_view_records_total") >= records + 2  # noqa: E731
        wait_until(applied, 30, "the records counted")
        assert value(collectors, "pcr_view_hashes") == 3 == len(view.blocks)
        assert value(collectors, "pcr_view_loads_total") >= 1
        assert 0 <= value(collectors, "pcr_view_age_seconds") < STALE_S
        assert not any(labels for (name, labels) in scraped(collectors) if "pcr_view" in name)
        metrics.unregister(view)
        assert not any("pcr_view" in name for (name, _labels) in scraped(collectors))
    finally:
        view.close()
        client.close()


def test_disabled_registers_nothing() -> None:
    """With the metrics off, the library's operations put nothing on the process'
    default registry (which may hold other collectors: ``pcr gateway``'s own, made by
    an earlier test in this process, are not the library's)."""
    import prometheus_client

    def names() -> set[str]:
        return {m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("pcr_")}

    assert metrics.active is None
    before = names()
    assert all(name.startswith("pcr_gateway_") for name in before), before
    server = fakeredis.FakeRedis()
    reg = PrefixCacheRegistry(server, "node-a")
    reg.claim()
    reg.register_kv([1], [H[0]])
    assert reg.match_kv_prefix(H) == ([1], H[0])
    assert not metrics.register_pool(FakePool("node-a"))
    assert not metrics.register_owner(reg)
    assert names() == before
    target = CollectorRegistry()
    metrics.enable_metrics(target)
    try:
        with pytest.raises(RuntimeError, match="already enabled"):
            metrics.enable_metrics(CollectorRegistry())
        assert value(target, "pcr_operations_total", operation="claim", outcome="ok") == 0
    finally:
        metrics.disable_metrics()
    metrics.disable_metrics()  # twice: no error


BLOCKER = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, Blocker())
import fakeredis
import registry
from registry import LocalPrefixCacheRegistry, PrefixCacheRegistry, PrefixRouter, metrics
reg = PrefixCacheRegistry(fakeredis.FakeRedis(), "node-a")
reg.claim()
reg.register_kv([1, 2], [11, 12])
assert reg.match_kv_prefix([11, 12, 13]) == ([1, 2], 12)
assert PrefixRouter(reg.client).best([11]) == "node-a"
local = LocalPrefixCacheRegistry()
local.register_kv([1], [11])
assert local.match_kv_prefix([11]) == ([1], 11)
assert metrics.register_pool(object()) is False
assert "prometheus_client" not in sys.modules
try:
    metrics.enable_metrics()
except ImportError as exc:
    assert "pip install 'prefix-cache-registry[metrics]'" in str(exc), exc
else:
    raise AssertionError("enable_metrics without prometheus-client")
print("ok")
"""


def test_registry_runs_without_prometheus_client() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def fetch(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text: str = reply.read().decode()
            return text
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


WANTED = {
    "direct": (
        'pcr_operations_total{operation="register_kv",outcome="ok"}',
        'pcr_router_decisions_total{outcome="hit"}',
        "pcr_listener_applied_total",
        "pcr_mamba_slots_in_use",
        "pcr_lease_min_remaining_seconds",
        "pcr_prefix_cache_hits_total",
    ),
    "bridge": (
        'pcr_operations_total{operation="bridge_apply",outcome="ok"}',
        'pcr_router_decisions_total{outcome="hit"}',
        "pcr_bridge_blocks_stored_total",
        "pcr_lease_min_remaining_seconds",
    ),
}


@pytest.mark.parametrize("mode", ["direct", "bridge"])
def test_simulate_serves_metrics(mode: str) -> None:
    """``pcr simulate --metrics-port`` serves every kind of metric while it runs."""
    port = free_port()
    command = [
        sys.executable, "-m", "pcr", "simulate", "--router", "prefix", "--nodes", "2",
        "--requests", "1500", "--no-progress", "--metrics-port", str(port),
    ]  # fmt: skip
    if mode == "bridge":
        pytest.importorskip("zmq")
        command.append("--bridge")
    wanted = WANTED[mode]
    seen = ""
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            while process.poll() is None:
                text = fetch(port)
                # Every wanted metric, once both nodes own their namespace (the bridge's
                # followers claim one after the other: an early scrape may see one).
                if (
                    text is not None
                    and all(w in text for w in wanted)
                    and "\npcr_owned_namespaces 2.0" in text
                ):
                    seen = text
                    break
                time.sleep(0.05)
            out, err = process.communicate(timeout=100)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, err
    assert "consistency" in out
    assert seen, "no scrape during the run showed every metric"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(seen)
        for s in family.samples
    }
    if mode == "direct":
        assert samples[("pcr_mamba_slots", ())] == 2 * 32  # two nodes, default slots
    assert samples[("pcr_owned_namespaces", ())] == 2
    assert 0 < samples[("pcr_lease_min_remaining_seconds", ())] <= 60  # the nodes' leases
    assert fetch(port) is None  # the server stops with the command


class FakeView:
    """What ``register_view`` reads of a ``FleetView``: its counts, hashes and age."""

    def __init__(self) -> None:
        from registry.fleet.holders import ViewCounts

        self.counts = ViewCounts(records=5, loads=2, gaps=1)
        self.blocks = {1: 1, 2: 1}

    def age(self) -> float:
        return 0.4


def test_dashboard_queries_exist(collectors: CollectorRegistry, client: Any) -> None:
    """Every metric the Grafana dashboard queries is in a scrape after known operations
    (with the real count shapes of the listener, pool and bridge)."""
    from gpu.listener import ListenerCounts
    from gpu.slot_pool import PoolCounts

    owner = PrefixCacheRegistry(client, "node-a")
    owner.claim(lease_ttl=30)
    owner.register_kv([1], H[:1])
    owner.match_kv_prefix(H)
    with pytest.raises(TypeError):
        owner.register_kv([True], [H[0]])
    PrefixRouter(client).best(H)
    listener_counts = ListenerCounts(*range(11))
    pool_counts = PoolCounts(*range(8))

    class Listener:
        def counts(self) -> ListenerCounts:
            return listener_counts

    class Pool:
        def counts(self) -> PoolCounts:
            return pool_counts

    metrics.register_listener(Listener())
    metrics.register_pool(Pool())
    metrics.register_bridge(FakeBridge())
    metrics.register_owner(owner)
    metrics.register_view(FakeView())
    names = {name for name, _ in scraped(collectors)}

    dashboard = json.loads((ROOT / "grafana" / "dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {m for expr in exprs for m in re.findall(r"\bpcr_[a-z0-9_]+", expr)}
    queried -= {m for m in queried if m.startswith("pcr_gateway_")}  # test_dashboard_gateway.py
    assert len(queried) >= 20
    assert sorted(queried - names) == []
    assert all(p.get("datasource", {}).get("uid", "prometheus") == "prometheus" for p in
               dashboard["panels"])  # fmt: skip


def test_compose_observability_profile() -> None:
    """Prometheus scrapes the simulation's port; Grafana is provisioned with both."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["prometheus"]["profiles"] == ["observability"]
    assert services["grafana"]["profiles"] == ["observability"]
    command = services["simulate"]["command"]
    port = command[command.index("--metrics-port") + 1]
    config = yaml.safe_load((ROOT / "grafana" / "prometheus.yml").read_text())
    jobs = {
        job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]
    }
    assert jobs["pcr-simulate"] == [f"simulate:{port}"]
    serve = services["serve"]["command"]
    assert jobs["pcr-serve"] == [f"serve:{serve[serve.index('--port') + 1]}"]
    for volume in services["grafana"]["volumes"] + services["prometheus"]["volumes"]:
        assert (ROOT / volume.split(":")[0]).exists(), volume
    source = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"


def test_metrics_extra_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'metrics = ["prometheus-client>=0.20"]' in text
    assert "prometheus-client==" in (ROOT / "constraints.txt").read_text()
