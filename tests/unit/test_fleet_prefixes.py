"""``registry.fleet.prefixes``: every member's prefixes from the index bitmaps at once,
against the per-namespace rule (``lua/score.lua`` without its parent-chain shortcut)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.fleet import (
    GROUPS,
    FleetKeys,
    bitmap,
    few_value_prefix_ends,
    global_id,
    group_masks,
    group_of,
    home_group,
    local_id,
    lookup_calls,
    prefix_ends,
    prefixes,
    stamp_calls,
    update_calls,
)
from registry.scripts import same_arguments


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
    # Each member's bits in its group's shard, under its local id.
    values: dict[int, list[str | None]] = {}
    for group in {m % GROUPS for m in members}:
        column: list[str | None] = []
        for position in range(length):
            bits = 0
            for m in members:
                if m % GROUPS == group:
                    kv, mamba = holds[m][position]
                    local = m // GROUPS
                    bits |= (kv << (2 * local)) | (mamba << (2 * local + 1))
            column.append(f"{bits:x}" if bits else None)
        values[group] = column
    found = prefixes(members, values, hybrid=hybrid)
    assert found == {m: reference(holds[m], hybrid) for m in members}


def test_malformed_values_count_as_no_holder() -> None:
    assert bitmap(None) == 0
    assert bitmap("zz") == 0
    assert bitmap("-5") == 0
    assert bitmap(b"1f") == 31
    assert prefixes([0, 16], {0: ["5", "garbage", "5"]}, hybrid=True) == {
        0: (1, 0),
        16: (1, 0),
    }


def test_ids_carry_their_group_and_local_id() -> None:
    for member in (0, 1, 15, 16, 17, 4095, 65_537):
        assert global_id(group_of(member), local_id(member)) == member
        assert 0 <= group_of(member) < GROUPS
    assert group_masks([0, 16, 3, 35]) == {0: 0b101, 3: 0b10001}


def test_lookups_read_every_position_once_per_group() -> None:
    fleet = FleetKeys("t")
    hashes = list(range(1, 200, 3))
    calls = lookup_calls(fleet, hashes, [0, 5])
    assert calls == [
        (fleet.shards[0], ("HMGET", fleet.shards[0], *hashes)),
        (fleet.shards[5], ("HMGET", fleet.shards[5], *hashes)),
    ]
    assert lookup_calls(fleet, [], [0, 5]) == []


def test_updates_are_one_call_per_id_on_its_groups_shard() -> None:
    fleet = FleetKeys()
    hashes = [1, 2, 17, 33]
    calls = update_calls(fleet, [4, 41], "kv+", hashes, epoch="9")
    assert [key for key, _command in calls] == [fleet.shards[4], fleet.shards[9]]
    # (EVALSHA, sha, 1, key, local id, change, epoch, count, hashes...)
    assert [command[3:] for _key, command in calls] == [
        (fleet.shards[4], 0, "kv+", "9", 4, *hashes),
        (fleet.shards[9], 2, "kv+", "9", 4, *hashes),
    ]
    assert update_calls(fleet, [], "kv+", hashes) == []
    assert update_calls(fleet, [1], "kv+", []) == []
    (stamp,) = stamp_calls(fleet, 41, "9")
    assert stamp[0] == fleet.shards[9]
    assert stamp[1][3:] == (fleet.shards[9], 2, "stamp", "9", 0)


def test_reads_of_several_shards_share_one_packing_of_the_prompt() -> None:
    hiredis = pytest.importorskip("hiredis")
    keys = ["pcr:{index-00.20}:blocks", "pcr:{index-02.1}:blocks", "p:{ü}:blocks"]
    hashes = [1, 2**63 - 1, 17, 0]
    commands = same_arguments("HMGET", keys, hashes)
    assert commands == [("HMGET", key, *hashes) for key in keys]
    for command in commands:  # each as hiredis packs it alone
        assert command.wire == hiredis.pack_command(tuple(command))  # type: ignore[attr-defined]
    assert same_arguments("HMGET", keys[:1], hashes) == [("HMGET", keys[0], *hashes)]


def test_an_owner_joins_the_group_whose_shard_its_own_node_serves() -> None:
    fleet = FleetKeys("pcr")

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name

    class Cluster:  # what registry.scripts.is_cluster looks for
        nodes_manager = None

        def __init__(self, where: dict[str, str], default: str) -> None:
            self.where, self.default = where, default

        def get_node_from_key(self, key: str) -> Node:
            if self.default == "raise":
                raise ConnectionError("layout moving")
            return Node(self.where.get(key, self.default))

    ns = "pcr:{node-a}:kv"
    on_b = {ns: "b", fleet.shards[5]: "b", fleet.shards[9]: "b"}
    assert home_group(Cluster(on_b, "a"), fleet, ns) == 5  # the first one on its node
    assert home_group(Cluster({ns: "c"}, "a"), fleet, ns) == 0  # none there: any is right
    assert home_group(Cluster({}, "raise"), fleet, ns) == 0
    assert home_group(object(), fleet, ns) == 0  # a standalone server: one group


@settings(deadline=None, max_examples=400)
@given(
    pool=st.lists(
        st.one_of(st.none(), st.just("zz"), st.integers(0, 255).map(lambda b: format(b, "x"))),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
    start=st.integers(1, 0b01010101),
    hybrid=st.booleans(),
)
def test_few_values_give_what_the_walk_gives(
    pool: list[str | None], data: st.DataObject, start: int, hybrid: bool
) -> None:
    """Worked out from a group's few distinct values, the prefixes are the walk's, holes
    in a member's blocks, missing fields and garbage included; or the walk is asked."""
    start &= 0b01010101  # KV bits only, as a group's mask has them
    if not start:
        start = 1
    places = data.draw(st.lists(st.integers(0, len(pool) - 1), max_size=60))
    values = [pool[i] for i in places]
    walked = prefix_ends(start, values, hybrid=hybrid)
    few = few_value_prefix_ends(start, values, hybrid=hybrid)
    if few is not None:
        assert few == walked
    if not hybrid:
        assert few is not None  # only a Mamba answer can need the walk


def test_a_chain_the_same_members_hold_is_worked_out_from_its_values() -> None:
    """The usual shape (every member holds the whole prompt, a Mamba checkpoint every
    8th block; some members stopping early) takes no walk, and agrees with it."""
    both, kv_only = "f", "5"  # members 0 and 1: KV and Mamba, KV only
    chain = [both if p % 8 == 7 else kv_only for p in range(512)]
    assert few_value_prefix_ends(0b101, chain, hybrid=True) == ({}, {0: 512, 1: 512})
    short = chain[:100] + ["1"] * 412
    got = few_value_prefix_ends(0b101, short, hybrid=True)
    assert got == prefix_ends(0b101, short, hybrid=True) == ({1: 100}, {0: 96, 1: 96})
