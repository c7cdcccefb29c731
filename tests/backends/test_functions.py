"""The scripts as a Redis Functions library (``pcr setup``), on a real server and a real
3-master cluster: with the library loaded every script runs by FCALL (FCALL_RO for the
read-only ones) in the same round trips and with the same results, none by EVALSHA; on a
cluster each goes to its slot's primary without a ``COMMAND GETKEYS`` round trip; a
library that goes missing between calls changes no reply; and a replica receives the
library from its primary."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster

from registry import MirroredRegistry, NodeIndex, PrefixCacheRegistry, PrefixRouter
from registry.fleet.view import FleetView
from registry.routing.aio_routing import AsyncPrefixRouter
from registry.transport.functions import Route, load_library
from registry.transport.lua import library_name
from tests.support.backends import new_namespace
from tests.support.counting import counted_sends
from tests.support.servers import (
    RedisClusterServers,
    RedisServer,
    replicas_streamed,
    require_redis_server,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.redis_server

H = [4401, 4402, 4403, 4404]
SCRIPT_COMMANDS = ("evalsha", "eval", "script|load", "script|exists")


class Deployment:
    """A server or a cluster with the library loaded; its nodes' command counts."""

    def __init__(self, nodes: list[RedisServer], client: Any, cluster: bool) -> None:
        self.nodes = nodes
        self.client = client
        self.cluster = cluster

    def async_client(self) -> Any:
        """A new ``redis.asyncio`` client (the caller closes it, in its event loop)."""
        first = self.nodes[0]
        if self.cluster:
            return redis.asyncio.cluster.RedisCluster(host=first.host, port=first.port)
        return redis.asyncio.Redis(host=first.host, port=first.port)

    def reset_stats(self) -> None:
        for node in self.nodes:
            admin = node.client()
            admin.config_resetstat()
            admin.close()

    def calls(self) -> dict[str, int]:
        """Calls of each command on every node since ``reset_stats``."""
        total: dict[str, int] = {}
        for node in self.nodes:
            admin = node.client()
            for name, stats in admin.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                total[command] = total.get(command, 0) + int(stats["calls"])
            admin.close()
        return total


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.cluster)])
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A standalone server of the test's own, or the session's cluster (its library
    deleted afterwards, so other tests meet a cluster without one)."""
    require_redis_server()
    if request.param == "redis":
        with RedisServer() as server:
            client = server.client()
            load_library(client)
            try:
                yield Deployment([server], client, cluster=False)
            finally:
                client.close()
        return
    cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
    client = cluster.client()
    load_library(client)
    try:
        yield Deployment(cluster.nodes, client, cluster=True)
    finally:
        for node in client.get_primaries():
            client.get_redis_connection(node).execute_command("FUNCTION", "DELETE", library_name())
        client.close()


def test_every_script_goes_by_fcall(deployment: Deployment) -> None:
    """Writes, ownership, the node index, gc, the mirror, both routers, a fleet view and
    the gateways' load exchange: every script by FCALL or FCALL_RO, nothing by EVALSHA,
    no SCRIPT LOAD, and on a cluster no ``COMMAND GETKEYS`` (each call goes to its
    slot's primary by the client's slot map)."""
    client = deployment.client
    names = [new_namespace() for _ in range(4)]
    deployment.reset_stats()

    owner = PrefixCacheRegistry(client, names[0])
    owner.claim(lease_ttl=60.0)
    owner.renew()
    fired: list[list[int]] = []
    owner.set_mamba_evict_callback(fired.append)
    owner.register_kv([1, 2, 3, 4], H)
    owner.register_mamba([2, 3], H[1:3])
    assert owner.match_kv_prefix(H) == ([1, 2, 3, 4], H[3])
    assert owner.evict_kv(H[2:]) == set(H[2:])
    assert fired == [[3]]
    assert owner.evict_mamba(H) == {H[1]}
    owner.register_mamba([1], H[:1])
    owner.clear_mamba()
    owner.register_mamba([2], H[1:2])
    assert owner.match_mamba_farthest(H) == 2
    for name in names[1:3]:
        other = PrefixCacheRegistry(client, name)
        other.claim(lease_ttl=60.0)
        other.register_kv([7], H[:1])
    with MirroredRegistry(client, names[3]) as mirrored:
        mirrored.claim(lease_ttl=60.0)
        mirrored.register_kv([5, 6], H[:2])
        mirrored.evict_kv(H[1:2])
        mirrored.flush()
    assert PrefixCacheRegistry(client, names[3]).match_kv_prefix(H) == ([5], H[0])

    index = NodeIndex(client)
    assert set(names) <= set(index.live())
    scores = PrefixRouter(client, live_cache_ttl=0.0, exact=True).score(H, names)
    assert [scores[name].kv_prefix for name in names] == [2, 1, 1, 1]
    assert scores[names[0]].mamba_prefix == 2
    asyncio.run(async_router(deployment, names))
    view = FleetView(client).start()
    try:
        view.sync(names)
        assert view.score(H, names)[names[0]].kv_prefix == 2
    finally:
        view.close()
    client.hset(PrefixCacheRegistry(client, names[2]).keys.meta, "lease_until", 1)
    client.zadd(index.key, {names[2]: 1})
    collected = NodeIndex(client).collect_dead()  # other tests' run-out namespaces too
    assert names[2] in collected
    assert not {names[0], names[1], names[3]} & set(collected)
    owner.reset()
    assert owner.match_kv_prefix(H) == ([], 0)

    calls = deployment.calls()
    assert {command: calls.get(command, 0) for command in SCRIPT_COMMANDS} == dict.fromkeys(
        SCRIPT_COMMANDS, 0
    )
    assert calls.get("command|getkeys", 0) == 0
    assert calls["fcall"] >= 20
    assert calls["fcall_ro"] >= 2 * len(names)  # score (twice) and fleet_snapshot


async def async_router(deployment: Deployment, names: list[str]) -> None:
    """The asyncio router's scores (a batch) and one replica's load (one call)."""
    client = deployment.async_client()
    try:
        router = AsyncPrefixRouter(client, live_cache_ttl=0.0)
        assert await router.scripts_loaded()
        scores = await router.score(H, names)
        assert [scores[name].kv_prefix for name in names] == [2, 1, 1, 1]
        assert await router.exchange_load("gw-functions", 1000, '{"seq": 1}') == {}
    finally:
        await client.aclose()


def test_each_call_is_one_round_trip(deployment: Deployment) -> None:
    """FCALL costs what EVALSHA cost: one socket write per write, none for the route
    (the first call's FCALL is the call)."""
    registry = PrefixCacheRegistry(deployment.client, new_namespace())
    registry.load_scripts()  # the probe: the library is there, nothing to load
    assert registry._runner.route is Route.FUNCTIONS
    for method, args in [
        ("register_kv", ([1, 2, 3], H[:3])),
        ("register_mamba", ([2], H[1:2])),
        ("evict_kv", (H[2:3],)),
        ("evict_mamba", (H,)),
        ("clear_kv", ()),
    ]:
        with counted_sends() as sends:
            getattr(registry, method)(*args)
        assert len(sends) == 1, method


def test_a_library_lost_between_calls_changes_no_reply(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """``FUNCTION FLUSH`` (or a restart without persistence) before each call: the call
    that meets it goes again by EVALSHA, with one warning, and every reply is right."""
    registry = PrefixCacheRegistry(deployment.client, new_namespace())
    registry.register_kv([1, 2, 3], H[:3])
    assert registry._runner.route is Route.FUNCTIONS
    flush = [("FUNCTION", "FLUSH")]
    with caplog.at_level(logging.WARNING, logger="registry.transport.functions"):
        for method, args, expected in [
            ("register_mamba", ([2], H[1:2]), None),
            ("match_mamba_farthest", (H,), 2),
            ("evict_kv", (H[1:2],), {H[1]}),
            ("match_kv_prefix", (H,), ([1], H[0])),
        ]:
            for node in deployment.nodes:
                admin = node.client()
                for command in flush:
                    admin.execute_command(*command)
                admin.close()
            assert getattr(registry, method)(*args) == expected, method
    assert registry._runner.route is Route.SCRIPTS
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert library_name() in warnings[0]
    load_library(deployment.client)  # for the fixture's clean-up


def test_a_replica_receives_the_library_from_its_primary() -> None:
    """``pcr setup`` loads the primary; the replica holds the library too (replication),
    so a failover keeps it; a confirmed write (``wait_replicas``) goes by FCALL."""
    require_redis_server()
    with (
        RedisServer() as primary,
        RedisServer(["--replicaof", "127.0.0.1", str(primary.port)]) as replica,
    ):
        wait_until(lambda: replicas_streamed(primary) >= 1, what="replica streamed to")
        admin = primary.client()
        follower = replica.client()
        try:
            assert load_library(admin).loaded == ("the server",)
            wait_until(lambda: libraries(follower) == [library_name()], what="library replicated")
            registry = PrefixCacheRegistry(primary.client(), "durable", wait_replicas=1)
            registry.claim(lease_ttl=30.0)
            registry.register_kv([1, 2], H[:2])
            assert registry._runner.route is Route.FUNCTIONS
            assert follower.hlen(registry.keys.kv) == 2  # WAIT answered: the replica has it
        finally:
            admin.close()
            follower.close()


def libraries(client: redis.Redis) -> list[str]:
    listed = client.execute_command("FUNCTION", "LIST")
    return [
        (entry[b"library_name"] if isinstance(entry, dict) else entry[1]).decode()
        for entry in listed
    ]
