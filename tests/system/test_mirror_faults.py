"""The mirrored owner under Redis faults: a server that stops answering (SIGSTOP, data
kept) and one that restarts empty. The engine keeps being answered from the mirror; a
bounded queue overflows into one resync; a namespace lost with the server fences it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis

from registry import MirroredRegistry, RegistryUnavailable, StaleEpochError
from tests.support.backends import new_namespace, registry_state
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until


@pytest.fixture
def client(own_server: RedisServer) -> Iterator[redis.Redis]:
    made = redis.Redis(
        host=own_server.host, port=own_server.port, socket_timeout=0.5, socket_connect_timeout=0.5
    )
    yield made
    made.close()


def test_an_outage_overflows_into_one_resync(own_server: RedisServer, client: redis.Redis) -> None:
    mirror = MirroredRegistry(client, new_namespace(), max_queue=8)
    mirror.claim()
    try:
        mirror.register_kv([1, 2], [11, 12])
        mirror.register_mamba([2], [12])
        mirror.flush()
        assert own_server.process is not None
        pid = own_server.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(3, 30):  # the engine goes on, answered from the mirror
                mirror.register_kv([i], [i * 11])
                assert mirror.match_kv_prefix([11, 12, i * 11]) == ([1, 2, i], i * 11)
            assert mirror.evict_kv([12]) == {12}  # a cascade, numbered locally
            assert mirror.match_mamba_farthest([11, 12]) == 0
            wait_until(lambda: mirror.counts().retries >= 1, what="the flusher finds Redis away")
            with pytest.raises(RegistryUnavailable):
                mirror.flush(timeout=0.1)
            counts = mirror.counts()
            assert counts.dropped > 0
            assert counts.queued == 0  # the backlog went: a resync is due
            assert counts.resyncs == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        mirror.flush()
        counts = mirror.counts()
        assert counts.resyncs == 1
        assert registry_state(mirror.inner) == mirror.entries()
        assert mirror.inner.notice_position() == mirror.notice_position()
        mirror.register_mamba([5], [55])
        mirror.evict_kv([55])
        mirror.flush()
        assert registry_state(mirror.inner) == mirror.entries()
        assert mirror.inner.notice_position() == mirror.notice_position()
        assert mirror.counts().resyncs == 1
    finally:
        mirror.close()


def test_a_short_outage_is_retried_exactly_once(
    own_server: RedisServer, client: redis.Redis
) -> None:
    mirror = MirroredRegistry(client, new_namespace())
    mirror.claim()
    try:
        mirror.register_kv([1], [11])
        mirror.register_mamba([1], [11])
        mirror.flush()
        assert own_server.process is not None
        pid = own_server.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            mirror.register_mamba([2], [11])  # a replace: one notice
            mirror.evict_kv([11])  # a cascade: one more
            wait_until(lambda: mirror.counts().retries >= 1, what="the flusher finds Redis away")
        finally:
            os.kill(pid, signal.SIGCONT)
        mirror.flush()
        counts = mirror.counts()
        assert (counts.resyncs, counts.dropped) == (0, 0)
        # The first copies may have run when the server woke; the re-sent ones did not.
        assert registry_state(mirror.inner) == mirror.entries() == ({}, {})
        assert mirror.inner.notice_position() == mirror.notice_position()
    finally:
        mirror.close()


def test_a_server_restarted_empty_fences_the_mirror(
    own_server: RedisServer, client: redis.Redis
) -> None:
    mirror = MirroredRegistry(client, new_namespace())
    mirror.claim()
    try:
        mirror.register_kv([1], [11])
        mirror.flush()
        own_server.restart()  # no persistence: the namespace and its epoch are gone
        mirror.register_kv([2], [22])
        with pytest.raises(StaleEpochError):
            mirror.flush()
        assert mirror.lost
        with pytest.raises(StaleEpochError):
            mirror.match_kv_prefix([11])
    finally:
        mirror.close()
