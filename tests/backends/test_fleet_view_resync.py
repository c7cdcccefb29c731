"""The fleet view while it loads (issue 45, "never stale while healthy"), on fakeredis, a
real server and a real 3-master cluster. A load is held by a hook (an event, no sleep):

* during a resync whose load of a namespace is held, the view keeps following: every
  write (to that namespace too) reaches it, it reads the live namespaces, it is fresh,
  and decisions come from memory (a router without a client) equal to exact scoring;
* a namespace that changes during its own load, read by the script or in pages with the
  scan made after the writes began, ends equal to its maps, with no number skipped;
* before its first load has landed, a view does not answer (routers score through
  Redis, exactly); a namespace that changes during that load ends equal to its maps;
* a subscription that stops answering the view's pings is never fresh, and is made
  again.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from registry import PrefixCacheRegistry, PrefixRouter
from registry.fleet import follower, snapshots
from registry.fleet.follower import RecordFollower
from registry.fleet.snapshots import SnapshotReader
from registry.fleet.view import FleetView
from tests.support.backends import Backend
from tests.support.waiting import wait_until

CHAIN = list(range(7000, 7064))


class Gate:
    """Holds the first load of ``name`` (once armed) until ``release``: after its
    snapshot was read (``script``), or after its record number was read and before its
    maps are scanned (``pages``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        self.armed = False
        self.entered.set()
        if not self.release.wait(60):
            raise AssertionError("the held load was never released")

    def install(self, load: str, monkeypatch: pytest.MonkeyPatch) -> None:
        gate = self
        if load == "script":
            read = SnapshotReader.snapshots

            def held_snapshots(reader: SnapshotReader, names: Any) -> Any:
                replies = read(reader, names)
                if gate.armed and gate.name in names:
                    gate.hold()
                return replies

            monkeypatch.setattr(SnapshotReader, "snapshots", held_snapshots)
        else:
            monkeypatch.setattr(snapshots, "PAGED_ABOVE", 1)
            fields = SnapshotReader._fields

            def held_fields(reader: SnapshotReader, key: str, what: str) -> Any:
                if gate.armed and f"{{{gate.name}}}" in str(key):
                    gate.hold()
                return fields(reader, key, what)

            monkeypatch.setattr(SnapshotReader, "_fields", held_fields)


@pytest.fixture
def prefix() -> str:
    return f"fr{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    made: list[Gate] = []
    yield made
    for gate in made:
        gate.release.set()  # a failed test never leaves the loader waiting


def owner(backend: Backend, prefix: str, first: str) -> PrefixCacheRegistry:
    """A claimed namespace whose name sorts by ``first`` (loads go in name order)."""
    reg = backend.registry(f"{first}-{uuid.uuid4().hex[:6]}", key_prefix=prefix)
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=60)
    return reg


def prefixes(router: PrefixRouter) -> dict[str, int]:
    return {n: s.kv_prefix for n, s in router.score(CHAIN).items()}


@pytest.mark.parametrize("load", ["script", "pages"])
def test_a_held_resync_leaves_decisions_in_memory_and_exact(
    redis_backend: Backend,
    prefix: str,
    gates: list[Gate],
    monkeypatch: pytest.MonkeyPatch,
    load: str,
) -> None:
    a, b = owner(redis_backend, prefix, "a"), owner(redis_backend, prefix, "b")
    a.register_kv(range(40), CHAIN[:40])
    b.register_kv(range(20), CHAIN[:20])
    view = FleetView(redis_backend.client(), prefix).start()
    try:
        view.sync()
        gate = Gate(a.namespace)
        gates.append(gate)
        gate.install(load, monkeypatch)
        loads, gaps = view.counts.loads, view.counts.gaps
        gate.armed = True
        view.resync()
        assert gate.entered.wait(30), "the resync never loaded the namespace"

        # a's own load is held: a and b change meanwhile (a loses blocks its snapshot
        # holds, then gets some back; b grows).
        a.evict_kv(CHAIN[20:40])
        a.register_kv(range(20, 30), CHAIN[20:30])
        b.register_kv(range(20, 25), CHAIN[20:25])
        view.sync()  # every write applied and the live namespaces read since: following
        wait_until(view.fresh, what="the view fresh while its resync is held")
        from_memory = PrefixRouter(None, prefix, view=view)  # through Redis it would raise
        exact = PrefixRouter(redis_backend.client(), prefix, exact=True)
        assert prefixes(from_memory) == prefixes(exact) == {a.namespace: 30, b.namespace: 25}
        assert from_memory.score(CHAIN) == exact.score(CHAIN)
        assert from_memory.best(CHAIN) == a.namespace
        assert view.counts.loads == loads  # a's load, and b's behind it, still held

        gate.release.set()
        wait_until(lambda: view.counts.loads >= loads + 2, what="the resync landed")
        view.sync()
        assert view.held(a.namespace) == (frozenset(CHAIN[:30]), frozenset())
        assert view.held(b.namespace) == (frozenset(CHAIN[:25]), frozenset())
        assert from_memory.score(CHAIN) == exact.score(CHAIN)
        assert view.counts.gaps == gaps
        assert view.counts.resyncs >= 1
    finally:
        view.close()


@pytest.mark.parametrize("load", ["script", "pages"])
def test_a_namespace_changing_during_its_first_load_ends_exact(
    redis_backend: Backend,
    prefix: str,
    gates: list[Gate],
    monkeypatch: pytest.MonkeyPatch,
    load: str,
) -> None:
    a = owner(redis_backend, prefix, "a")
    a.register_kv(range(40), CHAIN[:40])
    gate = Gate(a.namespace)
    gates.append(gate)
    gate.install(load, monkeypatch)
    gate.armed = True
    client = redis_backend.client()
    view = FleetView(client, prefix).start(timeout=None)
    try:
        assert gate.entered.wait(30), "the view never loaded the namespace"
        a.evict_kv(CHAIN[20:40])
        a.register_kv(range(20, 30), CHAIN[20:30])
        # Not loaded yet: the view does not answer, a router scores through Redis.
        assert not view.ready.is_set()
        assert not view.fresh()
        routed = PrefixRouter(client, prefix, view=view)
        exact = PrefixRouter(client, prefix, exact=True)
        assert prefixes(routed) == prefixes(exact) == {a.namespace: 30}

        gate.release.set()
        assert view.ready.wait(30)
        view.sync()
        assert view.held(a.namespace) == (frozenset(CHAIN[:30]), frozenset())
        wait_until(view.fresh, what="the view fresh once loaded")
        assert prefixes(PrefixRouter(None, prefix, view=view)) == {a.namespace: 30}
        assert view.counts.gaps == 0
    finally:
        view.close()


def test_a_subscription_that_answers_no_ping_is_not_fresh_and_is_made_again(
    redis_backend: Backend, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answers to the view's pings never arrive (as on a connection that died
    without a word): the view never counts as following, and subscribes again at the
    next ping once one went unanswered for ``SILENT_S``."""
    a = owner(redis_backend, prefix, "a")
    a.register_kv(range(8), CHAIN[:8])
    monkeypatch.setattr(follower, "SILENT_S", 0.0)
    monkeypatch.setattr(RecordFollower, "_answered", lambda self, token: None)
    view = FleetView(redis_backend.client(), prefix).start(timeout=None)
    try:
        wait_until(lambda: view.counts.reconnects >= 2, what="the subscription made again")
        loaded = (frozenset(CHAIN[:8]), frozenset[int]())
        wait_until(lambda: view.held(a.namespace) == loaded, what="the namespace loaded")
        assert not view.fresh()
        assert not view.ready.is_set()
    finally:
        view.close()
