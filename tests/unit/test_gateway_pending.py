"""Requests in flight counted as cached where they were sent (``pcr.gateway.pending``):
reference counts of shared prefixes, expiry, a success's grace, a failure dropped at once,
the bound per backend, confirmations, evictions and restarts heard from a fleet view
(``FleetView.detached``, records applied by hand), hybrid checkpoints, and the chains one
replica tells another."""

from __future__ import annotations

import json

import pytest

from pcr.gateway.pending import (
    Listed,
    PendingBounds,
    PendingPrefixes,
    checkpoints,
    ladder,
    parse_wire,
)
from registry.fleet.view import FleetView

CHAIN = list(range(101, 141))  # 40 parent-chained block hashes, as a prompt's
SIBLING = [*CHAIN[:24], *range(901, 911)]  # shares the first 24 blocks, then its own
NOTHING = Listed({})


def prefixes(pending: PendingPrefixes, hashes: list[int], listed: Listed = NOTHING) -> Listed:
    extended = pending.extend(["a", "b"], hashes, listed)
    return listed if extended is None else extended


def usable(pending: PendingPrefixes, hashes: list[int], listed: Listed = NOTHING) -> dict[str, int]:
    return prefixes(pending, hashes, listed).usable


def test_a_sent_prompt_counts_at_its_backend_for_the_prompts_that_share_it() -> None:
    pending = PendingPrefixes()
    assert pending.extend(["a", "b"], CHAIN, NOTHING) is None  # nothing in flight
    pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    assert usable(pending, CHAIN) == {"a": 30}  # the next turn: all of it
    assert usable(pending, SIBLING) == {"a": 24}  # a sibling: the shared part
    assert usable(pending, [7, 8, 9]) == {}
    assert pending.blocks("a") == 30
    assert pending.blocks("b") == 0


def test_the_registrys_prefix_is_continued_through_the_pending_blocks() -> None:
    """The registry lists the first 10 blocks at a; the request sent there holds 10 to 30
    pending (those listed are not counted twice)."""
    pending = PendingPrefixes()
    pending.sent("a", CHAIN[:30], 10, (), now=0.0)
    assert pending.blocks("a") == 20
    assert usable(pending, CHAIN, Listed({"a": 10, "b": 4})) == {"a": 30, "b": 4}
    # the registry lost a's first blocks (evicted): the pending ones no longer connect
    assert usable(pending, CHAIN, Listed({"a": 3})) == {"a": 3}


def test_a_prefix_shared_by_requests_in_flight_counts_until_the_last_ends() -> None:
    pending = PendingPrefixes(PendingBounds(grace=0))
    first = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    second = pending.sent("a", SIBLING, 0, (), now=0.0)
    assert pending.blocks("a") == 30 + 10  # the 24 shared blocks held once
    pending.ended(first, ok=True, now=1.0)
    assert usable(pending, CHAIN) == {"a": 24}  # the sibling still holds the shared part
    pending.ended(second, ok=True, now=1.0)
    assert usable(pending, CHAIN) == {}
    assert pending.blocks("a") == 0
    pending.ended(second, ok=True, now=1.0)  # twice: nothing more


def test_a_success_counts_for_the_grace_a_failure_not_at_all() -> None:
    pending = PendingPrefixes(PendingBounds(grace=2.0))
    done = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    failed = pending.sent("b", SIBLING, 0, (), now=0.0)
    pending.ended(done, ok=True, now=1.0)
    pending.ended(failed, ok=False, now=1.0)  # an error, a client gone: at once
    assert usable(pending, SIBLING) == {"a": 24}
    pending.expire(2.9)
    assert usable(pending, CHAIN) == {"a": 30}
    pending.expire(3.0)
    assert usable(pending, CHAIN) == {}


def test_blocks_stop_counting_when_the_ttl_passes_whatever_the_request_does() -> None:
    pending = PendingPrefixes(PendingBounds(ttl=5.0))
    old = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    pending.sent("b", SIBLING, 0, (), now=3.0)
    pending.expire(4.9)
    assert usable(pending, SIBLING) == {"a": 24, "b": 34}
    pending.expire(5.0)
    assert usable(pending, SIBLING) == {"b": 34}
    assert pending.counts.expired == 1
    pending.ended(old, ok=True, now=6.0)  # ended after it expired: nothing comes back
    assert usable(pending, CHAIN) == {"b": 24}


def test_a_ttl_of_zero_counts_nothing() -> None:
    pending = PendingPrefixes(PendingBounds(ttl=0))
    assert not pending.on
    assert pending.sent("a", CHAIN, 0, (), now=0.0) is None
    assert pending.extend(["a"], CHAIN, NOTHING) is None


def test_past_the_bound_the_oldest_requests_stop_counting() -> None:
    pending = PendingPrefixes(PendingBounds(max_blocks=32))
    pending.sent("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0, (), now=0.0)
    pending.sent("a", SIBLING, 0, (), now=1.0)  # 34 blocks: its first 32 only
    assert pending.blocks("a") == 32
    assert usable(pending, SIBLING) == {"a": 32}
    assert usable(pending, [1, 2, 3]) == {}  # the oldest went
    pending.sent("b", [1, 2, 3], 0, (), now=1.0)  # per backend
    assert usable(pending, [1, 2, 3]) == {"b": 3}


def test_bad_bounds_are_refused() -> None:
    for bad in ({"ttl": -1}, {"ttl": float("inf")}, {"grace": float("nan")}, {"max_blocks": 0}):
        with pytest.raises(ValueError, match="pending"):
            PendingBounds(**bad)


def watched(names: list[str]) -> tuple[FleetView, PendingPrefixes, dict[str, int]]:
    view = FleetView.detached(names)
    pending = PendingPrefixes(PendingBounds(grace=60.0))
    view.observe(pending.heard)
    return view, pending, dict.fromkeys(names, 0)


def record(view: FleetView, seq: dict[str, int], name: str, parts: str) -> None:
    """A change record of ``name``'s, numbered as its writes number them."""
    seq[name] += 1
    view.apply(f"{name} 0 {seq[name]} {parts}".encode())


def words(hashes: list[int]) -> str:
    return " ".join(map(str, hashes))


def test_blocks_the_view_lists_where_they_were_sent_are_confirmed() -> None:
    view, pending, seq = watched(["a", "b"])
    sent = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    record(view, seq, "b", "k+ " + words(CHAIN[:30]))  # another engine's: not these
    pending.expire(0.0)
    assert pending.blocks("a") == 30
    record(view, seq, "a", "k+ " + words(CHAIN[:20]))  # the engine's events, in part
    pending.expire(0.0)
    assert pending.blocks("a") == 10
    assert pending.counts.confirmed == 20
    matched = view.match(CHAIN, ["a", "b"], hybrid=False)
    assert usable(pending, CHAIN, Listed(dict(matched.items()))) == {"a": 30, "b": 30}
    # A new request holding a confirmed block again, then the first ends: the new one's
    # entry is its own, not dropped with the first's.
    pending.sent("a", [CHAIN[0], 55, 56], 0, (), now=0.0)
    pending.ended(sent, ok=False, now=1.0)
    assert pending.blocks("a") == 3


def test_blocks_seen_evicted_or_a_restart_stop_counting_at_once() -> None:
    """Request 1 went to a when the view listed none of its blocks there, yet the
    engine had its first 10 (their record was on its way): they count as pending too.
    The engine evicts two of them: the view sees it, and they stop counting at once,
    so a's prefix ends there (not 30 blocks on, where the request's blocks end)."""
    view, pending, seq = watched(["a", "b"])
    record(view, seq, "a", "k+ " + words(CHAIN[:10]))
    pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    pending.sent("b", SIBLING, 0, (), now=0.0)
    record(view, seq, "a", "k- " + words(CHAIN[0:2]))
    pending.expire(0.0)
    assert usable(pending, CHAIN) == {"b": 24}
    assert pending.counts.evicted == 2
    record(view, seq, "a", "C")  # a restart (a claim: the engine's cache is empty)
    record(view, seq, "b", "K")  # a reset of the cache (AllBlocksCleared)
    pending.expire(0.0)
    assert usable(pending, CHAIN) == {}
    assert pending.blocks("a") == pending.blocks("b") == 0
    assert pending.wire() == {}  # and no longer told to other replicas


def test_a_hybrid_nodes_pending_checkpoints_make_the_prefix_usable() -> None:
    """A request of 30 blocks and a token (481 tokens at 16) sent to a hybrid node
    leaves a Mamba state at its replay boundary (block 30); the KV hit it found there
    (12 blocks, usable 8) leaves another at 12. A prompt sharing 24 blocks can reuse
    the state at 12; the next turn the one at 30."""
    marks = list(checkpoints(True, 481, 16, 12, 8))
    assert marks == [30, 12]
    assert list(checkpoints(False, 481, 16, 12, 8)) == []
    assert list(checkpoints(True, 480, 16, 29, 29)) == [29]  # the last token is computed
    pending = PendingPrefixes()
    pending.sent("a", CHAIN[:30], 12, marks, now=0.0)
    listed = Listed({"a": 8}, {"a": 12}, frozenset({"a"}))
    assert prefixes(pending, SIBLING, listed) == Listed({"a": 12}, {"a": 24}, frozenset({"a"}))
    assert prefixes(pending, CHAIN, listed) == Listed({"a": 30}, {}, frozenset({"a"}))
    # seen confirmed (the Mamba entry listed): the view's from then on
    view, heard, seq = watched(["a"])
    heard.sent("a", CHAIN[:30], 12, marks, now=0.0)
    record(view, seq, "a", f"m+ {CHAIN[29]}")
    heard.expire(0.0)
    assert prefixes(heard, CHAIN, listed).usable == {"a": 12}


def test_another_replicas_chains_count_as_its_own() -> None:
    """What one replica tells (``wire``) the other parses and counts: all of a chain
    for the next turn, at least two thirds of a shared prefix for a sibling; chains
    whose listed part the registry no longer lists do not count."""
    one = PendingPrefixes()
    one.sent("a", CHAIN[:30], 4, [30], now=0.0)
    one.sent("b", [1, 2, 3], 0, (), now=0.0)
    told = json.loads(json.dumps(one.wire()))
    assert [chain[:2] for chain in told["a"]] == [[4, 30]]
    assert ladder(30) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 30]
    assert len(told["a"][0][2]) == 10
    two = PendingPrefixes()
    two.set_remote([parse_wire(told)])
    listed = Listed({"a": 4})
    assert usable(two, CHAIN, listed) == {"a": 30}  # the next turn: all of it
    assert usable(two, SIBLING, listed) == {"a": 24}  # shared 24: a ladder position
    assert usable(two, [*CHAIN[:23], 7], listed) == {"a": 16}  # 23 shared: 16
    assert usable(two, [1, 2, 3, 4], listed) == {"a": 4, "b": 3}
    assert usable(two, CHAIN, Listed({"a": 2})) == {"a": 2}  # a lost its listed part
    hybrid = Listed({"a": 0}, {"a": 4}, frozenset({"a"}))
    assert two.extend(["a"], CHAIN, hybrid) == Listed({"a": 30}, {}, frozenset({"a"}))
    assert two.told_chains("a") == 1


def test_the_wire_is_bounded_and_bad_wires_are_refused() -> None:
    one = PendingPrefixes()
    for i in range(20):
        one.sent("a", [*CHAIN[:10], 1000 + i], 0, (), now=float(i))
    told = one.wire()
    assert len(told["a"]) == 8  # the newest chains only
    assert told["a"][0][2][-1] == 1019
    bads: list[object] = [
        [],
        {"a": {}},
        {"a": [[0, 2, [5], []]]},  # one hash short of the ladder
        {"a": [[0, 1, [0], []]]},  # not a hash
        {"a": [[0, 1, [5], [[2, 5]]]]},  # a checkpoint past the chain
        {"a": [[-1, 1, [5], []]]},
        {"a": [[0, 1, [True], []]]},
        {"a": [[0, 2, [5, 1.0], []]]},  # a float among ints
        {"a": [[0, 2, [5, 2**63], []]]},  # past the largest hash
        {"a": [[0, 2, [5, "6"], []]]},
        {"a": [[0, 1, [5]]]},
        {str(i): [] for i in range(65)},
    ]
    for bad in bads:
        with pytest.raises(ValueError, match="pending: "):
            parse_wire(bad)


def test_records_in_their_grace_leave_little_for_the_collector_to_walk() -> None:
    """A busy gateway holds thousands of records (in flight, then in their grace), and
    every full collection walks what is tracked: a record's chain is a tuple of ints the
    collector stops tracking once a young collection has seen it, and a record with no
    checkpoint makes no list for them; its grace, its release and what it tells the
    other replicas are as before."""
    import gc

    pending = PendingPrefixes(PendingBounds(grace=1.0))
    hashes = list(CHAIN)
    record = pending.sent("a", hashes, 4, (), now=0.0)
    assert record is not None
    hashes[10] = 7  # the caller's list is not what the record holds
    assert list(record.chain) == CHAIN
    assert not isinstance(record.marks, list)
    gc.collect(0)
    assert not gc.is_tracked(record.chain)
    marked = pending.sent("a", SIBLING, 0, [8, 24], now=0.0)
    assert marked is not None
    assert [p for p, _e in marked.marks] == [8, 24]
    assert pending.wire()["a"][0][1] == len(SIBLING)  # the newest chain, all of it
    pending.ended(record, ok=True, now=1.0)
    pending.expire(1.5)
    assert usable(pending, CHAIN)["a"] == len(CHAIN)  # in its grace
    pending.expire(2.0)
    assert usable(pending, CHAIN)["a"] == 24  # the sibling's shared part is left
    pending.ended(marked, ok=False, now=2.0)
    assert not pending.busy()


def test_a_request_gives_its_blocks_back_at_its_end_its_grace_stamped_on_them() -> None:
    """A success's record is let go at its end (its memory still warm): its blocks count
    for the grace through a stamp on each, the newest few records are kept only to be
    told to the other replicas, and a sweep drops the blocks once the grace is over."""
    pending = PendingPrefixes(PendingBounds(grace=2.0))
    for i in range(50):
        record = pending.sent("a", [*CHAIN[:10], 1000 + i], 0, (), now=float(i) / 100)
        pending.ended(record, ok=True, now=float(i) / 100 + 0.01)
    assert not pending._live  # no record waits for its grace
    assert len(pending._backends["a"].recent) <= 8
    assert [c[2][-1] for c in pending.wire()["a"]][:2] == [1049, 1048]  # told in the grace
    pending.expire(1.0)
    assert usable(pending, [*CHAIN[:10], 1000]) == {"a": 11}  # the first one's grace lasts
    pending.expire(2.4)
    assert usable(pending, [*CHAIN[:10], 1000]) == {"a": 10}  # its own block's grace is over
    assert usable(pending, [*CHAIN[:10], 1049]) == {"a": 11}
    pending.expire(3.0)
    assert usable(pending, CHAIN) == {}
    assert pending.blocks("a") == 0  # swept
    assert pending.wire() == {}
    assert not pending.busy()


def test_the_grace_never_outlasts_the_ttl() -> None:
    pending = PendingPrefixes(PendingBounds(ttl=5.0, grace=2.0))
    record = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    pending.ended(record, ok=True, now=4.5)
    pending.expire(4.9)
    assert usable(pending, CHAIN) == {"a": 30}
    pending.expire(5.0)
    assert usable(pending, CHAIN) == {}


def test_a_block_in_its_grace_taken_up_again_counts_while_held() -> None:
    """A block whose holder ended successfully, sent again: held by the new request past
    the old grace; the new one failing drops it at once (its grace being over)."""
    pending = PendingPrefixes(PendingBounds(grace=2.0))
    first = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    pending.ended(first, ok=True, now=1.0)
    again = pending.sent("a", CHAIN[:20], 0, (), now=1.5)
    assert pending.blocks("a") == 30
    pending.expire(3.5)  # the first one's grace is over: its last 10 blocks with it
    assert usable(pending, CHAIN) == {"a": 20}
    assert pending.blocks("a") == 20
    pending.ended(again, ok=False, now=3.6)
    assert usable(pending, CHAIN) == {}
    assert not pending.busy()


def test_a_failure_leaves_the_grace_of_an_earlier_success_sharing_its_blocks() -> None:
    pending = PendingPrefixes(PendingBounds(grace=2.0))
    done = pending.sent("a", CHAIN[:30], 0, (), now=0.0)
    failing = pending.sent("a", SIBLING, 0, (), now=0.0)
    pending.ended(done, ok=True, now=1.0)  # the shared 24 still held by the other too
    pending.ended(failing, ok=False, now=1.5)  # its own 10 go at once
    pending.expire(1.6)
    assert usable(pending, SIBLING) == {"a": 24}  # the shared part: done's grace
    assert usable(pending, CHAIN) == {"a": 30}
    pending.expire(3.0)
    assert usable(pending, CHAIN) == {}
    assert not pending.busy()
