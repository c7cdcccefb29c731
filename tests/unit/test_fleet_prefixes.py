"""``registry.fleet.prefixes``: every member's prefixes from the index bitmaps at once,
against the per-namespace rule (``lua/score.lua`` without its parent-chain shortcut)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from registry.fleet import SHARDS, FleetKeys, bitmap, by_shard, lookup_calls, prefixes, update_calls
from registry.scripts import cross_slot_sha, merged_index_updates


def reference(holds: list[tuple[bool, bool]], hybrid: bool) -> tuple[int, int]:
    """One member's (KV prefix, Mamba-aware prefix): the KV prefix ends at the first
    block it lacks; the Mamba prefix is one past the farthest checkpoint inside it."""
    kv = 0
    while kv < len(holds) and holds[kv][0]:
        kv += 1
    mamba = 0
    if hybrid:
        mamba = max((p + 1 for p in range(kv) if holds[p][1]), default=0)
    return kv, mamba


members_st = st.lists(st.integers(0, 300), min_size=0, max_size=12, unique=True)


@settings(deadline=None)  # a busy machine must not fail it
@given(
    members=members_st,
    data=st.data(),
    hybrid=st.booleans(),
)
def test_prefixes_equal_the_per_member_rule(
    members: list[int], data: st.DataObject, hybrid: bool
) -> None:
    length = data.draw(st.integers(0, 40))
    holds = {
        m: data.draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=length,
                              max_size=length))
        for m in members
    }  # fmt: skip
    values: list[str | None] = []
    for position in range(length):
        bits = 0
        for m in members:
            kv, mamba = holds[m][position]
            bits |= (kv << (2 * m)) | (mamba << (2 * m + 1))
        values.append(f"{bits:x}" if bits else None)
    found = prefixes(members, values, hybrid=hybrid)
    assert found == {m: reference(holds[m], hybrid) for m in members}


def test_malformed_values_count_as_no_holder() -> None:
    assert bitmap(None) == 0
    assert bitmap("zz") == 0
    assert bitmap("-5") == 0
    assert bitmap(b"1f") == 31
    assert prefixes([0, 1], ["5", "garbage", "5"], hybrid=True) == {0: (1, 0), 1: (1, 0)}


def test_lookups_cover_every_position_once_per_shard() -> None:
    fleet = FleetKeys("t")
    hashes = list(range(1, 200, 3))
    calls, where = lookup_calls(fleet, hashes)
    assert len(calls) == len(by_shard(hashes)) <= SHARDS
    assert sorted(p for places in where for p in places) == list(range(len(hashes)))
    for (key, command), places in zip(calls, where, strict=True):
        assert command[:2] == ("HMGET", key)
        assert list(command[2:]) == [hashes[p] for p in places]
        assert {hashes[p] % SHARDS for p in places} == {fleet.shards.index(key)}


def test_updates_are_one_call_per_id_standalone_and_per_shard_on_a_cluster() -> None:
    fleet = FleetKeys()
    hashes = [1, 2, 17, 33]  # shards 1, 2, 1, 1
    assert len(update_calls(fleet, [4, 9], "kv+", hashes, cluster=False)) == 2
    assert len(update_calls(fleet, [4], "mamba-", hashes, cluster=True)) == 2
    assert update_calls(fleet, [], "kv+", hashes, cluster=False) == []
    assert update_calls(fleet, [1], "kv+", [], cluster=False) == []


def test_index_updates_merge_per_primary_only_in_runs_that_keep_their_order() -> None:
    """A set and a clear of the same hash sent in one round trip must reach the shard in
    that order: only consecutive updates of one member, change and epoch merge."""
    fleet = FleetKeys("pcr")
    hashes = list(range(32))  # every shard twice

    def calls(change: str, part: list[int]) -> list[Any]:
        return update_calls(fleet, [3], change, part, cluster=True, epoch="7")

    routed = [*calls("kv+", hashes), *calls("kv-", hashes[:4]), *calls("kv+", hashes[:4])]
    write = ("k", ("EVALSHA", "0" * 40, 1, "k", "x"))
    routed.insert(0, write)
    commands, sources = merged_index_updates(routed, range(len(routed)))
    assert commands[0] == write[1]
    assert [len(s) for s in sources] == [1, 16, 4, 4]  # three runs, each merged
    assert [c[1] for c in commands[1:]] == [cross_slot_sha("index_update")] * 3
    # (EVALSHA, sha, 1, first key, n, n more keys, member, change, epoch, ...)
    assert [c[5 + c[4] : 8 + c[4]] for c in commands[1:]] == [
        (3, "kv+", "7"),
        (3, "kv-", "7"),
        (3, "kv+", "7"),
    ]
    assert sorted(i for s in sources for i in s) == list(range(len(routed)))
    # A merged call carries every shard's hashes, its first key declared, the rest after
    # their count: what the cross-slot preamble moves back into KEYS.
    first = commands[1]
    assert first[2:4] == (1, fleet.shards[0])
    assert first[4] == 15
    assert list(first[5:20]) == list(fleet.shards[1:])
    # Nothing else merges: an update alone stays as it was.
    alone = calls("mamba+", [5])
    assert merged_index_updates(alone, [0]) == ([alone[0][1]], [[0]])
