"""Connecting: from_url schemes, client kinds, decode_responses, round trips, SCRIPT FLUSH."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster

from registry import PrefixCacheRegistry, PrefixRouter
from tests.support.backends import Backend, new_namespace
from tests.support.counting import counted_sends
from tests.support.servers import RedisClusterServers, RedisServer, require_redis_server

H = [1111, 2222, 3333]


def exercise(reg: PrefixCacheRegistry) -> None:
    """One pass over every method; asserts the results."""
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_kv([1, 2, 3], H)
    reg.register_mamba([2], H[1:2])
    assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])
    assert reg.match_mamba_farthest(H) == 2
    assert reg.find_mamba_backoff(H, 1) == 0
    assert reg.evict_kv(H[1:2]) == {H[1]}
    assert fired == [[2]]
    reg.register_mamba([1], H[:1])
    assert reg.evict_mamba(H) == {H[0]}
    reg.clear_kv()
    reg.clear_mamba()
    reg.reset()
    assert reg.match_kv_prefix(H) == ([], 0)


@pytest.mark.parametrize("decode_responses", [False, True])
def test_decode_responses_on_and_off(redis_backend: Backend, decode_responses: bool) -> None:
    reg = redis_backend.registry(decode_responses=decode_responses)
    assert isinstance(reg, PrefixCacheRegistry)
    exercise(reg)


def test_script_flush_between_calls(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    admin = redis_backend.client()
    for method, args in [
        ("register_kv", ([1, 2, 3], H)),
        ("match_kv_prefix", (H,)),
        ("register_mamba", ([2], H[1:2])),
        ("match_mamba_farthest", (H,)),
        ("evict_kv", (H[1:2],)),
        ("evict_mamba", (H,)),
        ("clear_kv", ()),
        ("clear_mamba", ()),
        ("reset", ()),
    ]:
        admin.script_flush()  # on a cluster: every primary
        getattr(reg, method)(*args)
    reg.register_kv([7], H[:1])
    admin.script_flush()
    assert reg.match_kv_prefix(H) == ([7], H[0])


class CountingRedis(redis.Redis):
    """Records the name of the first command of every socket write of its connections
    (redis-py's own path, and the registry's one-connection path): one entry is one
    round trip."""

    sent: list[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sent: list[str] = []
        self.sent = sent

        class Counted(self.connection_pool.connection_class):  # type: ignore[name-defined,misc]
            def send_packed_command(self, command: Any, *rest: Any, **options: Any) -> Any:
                payload = command if isinstance(command, bytes) else b"".join(command)
                name = payload.split(b"\r\n")[2] if payload.startswith(b"*") else payload
                if name.upper() != b"PING":  # redis-py's health check
                    sent.append(name.decode().upper())
                return super().send_packed_command(command, *rest, **options)

        self.connection_pool.connection_class = Counted


def test_one_round_trip_per_call_and_none_for_empty_input(redis_server: RedisServer) -> None:
    client = CountingRedis(port=redis_server.port)
    reg = PrefixCacheRegistry(client, new_namespace())
    reg.load_scripts()
    # (method, arguments, the commands sent): writes are one script, reads one HMGET.
    calls: list[tuple[str, tuple[Any, ...], list[str]]] = [
        ("register_kv", ([1, 2, 3], H), ["EVALSHA"]),
        ("register_kv", ([], []), []),
        ("match_kv_prefix", (H,), ["HMGET"]),
        ("match_kv_prefix", ([],), []),
        ("match_kv_prefix", ([-1, *H],), []),  # a leading sentinel can never match
        ("register_mamba", ([2], H[1:2]), ["EVALSHA"]),
        ("register_mamba", ([2], [-1]), []),
        ("match_mamba_farthest", (H,), ["HMGET"]),
        ("find_mamba_backoff", (H, 2), ["HMGET"]),
        ("find_mamba_backoff", (H, 0), []),
        ("mamba_block_ids", (H,), ["HMGET"]),
        ("notice_sequence", (), ["HMGET"]),
        ("evict_kv", (H[1:2],), ["EVALSHA"]),
        ("evict_kv", ([-1, -1],), []),
        ("evict_mamba", (H,), ["EVALSHA"]),
        ("evict_mamba", ([],), []),
        ("clear_kv", (), ["EVALSHA"]),
        ("clear_mamba", (), ["EVALSHA"]),
        ("reset", (), ["EVALSHA"]),
    ]
    for method, args, sent in calls:
        client.sent.clear()
        getattr(reg, method)(*args)
        assert client.sent == sent, f"{method}{args}: {client.sent}"
    big = list(range(1, 20_001))
    client.sent.clear()
    reg.register_kv(list(range(20_000)), big)
    assert reg.match_kv_prefix(big) == (list(range(20_000)), 20_000)
    assert client.sent == ["EVALSHA", "HMGET"]  # chunking happens inside the script
    client.close()


def test_an_owners_write_and_its_change_record_are_one_round_trip(
    redis_server: RedisServer,
) -> None:
    """A claimed owner's write publishes its change record (what fleet views follow)
    inside its own script: one round trip each."""
    client = redis.Redis(port=redis_server.port)
    reg = PrefixCacheRegistry(client, new_namespace())
    reg.load_scripts()
    reg.claim(lease_ttl=60)
    writes: list[tuple[str, tuple[Any, ...]]] = [
        ("register_kv", ([1, 2, 3], H[:3])),
        ("register_mamba", ([2], H[1:2])),
        ("evict_mamba", (H[1:2],)),
        ("evict_kv", (H[2:3],)),
    ]
    for method, args in writes:
        with counted_sends() as sends:
            getattr(reg, method)(*args)
        assert len(sends) == 1, method
    assert PrefixRouter(client).score(H, [reg.namespace])[reg.namespace].kv_prefix == 2
    client.close()


def test_from_url_standalone(redis_server: RedisServer) -> None:
    namespace = new_namespace()
    reg = PrefixCacheRegistry.from_url(redis_server.url, namespace, decode_responses=True)
    assert isinstance(reg.client, redis.Redis)
    assert reg.namespace == namespace
    exercise(reg)
    reg.client.close()


@pytest.fixture(scope="module")
def unix_socket_server() -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer(["--unixsocket", "{dir}/redis.sock", "--unixsocketperm", "700"]) as server:
        yield server


def test_from_url_unix_socket(unix_socket_server: RedisServer) -> None:
    reg = PrefixCacheRegistry.from_url(f"unix://{unix_socket_server.dir}/redis.sock", "n-unix")
    exercise(reg)
    assert reg.client.connection_pool.connection_class is redis.UnixDomainSocketConnection
    reg.client.close()


def test_from_url_rediss_builds_a_tls_client() -> None:
    reg = PrefixCacheRegistry.from_url("rediss://user:secret@127.0.0.1:1/0", "n-tls")
    assert reg.client.connection_pool.connection_class is redis.SSLConnection
    reg.client.close()


@pytest.mark.parametrize("scheme", ["redis+cluster", "cluster=True"])
def test_from_url_cluster(redis_cluster: RedisClusterServers, scheme: str) -> None:
    host, port = redis_cluster.startup_nodes[0]
    if scheme == "cluster=True":
        reg = PrefixCacheRegistry.from_url(f"redis://{host}:{port}", new_namespace(), cluster=True)
    else:
        reg = PrefixCacheRegistry.from_url(f"redis+cluster://{host}:{port}", new_namespace())
    assert isinstance(reg.client, redis.cluster.RedisCluster)
    exercise(reg)
    reg.client.close()


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("http://user:hunter2@localhost:6379", {}, "unsupported Redis URL scheme 'http'"),
        ("localhost:6379", {}, "unsupported Redis URL scheme"),
        ("redis+cluster://user:hunter2@h:1", {"cluster": False}, "cluster=False"),
        ("unix:///tmp/x.sock", {"cluster": True}, "unix://"),
    ],
)
def test_from_url_rejects_bad_urls_without_echoing_secrets(
    url: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        PrefixCacheRegistry.from_url(url, "n", **options)
    assert "hunter2" not in str(info.value)


def test_from_url_checks_the_namespace_before_connecting() -> None:
    with pytest.raises(ValueError, match="namespace"):
        PrefixCacheRegistry.from_url("redis://127.0.0.1:1/0", "bad namespace")
    with pytest.raises(TypeError, match="url"):
        PrefixCacheRegistry.from_url(None, "n")  # type: ignore[arg-type]
