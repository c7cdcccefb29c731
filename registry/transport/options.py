"""The keyword options a URL-built registry hands to redis-py, checked before they get
there (:func:`check_client_options`).

``PrefixCacheRegistry.from_url`` passes whatever keywords it does not take itself on to
redis-py. Unchecked, a misspelt or removed registry option (``mirror=True``,
``key_prefx=``) reached redis-py's connection constructor and failed there, at the first
connection, with a message naming ``AbstractConnection.__init__`` and not the registry.
Here a keyword that no redis-py client, pool or connection takes raises ``TypeError``
at once, naming the registry's own parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any


@functools.cache
def redis_client_options() -> frozenset[str]:
    """Every keyword some redis-py client, connection pool or connection accepts (the
    installed version's own signatures, so a new redis-py option passes)."""
    import redis
    import redis.cluster
    import redis.connection as connection

    takers: list[Any] = [
        redis.Redis.__init__,
        redis.cluster.RedisCluster.__init__,
        connection.ConnectionPool.__init__,
        connection.AbstractConnection.__init__,
        connection.Connection.__init__,
        connection.SSLConnection.__init__,
        connection.UnixDomainSocketConnection.__init__,
    ]
    names: set[str] = set()
    for taker in takers:
        for parameter in inspect.signature(taker).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    names.discard("self")
    return frozenset(names)


def check_client_options(options: Mapping[str, Any], caller: str, own: Iterable[str]) -> None:
    """Raise ``TypeError`` for a keyword in ``options`` that redis-py does not take,
    naming ``caller`` and its ``own`` parameters."""
    unknown = sorted(k for k in options if k not in redis_client_options())
    if not unknown:
        return
    shown = ", ".join(repr(k) for k in unknown)
    word = "arguments" if len(unknown) > 1 else "argument"
    raise TypeError(
        f"{caller}() got unexpected keyword {word} {shown}: its own parameters are "
        f"{', '.join(own)}; any other keyword must be a redis-py client option "
        "(decode_responses, password, socket_timeout, ...)"
    )
