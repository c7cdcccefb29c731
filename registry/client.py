"""The Redis client surface the registry uses, and building a client from a URL.

Any of ``redis.Redis``, ``redis.cluster.RedisCluster`` and ``fakeredis.FakeRedis``
fits, with ``decode_responses`` on or off: every reply is parsed with ``int()``,
which takes ``str`` and ``bytes`` alike. A redis-py client is thread-safe (it owns a
connection pool), so one client may serve many registries and threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
PLAIN_SCHEMES = ("redis", "rediss", "unix")


class Script(Protocol):
    """What ``register_script`` returns: calls EVALSHA and reloads on NOSCRIPT."""

    def __call__(
        self,
        keys: Sequence[Any] | None = None,
        args: Sequence[Any] | None = None,
        client: Any = None,
    ) -> Any: ...


class RedisClient(Protocol):
    """The part of a redis-py style client the registry calls."""

    def register_script(self, script: str) -> Any: ...

    def script_load(self, script: str) -> Any: ...

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    def hmget(self, name: str, keys: Any, *args: Any) -> Any: ...

    def hget(self, name: str, key: str) -> Any: ...

    def xrevrange(
        self, name: str, max: str = "+", min: str = "-", count: int | None = None
    ) -> Any: ...


def client_from_url(url: str, *, cluster: bool | None = None, **options: Any) -> Any:
    """Build a redis-py client for ``url``.

    ``redis://``, ``rediss://`` and ``unix://`` give ``redis.Redis``;
    ``redis+cluster://`` and ``rediss+cluster://`` (or ``cluster=True``) give
    ``redis.cluster.RedisCluster``. ``options`` go to the client's ``from_url``.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        if cluster is False:
            raise ValueError(f"url scheme {scheme!r} asks for Redis Cluster but cluster=False")
        url = CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
        cluster = True
    elif scheme not in PLAIN_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, *CLUSTER_SCHEMES))
        raise ValueError(f"unsupported Redis URL scheme {scheme or '(none)'!r}; use one of {known}")
    if cluster:
        if scheme == "unix":
            raise ValueError("Redis Cluster cannot be reached through a unix:// socket URL")
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    import redis

    return redis.Redis.from_url(url, **options)
