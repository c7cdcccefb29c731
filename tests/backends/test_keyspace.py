"""What a fleet leaves in Redis, on fakeredis, a real server and a real 3-master cluster:
after owners claim, write, evict, clear and claim again, an operator evicts, a mirrored
owner writes behind (and rewrites its namespace after its queue overflowed), routers
score exactly and from a fleet view, an engine and a gateway replica announce
themselves, and ``gc`` collects a dead namespace, the only keys are the namespaces' own
(``pcr:{NS}:*``), the node index ``pcr:nodes``, the engine table ``pcr:engines`` and the
gateway load table ``pcr:gateway:load``: no derived index is kept in Redis.
"""

from __future__ import annotations

import uuid
from typing import Any

from registry import (
    MirroredRegistry,
    NodeIndex,
    PrefixCacheRegistry,
    PrefixRouter,
    collect_dead,
    live_nodes,
)
from registry.core.keys import NamespaceKeys, engines_key, gateway_load_channel, gateway_load_key
from registry.fleet.view import FleetView
from registry.transport.scripts import ScriptRunner
from tests.support.backends import Backend, expire_lease

H = [10**15 + i for i in range(40)]


def keys_named(client: Any, prefix: str) -> set[str]:
    """Every key whose name holds ``prefix``, on every primary."""
    get_primaries = getattr(client, "get_primaries", None)
    servers = [client] if get_primaries is None else [
        client.get_redis_connection(node) for node in get_primaries()
    ]  # fmt: skip
    found = set()
    for server in servers:
        for key in server.scan_iter(match=f"*{prefix}*", count=1000):
            found.add(key.decode() if isinstance(key, bytes) else key)
    return found


def owner(backend: Backend, namespace: str, prefix: str) -> PrefixCacheRegistry:
    reg = backend.registry(namespace, key_prefix=prefix)
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=60)
    return reg


def test_a_fleet_leaves_only_its_namespaces_the_node_index_and_the_shared_tables(
    redis_backend: Backend,
) -> None:
    prefix = f"ks{uuid.uuid4().hex[:8]}"
    client = redis_backend.client()
    names = ["node-a", "node-b", "node-m", "node-dead"]
    with FleetView(redis_backend.client(), prefix) as view:
        a, b, dead = (owner(redis_backend, n, prefix) for n in ("node-a", "node-b", "node-dead"))
        for reg, n in ((a, 40), (b, 24), (dead, 8)):
            reg.register_kv(range(n), H[:n])
            reg.register_mamba([3, 7], [H[3], H[7]])
        a.evict_kv(H[30:])
        a.evict_mamba([H[7]])
        b.clear_kv()
        b.register_kv(range(12), H[:12])
        b.reset()
        b.register_kv(range(16), H[:16])
        again = owner(redis_backend, "node-a", prefix)  # a restart: a new epoch, emptied
        again.register_kv(range(20), H[:20])
        operator = redis_backend.registry("node-b", key_prefix=prefix)  # owns nothing
        operator.evict_kv(H[14:16])

        mirror = MirroredRegistry(redis_backend.client(), "node-m", key_prefix=prefix, max_queue=2)
        try:
            mirror.claim(lease_ttl=60)
            mirror.register_kv(range(10), H[:10])
            mirror.flush()
            mirror.stop_flusher()
            for i in range(3):  # the third overflows the queue: a resync rewrites it
                mirror.register_kv([10 + i], [H[10 + i]])
            mirror.register_mamba([4], [H[4]])
            mirror.flush()
            assert mirror.counts().resyncs == 1
        finally:
            mirror.close()

        index = NodeIndex(client, prefix)
        index.announce_engine("node-a", "http://10.0.0.7:8000")
        ScriptRunner(client).run(
            "gateway_load",
            (gateway_load_key(prefix),),
            ("gw-1", 5000, '{"seq": 1, "load": {}}', gateway_load_channel(prefix)),
        )

        expire_lease(dead)
        assert collect_dead(client, prefix) == ["node-dead"]
        view.sync()
        exact = PrefixRouter(client, prefix, exact=True).score(H)
        assert PrefixRouter(client, prefix, view=view).score(H) == exact
        assert {n: s.kv_prefix for n, s in exact.items()} == {
            "node-a": 20,
            "node-b": 14,
            "node-m": 13,
        }
        assert sorted(live_nodes(client, prefix)) == ["node-a", "node-b", "node-m"]

    shared = {f"{prefix}:nodes", engines_key(prefix), gateway_load_key(prefix)}
    own = [NamespaceKeys(n, prefix) for n in names]
    found = keys_named(client, prefix)
    strangers = {k for k in found if k not in shared and not any(ns.owns(k) for ns in own)}
    assert strangers == set()
    assert shared <= found
    for ns in own[:3]:
        assert {ns.kv, ns.meta} <= found
    assert not {*own[3].all_keys()} & found  # collected: only its expiring replies may stay
