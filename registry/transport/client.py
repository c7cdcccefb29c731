"""The Redis client surface the registry uses, building a client from a URL, and the
bounds of a call.

Any of ``redis.Redis``, ``redis.cluster.RedisCluster`` and ``fakeredis.FakeRedis``
fits, with ``decode_responses`` on or off: every reply is parsed with ``int()``,
which takes ``str`` and ``bytes`` alike. A redis-py client is thread-safe (it owns a
connection pool), so one client may serve many registries and threads. The defaults
of ``PrefixCacheRegistry.from_url`` (``bounded_options``) keep any call under
``CALL_BOUND`` seconds; ``async_client_from_url`` and ``bounded_async_options`` are the
same for ``redis.asyncio`` (the asyncio router, ``pcr serve``, ``pcr gateway``).
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
PLAIN_SCHEMES = ("redis", "rediss", "unix")


class RedisClient(Protocol):
    """The part of a redis-py style client the registry calls."""

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
    ``redis.cluster.RedisCluster``; ``redis+sentinel://host:port[,host:port...]/service[/db]``
    gives the master that Sentinel names, checked to be one (``registry.transport.sentinel``: found
    again after a failover, never an old primary that came back). ``options``
    go to the client's ``from_url`` (to the master's connections for Sentinel).
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme in SENTINEL_SCHEMES:
        if cluster:
            raise ValueError("a redis+sentinel:// URL names a standalone master, not a cluster")
        return _sentinel_master(url, scheme == "rediss+sentinel", options)
    if scheme in CLUSTER_SCHEMES:
        if cluster is False:
            raise ValueError(f"url scheme {scheme!r} asks for Redis Cluster but cluster=False")
        url = CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
        cluster = True
    elif scheme not in PLAIN_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES))
        raise ValueError(f"unsupported Redis URL scheme {scheme or '(none)'!r}; use one of {known}")
    if cluster:
        if scheme == "unix":
            raise ValueError("Redis Cluster cannot be reached through a unix:// socket URL")
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    import redis

    return redis.Redis.from_url(url, **options)


def _sentinel_master(url: str, tls: bool, options: dict[str, Any]) -> Any:
    """A client for the master of ``redis+sentinel://[user:pw@]h1:p1,h2:p2/service[/db]``."""
    from registry.transport.sentinel import VerifiedSentinel

    parts = urlsplit(url)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("a redis+sentinel:// URL ends with /SERVICE_NAME or /SERVICE_NAME/DB")
    hosts = parts.netloc.rpartition("@")[2]
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("a redis+sentinel:// URL lists sentinels as host:port,host:port")
        sentinels.append((host.strip("[]"), int(port)))
    master_options = dict(options)
    if parts.username:
        master_options.setdefault("username", unquote(parts.username))
    if parts.password:
        master_options.setdefault("password", unquote(parts.password))
    if len(path) == 2:
        master_options.setdefault("db", int(path[1]))
    if tls:
        master_options.setdefault("ssl", True)
    # The sentinels get the same bounded waits and retry policy as the master, so a
    # silent sentinel cannot stretch a call past the bound the caller chose.
    bounded = {
        k: master_options[k]
        for k in ("socket_timeout", "socket_connect_timeout", "retry")
        if k in master_options
    }
    sentinel = VerifiedSentinel(sentinels, sentinel_kwargs=bounded)  # type: ignore[no-untyped-call]
    return sentinel.master_for(path[0], **master_options)


# -- the bounds of a call ---------------------------------------------------------------

CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 2.0
RETRIES = 1
RETRY_BACKOFF_CAP = 0.25
CALL_BOUND = (RETRIES + 1) * (CONNECT_TIMEOUT + 2 * READ_TIMEOUT) + RETRIES * RETRY_BACKOFF_CAP
"""The longest a call on a ``from_url`` client blocks before raising (10.25 s): each
attempt may connect, send its handshake and read one reply, and there is one retry."""

DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": CONNECT_TIMEOUT,
    "socket_timeout": READ_TIMEOUT,
    "health_check_interval": 30,
}
"""``from_url`` defaults (any may be overridden): bounded waits (``CALL_BOUND``), so a
serving node sees ``RegistryUnavailable`` within seconds instead of hanging."""


def default_retry() -> Any:
    """The ``from_url`` retry policy: one quick retry with jittered backoff."""
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.retry import Retry

    return Retry(ExponentialWithJitterBackoff(base=0.02, cap=RETRY_BACKOFF_CAP), RETRIES)


def redacted(url: str) -> str:
    """``url`` without its user name and password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "the Redis URL"
    return f"{scheme}://{rest.rpartition('@')[2]}"


def bounded_options(client_options: dict[str, Any]) -> dict[str, Any]:
    """``client_options`` over the bounded defaults (timeouts and one quick retry)."""
    options = {**DEFAULT_CLIENT_OPTIONS, **client_options}
    options.setdefault("retry", default_retry())
    return options


# -- asyncio clients ---------------------------------------------------------------------


def async_client_from_url(url: str, **options: Any) -> Any:
    """A ``redis.asyncio`` client for a ``redis://``, ``rediss://``, ``unix://`` URL, or a
    ``redis.asyncio.cluster.RedisCluster`` for ``redis+cluster://`` / ``rediss+cluster://``
    (``options`` go to its ``from_url``). Sentinel URLs are not supported here."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    scheme = url.partition("://")[0].lower()
    if scheme in CLUSTER_SCHEMES:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(CLUSTER_SCHEMES[scheme] + url[len(scheme) :], **options)
    if scheme not in PLAIN_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, *CLUSTER_SCHEMES))
        raise ValueError(f"unsupported Redis URL scheme {scheme or '(none)'!r}; use one of {known}")
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, **options)


def bounded_async_options(
    cluster: bool = False, *, max_connections: int | None = None
) -> dict[str, Any]:
    """The bounded waits and the quick retry of ``PrefixCacheRegistry.from_url``, for an
    asyncio client; with ``max_connections``, a pool of that many connections (per Redis
    node on a cluster). redis-py refuses a command at once ("Too many connections") when
    they are all in use, on both kinds of client: let no more callers than that use the
    client at once (``pcr serve`` has them wait their turn)."""
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": READ_TIMEOUT,
    }
    if not cluster:
        options["retry"] = Retry(
            ExponentialWithJitterBackoff(base=0.02, cap=RETRY_BACKOFF_CAP), RETRIES
        )
    if max_connections is not None:
        options["max_connections"] = max_connections
    return options
