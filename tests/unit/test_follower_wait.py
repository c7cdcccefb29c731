"""How long the fleet view's follower waits for its next message (``_wait``): briefly
while loads are under way, not at all for a resync or (once subscribed) a live read
asked for, else until its next live read or resync, a second at most; and never zero
for a live read asked for before the subscription is confirmed (it would spin while
Redis does not answer the subscribe)."""

from __future__ import annotations

import time

from registry.fleet.follower import IDLE_WAIT_S, POLL_LOADING_S, RecordFollower
from registry.fleet.holders import HolderTable, ViewCounts


def follower(live_cache_ttl: float = 1.0) -> RecordFollower:
    counts = ViewCounts()
    return RecordFollower(
        None, "pcr", HolderTable(counts), counts, live_cache_ttl=live_cache_ttl,
        resync_interval=60.0,
    )  # fmt: skip


def test_the_wait_follows_what_is_due() -> None:
    f = follower(live_cache_ttl=30.0)
    later = time.monotonic() + 3600
    assert f._wait(later) == IDLE_WAIT_S  # not subscribed, nothing due: the longest
    f._following = True
    f.live_read_at = time.monotonic()
    assert f._wait(later) == IDLE_WAIT_S  # the live read 30 s away: a second at most
    f.live_read_at = time.monotonic() - 29.5
    assert f._wait(later) <= 0.5  # due within half a second
    f.live_read_at = time.monotonic() - 31
    assert f._wait(later) == 0.0  # overdue
    f.live_read_at = time.monotonic()
    assert 0.0 <= f._wait(time.monotonic() + 0.2) <= 0.2  # the resync is due first
    f._loading["a"] = []
    assert f._wait(later) == POLL_LOADING_S


def test_what_is_asked_for_is_done_at_once_but_a_live_read_only_once_subscribed() -> None:
    f = follower()
    later = time.monotonic() + 3600
    f.read_live.set()
    assert f._wait(later) == IDLE_WAIT_S  # not subscribed yet: the confirmation wakes it
    f._following = True
    f.live_read_at = time.monotonic()
    assert f._wait(later) == 0.0
    f.read_live.clear()
    f.resync.set()
    assert f._wait(later) == 0.0
