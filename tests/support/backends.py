"""The four storage backends every behaviour runs on, and helpers to look at a registry's
storage: in-memory, fakeredis, a real redis-server and a real 3-master Redis Cluster.

``BACKEND_PARAMS`` carries a marker on each real backend, so ``-m "not cluster"`` and
``-m "not redis_server"`` really deselect those runs. Each test works in namespaces of its
own, so tests never see each other's keys on the shared servers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import pytest

from registry import LocalPrefixCacheRegistry, NodeIndex, PrefixCacheRegistry, RegistryBase
from tests.support.servers import RedisClusterServers, RedisServer

BACKEND_PARAMS = [
    pytest.param("local", id="local"),
    pytest.param("fakeredis", id="fakeredis"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis_server),
    pytest.param("cluster", id="cluster", marks=[pytest.mark.redis_server, pytest.mark.cluster]),
]
"""Every storage kind, with its markers."""
REDIS_BACKEND_PARAMS = BACKEND_PARAMS[1:]
"""The Redis kinds (fakeredis, a real server, a real cluster)."""


def new_namespace() -> str:
    """A namespace no other test uses."""
    return f"t-{uuid.uuid4().hex[:12]}"


@dataclass
class Backend:
    """Makes registries (and raw clients) of one storage kind for one test."""

    name: str
    make_client: Callable[..., Any] | None
    _clients: list[Any] = field(default_factory=list)

    @property
    def is_redis(self) -> bool:
        return self.make_client is not None

    def client(self, **options: Any) -> Any:
        """A new raw client to this backend's server (not for ``local``)."""
        assert self.make_client is not None, "the local backend has no Redis client"
        client = self.make_client(**options)
        self._clients.append(client)
        return client

    def registry(
        self, namespace: str | None = None, *, decode_responses: bool = False, **options: Any
    ) -> RegistryBase:
        """A registry on a fresh namespace (or the one given)."""
        if not self.is_redis:
            return LocalPrefixCacheRegistry()
        client = self.client(decode_responses=decode_responses)
        return PrefixCacheRegistry(client, namespace or new_namespace(), **options)

    def close(self) -> None:
        for client in self._clients:
            client.close()


def make_backend(name: str, request: pytest.FixtureRequest) -> Backend:
    if name == "local":
        return Backend(name, None)
    if name == "fakeredis":
        server = fakeredis.FakeServer()
        return Backend(name, lambda **kw: fakeredis.FakeRedis(server=server, **kw))
    if name == "redis":
        real: RedisServer = request.getfixturevalue("redis_server")
        return Backend(name, real.client)
    cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
    return Backend(name, cluster.client)


def registry_state(registry: RegistryBase) -> tuple[dict[int, int], dict[int, int]]:
    """The (kv, mamba) mappings a registry holds, read straight from its storage."""
    if isinstance(registry, LocalPrefixCacheRegistry):
        return dict(registry.kv), dict(registry.mamba)
    assert isinstance(registry, PrefixCacheRegistry)
    client, keys = registry.client, registry.keys
    return (
        {int(k): int(v) for k, v in client.hgetall(keys.kv).items()},
        {int(k): int(v) for k, v in client.hgetall(keys.mamba).items()},
    )


def dump_keys(registry: PrefixCacheRegistry) -> dict[str, Any]:
    """Byte-exact snapshot of every key of a registry's namespace (``DUMP``)."""
    return {key: registry.client.dump(key) for key in registry.keys.all_keys()}


def notice_base(registry: RegistryBase) -> int:
    """Where a registry's notice numbers start: a Redis namespace's history counts from
    the server's clock in microseconds (the first 16 digits of its incarnation id), the
    in-memory registry from 0. Subtract it to compare numbers across registries."""
    if not isinstance(registry, PrefixCacheRegistry):
        return 0
    incarnation, _seq = registry.notice_position()
    return int(incarnation[:-3]) if incarnation else 0


def relative(registry: RegistryBase, notice: Any) -> tuple[int, str, tuple[tuple[int, int], ...]]:
    """A notice as (number from its history's start, kind, pairs), comparable across
    registries (the incarnation itself differs)."""
    return notice.seq - notice_base(registry), notice.kind, notice.pairs


def expire_lease(registry: PrefixCacheRegistry) -> None:
    """End an owner's lease now, by the server's own clock, in ``meta`` and in the node
    index: what the passing of time does, without a test waiting on a wall clock."""
    seconds, micros = registry.client.time()
    past = int(seconds) * 1000 + int(micros) // 1000 - 1
    registry.client.hset(registry.keys.meta, "lease_until", past)
    index = NodeIndex(registry.client, registry.keys.key_prefix)
    registry.client.zadd(index.key, {registry.namespace: past})
