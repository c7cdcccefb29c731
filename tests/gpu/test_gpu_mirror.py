"""The slot pool on a mirrored owner (``registry.mirror``): its hooks fire at local apply,
stamps and notices carry the numbers Redis publishes, and after a flush Redis holds
exactly the pool's pairs (CPU tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from registry import EvictionNotice, MirroredRegistry
from tests.support.backends import Backend, new_namespace, registry_state
from tests.support.gpu import make_pool, states

A, B, C, D = 1111, 2222, 3333, 4444


@pytest.fixture
def mirror(redis_backend: Backend) -> Iterator[MirroredRegistry]:
    made = MirroredRegistry(redis_backend.client(), new_namespace())
    made.claim()
    yield made
    made.close()


def test_the_pool_frees_at_local_apply_and_redis_agrees_after_a_flush(
    mirror: MirroredRegistry,
) -> None:
    seen: list[EvictionNotice] = []
    mirror.add_eviction_hook(seen.append)
    pool = make_pool(mirror, slots=3)
    mirror.stop_flusher()  # nothing reaches Redis until flush(): all of it is local
    conv, ssm = states(3)
    pool.store([1, 2, 3], [A, B, C], conv, ssm)
    assert pool.pairs() == {(1, A), (2, B), (3, C)}
    mirror.register_kv([1, 2, 3], [A, B, C])
    assert mirror.evict_kv([B]) == {B}  # the cascade frees the slot in the call
    assert pool.pairs() == {(1, A), (3, C)}
    assert seen[-1].pairs == ((2, B),)
    conv, ssm = states(2, seed=1)
    pool.store([4, 5], [D, 5555], conv, ssm)  # one free slot: the LRU one is evicted
    assert len(pool.pairs()) == 3
    assert registry_state(mirror.inner)[1] == {}  # still nothing in Redis
    mirror.flush()
    assert set(registry_state(mirror.inner)[1].items()) == {(h, b) for b, h in pool.pairs()}
    assert pool.reconcile(mirror.inner) == []  # Redis and the pool agree
    published = mirror.inner.notices_after(seen[0].seq - 1)
    assert published is not None
    assert [(n.seq, n.kind, n.pairs) for n in published] == [(n.seq, n.kind, n.pairs) for n in seen]
    assert pool.counts().stored == 5


def test_a_stamp_is_the_number_redis_gives(mirror: MirroredRegistry) -> None:
    pool = make_pool(mirror, slots=4)
    conv, ssm = states(2)
    pool.store([1, 2], [A, B], conv, ssm)
    mirror.flush()
    local = mirror.notice_sequence()
    assert mirror.inner.notice_position()[1] == local
    conv, ssm = states(1, seed=3)
    pool.store([1], [C], conv, ssm)  # block 1 again: its old entry is evicted first
    assert mirror.notice_sequence() == local + 1
    mirror.flush()
    assert mirror.inner.notice_position() == mirror.notice_position()
    assert pool.pairs() == {(1, C), (2, B)}


def test_claiming_again_clears_the_pool(mirror: MirroredRegistry) -> None:
    pool = make_pool(mirror, slots=4)
    conv, ssm = states(2)
    pool.store([1, 2], [A, B], conv, ssm)
    mirror.claim()
    assert pool.pairs() == set()
    assert pool.counts().free == 4
