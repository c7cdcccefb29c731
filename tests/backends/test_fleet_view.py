"""The in-process fleet view (``registry/fleet/view.py``) against the truth: each live
namespace's own maps, on fakeredis, a real server and a real 3-master cluster.

* once quiet (``sync``), the view scores every prompt as a direct computation from the
  maps does (and as the exact router does where its chain assumption holds), across
  random histories of owner writes, operator evictions, clears, resets, re-claims,
  expired leases and ``gc``, hybrid or not;
* a fenced owner's writes raise and never reach the view;
* a record lost (a number skipped), a new incarnation, garbage on the channel, a server
  killed and restarted (empty, or with its data) all end with the view equal to the maps;
* a mirror's batches reach the view like an owner's writes;
* only the namespaces that match are answered unless every live one is asked for.
"""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from registry import (
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryUnavailable,
    StaleEpochError,
    collect_dead,
)
from registry.core.keys import NamespaceKeys
from registry.fleet.follower import RecordFollower
from registry.fleet.view import FleetView
from tests.support.backends import Backend, expire_lease
from tests.support.scoring import chain_shaped, direct
from tests.support.waiting import wait_until

Score = tuple[int, int, int]


@pytest.fixture
def prefix() -> str:
    return f"fv{uuid.uuid4().hex[:8]}"


@pytest.fixture
def view_of(redis_backend: Backend, prefix: str) -> Iterator[Any]:
    views: list[FleetView] = []

    def make(**options: Any) -> FleetView:
        view = FleetView(redis_backend.client(), prefix, **options).start()
        views.append(view)
        return view

    yield make
    for view in views:
        view.close()


def owner(backend: Backend, namespace: str, prefix: str) -> PrefixCacheRegistry:
    reg = backend.registry(namespace, key_prefix=prefix)
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=60)
    return reg


def truth(
    regs: dict[str, PrefixCacheRegistry], prompt: Sequence[int], live: set[str]
) -> dict[str, Score]:
    """Every live namespace's (KV prefix, Mamba prefix, usable) from its own maps, with
    usable as ``hybrid=None`` ranks it (Mamba-aware where it holds Mamba state)."""
    scores = {}
    for name in live:
        reg = regs[name]
        kv, mamba = reg.entries()
        seen = reg.client.hget(reg.keys.meta, "mamba_seen") is not None
        end, farthest = direct((kv, mamba), prompt, hybrid=True)
        scores[name] = (end, farthest, farthest if seen else end)
    return scores


def viewed(view: FleetView, prompt: Sequence[int], **options: Any) -> dict[str, Score]:
    return {
        n: (s.kv_prefix, s.mamba_prefix, s.usable) for n, s in view.score(prompt, **options).items()
    }


def test_the_view_equals_the_maps_over_random_histories(
    redis_backend: Backend, prefix: str, view_of: Any
) -> None:
    rng = random.Random(27)
    names = [f"n{i}-{uuid.uuid4().hex[:6]}" for i in range(5)]
    regs = {n: owner(redis_backend, n, prefix) for n in names}
    operator = {n: redis_backend.registry(n, key_prefix=prefix) for n in names}
    chains = [[rng.randrange(1, 2**63) for _ in range(40)] for _ in range(3)]
    view = view_of()
    live = set(names)
    exact = PrefixRouter(redis_backend.client(), prefix, exact=True)
    routed = PrefixRouter(redis_backend.client(), prefix, view=view)
    for step in range(160):
        name = rng.choice(names)
        reg = regs[name]
        chain = rng.choice(chains)
        roll = rng.random()
        if name not in live:
            reg.claim(lease_ttl=60)  # back after gc, in a new history
            live.add(name)
        elif roll < 0.35:
            length = rng.randrange(1, 41)
            reg.register_kv(range(length), chain[:length])
        elif roll < 0.5:
            at = sorted(rng.sample(range(40), 3))
            reg.register_mamba(at, [chain[i] for i in at])
        elif roll < 0.6:
            reg.evict_kv(rng.sample(chain, 4))
        elif roll < 0.68:
            reg.evict_mamba(rng.sample(chain, 6))
        elif roll < 0.73:
            operator[name].evict_kv(rng.sample(chain, 2))  # not an owner: no epoch
        elif roll < 0.77:
            reg.clear_kv()
        elif roll < 0.8:
            reg.clear_mamba()
        elif roll < 0.83:
            reg.reset()
        elif roll < 0.88:
            reg.claim(lease_ttl=60)
        elif roll < 0.91 and len(live) > 2:
            expire_lease(reg)
            assert name in collect_dead(reg.client, prefix)
            live.discard(name)
        else:
            length = rng.randrange(1, 41)
            reg.register_kv(range(length), chain[:length])
        if step % 8 == 7:
            view.sync()
            assert set(view.live_nodes()) == live
            for prompt in [*chains, chains[0][:20] + chains[1][20:]]:
                want = truth(regs, prompt, live)
                assert viewed(view, prompt, everyone=True) == want, step
                matching = viewed(view, prompt)
                assert matching == {n: s for n, s in want.items() if s[0] > 0}
                assert {
                    n: (s.kv_prefix, s.mamba_prefix, s.usable)
                    for n, s in routed.score(prompt).items()
                } == want
                loads = {n: rng.choice([0, 1, 2]) for n in live}
                top = max(s[2] for s in want.values())
                best = min((n for n, s in want.items() if s[2] == top), key=lambda n: (loads[n], n))
                assert routed.best(prompt, loads) == best
                for n, s in exact.score(prompt).items():
                    if chain_shaped(regs[n].entries()[0], prompt):
                        assert (s.kv_prefix, s.mamba_prefix, s.usable) == want[n], (step, n)
    assert view.counts.records > 100
    assert view.counts.gaps == 0


def test_a_fenced_owners_writes_never_reach_the_view(
    redis_backend: Backend, prefix: str, view_of: Any
) -> None:
    name = f"f-{uuid.uuid4().hex[:6]}"
    old = owner(redis_backend, name, prefix)
    view = view_of()
    new = owner(redis_backend, name, prefix)  # takes the namespace over
    chain = list(range(1000, 1010))
    with pytest.raises(StaleEpochError):
        old.register_kv(range(10), chain)
    with pytest.raises(StaleEpochError):
        old.register_mamba([3], [chain[3]])
    new.register_kv(range(2), chain[:2])
    view.sync()
    assert viewed(view, chain) == {name: (2, 0, 2)}
    assert view.held(name) == (frozenset(chain[:2]), frozenset())


def test_a_lost_record_or_garbage_on_the_channel_ends_with_the_maps(
    redis_backend: Backend, prefix: str, view_of: Any
) -> None:
    name = f"g-{uuid.uuid4().hex[:6]}"
    reg = owner(redis_backend, name, prefix)
    chain = list(range(2000, 2020))
    reg.register_kv(range(5), chain[:5])
    view = view_of()
    client = redis_backend.client()
    channel = NamespaceKeys(name, prefix).changes_channel
    for junk in (b"", b"x", b"%s 1 2" % name.encode(), b"%s inc notanumber k+ 5" % name.encode(),
                 b"\xff\xfe k+ 1", b"nobody 1 1 k+ 12"):  # fmt: skip
        client.publish(channel, junk)
    # A record on another namespace's channel naming this one (what a node user allowed
    # only its own channel could try): skipped, whatever its numbers.
    other = NamespaceKeys(f"o-{name}", prefix).changes_channel
    seq = int(client.hget(reg.keys.meta, "change_seq"))
    incarnation = client.hget(reg.keys.meta, "incarnation").decode()
    client.publish(other, f"{name} {incarnation} {seq + 1} k+ {chain[19]}")
    # A record lost: its number taken without the record reaching anyone.
    client.hincrby(reg.keys.meta, "change_seq", 1)
    reg.register_kv(range(10), chain[:10])
    view.sync()
    assert viewed(view, chain) == {name: (10, 0, 10)}
    assert view.counts.gaps >= 1
    assert view.counts.skipped >= 6
    assert chain[19] not in view.blocks
    # A record with the right number but of another incarnation: loaded again.
    seq = int(client.hget(reg.keys.meta, "change_seq"))
    client.publish(channel, f"{name} 123 {seq + 1} k+ {chain[15]}")
    reg.register_kv([15], [chain[15]])
    view.sync()
    assert view.held(name) == (frozenset([*chain[:10], chain[15]]), frozenset())


def test_a_mirrors_batches_reach_the_view(
    redis_backend: Backend, prefix: str, view_of: Any
) -> None:
    from registry import MirroredRegistry

    name = f"m-{uuid.uuid4().hex[:6]}"
    mirror = MirroredRegistry(redis_backend.client(), name, key_prefix=prefix)
    mirror.claim(lease_ttl=60)
    view = view_of()
    chain = list(range(3000, 3030))
    try:
        mirror.register_kv(range(30), chain)
        mirror.register_mamba([9, 19], [chain[9], chain[19]])
        mirror.evict_kv([chain[25]])
        mirror.flush()
        view.sync()
        assert viewed(view, chain) == {name: (25, 20, 20)}
        mirror.clear_mamba()
        mirror.flush()
        view.sync()
        assert viewed(view, chain) == {name: (25, 0, 0)}  # still a hybrid node: its
        # Mamba-usable prefix is what its engine reuses
    finally:
        mirror.close()


def test_the_view_follows_a_server_killed_and_restarted_empty(own_server: Any) -> None:
    """The server dies and comes back empty: the view subscribes again, reads what it
    held again (nothing is left: it holds nothing), and follows the new history."""
    prefix = f"fk{uuid.uuid4().hex[:8]}"
    reg = PrefixCacheRegistry(own_server.client(), "node-k", key_prefix=prefix)
    reg.claim(lease_ttl=60)
    chain = list(range(4000, 4016))
    reg.register_kv(range(8), chain[:8])
    view = FleetView(own_server.client(socket_timeout=2), prefix).start()
    try:
        view.sync()
        assert viewed(view, chain) == {"node-k": (8, 0, 8)}
        own_server.kill()
        own_server.restart()
        wait_until(lambda: view.counts.reconnects >= 2, what="the view subscribed again")
        view.sync(["node-k"])
        assert view.held("node-k") is None
        assert viewed(view, chain) == {}
        reg.claim(lease_ttl=60)  # the owner notices and claims again: a new history
        reg.register_kv(range(16), chain)
        view.sync()
        assert viewed(view, chain) == {"node-k": (16, 0, 16)}
    finally:
        view.close()


def test_an_unexpected_fault_while_following_is_survived(
    redis_backend: Backend, prefix: str, view_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in applying a record (here: the first application raises) is logged; the
    view follows again, reads everything again and ends equal to the maps."""
    name = f"u-{uuid.uuid4().hex[:6]}"
    reg = owner(redis_backend, name, prefix)
    view = view_of()
    apply = RecordFollower.apply
    calls = []

    def broken(self: RecordFollower, data: Any) -> None:
        calls.append(data)
        if len(calls) == 1:
            raise KeyError("a bug")
        apply(self, data)

    monkeypatch.setattr(RecordFollower, "apply", broken)
    chain = list(range(5000, 5008))
    reg.register_kv(range(8), chain)
    wait_until(lambda: view.counts.errors >= 1, what="the fault")
    view.sync()
    assert viewed(view, chain) == {name: (8, 0, 8)}


def test_sync_without_a_live_read_still_reads_your_writes(
    redis_backend: Backend, prefix: str, view_of: Any
) -> None:
    """``sync(live=False)`` (the simulation's lockstep) skips the live read for
    namespaces it follows, yet every write that returned before it is in the view, one
    by one, and a namespace claimed after the view started is read before it returns."""
    first = owner(redis_backend, f"s-{uuid.uuid4().hex[:6]}", prefix)
    view = view_of(live_cache_ttl=3600)  # no live read but the ones sync asks for
    chain = list(range(6000, 6064))
    for n in range(1, 65, 7):
        first.register_kv(range(n), chain[:n])
        view.sync([first.namespace], live=False)
        assert viewed(view, chain) == {first.namespace: (n, 0, n)}
    later = owner(redis_backend, f"s-{uuid.uuid4().hex[:6]}", prefix)
    later.register_kv(range(3), chain[:3])
    view.sync([later.namespace], live=False)
    assert viewed(view, chain)[later.namespace] == (3, 0, 3)
    with pytest.raises(TypeError):
        view.sync(live=1)  # type: ignore[arg-type]


def test_sync_says_redis_is_away_in_the_retryable_error(own_server: Any) -> None:
    """With the server gone, ``sync`` raises ``RegistryUnavailable`` (a caller falls
    back, as the simulation routes round-robin), not a bare redis-py error."""
    prefix = f"fa{uuid.uuid4().hex[:8]}"
    reg = PrefixCacheRegistry(own_server.client(), "node-a", key_prefix=prefix)
    reg.claim(lease_ttl=60)
    view = FleetView(own_server.client(socket_timeout=2), prefix).start()
    try:
        own_server.kill()
        with pytest.raises(RegistryUnavailable):
            view.sync(["node-a"], live=False, timeout=5)
    finally:
        view.close()


def test_an_idle_view_waits_on_its_socket_and_sync_wakes_it(
    redis_backend: Backend, prefix: str, view_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing due (live reads and resyncs an hour apart, waits up to a minute),
    the follower waits on the subscription's socket and its wake pipe together: over a
    second it goes round at most a few times (it used to poll ten times a second; a
    busy machine only makes it fewer), and ``sync`` (which needs a live read the
    follower would not make for an hour) is answered: it wakes the follower. Where the
    socket cannot be waited on (fakeredis) the follower polls; the same holds but the
    count."""
    from registry.fleet import follower as following

    monkeypatch.setattr(following, "IDLE_WAIT_S", 60.0)
    rounds = []
    land = RecordFollower._land

    def counted(self: RecordFollower) -> None:
        rounds.append(time.monotonic())
        land(self)

    monkeypatch.setattr(RecordFollower, "_land", counted)
    name = f"i-{uuid.uuid4().hex[:6]}"
    reg = owner(redis_backend, name, prefix)
    view = view_of(live_cache_ttl=3600, resync_interval=3600)
    pubsub = view._follower._pubsub
    sock = getattr(getattr(pubsub, "connection", None), "_sock", None)
    waitable = isinstance(sock, socket.socket)
    view.sync(timeout=30)
    time.sleep(0.2)  # the start's own rounds done
    before = len(rounds)
    time.sleep(1.0)
    if waitable:
        assert len(rounds) - before <= 3, rounds[before:]
    chain = list(range(7000, 7006))
    reg.register_kv(range(6), chain)
    view.sync(timeout=30)
    assert viewed(view, chain) == {name: (6, 0, 6)}
    view.sync(timeout=30)  # nothing written since: only the live read, after a wake
