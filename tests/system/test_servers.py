"""Self-checks for the real-server helpers in ``servers.py`` (not tests of the registry)."""

from __future__ import annotations

import pytest

from tests.support.servers import RedisClusterServers, RedisServer, require_redis_server


@pytest.mark.redis_server
def test_standalone_server_start_restart_stop() -> None:
    """A standalone server answers, restart() keeps its port, stop() leaves no process."""
    require_redis_server()
    server = RedisServer()
    with server:
        port = server.port
        assert server.url == f"redis://127.0.0.1:{port}/0"
        with server.client(decode_responses=True) as client:
            assert client.set("k", "v")
            assert client.get("k") == "v"

        server.restart()
        assert server.port == port
        with server.client(decode_responses=True) as client:
            assert client.ping()
            # No persistence: the key is gone after the restart.
            assert client.get("k") is None
        process = server.process
    assert process is not None
    assert process.returncode is not None
    assert not server.running
    server.stop()  # idempotent


@pytest.mark.redis_server
@pytest.mark.cluster
def test_three_master_cluster_forms_and_serves() -> None:
    """A 3-master cluster forms; keys spread over slots work; registry hash tags co-locate."""
    require_redis_server()
    with RedisClusterServers() as cluster:
        assert len(cluster.nodes) == 3
        assert cluster.startup_nodes == [("127.0.0.1", node.port) for node in cluster.nodes]
        client = cluster.client(decode_responses=True)
        try:
            keys = [f"key:{i}" for i in range(50)]
            for i, key in enumerate(keys):
                assert client.set(key, str(i))
            assert [client.get(key) for key in keys] == [str(i) for i in range(50)]
            assert len({client.cluster_keyslot(key) for key in keys}) > 1
            # Every master holds some of the keys: they really are spread over the cluster.
            per_node = []
            for node in cluster.nodes:
                with node.client() as direct:
                    per_node.append(direct.dbsize())
            assert sum(per_node) == 50
            assert all(count > 0 for count in per_node)

            kv_slot = client.cluster_keyslot("pcr:{ns}:kv")
            mamba_slot = client.cluster_keyslot("pcr:{ns}:mamba")
            assert kv_slot == mamba_slot
        finally:
            client.close()
    assert all(node.process is not None for node in cluster.nodes)
    assert all(not node.running for node in cluster.nodes)
