"""The fleet index under server faults (real servers): a restart with an empty Redis, a
failover that loses writes, a frozen (SIGSTOPped) server, a resharding an owner's client
has not seen.

The index is derived from the namespaces' maps; after each fault the rules say how it
heals (``registry/fleet.py``): an owner whose namespace was lost is fenced and claims
again; an owner whose member id was lost rebuilds at its next renewal; a write and its
index update run in one script (or travel in one pipeline where the shard is on another
node), so a frozen server applies both or neither.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
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
)
from registry.fleet import GROUPS, FleetKeys, FleetMembers
from tests.support.servers import RedisClusterServers, RedisServer
from tests.support.waiting import wait_until

PROMPT = list(range(5001, 5033))


@pytest.fixture
def prefix() -> str:
    return f"ff{uuid.uuid4().hex[:8]}"


def direct(reg: PrefixCacheRegistry, prompt: list[int]) -> tuple[int, int]:
    """(KV prefix, Mamba-aware prefix) from the namespace's own maps."""
    kv, mamba = reg.entries()
    end = 0
    while end < len(prompt) and prompt[end] in kv:
        end += 1
    farthest = max((p + 1 for p in range(end) if prompt[p] in mamba), default=0)
    return end, farthest


def scores(client: Any, prefix: str, *, exact: bool = False) -> dict[str, tuple[int, int]]:
    router = PrefixRouter(client, prefix, live_cache_ttl=0 if exact else 3600, exact=exact)
    return {n: (s.kv_prefix, s.mamba_prefix) for n, s in router.score(PROMPT).items()}


def agrees(client: Any, prefix: str, live: dict[str, PrefixCacheRegistry]) -> bool:
    want = {name: direct(reg, PROMPT) for name, reg in live.items()}
    return scores(client, prefix) == want == scores(client, prefix, exact=True)


def answered(call: Callable[[], object]) -> Callable[[], bool]:
    """A poll: True once ``call`` got through to a server that answers (a connection
    the server dropped fails once, then redis-py reconnects)."""

    def poll() -> bool:
        try:
            call()
        except RegistryUnavailable:
            return False
        return True

    return poll


def fenced(call: Callable[[], object]) -> Callable[[], bool]:
    """A poll: True once ``call`` raises ``StaleEpochError``."""

    def poll() -> bool:
        try:
            call()
        except StaleEpochError:
            return True
        except RegistryUnavailable:
            return False
        raise AssertionError("the write went through: the owner was not fenced")

    return poll


# -- 5. restart with an empty Redis -------------------------------------------------------


def test_restart_with_an_empty_redis_fences_owners_until_they_claim_again(
    own_server: RedisServer, prefix: str
) -> None:
    a = PrefixCacheRegistry(own_server.client(), "node-a", key_prefix=prefix)
    b = PrefixCacheRegistry(own_server.client(), "node-b", key_prefix=prefix)
    for reg, n in ((a, 20), (b, 8)):
        reg.claim(lease_ttl=60)
        reg.register_kv(range(n), PROMPT[:n])
        reg.register_mamba([3], PROMPT[3:4])
    router_client = own_server.client()
    assert agrees(router_client, prefix, {"node-a": a, "node-b": b})
    own_server.restart()  # no persistence: everything is gone
    wait_until(fenced(lambda: a.register_kv(range(4), PROMPT[:4])), 10, "a fenced")
    wait_until(answered(lambda: scores(router_client, prefix)), 10, "router back")
    # Nobody is scored: the namespaces and the member table are gone with the data.
    assert scores(router_client, prefix) == {}
    assert scores(router_client, prefix, exact=True) == {}
    with pytest.raises(StaleEpochError):
        a.evict_kv(PROMPT[:1])
    wait_until(fenced(b.renew), 10, "b fenced")
    assert scores(router_client, prefix) == {}  # a fenced write left no counted bits
    # A new claim joins the index again, with a fresh id; its writes count.
    a.claim(lease_ttl=60)
    assert FleetMembers(router_client, prefix).current("node-a") is not None
    a.register_kv(range(12), PROMPT[:12])
    a.register_mamba([5], PROMPT[5:6])
    assert agrees(router_client, prefix, {"node-a": a})
    assert scores(router_client, prefix) == {"node-a": (12, 6)}
    b.claim(lease_ttl=60)
    b.register_kv(range(2), PROMPT[:2])
    assert agrees(router_client, prefix, {"node-a": a, "node-b": b})


# -- 6. failover: a replica promoted without the last writes -----------------------------


@pytest.fixture
def replica(own_server: RedisServer) -> Iterator[RedisServer]:
    """A replica of ``own_server``, in sync when yielded."""
    primary = own_server.client()
    primary.config_set("repl-diskless-sync-delay", 0)  # sync at once, not after 5 s
    primary.close()
    with RedisServer(["--replicaof", own_server.host, str(own_server.port)]) as server:
        client = server.client()
        wait_until(
            lambda: client.info("replication").get("master_link_status") == "up",
            20,
            "replica in sync",
        )
        client.close()
        yield server


def command(client: redis.Redis, *args: Any) -> Any:
    """A raw command (redis-py leaves ``execute_command`` untyped)."""
    run: Callable[..., Any] = client.execute_command
    return run(*args)


def fail_over(client: redis.Redis, to: RedisServer) -> None:
    """Point a client at the promoted replica, as a Sentinel-managed client would."""
    pool = client.connection_pool
    pool.connection_kwargs["port"] = to.port
    pool.disconnect()
    pool.reset()  # connections made from now on go to the promoted replica


def test_failover_that_loses_a_membership_is_healed_by_the_next_renewal(
    own_server: RedisServer, replica: RedisServer, prefix: str
) -> None:
    """Bound: after a failover, an owner whose member id was lost (its join, switch or
    rebuild not replicated) keeps writing bits under an id no router counts until its
    next renewal (a heartbeat, a third of the lease): ``check`` finds the id gone and
    the owner rebuilds, so its scores are right again within one heartbeat of Redis
    answering. Meanwhile it is under-scored (a worse route, never a wrong one)."""
    client = own_server.client()
    reg = PrefixCacheRegistry(client, "node-f", key_prefix=prefix)
    reg.claim(lease_ttl=60)
    reg.register_kv(range(8), PROMPT[:8])
    reg.register_mamba([2], PROMPT[2:3])
    assert int(command(client, "WAIT", 1, 10_000)) == 1  # the replica has it all
    promoted = replica.client()
    command(promoted, "REPLICAOF", "NO", "ONE")  # split: later writes are lost
    lost_id = reg.reindex()  # a rebuild on the old primary only: a new member id
    reg.register_kv(range(16), PROMPT[:16])  # lost with the old primary
    assert scores(client, prefix) == {"node-f": (16, 3)}
    fail_over(client, replica)
    wait_until(answered(reg.info), 10, "the owner reaches the promoted replica")
    members = FleetMembers(promoted, prefix)
    assert members.current("node-f") != lost_id  # the promoted replica never saw it
    live = {"node-f": reg}
    assert agrees(promoted, prefix, live)  # what it holds is consistent: 8 blocks
    reg.register_kv(range(24), PROMPT[:24])  # bits under the lost id: not counted
    assert scores(promoted, prefix, exact=True) == {"node-f": (24, 3)}
    assert scores(promoted, prefix)["node-f"][0] < 24  # stale: a worse route only
    reg.renew()  # the heartbeat's renewal finds the id gone and rebuilds
    assert members.current("node-f") is not None  # a fresh id there (numbers may repeat)
    assert agrees(promoted, prefix, live)
    assert scores(promoted, prefix) == {"node-f": (24, 3)}
    promoted.close()


def test_failover_that_loses_the_claim_fences_the_owner(
    own_server: RedisServer, replica: RedisServer, prefix: str
) -> None:
    """A replica promoted before an owner's claim reached it: the owner's epoch is
    unknown there, so its writes and renewals raise ``StaleEpochError`` and it is never
    scored until it claims again."""
    client = own_server.client()
    promoted = replica.client()
    command(promoted, "REPLICAOF", "NO", "ONE")
    reg = PrefixCacheRegistry(client, "node-g", key_prefix=prefix)
    reg.claim(lease_ttl=60)
    reg.register_kv(range(8), PROMPT[:8])
    fail_over(client, replica)
    wait_until(fenced(reg.renew), 10, "fenced on the promoted replica")
    assert scores(promoted, prefix) == {}
    assert scores(promoted, prefix, exact=True) == {}
    reg.claim(lease_ttl=60)
    reg.register_kv(range(4), PROMPT[:4])
    assert agrees(promoted, prefix, {"node-g": reg})
    promoted.close()


# -- a frozen server -----------------------------------------------------------------------


@pytest.fixture
def frozen(own_server: RedisServer) -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    """(stop, resume): SIGSTOP and SIGCONT the server; the fixture always resumes it."""
    assert own_server.process is not None
    pid = own_server.process.pid
    try:
        yield (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT))
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_write_cut_off_by_a_frozen_server_and_its_index_update_land_together(
    own_server: RedisServer,
    frozen: tuple[Callable[[], None], Callable[[], None]],
    prefix: str,
) -> None:
    """The owner gives up on a write while the server is frozen (no retry): the write
    and its index update are one script, so once the server runs again the
    index agrees with the maps, whether the server applied the pair or not."""
    stop, resume = frozen
    impatient = redis.Redis(
        host=own_server.host, port=own_server.port, socket_timeout=0.3, retry=Retry(NoBackoff(), 0)
    )
    reg = PrefixCacheRegistry(impatient, "node-z", key_prefix=prefix)
    reg.claim(lease_ttl=60)
    reg.load_scripts()
    reg.register_kv(range(8), PROMPT[:8])
    reg.register_mamba([4], PROMPT[4:5])
    router_client = own_server.client()
    live = {"node-z": PrefixCacheRegistry(router_client, "node-z", key_prefix=prefix)}
    assert agrees(router_client, prefix, live)
    stop()
    with pytest.raises(RegistryUnavailable):
        reg.register_kv(range(20), PROMPT[:20])
    with pytest.raises(RegistryUnavailable):
        PrefixRouter(impatient, prefix).score(PROMPT)  # routing is bounded too
    resume()
    wait_until(answered(lambda: agrees(router_client, prefix, live)), 10, "server back")
    wait_until(lambda: agrees(router_client, prefix, live), 10, "index agrees")
    reg.evict_kv(PROMPT[6:])  # and the owner goes on
    assert agrees(router_client, prefix, live)
    assert scores(router_client, prefix) == {"node-z": (6, 5)}
    impatient.close()


# -- a resharding the owner has not seen -----------------------------------------------------


def move_slot(admin: Any, slot: int, source: Any, target: Any) -> None:
    """Move ``slot`` with its keys from primary ``source`` to ``target``, as a resharding
    does (IMPORTING / MIGRATING, MIGRATE, then SETSLOT NODE on every primary), without
    telling any client."""
    src = admin.get_redis_connection(source)
    dst = admin.get_redis_connection(target)
    src_id, dst_id = (_text(c.execute_command("CLUSTER", "MYID")) for c in (src, dst))
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
    for node in admin.get_primaries():
        admin.get_redis_connection(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_a_resharding_the_owner_has_not_seen_keeps_the_index_exact(prefix: str) -> None:
    """The slot of an owner's group shard moves to another primary behind its back (its
    client's slot map still puts the shard on the owner's own node). Its writes, KV and
    Mamba, keep the maps and the index exact: the write script finds the shard gone, the
    owner sends the upkeep right after, to wherever the shard now is. Routers follow. Its
    next renewal rebuilds it under a new id in a group its own node serves."""
    with RedisClusterServers() as cluster:
        owner_client = cluster.client()
        reg = PrefixCacheRegistry(owner_client, "moving", key_prefix=prefix)
        reg.claim(lease_ttl=60)
        reg.register_kv(range(8), PROMPT[:8])
        reg.register_mamba([4], PROMPT[4:5])
        fleet = FleetKeys(prefix)
        member = FleetMembers(owner_client, prefix).current("moving")
        assert member is not None
        shard = fleet.shards[member % GROUPS]
        admin = cluster.client()
        home = admin.get_node_from_key(reg.keys.kv)
        assert admin.get_node_from_key(shard).name == home.name  # its home group
        target = next(n for n in admin.get_primaries() if n.name != home.name)
        move_slot(admin, admin.keyslot(shard), home, target)

        reg.register_kv(range(20), PROMPT[:20])
        reg.evict_kv(PROMPT[16:])
        reg.register_mamba([12], PROMPT[12:13])
        reg.evict_mamba(PROMPT[4:5])
        assert not reg._index_dirty  # every upkeep landed
        routers = cluster.client()
        assert routers.get_node_from_key(shard).name == target.name
        assert routers.hget(shard, PROMPT[12]) is not None  # the bits are on the new node
        live = {"moving": reg}
        assert agrees(routers, prefix, live)
        assert scores(routers, prefix)["moving"] == (16, 13)

        reg.renew()  # rebuilt in a group its own node serves
        moved = FleetMembers(routers, prefix).current("moving")
        assert moved is not None
        assert moved != member
        assert routers.get_node_from_key(fleet.shards[moved % GROUPS]).name == home.name
        reg.register_kv([30], PROMPT[16:17])
        assert agrees(routers, prefix, live)
        assert scores(routers, prefix)["moving"] == (17, 13)
