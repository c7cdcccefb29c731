"""Per-namespace entry quotas on fakeredis, a real redis-server and a real Redis Cluster:
every script that adds entries (``register_kv``, ``register_mamba``, ``mirror_apply``,
``mirror_resync``, ``bridge_apply``) refuses a write that would pass its namespace's
limit, whole and before writing anything; removals and rewrites of held entries always
pass; other namespaces never notice. The limit lives in ``pcr:quota:{NS}``, the
namespace's slot, so on a cluster the scripts read it on the shard that runs them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from registry import MirroredRegistry, PrefixCacheRegistry, RegistryQuotaExceeded
from registry.bridge.counts import FollowerCounts
from registry.bridge.source import EngineSource
from registry.bridge.writes import PendingWrite, without_stores
from registry.core.errors import RegistryMisconfigured
from registry.core.hashing import digest_hash
from registry.namespace.quota import MAX_QUOTA, clear_quota, entry_quotas, set_quota
from registry.transport.scripts import ScriptRunner
from tests.support.backends import Backend, dump_keys, new_namespace, registry_state

H = [1_000_000_000_000 + i for i in range(40)]


def owner(backend: Backend, namespace: str | None = None) -> PrefixCacheRegistry:
    registry = backend.registry(namespace)
    assert isinstance(registry, PrefixCacheRegistry)
    registry.claim(60.0)
    return registry


def test_a_registration_past_the_quota_is_refused_whole(redis_backend: Backend) -> None:
    registry = owner(redis_backend)
    ns = registry.namespace
    set_quota(registry.client, ns, 4)
    registry.register_kv([1, 2, 3], H[:3])
    registry.register_mamba([2], [H[1]])  # 3 KV + 1 Mamba: at the limit
    before = dump_keys(registry)

    with pytest.raises(RegistryQuotaExceeded) as refused:
        registry.register_kv([4, 5], H[3:5])
    error = refused.value
    assert (error.namespace, error.held, error.limit, error.after) == (ns, 4, 4, 6)
    assert error.what == "entries"
    assert f"pcr quota set {ns} N" in str(error)
    with pytest.raises(RegistryQuotaExceeded):  # a Mamba entry is an entry too
        registry.register_mamba([3], [H[2]])
    with pytest.raises(RegistryQuotaExceeded):  # one held, one new: all or nothing
        registry.register_kv([9, 4], [H[0], H[3]])
    assert dump_keys(registry) == before

    # Entries it holds may be written again (nothing added), and removals always pass.
    registry.register_kv([9], [H[0]])
    registry.register_mamba([7], [H[1]])
    assert registry_state(registry) == ({H[0]: 9, H[1]: 2, H[2]: 3}, {H[1]: 7})
    assert registry.evict_kv([H[1]]) == {H[1]}  # and its Mamba entry: 2 left
    registry.register_kv([4, 5], H[3:5])
    assert registry_state(registry)[0] == {H[0]: 9, H[2]: 3, H[3]: 4, H[4]: 5}


def test_other_namespaces_and_a_cleared_limit_are_unaffected(redis_backend: Backend) -> None:
    full = owner(redis_backend)
    set_quota(full.client, full.namespace, 1)
    full.register_kv([1], H[:1])
    other = owner(redis_backend)
    other.register_kv(list(range(30)), H[:30])  # no limit of its own
    with pytest.raises(RegistryQuotaExceeded):
        full.register_kv([2], H[1:2])
    assert clear_quota(full.client, full.namespace) is True
    assert clear_quota(full.client, full.namespace) is False
    full.register_kv([2, 3], H[1:3])
    assert len(registry_state(full)[0]) == 3
    assert len(registry_state(other)[0]) == 30


def test_a_limit_lowered_under_what_a_namespace_holds(redis_backend: Backend) -> None:
    """The namespace keeps its entries and may shrink and rewrite, never grow, until
    it is under the limit; 0 refuses every new entry."""
    registry = owner(redis_backend)
    registry.register_kv([1, 2, 3], H[:3])
    set_quota(registry.client, registry.namespace, 0)
    (shown,) = entry_quotas(registry.client, [registry.namespace])
    assert (shown.limit, shown.entries, shown.over) == (0, 3, True)
    registry.register_kv([7], H[:1])
    assert registry.evict_kv([H[2]]) == {H[2]}
    with pytest.raises(RegistryQuotaExceeded) as refused:
        registry.register_kv([3], H[2:3])
    assert (refused.value.held, refused.value.limit, refused.value.after) == (2, 0, 3)
    assert registry_state(registry) == ({H[0]: 7, H[1]: 2}, {})


def test_bad_limits_fail_before_anything_is_sent(redis_backend: Backend) -> None:
    registry = owner(redis_backend)
    client = registry.client
    for bad in (-1, MAX_QUOTA + 1):
        with pytest.raises(ValueError, match="limit"):
            set_quota(client, registry.namespace, bad)
    for bad_type in (1.5, "10", True, None):
        with pytest.raises(TypeError, match="limit"):
            set_quota(client, registry.namespace, bad_type)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        set_quota(client, "a{b}", 3)
    assert client.exists(registry.keys.quota) == 0


def test_a_limit_that_is_not_a_whole_number_refuses_writes(redis_backend: Backend) -> None:
    """Written by hand, not by ``set_quota``: the scripts take no guess at what it
    meant; each write says which key to fix, removals still pass."""
    registry = owner(redis_backend)
    registry.register_kv([1], H[:1])
    registry.client.set(registry.keys.quota, "1e3")
    with pytest.raises(RegistryMisconfigured, match=r"QUOTA_INVALID .*pcr quota set"):
        registry.register_kv([2], H[1:2])
    assert registry.evict_kv([H[0]]) == {H[0]}
    (shown,) = entry_quotas(registry.client, [registry.namespace])
    assert (shown.limit, shown.unreadable) == (None, "1e3")


# -- mirror_apply and mirror_resync ----------------------------------------------------------


def mirror_run(inner: PrefixCacheRegistry, run: list[Any]) -> Any:
    """One ``mirror_apply`` call of ``run`` (the writes as the mirror encodes them)."""
    keys, args = inner.write_args("mirror_apply", inner.all_write_keys, True, run)
    return ScriptRunner(inner.client).run("mirror_apply", keys, args, namespace=inner.namespace)


def test_a_mirror_run_counts_its_evictions_and_clears(redis_backend: Backend) -> None:
    """A run is refused by what it would leave, worked out through every write in it:
    evictions (a KV eviction takes the hash's Mamba entry along) and clears make room
    for the registrations after them."""
    inner = owner(redis_backend)
    set_quota(inner.client, inner.namespace, 4)
    mirror_run(inner, ["k", 3, H[0], 1, H[1], 2, H[2], 3, "m", 1, H[1], 2])  # 4
    before = dump_keys(inner)
    with pytest.raises(RegistryQuotaExceeded) as refused:  # evicts 1, adds 2: 5
        mirror_run(inner, ["e", 1, H[0], "k", 2, H[3], 4, H[4], 5])
    assert (refused.value.held, refused.value.after) == (4, 5)
    with pytest.raises(RegistryQuotaExceeded):  # removes nothing: x of a hash it lacks
        mirror_run(inner, ["x", 1, H[9], "m", 1, H[2], 3])
    assert dump_keys(inner) == before

    mirror_run(inner, ["e", 1, H[1], "k", 2, H[3], 4, H[4], 5])  # -2 (cascade), +2
    assert registry_state(inner) == ({H[0]: 1, H[2]: 3, H[3]: 4, H[4]: 5}, {})
    mirror_run(inner, ["R", 0, "k", 3, H[5], 6, H[6], 7, H[7], 8, "m", 1, H[5], 6])
    assert registry_state(inner) == ({H[5]: 6, H[6]: 7, H[7]: 8}, {H[5]: 6})
    with pytest.raises(RegistryQuotaExceeded):  # a clear of the other map makes no room
        mirror_run(inner, ["M", 0, "k", 2, H[8], 9, H[9], 10])


def test_a_mirror_over_its_quota_keeps_redis_as_it_was(redis_backend: Backend) -> None:
    """The refused batch raises on ``flush``; the mirror keeps its entries and, once
    they fit again, its resync writes them all."""
    mirror = MirroredRegistry(redis_backend.client(), new_namespace())
    try:
        mirror.claim()
        set_quota(mirror.inner.client, mirror.namespace, 2)
        mirror.register_kv([1, 2], H[:2])
        mirror.flush()
        mirror.register_kv([3], H[2:3])
        with pytest.raises(RegistryQuotaExceeded):
            mirror.flush()
        assert registry_state(mirror.inner) == ({H[0]: 1, H[1]: 2}, {})
        with pytest.raises(RegistryQuotaExceeded):  # the resync: 3 entries do not fit
            mirror.flush()
        mirror.evict_kv([H[0]])
        mirror.flush()
        assert registry_state(mirror.inner) == mirror.entries() == ({H[1]: 2, H[2]: 3}, {})
    finally:
        mirror.close()


# -- bridge_apply -----------------------------------------------------------------------------


def store(engines: list[int], first: int = 0, map_name: str = "k", slot: int = 1) -> list[Any]:
    """One STORE of blocks at positions ``first``.., as ``registry.bridge.chain`` packs it."""
    digests = [hashlib.sha256(b"%d" % h).digest() for h in engines]
    return [
        "S", slot, map_name, first, len(engines),
        b"".join(b"%020d" % h for h in engines),
        b"".join(b"%019d" % digest_hash(d) for d in digests),
        b"".join(digests).hex(),
    ]  # fmt: skip


def remove(engines: list[int], slot: int = 1) -> list[Any]:
    return ["R", slot, len(engines), b"".join(b"%020d" % h for h in engines)]


@pytest.fixture
def bridged(redis_backend: Backend) -> PendingWrite:
    registry = owner(redis_backend)
    return PendingWrite(
        registry, EngineSource(registry.namespace, "tcp://127.0.0.1:5557"), FollowerCounts()
    )


def engine_blocks(pending: PendingWrite) -> int:
    registry = pending.registry
    return int(registry.client.hlen(registry.keys.engine_blocks))


def test_a_bridge_call_past_the_quota_changes_nothing(bridged: PendingWrite) -> None:
    registry = bridged.registry
    set_quota(registry.client, registry.namespace, 3)
    E = [9_000 + i for i in range(10)]
    bridged.apply(store(E[:3]), 1, 4)
    before = dump_keys(registry)
    call = [*remove(E[:1]), *store(E[3:5], 3)]  # -1 +2: 4
    with pytest.raises(RegistryQuotaExceeded) as refused:
        bridged.apply(call, 2, 4)
    assert (refused.value.held, refused.value.after, refused.value.what) == (3, 4, "entries")
    assert dump_keys(registry) == before  # meta's bridge_seq included
    assert registry.client.hget(registry.keys.meta, "bridge_seq") == b"1"

    # What the bridge then sends: the removals alone, at the same position.
    kept, dropped = without_stores(call)
    assert (kept, dropped) == (remove(E[:1]), 2)
    bridged.apply(kept, 2, 4)
    assert len(registry_state(registry)[0]) == engine_blocks(bridged) == 2
    assert registry.client.hget(registry.keys.meta, "bridge_seq") == b"2"
    # At the limit, a call that removes as many as it stores fits; a clear makes room.
    bridged.apply(store(E[5:6], 5), 3, 4)
    bridged.apply([*remove(E[5:6]), *store(E[7:8], 7)], 4, 4)
    assert len(registry_state(registry)[0]) == engine_blocks(bridged) == 3
    bridged.apply(["C", *store(E[:3])], 5, 4)
    assert registry_state(registry)[0] == {
        digest_hash(hashlib.sha256(b"%d" % h).digest()): i for i, h in enumerate(E[:3])
    }


def test_engine_blocks_no_map_lists_count_against_the_quota(bridged: PendingWrite) -> None:
    """Blocks held only by a Mamba group are listed in neither map (no KV prefix), but
    the bridge keeps each one in engine-blocks: those are held to the limit too."""
    registry = bridged.registry
    set_quota(registry.client, registry.namespace, 3)
    E = [7_000 + i for i in range(6)]
    bridged.apply(store(E[:3], 0, "m", 2), 1, 4)
    assert registry_state(registry) == ({}, {})
    assert engine_blocks(bridged) == 3
    with pytest.raises(RegistryQuotaExceeded) as refused:
        bridged.apply(store(E[3:4], 3, "m", 2), 2, 4)
    assert (refused.value.what, refused.value.held, refused.value.after) == ("engine blocks", 3, 4)
    assert engine_blocks(bridged) == 3
