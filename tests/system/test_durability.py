"""``wait_replicas``: each write waits on its own connection for replicas to acknowledge
it (``WAIT``), on a standalone primary with a replica and on a Redis Cluster with
replicas; a write no replica acknowledged raises ``RegistryUnavailable`` with
``outcome_unknown`` (it ran, but a failover may lose it)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from registry import PrefixCacheRegistry, RegistryUnavailable
from tests.support.servers import (
    RedisClusterServers,
    RedisServer,
    replicas_streamed,
    require_redis_server,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.redis_server

H = [7001, 7002, 7003]


@pytest.fixture
def primary_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    require_redis_server()
    with (
        RedisServer() as primary,
        RedisServer(["--replicaof", "127.0.0.1", str(primary.port)]) as replica,
    ):
        client = replica.client()
        try:
            wait_until(
                lambda: client.info("replication")["master_link_status"] == "up",
                what="replica linked",
            )
        finally:
            client.close()
        wait_until(lambda: replicas_streamed(primary) >= 1, what="replica streamed to")
        yield primary, replica


def test_a_write_counts_once_a_replica_has_it_and_raises_when_none_does(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_and_replica
    reg = PrefixCacheRegistry.from_url(
        primary.url, "durable", wait_replicas=1, wait_timeout=0.2, socket_timeout=2
    )
    plain = PrefixCacheRegistry.from_url(primary.url, "durable", socket_timeout=2)
    replica_client = replica.client()
    assert replica.process is not None
    try:
        reg.claim()
        reg.register_kv([1, 2], H[:2])
        assert replica_client.hlen(reg.keys.kv) == 2  # WAIT returned: the replica has both
        os.kill(replica.process.pid, signal.SIGSTOP)  # it acknowledges nothing now
        try:
            with pytest.raises(RegistryUnavailable, match="0 of the 1 replicas") as caught:
                reg.register_kv([3], [H[2]])
            assert caught.value.outcome_unknown
            plain.adopt_epoch(reg.epoch)
            plain.register_mamba([3], [H[2]])  # without the option: acknowledged at once
            # A read is confirmed too: it saw the unconfirmed entry, so it must not answer.
            with pytest.raises(RegistryUnavailable, match="held what it saw"):
                reg.match_kv_prefix(H)
            with pytest.raises(RegistryUnavailable, match="held what it saw"):
                reg.mamba_block_ids(H)
            assert plain.match_kv_prefix(H) == ([1, 2, 3], H[2])  # unconfirmed: at once
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])  # the write did run
        assert reg.mamba_block_ids(H) == [None, None, 3]
        assert replica_client.hlen(reg.keys.kv) == 3  # the read answered once the replica had it
        assert 0 < replica_client.pttl(f"{reg.keys.base}:read-mark") <= 10_000
        reg.evict_kv([H[2]])  # and the replica acknowledges again
    finally:
        replica_client.close()
        reg.client.close()
        plain.client.close()


def test_bad_durability_options_fail_before_connecting() -> None:
    for options, message in [
        ({"wait_replicas": -1}, "wait_replicas"),
        ({"wait_replicas": 1.5}, "wait_replicas"),
        ({"wait_replicas": 1, "wait_timeout": 0}, "wait_timeout"),
        ({"wait_replicas": 1, "wait_timeout": 2.0, "socket_timeout": 1.0}, "socket_timeout"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            PrefixCacheRegistry.from_url("redis://127.0.0.1:1", "n", **options)  # type: ignore[arg-type]


@pytest.mark.cluster
def test_on_a_cluster_the_write_waits_on_its_slots_primary() -> None:
    """WAIT runs on the connection to the primary that took the write: it counts that
    primary's replica, and a stopped replica makes the write raise."""
    require_redis_server()
    with RedisClusterServers(masters=3, replicas=1) as cluster:
        reg = PrefixCacheRegistry.from_url(
            cluster.url, "durable-c", cluster=True, wait_replicas=1, wait_timeout=0.2
        )
        try:
            node = reg.client.get_node_from_key(reg.keys.kv)
            server = next(n for n in cluster.nodes if n.port == node.port)
            probe = "tests-replication-probe:{durable-c}"  # the namespace's slot
            wait_until(lambda: replicas_streamed(server, probe) >= 1, what="replica streamed to")
            reg.claim()
            reg.register_kv([1, 2], H[:2])
            primary = reg.client.get_node_from_key(reg.keys.kv)
            replica_port = next(
                int(r["port"])
                for r in reg.client.get_redis_connection(primary).info("replication").values()
                if isinstance(r, dict) and "port" in r
            )
            replica = next(n for n in cluster.nodes if n.port == replica_port)
            assert replica.process is not None
            os.kill(replica.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(RegistryUnavailable, match="0 of the 1 replicas"):
                    reg.register_kv([3], [H[2]])
                with pytest.raises(RegistryUnavailable, match="held what it saw"):
                    reg.match_kv_prefix(H)
            finally:
                os.kill(replica.process.pid, signal.SIGCONT)
            reg.evict_kv([H[2]])
            assert reg.match_kv_prefix(H) == ([1, 2], H[1])
        finally:
            reg.client.close()
