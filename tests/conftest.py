"""Fixtures shared by every test: the session's real servers, the storage backends
(``tests/support/backends.py``), fresh servers to kill, and no thread left behind.

Without a ``redis-server`` binary the real backends skip loudly, or fail under CI.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from registry import Heartbeat
from tests.support.backends import (
    BACKEND_PARAMS,
    REDIS_BACKEND_PARAMS,
    Backend,
    make_backend,
)
from tests.support.servers import RedisClusterServers, RedisServer, require_redis_server

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started in the background by a shell (`make test &`), which ignores SIGINT for its
    # children: the commands the tests Ctrl-C would inherit that and never stop. A
    # handler here is reset to the default in every process the tests start.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the real servers its fixtures start, so that ``-m "not cluster"``
    and ``-m "not redis_server"`` deselect the tests that need them."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "redis_cluster" in names:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.redis_server)
        elif names & {"redis_server", "own_server", "targets"}:  # targets: the CLI fuzz's
            item.add_marker(pytest.mark.redis_server)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real standalone redis-server for the session."""
    require_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One real 3-master Redis Cluster for the session."""
    require_redis_server()
    with RedisClusterServers() as cluster:
        yield cluster


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill, restart or stop."""
    require_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each of the four storage kinds in turn."""
    made = make_backend(request.param, request)
    yield made
    made.close()


@pytest.fixture(params=REDIS_BACKEND_PARAMS)
def redis_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each Redis storage kind in turn (fakeredis, a real server, a real cluster)."""
    made = make_backend(request.param, request)
    yield made
    made.close()


@pytest.fixture(autouse=True)
def _stop_leftover_heartbeats() -> Iterator[None]:
    """A test that fails half-way must not leave a heartbeat renewing after it."""
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        if isinstance(owner, Heartbeat):
            owner.stop()
