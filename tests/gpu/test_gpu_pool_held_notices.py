"""Notices that reach stores in flight: each occupant holds a notice once, and a held
notice, applied at commit, touches that store's own occupants only.

A ``clear`` that arrived while several stores were in flight used to be applied pool-wide
again by each store's commit, handing every store still in flight one more copy each
time (with the in-process hook and a listener both delivering it, three per hop): 59,049
copies after ten overlapping stores, and commits that spun for seconds under the lock.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpu import EvictionListener, MambaSlotPool
from registry import EvictionNotice, PrefixCacheRegistry
from tests.gpu.test_gpu_pool_threads import (
    JOIN_TIMEOUT,
    CountDown,
    assert_every_slot_holds_its_own_state,
    filled,
    run_together,
)
from tests.support.backends import Backend, registry_state
from tests.support.gpu import make_pool
from tests.support.waiting import wait_until


@pytest.fixture
def node(redis_backend: Backend) -> PrefixCacheRegistry:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    return reg


def held_copies(pool: MambaSlotPool) -> list[int]:
    """How many notices each in-flight occupant holds (white box: the bug's own measure)."""
    return [len(o.held) for o in pool._table.occupants if o is not None and o.stamp is None]


class GatedRegistrations:
    """Makes ``register_mamba_stamped`` land, then wait at a gate of its own before it
    returns: the store stays in flight, its entry already in Redis (stamped below any
    notice published meanwhile)."""

    def __init__(self, registry: PrefixCacheRegistry) -> None:
        self.register = registry.register_mamba_stamped
        self.landed = threading.Semaphore(0)
        self.gates: dict[int, threading.Event] = {}
        self.lock = threading.Lock()
        registry.register_mamba_stamped = self  # type: ignore[method-assign]

    def __call__(self, block_ids: Any, hashes: Any) -> int:
        stamp = self.register(block_ids, hashes)
        with self.lock:
            gate = self.gates.setdefault(block_ids[0], threading.Event())
        self.landed.release()
        assert gate.wait(JOIN_TIMEOUT), "the test never opened this store's gate"
        return stamp

    def open(self, block_id: int) -> None:
        with self.lock:
            self.gates.setdefault(block_id, threading.Event()).set()

    def open_all(self) -> None:
        with self.lock:
            for gate in self.gates.values():
                gate.set()


def storing(
    pool: MambaSlotPool, block: int, h: int, failures: list[BaseException]
) -> threading.Thread:
    """A thread (not started) storing one block; what it raises goes to ``failures``."""

    def run() -> None:
        try:
            pool.store([block], [h], *filled([block]))
        except BaseException as exc:
            failures.append(exc)

    return threading.Thread(target=run, name=f"store-{block}")


@pytest.mark.parametrize("stores", [2, 10])
def test_a_clear_held_by_overlapping_stores_is_held_once_each(
    node: PrefixCacheRegistry, stores: int
) -> None:
    """``stores`` stores land their entries and wait; a clear comes (twice, as the hook and
    a listener deliver it); the stores then commit one by one. Every store still in flight
    holds the clear exactly once after each commit, and every stored slot is freed."""
    pool = make_pool(node, slots=stores + 2)
    gated = GatedRegistrations(node)
    failures: list[BaseException] = []
    threads = [storing(pool, b, 1_000 + b, failures) for b in range(stores)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(stores):
            assert gated.landed.acquire(timeout=JOIN_TIMEOUT)
        assert held_copies(pool) == [0] * stores
        seen: list[EvictionNotice] = []
        node.add_eviction_hook(seen.append)
        node.clear_mamba()  # the in-process hook hands the clear to the pool
        assert [n.kind for n in seen] == ["clear"]
        pool.apply_notice(seen[0])  # ... and a listener hands it over again
        assert held_copies(pool) == [1] * stores
        for done, (block, thread) in enumerate(zip(range(stores), threads, strict=True), 1):
            gated.open(block)
            thread.join(JOIN_TIMEOUT)
            assert not thread.is_alive()
            assert held_copies(pool) == [1] * (stores - done), f"after {done} commits"
    finally:
        gated.open_all()
        for thread in threads:
            thread.join(JOIN_TIMEOUT)
        pool.close()
    assert failures == []
    assert pool.pairs() == set()
    assert registry_state(node)[1] == {}
    counts = pool.counts()
    assert (counts.stored, counts.freed, counts.in_use) == (stores, stores, 0)


def test_an_eviction_held_by_a_store_frees_only_its_pair(node: PrefixCacheRegistry) -> None:
    """An eviction of one in-flight block, held by its store, frees that block at commit
    and nothing of another store in flight; a notice delivered twice is held once."""
    pool = make_pool(node, slots=4)
    gated = GatedRegistrations(node)
    failures: list[BaseException] = []
    threads = [storing(pool, b, 2_000 + b, failures) for b in (1, 2)]
    try:
        for thread in threads:
            thread.start()
        for _ in threads:
            assert gated.landed.acquire(timeout=JOIN_TIMEOUT)
        seen: list[EvictionNotice] = []
        node.add_eviction_hook(seen.append)
        assert node.evict_mamba([2_001]) == {2_001}
        assert [n.kind for n in seen] == ["evict"]
        pool.apply_notice(seen[0])  # delivered again, as a listener would
        assert sorted(held_copies(pool)) == [0, 1]
        gated.open(1)
        threads[0].join(JOIN_TIMEOUT)
        assert held_copies(pool) == [0]  # store 2 was not handed the eviction
        gated.open(2)
        threads[1].join(JOIN_TIMEOUT)
    finally:
        gated.open_all()
        for thread in threads:
            thread.join(JOIN_TIMEOUT)
        pool.close()
    assert failures == []
    assert pool.pairs() == {(2, 2_002)}
    assert pool.pairs() == {(b, h) for h, b in registry_state(node)[1].items()}


@pytest.mark.parametrize("threads", [4, 16])
def test_stores_beside_clears_and_resets_from_another_client_end_in_agreement(
    node: PrefixCacheRegistry, redis_backend: Backend, threads: int
) -> None:
    """``threads`` threads store (new blocks, and old block ids with new hashes) while a
    second client clears the Mamba map and resets the namespace behind the pool's back
    (only the listener tells) and this node clears in-process now and then: the pool ends
    equal to the registry. Prints the longest commit and stores/s (not asserted)."""
    if redis_backend.name == "fakeredis" and threads > 4:
        pytest.skip("fakeredis runs every call under one lock: the big races need a server")
    pool = make_pool(node, slots=threads * 2)
    elsewhere = redis_backend.registry(node.namespace)
    commit = pool._commit
    longest = [0.0]

    def timed_commit(slots: list[int], stamp: int) -> None:
        start = time.perf_counter()
        commit(slots, stamp)
        longest[0] = max(longest[0], time.perf_counter() - start)

    pool._commit = timed_commit  # type: ignore[method-assign]
    rounds = 40
    versions = itertools.count(1)
    lock = threading.Lock()
    done = threading.Event()

    def storer(worker: int) -> Callable[[], None]:
        rng = random.Random(worker)
        own = [worker * 1_000 + i for i in range(6)]

        def run() -> None:
            for i in range(rounds):
                blocks = rng.sample(own, 2)
                with lock:
                    hashes = [next(versions) * 100_000 + b for b in blocks]
                pool.store(blocks, hashes, *filled(blocks))
                if worker == 0 and i % 10 == 5:
                    node.clear_mamba()

        return run

    def disturber() -> None:
        rng = random.Random(99)
        while not done.wait(0.002):  # pacing only
            if rng.random() < 0.8:
                elsewhere.clear_mamba()
            else:
                elsewhere.reset()

    counted = CountDown(threads, done)

    listener = EvictionListener(redis_backend.client(), node.namespace, pool)
    started = time.perf_counter()
    try:
        with listener:
            errors = run_together([counted(storer(w)) for w in range(threads)] + [disturber])
            elapsed = time.perf_counter() - started
            wait_until(
                lambda: pool.pairs() == {(b, h) for h, b in registry_state(node)[1].items()},
                timeout=30,
                what="pool == registry",
            )
    finally:
        done.set()
        pool.close()
    assert errors == []
    assert_every_slot_holds_its_own_state(pool)
    assert held_copies(pool) == []
    counts = pool.counts()
    assert counts.stored == counts.in_use + counts.freed == threads * rounds * 2
    print(
        f"\n{threads} threads on {redis_backend.name}: longest commit "
        f"{longest[0] * 1000:.2f} ms, {threads * rounds / elapsed:.0f} stores/s"
    )
