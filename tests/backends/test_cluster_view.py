"""Cluster view: leases and gc, epoch fencing, and prefix-aware routing scores."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
import redis

from registry import (
    NodeIndex,
    PrefixCacheRegistry,
    PrefixRouter,
    StaleEpochError,
    block_hashes,
    collect_dead,
    live_nodes,
)
from registry.fleet.view import FleetView
from registry.namespace.admin import namespace_infos
from tests.support.backends import Backend, dump_keys, expire_lease, notice_base, registry_state
from tests.support.counting import counted_sends
from tests.support.waiting import wait_until

TOKENS = list(range(1000, 1160))  # 10 blocks of 16 tokens
H = block_hashes(TOKENS, 16)


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so its node index is its own too."""
    return f"cv{uuid.uuid4().hex[:8]}"


def owner(
    backend: Backend, namespace: str, prefix: str, lease: float = 30.0
) -> PrefixCacheRegistry:
    reg = backend.registry(namespace, key_prefix=prefix)
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=lease)
    return reg


def cluster_backend(redis_cluster: Any) -> Backend:
    """The "cluster" backend on the module's cluster, for tests outside the backend matrix."""
    from tests.support.backends import make_backend

    class Request:
        def getfixturevalue(self, name: str) -> Any:
            return redis_cluster

    return make_backend("cluster", Request())  # type: ignore[arg-type]


def three_nodes(backend: Backend, prefix: str) -> dict[str, PrefixCacheRegistry]:
    a, b, c = (owner(backend, name, prefix) for name in ("node-a", "node-b", "node-c"))
    a.register_kv(range(10), H)
    a.register_mamba([3, 7], [H[3], H[7]])
    b.register_kv(range(6), H[:6])
    b.register_mamba([5], [H[5]])
    c.register_kv(range(3), H[:3])
    return {"node-a": a, "node-b": b, "node-c": c}


def test_scores_and_best_node(redis_backend: Backend, prefix: str) -> None:
    three_nodes(redis_backend, prefix)
    router = PrefixRouter(redis_backend.client(), prefix)
    scores = router.score(H)
    assert {n: (s.kv_prefix, s.mamba_prefix) for n, s in scores.items()} == {
        "node-a": (10, 8),
        "node-b": (6, 6),
        "node-c": (3, 0),
    }
    assert router.best(H) == "node-a"
    # A shorter prompt: node-a's farthest Mamba state within 6 blocks is block 4.
    short = H[:6]
    assert {n: s.mamba_prefix for n, s in router.score(short).items()} == {
        "node-a": 4,
        "node-b": 6,
        "node-c": 0,
    }
    assert router.best(short) == "node-b"
    kv_router = PrefixRouter(redis_backend.client(), prefix, hybrid=False)
    assert kv_router.best(short) == "node-a"  # tie at 6: then by name
    assert kv_router.best(short, load={"node-a": 5, "node-b": 1}) == "node-b"
    assert kv_router.best(short, load={"node-a": 0.1, "node-b": 0.2}) == "node-a"
    # Nothing cached anywhere: the least loaded node wins.
    other = block_hashes(list(range(9000, 9064)), 16)
    assert router.best(other, load={"node-a": 3, "node-b": 2, "node-c": 9}) == "node-b"
    assert router.score([]) == {n: router.score([])[n] for n in ("node-a", "node-b", "node-c")}
    assert router.score(H, namespaces=["node-c"])["node-c"].kv_prefix == 3


def test_binary_search_finds_every_prefix_length(redis_backend: Backend, prefix: str) -> None:
    reg = owner(redis_backend, "node-z", prefix)
    router = PrefixRouter(redis_backend.client(), prefix)
    chain = list(range(1, 301))
    for k in [0, 1, 2, 3, 64, 127, 128, 129, 299, 300]:
        reg.reset()
        reg.register_kv(range(k), chain[:k])
        reg.register_mamba([0], [chain[0]])
        score = router.score(chain)["node-z"]
        assert (score.kv_prefix, score.mamba_prefix) == (k, min(k, 1)), k
        assert score.kv_prefix == len(reg.match_kv_prefix(chain)[0])


@pytest.mark.parametrize("entries", [1, 5, 16, 17, 200])
def test_mamba_prefix_is_exact_for_few_and_many_checkpoints(
    redis_backend: Backend, prefix: str, entries: int
) -> None:
    """The script looks at the prefix's last 8 hashes first; then, up to 16 Mamba
    entries, it finds each in the packed prompt, above that it scans the prefix back.
    Every path gives the farthest checkpoint inside the KV prefix, also with checkpoints
    of other prompts, beyond the prefix, or at hashes whose digits appear across two
    packed hashes."""
    rng = random.Random(entries)
    reg = owner(redis_backend, "node-m", prefix)
    chain = [rng.randrange(1, 2**63) for _ in range(400)]
    reg.register_kv(range(300), chain[:300])
    others = [rng.randrange(1, 2**63) for _ in range(entries - 1)]
    # A Mamba hash whose 19 padded digits appear in the packed prompt across hashes 9|10.
    others.append(int(str(chain[9]).zfill(19)[-7:] + str(chain[10]).zfill(19)[:12]))
    positions = rng.sample(range(400), min(entries, 40))
    mamba = {h: 1 for h in others}
    mamba.update({chain[p]: 1 for p in positions})
    reg.register_mamba(range(len(mamba)), list(mamba)[: len(mamba)])
    hybrid = PrefixRouter(redis_backend.client(), prefix)
    plain = PrefixRouter(redis_backend.client(), prefix, hybrid=False)
    for prompt in (chain, chain[:150], chain[:7], [*chain[:50], *others[:3]]):
        kv = len(reg.match_kv_prefix(prompt)[0])
        expected = reg.match_mamba_farthest(prompt[:kv])
        score = hybrid.score(prompt)["node-m"]
        assert (score.kv_prefix, score.mamba_prefix, score.usable) == (kv, expected, expected)
        flat = plain.score(prompt)["node-m"]
        assert (flat.kv_prefix, flat.mamba_prefix, flat.usable) == (kv, 0, kv)


def test_router_never_writes(redis_backend: Backend, prefix: str) -> None:
    nodes = three_nodes(redis_backend, prefix)
    before = {n: dump_keys(r) for n, r in nodes.items()}
    router = PrefixRouter(redis_backend.client(), prefix)
    router.best(H)
    assert {n: dump_keys(r) for n, r in nodes.items()} == before


def test_expired_lease_drops_out_and_gc_removes_the_namespace(
    redis_backend: Backend, prefix: str
) -> None:
    short_lived = owner(redis_backend, "node-x", prefix)
    long_lived = owner(redis_backend, "node-y", prefix)
    for reg in (short_lived, long_lived):
        reg.register_kv([1, 2], H[:2])
        reg.register_mamba([2], H[1:2])
    client = redis_backend.client()
    router = PrefixRouter(client, prefix, live_cache_ttl=0)
    assert set(live_nodes(client, prefix)) == {"node-x", "node-y"}
    assert set(router.score(H)) == {"node-x", "node-y"}
    y_before = dump_keys(long_lived)
    expire_lease(short_lived)
    assert live_nodes(client, prefix) == ["node-y"]
    assert set(router.score(H)) == {"node-y"}
    assert router.score(H, namespaces=["node-x"]) == {}  # dead: never scored, even if asked
    assert collect_dead(client, prefix) == ["node-x"]
    assert all(client.exists(k) == 0 for k in short_lived.keys.all_keys())
    assert client.zscore(NodeIndex(client, prefix).key, "node-x") is None
    assert dump_keys(long_lived) == y_before  # a live node's keys are untouched
    with pytest.raises(StaleEpochError):
        short_lived.register_kv([3], H[2:3])  # the zombie resurrects nothing
    with pytest.raises(StaleEpochError):
        short_lived.renew()
    assert all(client.exists(k) == 0 for k in short_lived.keys.all_keys())
    assert collect_dead(client, prefix) == []


def test_gc_spares_a_namespace_renewed_in_time(redis_backend: Backend, prefix: str) -> None:
    reg = owner(redis_backend, "node-r", prefix)
    reg.register_kv([1], H[:1])
    client = redis_backend.client()
    expire_lease(reg)
    assert live_nodes(client, prefix) == []
    index = NodeIndex(client, prefix)
    listed_dead = index.dead()
    assert listed_dead == ["node-r"]
    reg.renew()  # back between gc listing it and deleting it
    index.dead = lambda: listed_dead  # type: ignore[method-assign]
    assert index.collect_dead() == []  # the lease is checked again, atomically with the delete
    assert registry_state(reg)[0] == {H[0]: 1}
    assert live_nodes(client, prefix) == ["node-r"]


def test_restarted_owner_fences_the_old_one(redis_backend: Backend, prefix: str) -> None:
    old = owner(redis_backend, "node-e", prefix)
    old.register_kv([1, 2, 3], H[:3])
    old.register_mamba([3], H[2:3])
    seen: list[Any] = []
    old.add_eviction_hook(seen.append)
    new = redis_backend.registry("node-e", key_prefix=prefix)
    assert isinstance(new, PrefixCacheRegistry)
    assert new.claim() not in (None, old.epoch)  # epochs never repeat
    assert new.match_kv_prefix(H) == ([], 0)  # the new incarnation starts empty
    assert new.match_mamba_farthest(H) == 0
    new.register_kv([7], H[:1])
    snapshot = dump_keys(new)
    for call in [
        lambda: old.register_kv([9], H[:1]),
        lambda: old.evict_kv(H[:1]),
        lambda: old.register_mamba([9], H[:1]),
        lambda: old.evict_mamba(H[:1]),
        lambda: old.clear_kv(),
        lambda: old.clear_mamba(),
        lambda: old.reset(),
        lambda: old.renew(),
    ]:
        with pytest.raises(StaleEpochError, match="node-e"):
            call()
    assert dump_keys(new) == snapshot  # nothing changed
    assert seen == []  # and no hook fired
    assert old.match_kv_prefix(H) == ([7], H[0])  # reads still work
    operator = redis_backend.registry("node-e", key_prefix=prefix)  # not an owner: unfenced
    assert operator.evict_kv(H[:1]) == {H[0]}


def test_claim_announces_a_clear_to_listeners(redis_backend: Backend, prefix: str) -> None:
    old = owner(redis_backend, "node-l", prefix)
    old.register_mamba([1], H[:1])
    new = redis_backend.registry("node-l", key_prefix=prefix)
    assert isinstance(new, PrefixCacheRegistry)
    heard: list[Any] = []
    new.add_eviction_hook(heard.append)  # the pool attached to the new owner
    new.claim()
    (clear,) = heard  # delivered in-process too, so the pool frees at once
    assert clear.kind == "clear"
    assert new.notices_after(clear.seq - 1) == [clear]
    assert [n.kind for n in new.notices_after(notice_base(new)) or []] == ["clear", "clear"]


def test_heartbeat_keeps_the_lease_and_notices_being_superseded(
    redis_backend: Backend, prefix: str
) -> None:
    reg = owner(redis_backend, "node-h", prefix)
    client = redis_backend.client()
    beat = reg.start_heartbeat(interval=0.01)
    try:
        # The lease ran out (the heartbeat may renew it at any moment, so the dead state
        # is not asserted); only a renewal can bring the node back into the live set.
        expire_lease(reg)
        wait_until(lambda: live_nodes(client, prefix) == ["node-h"], what="a renewal")
        redis_backend.registry("node-h", key_prefix=prefix).claim()  # type: ignore[attr-defined]
        wait_until(beat.lost.is_set, what="heartbeat sees it was superseded")
        wait_until(lambda: not beat.alive, what="the heartbeat stops by itself")
    finally:
        beat.stop()


def test_a_heartbeat_stops_when_its_registry_is_gone(redis_backend: Backend, prefix: str) -> None:
    """The heartbeat thread holds its registry weakly: dropping the registry ends it."""
    import gc as garbage

    if redis_backend.name == "fakeredis":
        pytest.skip("fakeredis's Lua runtime keeps the calling frames (and the registry)")
    reg = owner(redis_backend, "node-w", prefix)
    beat = reg.start_heartbeat(interval=0.01)
    del reg
    garbage.collect()
    wait_until(lambda: not beat.alive, what="the heartbeat thread ends")
    assert not beat.lost.is_set()


def test_bad_arguments(redis_backend: Backend, prefix: str) -> None:
    reg = redis_backend.registry(key_prefix=prefix)
    assert isinstance(reg, PrefixCacheRegistry)
    with pytest.raises(RuntimeError, match="claim"):
        reg.renew()
    with pytest.raises(ValueError, match="lease"):
        reg.claim(lease_ttl=0)
    with pytest.raises(TypeError, match="lease"):
        reg.claim(lease_ttl="10")  # type: ignore[arg-type]
    router = PrefixRouter(redis_backend.client(), prefix)
    with pytest.raises(TypeError):
        router.score([1.5])
    with pytest.raises(ValueError, match="namespace"):
        router.score(H, namespaces=["bad name"])


def test_router_survives_script_flush(redis_backend: Backend, prefix: str) -> None:
    three_nodes(redis_backend, prefix)
    client = redis_backend.client()
    router = PrefixRouter(client, prefix)
    assert router.best(H) == "node-a"
    client.script_flush()
    assert router.best(H) == "node-a"


def test_score_over_sixteen_namespaces_across_shards(redis_cluster: Any, prefix: str) -> None:
    backend = cluster_backend(redis_cluster)
    try:
        chain = list(range(10**12, 10**12 + 512))
        nodes = {}
        for i in range(16):
            reg = owner(backend, f"node-{i:02d}", prefix)
            reg.register_kv(range(i * 32), chain[: i * 32])
            reg.register_mamba([0, i], [chain[0], chain[i]])
            nodes[reg.namespace] = reg
        client = backend.client()
        shards = {client.get_node_from_key(r.keys.kv).name for r in nodes.values()}
        assert len(shards) == 3
        router = PrefixRouter(client, prefix, exact=True)
        router.score(chain)  # scripts loaded, connections open
        primaries = {n.name: redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()}
        for admin in primaries.values():
            admin.config_resetstat()
        with counted_sends() as sends:
            scores = router.score(chain)
        # One round trip per shard: one write to each primary, no COMMAND GETKEYS.
        assert sorted(sends) == sorted(primaries)
        for name, admin in primaries.items():
            stats = admin.info("commandstats")
            admin.close()
            here = sum(client.get_node_from_key(r.keys.kv).name == name for r in nodes.values())
            assert stats["cmdstat_evalsha"]["calls"] == here
            assert "cmdstat_command|getkeys" not in stats
        for name, reg in nodes.items():
            block_ids, _ = reg.match_kv_prefix(chain)
            kv = len(block_ids)
            assert scores[name].kv_prefix == kv
            assert scores[name].mamba_prefix == reg.match_mamba_farthest(chain[:kv])
    finally:
        backend.close()


def test_stats_of_many_namespaces_cost_one_round_trip_per_shard(
    redis_cluster: Any, prefix: str
) -> None:
    backend = cluster_backend(redis_cluster)
    try:
        regs = [owner(backend, f"stats-{i:02d}", prefix) for i in range(12)]
        for i, reg in enumerate(regs):
            reg.register_kv(range(i % 10), H[: i % 10])
        client = backend.client()
        names = [reg.namespace for reg in regs]
        namespace_infos(client, names, key_prefix=prefix)  # connections open
        with counted_sends() as sends:
            infos = namespace_infos(client, names, key_prefix=prefix)
        assert sorted(sends) == sorted(n.name for n in client.get_primaries())
        for reg, (info, memory) in zip(regs, infos, strict=True):
            alone = reg.info()
            assert (info.namespace, info.kv_entries, info.epoch, info.lease_until_ms) == (
                alone.namespace, alone.kv_entries, alone.epoch, alone.lease_until_ms,
            )  # fmt: skip
            assert memory is not None
            assert memory > 0
    finally:
        backend.close()


def test_an_owners_write_goes_to_its_primary_alone(redis_cluster: Any, prefix: str) -> None:
    """An owner's write (its change record published inside its own script) wakes one
    node, its namespace's primary, and runs one script there; with its scripts flushed
    from every primary it still lands."""
    backend = cluster_backend(redis_cluster)
    try:
        reg = owner(backend, "upkeep", prefix)
        hashes = [10**12 + i for i in range(64)]
        reg.register_kv(range(64), hashes)  # scripts loaded, connections open
        reg.evict_kv(hashes)
        client = backend.client()
        kv_node = client.get_node_from_key(reg.keys.kv).name
        primaries = {n.name: redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()}
        try:
            for admin in primaries.values():
                admin.config_resetstat()
            with counted_sends() as sends:
                reg.register_kv(range(64), hashes)
            assert sends == [kv_node]  # one write to one node
            for name, admin in primaries.items():
                calls = admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                assert calls == (1 if name == kv_node else 0), name
            assert PrefixRouter(client, prefix).score(hashes)["upkeep"].kv_prefix == 64
            # Scripts gone (a restart, a failover): NOSCRIPT, loaded, sent again.
            for admin in primaries.values():
                admin.script_flush()
            reg.evict_kv(hashes[32:])
            assert PrefixRouter(client, prefix).score(hashes)["upkeep"].kv_prefix == 32
        finally:
            for admin in primaries.values():
                admin.close()
    finally:
        backend.close()


def test_a_script_call_goes_straight_to_its_primary_and_follows_a_stale_map(
    redis_cluster: Any, prefix: str
) -> None:
    """A single script call (here an owner's writes) is one packed write to the primary
    serving its keys, with no question to any node first;
    sent to a node that no longer serves them, it is answered MOVED and redis-py's path
    follows the redirection."""
    backend = cluster_backend(redis_cluster)
    try:
        client = backend.client()
        reg = PrefixCacheRegistry(client, "single", key_prefix=prefix)
        reg.claim(lease_ttl=30.0)
        reg.register_kv(range(3), H[:3])  # scripts loaded, connections open
        reg.evict_kv(H[2:3])
        home = client.get_node_from_key(reg.keys.kv)
        admin = redis.Redis(host=home.host, port=home.port)
        try:
            admin.config_resetstat()
            with counted_sends() as sends:
                reg.register_kv(range(6), H[:6])
                reg.evict_kv(H[5:6])
            assert sends == [home.name, home.name]
            stats = admin.info("commandstats")
            assert stats["cmdstat_evalsha"]["calls"] == 2
            assert "cmdstat_command|getkeys" not in stats
        finally:
            admin.close()
        wrong = next(n for n in client.get_primaries() if n.name != home.name)
        real = client.get_node_from_key
        with pytest.MonkeyPatch.context() as patch:
            kv = reg.keys.kv
            patch.setattr(client, "get_node_from_key", lambda k, *a: wrong if k == kv else real(k))
            assert reg.evict_kv(H[4:5]) == {H[4]}
        assert reg.match_kv_prefix(H)[0] == [0, 1, 2, 3]
    finally:
        backend.close()


def test_scores_stay_exact_when_the_slot_map_is_stale(redis_cluster: Any, prefix: str) -> None:
    """Commands sent to a node that no longer serves their slot are answered MOVED; the
    router then falls back to redis-py's pipeline, which follows the redirection."""
    backend = cluster_backend(redis_cluster)
    try:
        regs = [owner(backend, f"moved-{i}", prefix) for i in range(6)]
        for i, reg in enumerate(regs):
            reg.register_kv(range(i + 1), H[: i + 1])
        client = backend.client()
        wrong = {}
        primaries = client.get_primaries()
        for reg in regs:  # each namespace mapped to a primary that does not serve it
            right = client.get_node_from_key(reg.keys.kv)
            wrong[reg.keys.kv] = next(n for n in primaries if n.name != right.name)
        real = client.get_node_from_key
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(client, "get_node_from_key", lambda key, *a: wrong.get(key) or real(key))
            scores = PrefixRouter(client, prefix).score(H)
        assert {n: s.kv_prefix for n, s in scores.items()} == {
            reg.namespace: i + 1 for i, reg in enumerate(regs)
        }
    finally:
        backend.close()


def test_router_leaves_the_prompt_alone(redis_backend: Backend, prefix: str) -> None:
    three_nodes(redis_backend, prefix)
    prompt = [*H[:3], -1, *H[3:]]
    PrefixRouter(redis_backend.client(), prefix).score(prompt)
    assert prompt == [*H[:3], -1, *H[3:]]


def test_writes_larger_than_one_lua_chunk_reach_the_maps_and_a_view(
    redis_backend: Backend, prefix: str
) -> None:
    """10,000 new hashes in one write (Lua's unpack is chunked at 4,000 values): the
    maps and the change record (one message) take them, and a view following the
    namespace scores as the exact router does."""
    with FleetView(redis_backend.client(), prefix) as view:
        reg = owner(redis_backend, "node-big", prefix)
        chain = list(range(10**13, 10**13 + 10_000))
        reg.register_kv(range(10_000), chain)
        reg.register_mamba(range(0, 10_000, 2), chain[::2])
        viewed = PrefixRouter(reg.client, prefix, view=view)
        exact = PrefixRouter(reg.client, prefix, exact=True)
        view.sync()
        assert viewed.score(chain) == exact.score(chain)
        assert exact.score(chain)["node-big"].kv_prefix == 10_000
        reg.evict_kv(chain[5_000:])
        view.sync()
        assert viewed.score(chain) == exact.score(chain)
        assert exact.score(chain)["node-big"].kv_prefix == 5_000
