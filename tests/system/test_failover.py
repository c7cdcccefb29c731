"""Failover: a Redis Cluster with replicas loses the master that holds a namespace in
the middle of a workload. Operations fail with RegistryUnavailable for a moment, then
continue on the promoted replica; the eviction listener reconnects and reconciles; in
the end the slot pool holds exactly the Mamba entries the registry has."""

from __future__ import annotations

import random
import threading
import time

import pytest
import redis

from gpu import EvictionListener
from registry import PrefixCacheRegistry, RegistryUnavailable
from tests.support.gpu import make_pool, states
from tests.support.servers import RedisClusterServers, require_redis_server
from tests.support.waiting import wait_until


@pytest.mark.redis_server
@pytest.mark.cluster
def test_master_failover_during_a_workload() -> None:
    require_redis_server()
    with RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        client = cluster.client()
        reg = PrefixCacheRegistry(client, "failover-node")
        reg.claim(lease_ttl=120)
        owner = client.get_node_from_key(reg.keys.kv)
        victim = next(n for n in cluster.nodes if n.port == owner.port)
        pool = make_pool(reg, slots=300)
        evictor_client = cluster.client()
        evictor = PrefixCacheRegistry(evictor_client, reg.namespace)  # no hook: notices only
        listener_client = cluster.client()
        listener = EvictionListener(listener_client, reg.namespace, pool, resync_interval=1.0)
        done = {"ok": 0, "unavailable": 0}
        stop = threading.Event()

        def workload() -> None:
            rng = random.Random(3)
            next_id = 0
            while not stop.is_set():
                try:
                    block = next_id
                    pool.store([block], [10**12 + block], *states(1, seed=block))
                    next_id += 1
                    held = sorted(pool.pairs())
                    if len(held) > 150:
                        doomed = rng.sample(held, 5)
                        evictor.evict_mamba([h for _, h in doomed])
                    done["ok"] += 1
                except RegistryUnavailable:
                    done["unavailable"] += 1
                    time.sleep(0.05)

        with listener:
            worker = threading.Thread(target=workload)
            worker.start()
            try:
                wait_until(lambda: done["ok"] >= 300, timeout=30, what="warm-up")
                before = done["ok"]
                reconciled_before = listener.counts().reconciles
                victim.kill()  # the master holding the namespace's slot
                wait_until(
                    lambda: done["ok"] >= before + 300, timeout=60, what="ops after failover"
                )
            finally:
                stop.set()
                worker.join(30)
            mamba_key = reg.keys.mamba

            def pool_matches_registry() -> bool:
                try:
                    entries = {(int(b), int(h)) for h, b in client.hgetall(mamba_key).items()}
                except redis.ConnectionError:  # this client's map may still name the dead node
                    return False
                return pool.pairs() == entries

            def listener_back() -> bool:
                # Reconciled since the kill, and re-subscribed if its connection was lost.
                now = listener.counts()
                resubscribed = now.connection_losses == 0 or now.reconnects >= 1
                return now.reconciles > reconciled_before and resubscribed

            wait_until(listener_back, timeout=30, what="the listener back after the failover")
            try:
                wait_until(pool_matches_registry, timeout=30, what="pool == registry")
            except AssertionError:
                entries = {(int(b), int(h)) for h, b in client.hgetall(mamba_key).items()}
                held = pool.pairs()
                raise AssertionError(
                    f"pool has {len(held - entries)} extra, registry {len(entries - held)} extra: "
                    f"{sorted(held - entries)[:5]} / {sorted(entries - held)[:5]}; "
                    f"listener {listener.counts()}, pool {pool.counts()}"
                ) from None
            counts = listener.counts()
        assert done["unavailable"] >= 1  # the failover was felt...
        assert counts.reconciles > reconciled_before  # ...and caught up after
        entries = client.hgetall(mamba_key)
        assert pool.counts().in_use == len(entries) > 0
        print(
            f"\nfailover: {done['ok']} operations, {done['unavailable']} unavailable during the "
            f"failover, listener reconnects {counts.reconnects}, reconciles {counts.reconciles}"
        )
        for c in (client, evictor_client, listener_client):
            c.close()
