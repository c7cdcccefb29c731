"""The tests' redis-server launcher: ``pcr.servers`` (shared with ``pcr bench``), plus
the rule for when no ``redis-server`` binary is installed."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from pcr.servers import HOST, RedisClusterServers, RedisServer, find_redis_server, free_port

__all__ = [
    "HOST",
    "RedisClusterServers",
    "RedisServer",
    "find_redis_server",
    "free_port",
    "refused_port",
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
