"""Redis Cluster: one namespace lives in one slot; many namespaces spread over shards."""

from __future__ import annotations

import pytest
import redis
import redis.cluster

from registry import NamespaceKeys, PrefixCacheRegistry
from registry.transport.scripts import script_source
from tests.support.backends import new_namespace
from tests.support.servers import RedisClusterServers

H = [1111, 2222, 3333]


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterServers) -> redis.cluster.RedisCluster:
    client = redis_cluster.client()
    yield client
    client.close()


def test_every_key_and_the_channel_of_a_namespace_share_one_slot(
    cluster_client: redis.cluster.RedisCluster,
) -> None:
    for namespace in ["node-0", "node-1", "dp-rank-7", "nœud", "a:b"]:
        keys = NamespaceKeys(namespace)
        names = [*keys.all_keys(), keys.mamba_evicted_channel]
        slots = {cluster_client.cluster_keyslot(name) for name in names}
        assert slots == {cluster_client.cluster_keyslot(namespace)}, namespace


def test_keys_of_two_namespaces_in_one_script_are_refused_with_crossslot(
    cluster_client: redis.cluster.RedisCluster,
) -> None:
    """Why the hash tag matters: a script over keys of two slots cannot run."""
    a = NamespaceKeys("node-0")
    b = next(
        NamespaceKeys(f"node-{i}")
        for i in range(1, 100)
        if cluster_client.cluster_keyslot(f"node-{i}") != cluster_client.cluster_keyslot("node-0")
    )
    node = cluster_client.get_node_from_key(a.kv)
    direct = redis.Redis(host=node.host, port=node.port)
    try:
        with pytest.raises(redis.ResponseError, match=r"(CROSSSLOT|same slot)"):
            direct.eval(script_source("clear_kv"), 2, a.kv, b.kv)
    finally:
        direct.close()


def test_namespaces_spread_over_all_shards_and_work_independently(
    cluster_client: redis.cluster.RedisCluster,
) -> None:
    registries = [PrefixCacheRegistry(cluster_client, new_namespace()) for _ in range(30)]
    owners = {cluster_client.get_node_from_key(r.keys.kv).name for r in registries}
    assert len(owners) == 3  # 30 random namespaces land on every master
    for i, reg in enumerate(registries):
        reg.register_kv([i, i + 1], H[:2])
        reg.register_mamba([i], H[:1])
    for i, reg in enumerate(registries):
        assert reg.match_kv_prefix(H) == ([i, i + 1], H[1])
        assert reg.evict_kv(H[:1]) == {H[0]}
        assert reg.match_mamba_farthest(H) == 0
