"""Connection faults: one clear exception while Redis is away, and recovery by itself.

A server without persistence is killed and restarted during use: every operation
raises ``RegistryUnavailable`` (quickly, and without secrets) while it is down; when it
is back empty, owners find their epoch gone (``StaleEpochError``), claim again and
start from an empty namespace; the fleet simulation carries on and ends consistent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from registry import (
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryUnavailable,
    StaleEpochError,
    collect_dead,
    live_nodes,
)
from tests.support.servers import RedisServer

H = [1111, 2222, 3333]


def test_every_operation_raises_registry_unavailable_while_down(own_server: RedisServer) -> None:
    reg = PrefixCacheRegistry.from_url(own_server.url, "node-f")
    reg.claim()
    reg.register_kv([1, 2, 3], H)
    reg.register_mamba([3], H[2:])
    router = PrefixRouter(reg.client, live_cache_ttl=0)
    assert router.best(H) == "node-f"
    own_server.kill()
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("match_kv_prefix", lambda: reg.match_kv_prefix(H)),
        ("register_kv", lambda: reg.register_kv([4], [4444])),
        ("evict_kv", lambda: reg.evict_kv(H)),
        ("match_mamba_farthest", lambda: reg.match_mamba_farthest(H)),
        ("find_mamba_backoff", lambda: reg.find_mamba_backoff(H, 2)),
        ("register_mamba", lambda: reg.register_mamba([4], [4444])),
        ("evict_mamba", lambda: reg.evict_mamba(H)),
        ("clear_kv", reg.clear_kv),
        ("clear_mamba", reg.clear_mamba),
        ("reset", reg.reset),
        ("renew", reg.renew),
        ("claim", reg.claim),
        ("notice_sequence", reg.notice_sequence),
        ("score", lambda: router.score(H)),
        ("live_nodes", lambda: live_nodes(reg.client)),
        ("collect_dead", lambda: collect_dead(reg.client)),
    ]
    for name, call in calls:
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="Redis unavailable") as info:
            call()
        assert time.monotonic() - started < 3.0, f"{name} took too long to give up"
        assert isinstance(info.value.__cause__, redis.RedisError), name
    own_server.restart()
    # Back, and empty: reads work and see nothing; the owner's epoch is gone.
    assert reg.match_kv_prefix(H) == ([], 0)
    with pytest.raises(StaleEpochError):
        reg.register_kv([1], H[:1])
    old_epoch = reg.epoch
    assert reg.claim() not in (None, old_epoch)  # a fresh epoch on the fresh server
    reg.register_kv([1], H[:1])
    assert reg.match_kv_prefix(H) == ([1], H[0])
    reg.client.close()


def test_password_never_appears_in_the_error(own_server: RedisServer) -> None:
    url = f"redis://user:hunter2-secret@127.0.0.1:{own_server.port}/0"
    reg = PrefixCacheRegistry.from_url(url, "node-p")
    own_server.kill()
    with pytest.raises(RegistryUnavailable) as info:
        reg.match_kv_prefix(H)
    assert "hunter2" not in str(info.value)
    assert "hunter2" not in repr(info.value)
    reg.client.close()


def test_simulation_rides_out_a_server_restart(own_server: RedisServer) -> None:
    """Redis goes away for 40 requests and comes back empty: requests are served
    without the cache meanwhile, every node claims again, and the end is consistent."""
    from sim import FleetConfig, simulate
    from sim.workload import WorkloadConfig

    client = redis.Redis(
        port=own_server.port,
        socket_connect_timeout=1,
        socket_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    config = FleetConfig(
        nodes=3, kv_blocks=256, mamba_slots=16, workload=WorkloadConfig(requests=400, seed=5)
    )
    events: list[str] = []

    def chaos(done: int, total: int) -> None:
        if done == 120:
            own_server.kill()
            events.append("killed")
        elif done == 160:
            own_server.restart()
            events.append("restarted")

    result = simulate(client, config, "prefix", progress=chaos)
    client.close()
    assert events == ["killed", "restarted"]
    totals = result["totals"]
    assert totals["requests"] == 400
    assert totals["unavailable_requests"] >= 40  # each request while down: no cache
    assert totals["reclaims"] == 3  # every node found its epoch gone and started over
    assert result["route_fallbacks"] >= 40
    assert set(result["consistency"].values()) == {0}, result["consistency"]
    assert result["usable_hit_rate_blocks"] > 0  # the cache worked again afterwards
