"""EvictionListener: notices from anywhere free the right slots, and nothing is lost
or wrongly freed across gaps, dropped connections and garbage on the channel."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from gpu import EvictionListener, MambaSlotPool
from registry import PrefixCacheRegistry
from tests.support.backends import Backend, new_namespace, notice_base
from tests.support.gpu import make_pool, states
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until

A, B, C = 1111, 2222, 3333


def node(backend: Backend, **pool_options: Any) -> tuple[PrefixCacheRegistry, MambaSlotPool]:
    """A serving node: its registry and its slot pool."""
    reg = backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    return reg, make_pool(reg, **pool_options)


def listen(backend: Backend, reg: PrefixCacheRegistry, pool: MambaSlotPool) -> EvictionListener:
    return EvictionListener(backend.client(), reg.namespace, pool).start()


def test_notices_from_another_registry_free_the_slots(redis_backend: Backend) -> None:
    reg, pool = node(redis_backend)
    pool.store([1, 2, 3], [A, B, C], *states(3))
    elsewhere = redis_backend.registry(reg.namespace)  # no hook: only the channel tells
    with listen(redis_backend, reg, pool) as listener:
        elsewhere.register_kv([2], [B])
        elsewhere.evict_kv([B])  # cascade
        elsewhere.evict_mamba([C])
        wait_until(lambda: pool.pairs() == {(1, A)}, what="slots of B and C freed")
        elsewhere.clear_mamba()
        wait_until(lambda: pool.counts().in_use == 0, what="clear applied")
        counts = listener.counts()
    assert counts.applied == 3
    assert counts.last_seq - notice_base(reg) == 3
    assert (counts.gaps, counts.malformed, counts.errors) == (0, 0, 0)
    assert not listener.alive


def test_local_hook_and_listener_together_free_each_slot_once(redis_backend: Backend) -> None:
    reg, pool = node(redis_backend, slots=64)
    ids = list(range(40))
    pool.store(ids, [10_000 + i for i in ids], *states(40))
    with listen(redis_backend, reg, pool) as listener:
        for i in range(0, 40, 4):
            reg.evict_mamba([10_000 + i, 10_000 + i + 1])  # the hook frees at once
        wait_until(lambda: listener.counts().applied == 10, what="listener saw every notice")
        pool.store([100], [A], *states(1))
    counts = pool.counts()
    assert counts.freed == 20  # not 40: the listener's copies freed nothing
    assert pool.pairs() == {(i, 10_000 + i) for i in ids if i % 4 >= 2} | {(100, A)}


def test_start_catches_up_with_what_happened_before(redis_backend: Backend) -> None:
    reg, pool = node(redis_backend)
    pool.store([1, 2], [A, B], *states(2))
    redis_backend.registry(reg.namespace).evict_mamba([A])  # while no listener runs
    with listen(redis_backend, reg, pool) as listener:
        assert pool.pairs() == {(2, B)}
        assert listener.counts().reconciles == 1


def test_a_namespaces_first_history_is_not_a_restart(redis_backend: Backend) -> None:
    """A listener started before the namespace's first write counts no restart when that
    write begins its history; a history begun again (meta lost) counts one."""
    reg, pool = node(redis_backend)
    with listen(redis_backend, reg, pool) as listener:
        assert listener.incarnation == ""
        pool.store([1, 2], [A, B], *states(2))  # the first write: its history begins
        reg.evict_mamba([A])  # a notice of that history
        wait_until(lambda: listener.incarnation != "", what="the listener saw the history")
        wait_until(lambda: pool.pairs() == {(2, B)}, what="the eviction applied")
        assert listener.counts().restarts == 0
        first = listener.incarnation
        reg.client.delete(reg.keys.meta)  # meta lost: the next write begins a new history
        redis_backend.registry(reg.namespace).evict_mamba([B])
        wait_until(lambda: listener.incarnation not in ("", first), what="the new history")
        wait_until(lambda: pool.pairs() == set(), what="the eviction applied")
        assert listener.counts().restarts == 1


def test_block_id_reuse_race(redis_backend: Backend) -> None:
    """Block 5 is evicted (hash A), then stored again with hash B, and again with A,
    before the listener handles the old notices: the newer states stay."""
    reg, pool = node(redis_backend)
    pool.store([5], [A], *states(1))
    elsewhere = redis_backend.registry(reg.namespace)
    gate = threading.Event()
    listener = EvictionListener(redis_backend.client(), reg.namespace, pool)
    handle = listener._handle

    def delayed_handle(data: Any) -> None:
        gate.wait(10)
        handle(data)

    listener._handle = delayed_handle  # type: ignore[method-assign]
    with listener.start():
        elsewhere.evict_mamba([A])  # notice 1: (5, A), held back by the gate
        pool.store([5], [B], *states(1, seed=1))
        assert pool.holds(5, B)
        elsewhere.evict_mamba([B])  # notice 2: (5, B)
        pool.store([5], [A], *states(1, seed=2))  # the very same pair as notice 1
        gate.set()
        wait_until(lambda: listener.counts().last_seq - notice_base(reg) == 2, what="both handled")
        assert pool.holds(5, A)
        assert pool.counts().in_use == 1


def test_malformed_messages_do_not_stop_the_listener(redis_backend: Backend) -> None:
    reg, pool = node(redis_backend)
    pool.store([1, 2], [A, B], *states(2))
    publisher = redis_backend.client()
    with listen(redis_backend, reg, pool) as listener:
        for garbage in [b"", b"hello", b"9 evict 1:x", b"\xff\xfe", b"1 clear 1:2", b"x" * 10_000]:
            publisher.publish(reg.keys.mamba_evicted_channel, garbage)
        redis_backend.registry(reg.namespace).evict_mamba([A])
        wait_until(lambda: pool.pairs() == {(2, B)}, what="the valid notice applied")
        counts = listener.counts()
        assert counts.malformed == 6
        assert listener.alive


def listener_losing_first_notice(
    backend: Backend, reg: PrefixCacheRegistry, pool: MambaSlotPool, trim_stream: bool
) -> EvictionListener:
    """A listener whose first channel message is lost, as if pub/sub had dropped it;
    with ``trim_stream`` the stream loses it too, so only a reconcile can recover."""
    listener = EvictionListener(backend.client(), reg.namespace, pool)
    handle, dropped = listener._handle, []

    def drop_first(data: Any) -> None:
        if dropped:
            handle(data)
            return
        dropped.append(data)
        if trim_stream:
            reg.client.xtrim(reg.keys.mamba_evictions, maxlen=0, approximate=False)

    listener._handle = drop_first  # type: ignore[method-assign]
    return listener


@pytest.mark.parametrize(
    ("trim_stream", "replays", "reconciles"),
    [(False, 1, 1), (True, 0, 2)],
    ids=["replay", "trimmed"],
)
def test_a_gap_is_caught_up(
    redis_backend: Backend, trim_stream: bool, replays: int, reconciles: int
) -> None:
    """A lost notice shows up as a gap: replayed from the stream, or reconciled when the
    stream was trimmed (the first reconcile is the start's)."""
    reg, pool = node(redis_backend)
    pool.store([1, 2], [A, B], *states(2))
    elsewhere = redis_backend.registry(reg.namespace)
    with listener_losing_first_notice(redis_backend, reg, pool, trim_stream) as listener:
        elsewhere.evict_mamba([A])  # lost on the channel
        elsewhere.evict_mamba([B])  # arrives: a gap
        wait_until(lambda: pool.counts().in_use == 0, what="both slots freed")
        counts = listener.counts()
    assert (counts.gaps, counts.replays, counts.reconciles) == (1, replays, reconciles)
    assert counts.last_seq - notice_base(reg) == 2


def test_stop_is_bounded_and_idempotent(redis_backend: Backend) -> None:
    reg, pool = node(redis_backend)
    listener = listen(redis_backend, reg, pool)
    started = time.monotonic()
    listener.stop(timeout=5)
    listener.stop(timeout=5)
    assert not listener.alive
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="already started"):
        listener.start()


def test_listener_from_url(redis_server: RedisServer) -> None:
    reg = PrefixCacheRegistry(redis_server.client(), new_namespace())
    pool = make_pool(reg)
    pool.store([1], [A], *states(1))
    with EvictionListener(redis_server.url, reg.namespace, pool):
        PrefixCacheRegistry.from_url(redis_server.url, reg.namespace).evict_mamba([A])
        wait_until(lambda: pool.counts().in_use == 0, what="slot freed")
    reg.client.close()


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from registry import PrefixCacheRegistry
    url, namespace, hashes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    reg = PrefixCacheRegistry.from_url(url, namespace)
    reg.load_scripts()
    sent = {}
    for h in hashes:
        sent[h] = time.monotonic()
        assert reg.evict_mamba([h]) == {h}
        time.sleep(0.002)
    print(json.dumps(sent))
    """
)


def test_eviction_in_another_process_frees_the_slot(redis_server: RedisServer) -> None:
    client = redis_server.client()
    reg = PrefixCacheRegistry(client, new_namespace())
    freed_at: dict[int, float] = {}
    pool = make_pool(
        reg,
        slots=256,
        on_free=lambda pairs: freed_at.update(
            dict.fromkeys((h for _, h in pairs), time.monotonic())
        ),
    )
    hashes = [50_000 + i for i in range(200)]
    pool.store(list(range(200)), hashes, *states(200))
    with EvictionListener(client, reg.namespace, pool) as listener:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, redis_server.url, reg.namespace, json.dumps(hashes)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        sent = {int(h): t for h, t in json.loads(done.stdout).items()}
        wait_until(lambda: len(freed_at) == 200, what="every slot freed")
        assert listener.counts().applied == 200
    assert pool.counts().in_use == 0
    latencies = sorted((freed_at[h] - sent[h]) * 1e3 for h in hashes)
    p50 = statistics.median(latencies)
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(f"\nnotice-to-free latency over 200 evictions: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    client.close()


def test_connection_kills_lose_nothing_and_free_nothing_wrongly(redis_server: RedisServer) -> None:
    """While another thread evicts and stores thousands of entries, the listener's
    connection is killed again and again; in the end the pool matches the registry."""
    client = redis_server.client()
    reg = PrefixCacheRegistry(client, new_namespace())
    pool = make_pool(reg, slots=3_000)
    engine = PrefixCacheRegistry(redis_server.client(), reg.namespace)  # evicts, no hook
    rng = random.Random(7)
    live = list(range(2_500))
    pool.store(live, [90_000 + b for b in live], *states(2_500))
    stop = threading.Event()
    evicted = 0

    def churn() -> None:
        nonlocal evicted
        next_id = 10_000
        while not stop.is_set():
            batch = [live.pop(rng.randrange(len(live))) for _ in range(min(20, len(live)))]
            evicted += len(engine.evict_mamba([90_000 + b for b in batch]))
            fresh = list(range(next_id, next_id + 15))
            next_id += 15
            pool.store(fresh, [90_000 + b for b in fresh], *states(15))
            live.extend(fresh)

    admin = redis_server.client()
    with EvictionListener(redis_server.client(), reg.namespace, pool) as listener:
        worker = threading.Thread(target=churn)
        worker.start()
        kills, deadline = 0, time.monotonic() + 60
        while (kills < 50 or evicted < 3_000) and time.monotonic() < deadline:
            kills += admin.client_kill_filter(_type="pubsub")
            time.sleep(0.005)
        stop.set()
        worker.join(60)
        assert not worker.is_alive()
        registered = {int(h): int(b) for h, b in client.hgetall(reg.keys.mamba).items()}
        expected = {(b, h) for h, b in registered.items()}
        wait_until(lambda: pool.pairs() == expected, timeout=20, what="pool == registry")
        counts = listener.counts()
    assert evicted >= 3_000
    assert kills >= 50
    assert counts.reconnects >= 1
    assert pool.counts().in_use == len(registered)  # nothing leaked
    assert {b for b, _ in pool.pairs()} == set(live)  # nothing wrongly freed
    print(
        f"\nfault test: {evicted} evicted, {kills} connection kills, "
        f"{counts.reconnects} re-subscriptions, {counts.replays} replays, "
        f"{counts.reconciles} reconciles, {counts.gaps} gaps"
    )
    for c in (client, admin, engine.client):
        c.close()


def test_notice_lost_while_disconnected_is_recovered_on_resubscribe(
    redis_server: RedisServer,
) -> None:
    """The last notice goes out while the listener's connection is dead and nothing
    follows it: only the catch-up after re-subscribing can free that slot."""
    client = redis_server.client()
    reg = PrefixCacheRegistry(client, new_namespace())
    pool = make_pool(reg)
    pool.store([1, 2], [A, B], *states(2))
    elsewhere = PrefixCacheRegistry(redis_server.client(), reg.namespace)
    listener = EvictionListener(redis_server.client(), reg.namespace, pool)
    gate, handle = threading.Event(), listener._handle

    def gated(data: Any) -> None:
        gate.wait(10)
        handle(data)

    listener._handle = gated  # type: ignore[method-assign]
    with listener.start():
        elsewhere.evict_mamba([B])  # notice 1: the listener is stuck handling it
        wait_until(lambda: client.client_kill_filter(_type="pubsub") == 1, what="a kill")
        elsewhere.evict_mamba([A])  # notice 2: published to nobody
        gate.set()
        wait_until(lambda: pool.counts().in_use == 0, what="the lost notice recovered")
        counts = listener.counts()
    assert counts.reconnects == 1
    assert counts.last_seq - notice_base(reg) == 2
    for c in (client, elsewhere.client):
        c.close()


@pytest.mark.redis_server
def test_server_restart_empties_the_pool_and_the_listener_carries_on() -> None:
    """A restarted Redis keeps nothing: the registry is empty, so every slot goes;
    the notices of the new history (a new incarnation) are applied, not taken for old
    ones, and the listener counts the restart."""
    from tests.support.servers import require_redis_server

    require_redis_server()
    with RedisServer() as server:
        client = server.client()
        reg = PrefixCacheRegistry(client, new_namespace())
        pool = make_pool(reg)
        pool.store([1, 2, 3], [A, B, C], *states(3))
        elsewhere = PrefixCacheRegistry(server.client(), reg.namespace)
        listening = EvictionListener(server.client(), reg.namespace, pool, max_backoff=0.2)
        with listening as listener:
            elsewhere.evict_mamba([C])
            wait_until(lambda: pool.counts().in_use == 2, what="first notice")
            first, first_incarnation = listener.counts(), listener.incarnation
            server.kill()  # down for a while: reads fail as RegistryUnavailable
            wait_until(lambda: listener.counts().connection_losses >= 1, what="a loss")
            server.restart()
            wait_until(lambda: pool.counts().in_use == 0, timeout=20, what="slots freed")
            pool.store([4], [A], *states(1))  # the node re-registers what it holds
            elsewhere.evict_mamba([A])  # the first notice of the new server's history
            wait_until(lambda: pool.counts().in_use == 0, what="new notice applied")
            counts, incarnation = listener.counts(), listener.incarnation
            assert listener.alive
        assert counts.reconnects >= 1
        assert counts.reconciles >= 2
        assert incarnation not in ("", first_incarnation)
        assert counts.restarts >= 1
        # A read that raised RegistryUnavailable is a lost connection, not an error.
        assert counts.connection_losses >= 1
        assert counts.errors == 0
        assert counts.last_seq > first.last_seq  # numbers never went back
        for c in (client, elsewhere.client):
            c.close()


def test_publish_to_free_lag_is_measured(redis_backend: Backend) -> None:
    """With metrics on, every notice a listener applies reports the time from its publish
    (the server's clock, carried in the notice) to its slots freed."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from registry import metrics

    target = CollectorRegistry()
    metrics.enable_metrics(target)
    try:
        reg, pool = node(redis_backend)
        pool.store([1, 2], [A, B], *states(2))
        elsewhere = redis_backend.registry(reg.namespace)
        with listen(redis_backend, reg, pool):
            elsewhere.evict_mamba([A])
            elsewhere.evict_mamba([B])
            wait_until(lambda: pool.counts().in_use == 0, what="both slots freed")
        count = target.get_sample_value("pcr_listener_lag_seconds_count")
        total = target.get_sample_value("pcr_listener_lag_seconds_sum")
    finally:
        metrics.disable_metrics()
    assert count == 2
    assert total is not None
    assert total >= 0
