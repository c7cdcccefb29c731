"""Every Mamba removal publishes a numbered notice and appends it to the stream."""

from __future__ import annotations

import time
from typing import Any

import pytest

from registry import EvictionNotice, PrefixCacheRegistry, parse_notice, parse_stream_entry
from tests.support.backends import Backend, notice_base, relative

H = [1111, 2222, 3333, 4444]


def next_notice(pubsub: Any, timeout: float = 5.0) -> EvictionNotice:
    """The next message on the subscribed channel, parsed (poll with a deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            return parse_notice(message["data"])
    raise AssertionError("no notice arrived")


def stream_notices(reg: PrefixCacheRegistry) -> list[EvictionNotice]:
    return [parse_stream_entry(f) for _, f in reg.client.xrange(reg.keys.mamba_evictions)]


def subscribe(backend: Backend, reg: PrefixCacheRegistry) -> Any:
    pubsub = backend.client().pubsub()
    pubsub.subscribe(reg.keys.mamba_evicted_channel)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # wait for the subscription to be confirmed
        message = pubsub.get_message(timeout=0.1)
        if message is not None and message["type"] == "subscribe":
            return pubsub
    raise AssertionError("subscription not confirmed")


def test_each_removal_kind_publishes_one_numbered_notice(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    pubsub = subscribe(redis_backend, reg)
    try:
        reg.register_kv([1, 2, 3, 4], H)
        reg.register_mamba([1, 2, 3], H[:3])
        reg.evict_mamba([H[0], H[3]])  # only H[0] has Mamba state
        reg.evict_kv([H[1]])  # cascades to H[1]'s Mamba entry
        reg.register_mamba([9], [H[2]])  # replaces (3, H[2])
        reg.evict_kv([H[3]])  # no Mamba entry: no notice
        reg.clear_mamba()
        reg.clear_mamba()  # nothing left: no notice
        reg.register_mamba([4], [H[3]])
        reg.reset()
        expected = [
            (1, "evict", ((1, H[0]),)),
            (2, "cascade", ((2, H[1]),)),
            (3, "replace", ((3, H[2]),)),
            (4, "clear", ()),
            (5, "clear", ()),
        ]
        published = [next_notice(pubsub) for _ in expected]
        assert [relative(reg, n) for n in published] == expected
        incarnation, newest = reg.notice_position()
        assert {n.incarnation for n in published} == {incarnation}
        assert pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
        assert stream_notices(reg) == published
        assert newest - notice_base(reg) == 5
    finally:
        pubsub.close()


def test_notice_lists_every_pair_of_a_bulk_eviction(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    size = 4_500 if redis_backend.name == "fakeredis" else 9_000  # past one 4,000 chunk
    hashes = [2**63 - 1 - i for i in range(size)]
    reg.register_kv(range(size), hashes)
    reg.register_mamba(range(size), hashes)
    seen: list[EvictionNotice] = []
    reg.add_eviction_hook(seen.append)
    pubsub = subscribe(redis_backend, reg)
    try:
        reg.evict_kv(hashes)
        published = next_notice(pubsub)
    finally:
        pubsub.close()
    expected = sorted(zip(range(size), hashes, strict=True))
    (notice,) = seen
    assert notice == published  # the channel carries every pair, as the hook sees them
    assert notice.kind == "cascade"
    assert sorted(notice.pairs) == expected
    # The stream keeps at most 1 KiB of pairs per notice: this one is kept truncated, so
    # a replay knows it must reconcile instead.
    (kept,) = stream_notices(reg)
    assert (kept.seq, kept.kind, kept.pairs, kept.truncated) == (notice.seq, "cascade", (), True)
    assert reg.notices_after(notice.seq - 1) is None


def test_stream_is_bounded_in_bytes(redis_backend: Backend) -> None:
    """1,300 notices of 100 pairs each (about 2.5 KB): the stream stays small (25 MB
    after 2,000 large evictions when every notice kept all its pairs)."""
    if redis_backend.name == "fakeredis":
        pytest.skip("fakeredis has no MEMORY USAGE")
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    hashes = [2**62 + i for i in range(100)]
    for round_ in range(1_300):  # each moves the 100 hashes: one 'replace' notice
        reg.register_mamba(range(round_ % 2, 200, 2), hashes)
    assert reg.client.xlen(reg.keys.mamba_evictions) >= 1_000
    used = reg.client.memory_usage(reg.keys.mamba_evictions, samples=0)
    # At most maxlen (1,000) + one stream node (100) entries of about 150 bytes each.
    assert used < 1_100 * 400, used


def test_stream_is_capped(redis_backend: Backend) -> None:
    reg = redis_backend.registry(notice_stream_maxlen=10)
    assert isinstance(reg, PrefixCacheRegistry)
    for i in range(1, 401):
        reg.register_mamba([i], [i])
        reg.evict_mamba([i])
    length = reg.client.xlen(reg.keys.mamba_evictions)
    # MAXLEN ~ trims whole stream nodes (100 entries by default), never below the cap.
    assert 10 <= length <= 10 + 100
    assert relative(reg, stream_notices(reg)[-1]) == (400, "evict", ((400, 400),))


def test_sequence_survives_reset(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.register_mamba([1], [H[0]])
    reg.reset()
    reg.register_mamba([1], [H[0]])
    reg.evict_mamba([H[0]])
    assert [relative(reg, n)[:2] for n in stream_notices(reg)] == [(1, "clear"), (2, "evict")]


def test_a_lost_meta_starts_a_new_history_whose_numbers_never_go_back(
    redis_backend: Backend,
) -> None:
    """meta lost (gc, an empty restart, an eviction): the next notice names a new
    incarnation and is numbered above every notice of the old one."""
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.register_mamba([1, 2], H[:2])
    reg.evict_mamba(H[:1])
    old_incarnation, old_seq = reg.notice_position()
    reg.client.delete(reg.keys.meta)  # as maxmemory eviction or a restart would
    assert reg.notice_position() == ("", 0)
    seen: list[EvictionNotice] = []
    reg.add_eviction_hook(seen.append)
    reg.evict_mamba(H[1:2])
    (notice,) = seen
    assert notice.incarnation not in ("", old_incarnation)
    assert notice.seq > old_seq
    assert reg.notice_position() == (notice.incarnation, notice.seq)
    assert reg.notices_after(old_seq, incarnation=old_incarnation) is None
    assert reg.notices_after(notice.seq - 1, incarnation=notice.incarnation) == [notice]


def test_hooks_receive_the_published_notices(backend: Backend) -> None:
    reg = backend.registry()
    seen: list[EvictionNotice] = []
    reg.add_eviction_hook(seen.append)
    reg.register_kv([1, 2], H[:2])
    stamp = reg.register_mamba_stamped([1, 2], H[:2])
    base = notice_base(reg)
    assert stamp - base == 0  # no notice numbered yet in this history
    reg.evict_kv(H[:1])
    assert reg.register_mamba_stamped([5], H[1:2]) - base == 2  # its own replace notice
    reg.clear_mamba()
    assert [relative(reg, n) for n in seen] == [
        (1, "cascade", ((1, H[0]),)),
        (2, "replace", ((2, H[1]),)),
        (3, "clear", ()),
    ]
    assert reg.notice_sequence() - base == 3
    reg.remove_eviction_hook(seen.append)
    reg.register_mamba([1], H[:1])
    reg.evict_mamba(H[:1])
    assert len(seen) == 3


def test_mamba_block_ids_reads_each_hash(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_mamba([4, 0], [H[0], H[2]])
    assert reg.mamba_block_ids([H[0], H[1], H[2], -1]) == [4, None, 0, None]
    assert reg.mamba_block_ids([]) == []
    many = list(range(1, 10_001))
    reg.register_mamba(many, many)
    assert reg.mamba_block_ids([*many, 10_001]) == [*many, None]


def test_notices_after_reads_the_stream_back(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    assert reg.notices_after(0) == []
    for i in range(1, 8):
        reg.register_mamba([i], [i])
        reg.evict_mamba([i])
    b = notice_base(reg)
    everything = stream_notices(reg)
    assert [n.seq - b for n in everything] == list(range(1, 8))
    assert reg.notices_after(b, page=3) == everything
    assert reg.notices_after(b + 4, page=2) == everything[4:]
    assert reg.notices_after(b + 7) == []
    assert reg.notices_after(b + 9) is None  # numbers went backwards: the namespace was wiped
    reg.client.xtrim(reg.keys.mamba_evictions, maxlen=2, approximate=False)
    assert reg.notices_after(b + 5) == everything[5:]
    assert reg.notices_after(b + 4) is None  # notice 5 was trimmed away: reconcile instead


def test_notices_after_zero_gives_the_whole_history(redis_backend: Backend) -> None:
    """A number below the history's first one (0, say) asks for every notice of the
    current history, also when the stream still holds an older history's notices."""
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    assert reg.notices_after(0) == []
    reg.register_mamba([1], [H[0]])  # the history begins: nothing published yet
    assert reg.notices_after(0) == []
    reg.evict_mamba([H[0]])
    reg.register_mamba([2, 3], H[1:3])
    reg.register_mamba([4], [H[1]])  # replaces block 2: a notice
    everything = stream_notices(reg)
    assert len(everything) == 2
    assert reg.notices_after(0) == everything
    assert reg.notices_after(0, page=1) == everything
    assert reg.notices_after(notice_base(reg) - 5) == everything
    incarnation = everything[0].incarnation
    assert reg.notices_after(0, incarnation=incarnation) == everything
    assert reg.notices_after(0, incarnation="123") is None
    reg.client.hdel(reg.keys.meta, "incarnation", "notice_seq")  # meta lost: a new history
    reg.evict_mamba([H[2]])
    newer = stream_notices(reg)[-1]
    assert newer.incarnation != incarnation
    assert reg.notices_after(0) == [newer]  # the older history's notices are not part of it
    reg.client.xtrim(reg.keys.mamba_evictions, maxlen=0, approximate=False)
    assert reg.notices_after(0) is None  # trimmed: reconcile instead


def test_notice_sequence_is_zero_before_any_write_then_the_history_start(
    redis_backend: Backend,
) -> None:
    """0 before the first write; then the number the history counts from (no notice yet);
    each notice one above the last."""
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    assert reg.notice_sequence() == 0
    reg.register_mamba([1], [H[0]])
    start = reg.notice_sequence()
    assert start == notice_base(reg) > 0
    assert reg.notices_after(start) == []
    reg.evict_mamba([H[0]])
    assert reg.notice_sequence() == start + 1
    assert [n.seq for n in stream_notices(reg)] == [start + 1]
