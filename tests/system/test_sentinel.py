"""Sentinel-managed standalone Redis through ``redis+sentinel://``: the registry follows
the master across a failover (RegistryUnavailable meanwhile, then it carries on)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from registry import PrefixCacheRegistry, RegistryUnavailable
from tests.support.servers import RedisServer, find_redis_server, free_port, require_redis_server
from tests.support.waiting import wait_until

H = [1111, 2222, 3333]


@pytest.fixture
def sentinel_setup() -> Iterator[tuple[RedisServer, RedisServer, int]]:
    """A master, its replica, and one Sentinel watching them as ``mymaster``."""
    require_redis_server()
    binary = find_redis_server()
    assert binary is not None
    with (
        RedisServer() as master,
        RedisServer(["--replicaof", "127.0.0.1", str(master.port)]) as replica,
    ):
        replica_client = replica.client()
        wait_until(
            lambda: replica_client.info("replication")["master_link_status"] == "up",
            what="replica linked",
        )
        replica_client.close()
        directory = Path(tempfile.mkdtemp(prefix="pcr-sentinel-"))
        port = free_port()
        (directory / "sentinel.conf").write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 2000\n"
        )
        process = subprocess.Popen(
            [binary, str(directory / "sentinel.conf"), "--sentinel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        sentinel = redis.Redis(port=port)
        try:
            wait_until(lambda: _answers(sentinel), what="sentinel up")
            yield master, replica, port
        finally:
            sentinel.close()
            process.terminate()
            process.wait(10)
            shutil.rmtree(directory, ignore_errors=True)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_registry_follows_the_master_across_a_sentinel_failover(
    sentinel_setup: tuple[RedisServer, RedisServer, int],
) -> None:
    master, replica, sentinel_port = sentinel_setup
    reg = PrefixCacheRegistry.from_url(
        f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster", "node-s", socket_timeout=2
    )
    reg.claim()
    reg.register_kv([1, 2, 3], H)
    assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])
    replica_client = replica.client()
    wait_until(lambda: replica_client.hlen(reg.keys.kv) == 3, what="entries replicated")
    master.kill()
    unavailable = 0
    deadline = time.monotonic() + 30
    while True:
        try:
            reg.register_kv([4], [4444])
            break
        except RegistryUnavailable:
            unavailable += 1
            assert time.monotonic() < deadline, "no failover within 30 s"
            time.sleep(0.1)
    assert unavailable >= 1
    assert replica_client.execute_command("ROLE")[0] == b"master"  # the replica took over
    assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])  # and kept the replicated entries
    assert replica_client.hget(reg.keys.kv, "4444") == b"4"
    replica_client.close()


def test_bad_sentinel_urls() -> None:
    for url, message in [
        ("redis+sentinel://127.0.0.1:26379", "SERVICE_NAME"),
        ("redis+sentinel://127.0.0.1/mymaster", "host:port"),
        ("redis+sentinel://127.0.0.1:26379/mymaster/x", "SERVICE_NAME"),
    ]:
        with pytest.raises(ValueError, match=message):
            PrefixCacheRegistry.from_url(url, "n")
    with pytest.raises(ValueError, match="standalone master"):
        PrefixCacheRegistry.from_url("redis+sentinel://h:1/m", "n", cluster=True)
