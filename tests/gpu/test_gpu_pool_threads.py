"""The slot pool under threads: a store never fails while enough slots are free or
evictable, evictions are counted once each, and the pool ends equal to the registry.

Every slot holds states filled with its block id, so a restore that returns another
block's state is caught. Threads start together (a barrier), every wait is bounded,
and every thread is joined in ``finally``.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu import EvictionListener, MambaSlotPool, PoolExhausted
from registry import EvictionNotice, PrefixCacheRegistry
from tests.support.backends import Backend, dump_keys, registry_state
from tests.support.gpu import CONV_SHAPE, LAYERS, SSM_SHAPE, make_pool, out_buffers
from tests.support.waiting import wait_until

JOIN_TIMEOUT = 120.0


def filled(block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """States whose every value is the block's id (exact in float32 below 2^24)."""
    values = torch.tensor(block_ids, dtype=torch.float32)
    conv = values.view(1, -1, 1, 1).expand(LAYERS, -1, *CONV_SHAPE).contiguous()
    ssm = values.view(1, -1, 1, 1, 1).expand(LAYERS, -1, *SSM_SHAPE).contiguous()
    return conv, ssm


def run_together(workers: list[Callable[[], None]]) -> list[BaseException]:
    """Run each worker in its own thread, started together; return what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers), timeout=30)

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                work()
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        return run

    threads = [
        threading.Thread(target=guarded(w), name=f"worker-{i}") for i, w in enumerate(workers)
    ]
    try:
        for thread in threads:
            thread.start()
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    return errors


class CountDown:
    """Wraps workers so that ``done`` is set once ``count`` of them have returned (or
    raised): the thread that waits on it stops with the last worker."""

    def __init__(self, count: int, done: threading.Event) -> None:
        self.remaining = count
        self.done = done
        self.lock = threading.Lock()

    def __call__(self, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            finally:
                with self.lock:
                    self.remaining -= 1
                    if self.remaining == 0:
                        self.done.set()

        return run


class Checker:
    """Restores recently stored blocks while the stores run, until ``done``; any state it
    gets back must be the block's own."""

    def __init__(self, pool: MambaSlotPool) -> None:
        self.pool = pool
        self.recent: list[int] = []
        self.done = threading.Event()
        self.hits = self.misses = 0
        self.wrong: list[int] = []

    def __call__(self) -> None:
        conv_out, ssm_out = out_buffers()
        rng = random.Random(1)
        while not self.done.is_set():
            if not self.recent:
                self.done.wait(0.001)  # pacing only: nothing stored yet
                continue
            block = self.recent[rng.randrange(max(0, len(self.recent) - 32), len(self.recent))]
            if self.pool.restore(block, conv_out, ssm_out):
                self.hits += 1
                if not (bool((conv_out == block).all()) and bool((ssm_out == block).all())):
                    self.wrong.append(block)
            else:
                self.misses += 1


def assert_every_slot_holds_its_own_state(pool: MambaSlotPool) -> None:
    conv_out, ssm_out = out_buffers()
    for block, h in pool.pairs():
        assert pool.restore(block, conv_out, ssm_out, expected_hash=h)
        assert bool((conv_out == block).all()), block
        assert bool((ssm_out == block).all()), block


@pytest.fixture
def node(redis_backend: Backend) -> PrefixCacheRegistry:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    return reg


@pytest.mark.parametrize(
    ("threads", "per_store", "slots"),
    [(4, 1, 16), (8, 2, 16), (16, 4, 64)],
    ids=["4 threads x 1 block, 16 slots", "8 x 2, 16 slots", "16 x 4, 64 slots"],
)
def test_stores_never_fail_while_slots_are_evictable(
    node: PrefixCacheRegistry, redis_backend: Backend, threads: int, per_store: int, slots: int
) -> None:
    """Slots >= threads x blocks per store: some slot is always free or evictable for
    every store, so PoolExhausted is never right; every eviction is counted once."""
    pool = make_pool(node, slots=slots)
    removed: list[int] = []

    def count_evictions(notice: EvictionNotice) -> None:
        if notice.kind == "evict":
            removed.append(len(notice.pairs))

    node.add_eviction_hook(count_evictions)
    ids = itertools.count()
    ids_lock = threading.Lock()
    exhausted: list[PoolExhausted] = []
    checker = Checker(pool)
    if redis_backend.name == "fakeredis" and threads > 4:
        pytest.skip("fakeredis runs every call under one lock: the big races need a server")
    stores_each = 60

    def storer() -> None:
        for _ in range(stores_each):
            with ids_lock:
                blocks = [next(ids) for _ in range(per_store)]
            try:
                pool.store(blocks, [10_000 + b for b in blocks], *filled(blocks))
            except PoolExhausted as exc:
                exhausted.append(exc)
                continue
            checker.recent.extend(blocks)

    remaining = [threads]
    remaining_lock = threading.Lock()

    def storer_then_count_down() -> None:
        try:
            storer()
        finally:
            with remaining_lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    checker.done.set()

    try:
        errors = run_together([storer_then_count_down] * threads + [checker])
    finally:
        checker.done.set()
        pool.close()
    assert errors == []
    assert exhausted == []
    assert checker.wrong == []  # restores during the run (as many as scheduling allowed)
    assert_every_slot_holds_its_own_state(pool)
    counts = pool.counts()
    total = threads * stores_each * per_store
    assert counts.stored == total
    assert counts.in_use == slots
    assert counts.evicted == sum(removed) == total - slots  # each eviction counted once
    assert counts.freed == counts.evicted
    assert counts.stored == counts.in_use + counts.freed
    assert pool.pairs() == {(b, h) for h, b in registry_state(node)[1].items()}


def test_exhausted_only_when_every_slot_is_pinned(node: PrefixCacheRegistry) -> None:
    """A store in flight holds 3 of 4 slots: a 2-block store is refused, changing
    nothing; a 1-block store evicts the one registered slot; re-storing a block that is
    in flight is refused; when the first store lands everything agrees."""
    pool = make_pool(node, slots=4)
    pool.store([0], [100], *filled([0]))
    entered, gate = threading.Event(), threading.Event()
    register = node.register_mamba_stamped

    def held_register(block_ids: Any, hashes: Any) -> int:
        if not entered.is_set():
            entered.set()
            assert gate.wait(JOIN_TIMEOUT)
        return register(block_ids, hashes)

    node.register_mamba_stamped = held_register  # type: ignore[method-assign]
    failures: list[BaseException] = []

    def first_store() -> None:
        try:
            pool.store([1, 2, 3], [101, 102, 103], *filled([1, 2, 3]))
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=first_store)
    try:
        worker.start()
        assert entered.wait(JOIN_TIMEOUT)
        before = (pool.counts(), pool.pairs(), dump_keys(node))
        with pytest.raises(PoolExhausted, match="1 evictable, 3 held by stores in flight"):
            pool.store([4, 5], [104, 105], *filled([4, 5]))
        with pytest.raises(RuntimeError, match=r"block_ids\[0\] = 2 is being stored"):
            pool.store([2], [202], *filled([2]))
        assert (pool.counts(), pool.pairs(), dump_keys(node)) == before
        pool.store([4], [104], *filled([4]))  # block 0 is evictable
        assert pool.pairs() == {(4, 104)}
    finally:
        gate.set()
        worker.join(JOIN_TIMEOUT)
    assert not worker.is_alive()
    assert failures == []
    assert pool.pairs() == {(1, 101), (2, 102), (3, 103), (4, 104)}
    assert pool.pairs() == {(b, h) for h, b in registry_state(node)[1].items()}
    counts = pool.counts()
    assert (counts.stored, counts.in_use, counts.freed, counts.evicted) == (5, 4, 1, 1)


def test_churn_with_a_listener_ends_in_agreement(
    node: PrefixCacheRegistry, redis_backend: Backend
) -> None:
    """Threads store new blocks and store old block ids again with new hashes, another
    registry object evicts behind the pool's back (only the listener tells), a checker
    restores: no spurious PoolExhausted, no wrong state, and in the end the pool equals
    the registry with ``stored == in_use + freed``."""
    threads, per_store, slots = 6, 2, 12
    rounds = 20 if redis_backend.name == "fakeredis" else 80  # fakeredis serialises
    pool = make_pool(node, slots=slots)
    elsewhere = redis_backend.registry(node.namespace)
    exhausted: list[PoolExhausted] = []
    checker = Checker(pool)
    versions = itertools.count(1)
    lock = threading.Lock()

    def storer(worker: int) -> Callable[[], None]:
        rng = random.Random(worker)
        own = [worker * 1_000 + i for i in range(40)]  # block ids only this thread stores

        def run() -> None:
            for _ in range(rounds):
                blocks = rng.sample(own, per_store)
                with lock:
                    hashes = [next(versions) * 100_000 + b for b in blocks]
                try:
                    pool.store(blocks, hashes, *filled(blocks))
                except PoolExhausted as exc:
                    exhausted.append(exc)
                    continue
                checker.recent.extend(blocks)
                if rng.random() < 0.3:
                    elsewhere.evict_mamba(hashes[:1])

        return run

    counted = CountDown(threads, checker.done)

    listener = EvictionListener(redis_backend.client(), node.namespace, pool)
    try:
        with listener:
            errors = run_together([counted(storer(w)) for w in range(threads)] + [checker])
            registered = {(b, h) for h, b in registry_state(node)[1].items()}
            wait_until(lambda: pool.pairs() == registered, timeout=30, what="pool == registry")
    finally:
        checker.done.set()
        pool.close()
    assert errors == []
    assert exhausted == []
    assert checker.wrong == []
    assert_every_slot_holds_its_own_state(pool)
    counts = pool.counts()
    assert counts.stored == counts.in_use + counts.freed
    assert counts.stored == threads * rounds * per_store
