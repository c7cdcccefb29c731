"""The tests' redis-server launcher: ``pcr.bench.servers`` (shared with ``pcr bench``), plus
the rule for when no ``redis-server`` binary is installed."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
import redis

from pcr.bench.servers import HOST, RedisClusterServers, RedisServer, find_redis_server, free_port

__all__ = [
    "HOST",
    "RedisClusterServers",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "refused_port",
    "replicas_streamed",
    "require_redis_server",
]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port held bound but never listening for the block: connecting to it is
    refused at once, and no other process can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        yield int(sock.getsockname()[1])


def require_redis_server() -> str:
    """Return the ``redis-server`` path, or skip the test (fail it when ``CI`` is set).

    Skipping locally keeps the suite usable without a server; failing in CI makes sure the
    real-server tests cannot silently stop running there.
    """
    path = find_redis_server()
    if path is not None:
        return path
    reason = (
        "redis-server not found: real-server tests SKIPPED "
        "(install redis-server; with CI set they fail)"
    )
    if os.environ.get("CI"):
        pytest.fail(reason.replace("SKIPPED", "FAILED because CI is set"), pytrace=False)
    pytest.skip(reason)


def replicas_streamed(server: RedisServer, key: str = "tests-replication-probe") -> int:
    """How many replicas acknowledged a write to ``key`` on ``server`` within 100 ms
    (``WAIT``); 0 when it does not answer. A replica counts once the primary streams to
    it, which is later than the replica's own "link up": after a full sync the primary
    holds the stream until its RDB child has ended and the replica's first ACK came in
    (seconds on a busy machine), and a ``WAIT`` with nothing written counts it before
    that. On a cluster, ``key`` must be in a slot ``server`` serves."""
    client = server.client(socket_timeout=5)
    try:
        client.set(key, "1")
        return int(client.execute_command("WAIT", 1, 100))
    except redis.RedisError:
        return 0
    finally:
        client.close()
