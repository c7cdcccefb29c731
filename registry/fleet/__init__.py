"""The fleet index: per block hash, which live namespaces hold it, in one shard per
group of members (on Redis Cluster, a group per primary).

Routers answer ``score``/``best`` from it in one round trip per Redis node, whatever the
number of namespaces: one HMGET of the prompt's hashes per group's shard and one
``fleet_members since`` call, the leases checked by the server's clock in that same
round trip. A router keeps the member list (``MemberList``) by the member table's
version, so a decision carries only the members whose lease ended. It is a *derived*
view: each namespace's own maps stay the truth, and the engine's own
``match_kv_prefix`` stays exact, so a stale index costs at most a suboptimal route.

Layout (``FleetKeys``; the README's data layout shows it with ``redis-cli``):

* ``pcr:{index-NN.x}:blocks``, one shard per group NN = 0..15 (the tags put the shards'
  slots 1,024 apart, so any even split of the slots over the primaries gives each one
  some; a standalone server uses only the first): HASH block hash -> bitmap of the
  group's holders in hex, bit ``2*local`` for the KV block of the member whose local id
  is ``local``, ``2*local+1`` for its Mamba state; ``@<local>`` -> the epoch of the
  ownership the id belongs to (its stamp).
* Member ids carry their group: id = ``local * 16 + group``. An owner joins the group
  whose shard its own primary serves (``home_group``), so on a cluster its index upkeep
  goes to the node its write goes to, in the same round trip, and a write wakes one
  server, as it does without the index. Each group hands out its own ids, smallest free
  first, so each shard's bitmaps are as short as its members allow. Where a group's
  shard lives only changes speed: after a resharding, a member's upkeep may go to
  another node until its next rebuild.
* ``{pcr:nodes}:members`` / ``:retired`` / ``:free`` (in the node index's slot, so that
  joining, renewing and listing the live members are each one atomic call with the
  leases): member ids, handed to a namespace per ownership (``lua/fleet_members.lua``).

Consistency rules (ARCHITECTURE.md, "The fleet index"):

* An owner writes its index bits with the write itself: inside the write's own
  script when the group's shard is on its node (``finish_indexed`` in
  ``lua/_prelude.lua``), else by ``lua/index_update.lua`` sent after the write in the
  same round trip; evictions clear the bits of every hash asked for.
* Member ids are per ownership: ``claim`` retires the namespace's old id, joins with a
  new one and stamps it on its group's shard with its epoch, so the bits of a superseded
  (fenced) owner, even those it sends after it was fenced, belong to an id no router
  counts. ``gc`` retires the ids of the namespaces it collects, deletes their stamps and
  scrubs their bits before an id is handed out again; a shard refuses updates under an
  id not stamped with the sender's epoch, so a superseded owner never writes under an
  id handed out again.
* Anything that may have left an owner's bits wrong (an index command that failed, a
  clear, an id lost in a failover) marks them dirty; the owner then *rebuilds* them: a
  reserved id gets the bits of everything its maps hold, then becomes current in one
  step. Its heartbeat (every third of the lease) checks membership and rebuilds, so the
  index heals within a heartbeat once Redis answers.
* Namespaces that are live but have no member id (written with ``fleet_index=False``)
  are scored exactly, per namespace, in the same round trip from the second call on.
"""

from __future__ import annotations

import functools
import logging
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import Any

from registry.keys import (
    DEFAULT_KEY_PREFIX,
    node_index_key,
    validate_key_prefix,
    validate_namespace,
)
from registry.scripts import ScriptRunner, is_cluster, same_arguments, script_sha

log = logging.getLogger(__name__)

SHARD_TAGS = (
    "index-00.20",
    "index-01.23",
    "index-02.1",
    "index-03.2",
    "index-04.43",
    "index-05.40",
    "index-06.63",
    "index-07.60",
    "index-08.13",
    "index-09.10",
    "index-10.20",
    "index-11.23",
    "index-12.12",
    "index-13.11",
    "index-14.43",
    "index-15.40",
)
"""Hash tags of the index shards: tag i hashes to a slot in [1024*i, 1024*(i+1))."""

GROUPS = len(SHARD_TAGS)
CHANGES = ("kv+", "kv-", "mamba+", "mamba-")
REBUILD_CHUNK = 4096
"""Hashes per ``index_update`` call when rebuilding (bounds how long one call blocks)."""

Routed = tuple[Any, tuple[Any, ...]]


@dataclass(frozen=True)
class FleetKeys:
    """The fleet index's key names under one key prefix."""

    key_prefix: str = DEFAULT_KEY_PREFIX

    def __post_init__(self) -> None:
        validate_key_prefix(self.key_prefix)

    @functools.cached_property
    def nodes(self) -> str:
        """The node index (ZSET namespace -> lease end), ``pcr:nodes``."""
        return node_index_key(self.key_prefix)

    @functools.cached_property
    def members(self) -> str:
        """HASH ``ns:<namespace>`` -> id, ``id:<id>`` -> namespace, ``next``."""
        return f"{{{self.nodes}}}:members"

    @functools.cached_property
    def live(self) -> str:
        """ZSET ``"<id> <namespace>"`` of current members -> lease end (server ms)."""
        return f"{{{self.nodes}}}:live"

    @functools.cached_property
    def retired(self) -> str:
        """SET of retired ids whose bits may still be in the shards."""
        return f"{{{self.nodes}}}:retired"

    @functools.cached_property
    def free(self) -> str:
        """SET of ids scrubbed from the shards, handed out again first."""
        return f"{{{self.nodes}}}:free"

    @functools.cached_property
    def member_keys(self) -> tuple[str, str, str, str, str]:
        """The KEYS of ``lua/fleet_members.lua``."""
        return (self.nodes, self.members, self.live, self.retired, self.free)

    @functools.cached_property
    def shards(self) -> tuple[str, ...]:
        """The index shards, ``pcr:{index-NN.x}:blocks``."""
        return tuple(f"{self.key_prefix}:{{{tag}}}:blocks" for tag in SHARD_TAGS)

    def all_keys(self) -> tuple[str, ...]:
        """Every key of the index (for tools and tests)."""
        return (self.members, self.live, self.retired, self.free, *self.shards)


def group_of(member: int) -> int:
    """The group of member id ``member``: the index shard that holds its bits."""
    return member % GROUPS


def local_id(member: int) -> int:
    """Member ``member``'s id inside its group's shard: its bits there are
    ``2*local_id`` (KV) and ``2*local_id+1`` (Mamba)."""
    return member // GROUPS


def global_id(group: int, local: int) -> int:
    """The member id of local id ``local`` in ``group``."""
    return local * GROUPS + group


def home_group(client: Any, fleet: FleetKeys, key: str) -> int:
    """The group a namespace whose keys share ``key``'s slot should join: on Redis
    Cluster the first shard served by the same primary (so its index upkeep rides its
    writes' round trip to that one node), else 0. Only speed depends on it: a member in
    any group is written and read correctly wherever its shard lives."""
    if not is_cluster(client):
        return 0
    try:
        home = client.get_node_from_key(key).name
        for group, shard in enumerate(fleet.shards):
            if client.get_node_from_key(shard).name == home:
                return group
    except Exception:  # a layout being refreshed: any group is correct
        log.debug("no home group for %r", key, exc_info=True)
    return 0


def update_calls(
    fleet: FleetKeys,
    ids: Sequence[int],
    change: str,
    hashes: Sequence[int],
    *,
    epoch: str = "",
) -> list[Routed]:
    """The ``index_update`` commands setting or clearing ``change`` for ``hashes`` under
    each member id in ``ids``, by the owner of ``epoch`` ('' for an operator): one call
    per id, on its group's shard. A shard applies one only while the id is stamped
    there with that epoch (``stamp_calls``)."""
    if change not in CHANGES:
        raise ValueError(f"change must be one of {', '.join(CHANGES)}, not {change!r}")
    if not hashes or not ids:
        return []
    sha = script_sha("index_update")
    shards = fleet.shards
    calls: list[Routed] = []
    for member in ids:
        key = shards[member % GROUPS]
        local = member // GROUPS
        calls.append((key, ("EVALSHA", sha, 1, key, local, change, epoch, len(hashes), *hashes)))
    return calls


def stamp_calls(fleet: FleetKeys, member: int, epoch: str) -> list[Routed]:
    """The ``index_update`` command stamping ``member`` with its owner's ``epoch`` on its
    group's shard: sent when the owner joins with the id or reserves it, before any bit."""
    key = fleet.shards[member % GROUPS]
    sha = script_sha("index_update")
    return [(key, ("EVALSHA", sha, 1, key, member // GROUPS, "stamp", epoch, 0))]


def lookup_calls(fleet: FleetKeys, hashes: Sequence[int], groups: Iterable[int]) -> list[Routed]:
    """One HMGET of every hash of the prompt per group's shard, in ``groups`` order."""
    if not hashes:
        return []
    keys = [fleet.shards[g] for g in groups]
    return list(zip(keys, same_arguments("HMGET", keys, hashes), strict=True))


@dataclass(frozen=True)
class MemberList:
    """A router's copy of the member table (every entry of ``:live``, dead ones
    included), kept between decisions and read again only when the table's version
    changed, or after ``ttl`` seconds. Each decision then carries only the entries whose
    lease is over, usually none, instead of every live member's name."""

    version: str = ""
    members: Mapping[str, int] = field(default_factory=dict)
    """namespace -> id, for names that follow the namespace rules."""
    entries: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """each ``"<id> <namespace>"`` entry -> (namespace, id)."""
    fetched_at: float = float("-inf")
    masks: Mapping[int, int] = field(default_factory=dict)
    """group -> the KV bits (``2*local``) of the group's members, as ``group_masks``."""

    def call(self, fleet: FleetKeys, ttl: float) -> Routed:
        """The ``fleet_members since`` command (the full list when this copy is older
        than ``ttl`` seconds)."""
        fresh = time.monotonic() - self.fetched_at < ttl
        keys = fleet.member_keys
        version = self.version if fresh else ""
        return (keys[0], ("EVALSHA", script_sha("fleet_members"), 5, *keys, "since", version))

    def update(self, reply: Any) -> tuple[MemberList, Mapping[str, int], int]:
        """From a ``since`` reply: (the copy to keep, {live member: id}, the number of
        live namespaces in the node index)."""
        version, listed, ended, live_count = reply
        kept = self
        if listed is not None:
            kept = member_list(_text(version), listed)
        live = kept.members
        if ended:
            live = dict(live)
            for entry in ended:
                found = kept.entries.get(_text(entry))
                if found is not None and live.get(found[0]) == found[1]:
                    del live[found[0]]
        return kept, live, int(live_count)


def member_list(version: str, listed: Iterable[Any]) -> MemberList:
    """A ``MemberList`` of ``listed`` entries; those that are not "<id> <namespace>"
    with a valid namespace are left out (anyone who may write the member table could
    write garbage)."""
    members: dict[str, int] = {}
    entries: dict[str, tuple[str, int]] = {}
    for raw_entry in listed:
        entry = _text(raw_entry)
        raw, _, name = entry.partition(" ")
        if raw.isdigit() and len(raw) < 10 and _is_namespace(name):
            members[name] = int(raw)
            entries[entry] = (name, int(raw))
    return MemberList(version, members, entries, time.monotonic(), group_masks(members.values()))


@functools.lru_cache(maxsize=65_536)
def _is_namespace(name: str) -> bool:
    """Whether ``name`` follows the namespace rules (remembered: a router sees the same
    few hundred names again and again)."""
    try:
        validate_namespace(name)
    except (TypeError, ValueError):
        return False
    return True


def bitmap(value: Any) -> int:
    """An index field's value as an int (0 for a missing or malformed one: anyone who
    may write the index could write garbage; it must not break routing)."""
    if value is None:
        return 0
    try:
        bits = int(value, 16)
    except (TypeError, ValueError):
        return 0
    return bits if bits > 0 else 0


def prefix_ends(
    start: int,
    values: Iterable[Any],
    *,
    hybrid: bool,
    parse: Callable[[Any], int] | None = None,
) -> tuple[dict[int, int], dict[int, int]]:
    """For the members whose KV bits are set in ``start``: ({id: where its KV prefix
    ends}, {id: one past its farthest Mamba checkpoint inside that prefix}) over the
    index ``values`` of a prompt's positions; a member missing from the first ran to the
    end, one missing from the second has no checkpoint. The values are walked run by run
    (a chain the same members hold is one run; ``itertools.groupby`` finds the runs in
    C), and each distinct value is parsed once (by ``parse``, ``bitmap`` by default)."""
    alive = start
    kv_end: dict[int, int] = {}
    if not alive:
        return kv_end, {}
    read = parse or bitmap
    checkpoints: list[tuple[int, int]] = []  # (last position of a run, members' bits)
    parsed: dict[Any, int] = {}
    position = 0
    for value, run in groupby(values):
        bits = parsed.get(value)
        if bits is None:
            bits = parsed[value] = read(value)
        still = alive & bits
        if still != alive:
            _record(alive ^ still, position, kv_end)
            alive = still
            if not alive:
                break
        position += len(list(run))
        if hybrid:
            held = (bits >> 1) & alive
            if held:
                checkpoints.append((position - 1, held))
    mamba_end: dict[int, int] = {}
    found = 0
    for position, held in reversed(checkpoints):
        fresh = held & ~found
        if fresh:
            found |= fresh
            _record(fresh, position + 1, mamba_end)
    return kv_end, mamba_end


def _record(members: int, position: int, into: dict[int, int]) -> None:
    """``into[id] = position`` for each member whose KV bit is set in ``members``."""
    while members:
        lowest = members & -members
        into[(lowest.bit_length() - 1) >> 1] = position
        members ^= lowest


def group_masks(ids: Iterable[int]) -> dict[int, int]:
    """group -> the KV bits of member ``ids``' local ids in that group's shard."""
    masks: dict[int, int] = {}
    for member in ids:
        group = member % GROUPS
        masks[group] = masks.get(group, 0) | 1 << (2 * (member // GROUPS))
    return masks


FEW_VALUES = 8
"""A group's prompt values with at most this many distinct values are worked out from
those values alone (``few_value_prefix_ends``); more, by the walk over runs."""


def few_value_prefix_ends(
    start: int, values: Sequence[Any], *, hybrid: bool
) -> tuple[dict[int, int], dict[int, int]] | None:
    """``prefix_ends`` for one group's values (its default parse) by their distinct
    values, when there are at most ``FEW_VALUES``: the KV prefixes end at the first
    places of the values that lack a member's KV bit, and each member's farthest Mamba
    checkpoint is the last place of some value that has its Mamba bit, found by C-level
    scans of the list rather than a Python step per run (a chain held by the same
    members, with a Mamba checkpoint every few blocks, is two values in 2 * 64 runs).
    None where that does not settle it (more values; a value with a member's Mamba bit
    found both inside and past that member's prefix, as a hole in its blocks makes):
    the caller walks the runs."""
    distinct = set(values)
    if len(distinct) > FEW_VALUES:
        return None
    listed = values if isinstance(values, list) else list(values)
    bits = {value: bitmap(value) for value in distinct}
    # Where the members still holding every KV block so far change: at the first place
    # of each value lacking one of them, in order.
    drops = sorted((listed.index(v), v) for v in distinct if start & ~bits[v])
    kv_end: dict[int, int] = {}
    places: list[int] = []  # where `alive` changed ...
    alives: list[int] = []  # ... and what it became
    alive = start
    for place, value in drops:
        still = alive & bits[value]
        if still != alive:
            _record(alive ^ still, place, kv_end)
            alive = still
            places.append(place)
            alives.append(alive)
            if not alive:
                break
    if not hybrid:
        return kv_end, {}

    def alive_at(place: int) -> int:
        """The members whose KV prefix runs past ``place``."""
        at = bisect_right(places, place)
        return alives[at - 1] if at else start

    backwards = listed[::-1]
    last = len(listed) - 1
    held_by = []  # (last place of a value, members whose Mamba bit it has, the value)
    for value in distinct:
        held = (bits[value] >> 1) & start
        if held:
            held_by.append((last - backwards.index(value), held, value))
    held_by.sort(key=itemgetter(0), reverse=True)
    mamba_end: dict[int, int] = {}
    found = 0
    for place, held, value in held_by:
        inside = alive_at(place)
        fresh = held & inside & ~found
        if fresh:
            found |= fresh
            _record(fresh, place + 1, mamba_end)
        if held & ~inside & ~found & alive_at(listed.index(value)):
            return None  # also inside some prefix, but not at its last place
    return kv_end, mamba_end


def group_prefixes(
    masks: Mapping[int, int], values: Mapping[int, Sequence[Any]], *, hybrid: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """``prefix_ends`` over several groups: for the members whose KV bits are in
    ``masks`` (group -> local KV bits) and whose group's shard answered ``values``
    (group -> one value per prompt position), ({member id: where its KV prefix ends},
    {member id: one past its farthest Mamba checkpoint inside it}). A group of few
    distinct values is worked out from them (``few_value_prefix_ends``); the others are
    walked at once: each position's values side by side, each group's bits (its live
    members' only) moved to a range of its own in one bitmap."""
    kv_end: dict[int, int] = {}
    mamba_end: dict[int, int] = {}
    walked = []
    for g in sorted(masks):
        if not masks[g] or g not in values:
            continue
        few = few_value_prefix_ends(masks[g], values[g], hybrid=hybrid)
        if few is None:
            walked.append(g)
            continue
        kv_end.update({local * GROUPS + g: end for local, end in few[0].items()})
        mamba_end.update({local * GROUPS + g: end for local, end in few[1].items()})
    if len(walked) == 1:
        (group,) = walked
        kv, mamba = prefix_ends(masks[group], values[group], hybrid=hybrid)
        kv_end.update({local * GROUPS + group: end for local, end in kv.items()})
        mamba_end.update({local * GROUPS + group: end for local, end in mamba.items()})
    elif walked:
        _walk_groups(masks, values, walked, hybrid, kv_end, mamba_end)
    return kv_end, mamba_end


def _walk_groups(
    masks: Mapping[int, int],
    values: Mapping[int, Sequence[Any]],
    groups: list[int],
    hybrid: bool,
    kv_end: dict[int, int],
    mamba_end: dict[int, int],
) -> None:
    """``prefix_ends`` over several groups' values walked side by side, the results
    added to ``kv_end`` and ``mamba_end`` by member id."""
    width = max(masks[g].bit_length() for g in groups) + 1  # even: KV and Mamba bits
    width += width % 2
    kept = [masks[g] | masks[g] << 1 for g in groups]  # a live member's two bits
    start = 0
    for at, g in enumerate(groups):
        start |= masks[g] << (at * width)

    def joined(row: tuple[Any, ...]) -> int:
        bits = 0
        for at, value in enumerate(row):
            bits |= (bitmap(value) & kept[at]) << (at * width)
        return bits

    rows = zip(*(values[g] for g in groups), strict=True)
    kv, mamba = prefix_ends(start, rows, hybrid=hybrid, parse=joined)
    half = width // 2  # members per group range

    def member(index: int) -> int:
        return (index % half) * GROUPS + groups[index // half]

    kv_end.update({member(i): end for i, end in kv.items()})
    mamba_end.update({member(i): end for i, end in mamba.items()})


def prefixes(
    ids: Iterable[int], values: Mapping[int, Sequence[Any]], *, hybrid: bool
) -> dict[int, tuple[int, int]]:
    """Per member id, (KV prefix, Mamba-aware prefix) of the prompt whose positions have
    the index ``values`` (per group, one per position, in order): the KV prefix ends at
    the first position whose KV bit is clear; the Mamba prefix is one past the farthest
    position inside it with the Mamba bit (0 with ``hybrid`` off): the same answer as
    ``lua/score.lua`` gives from the namespace's own maps."""
    ids = list(ids)
    kv_end, mamba_end = group_prefixes(group_masks(ids), values, hybrid=hybrid)
    everything = len(next(iter(values.values()), ()))
    return {member: (kv_end.get(member, everything), mamba_end.get(member, 0)) for member in ids}


def members_from_reply(reply: Any) -> tuple[dict[str, int], int]:
    """The ``fleet_members live`` reply as ({namespace: id}, the number of live
    namespaces in the node index). Entries that are not "<id> <name>" are skipped
    (anyone who may write the member table could write garbage); the caller checks
    the names."""
    listed, live_count = reply
    members: dict[str, int] = {}
    for entry in listed:
        raw, _, name = _text(entry).partition(" ")
        if raw.isdigit() and len(raw) < 10 and name:
            members[name] = int(raw)
    return members, int(live_count)


class FleetMembers:
    """The member table (``lua/fleet_members.lua``) through the one script runner."""

    def __init__(self, client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.client = client
        self.keys = FleetKeys(key_prefix)
        self._runner = ScriptRunner(client)

    def _run(self, *args: Any) -> Any:
        return self._runner.run(
            "fleet_members",
            self.keys.member_keys,
            args,
            context=f"fleet index {self.keys.members!r}",
            write=True,
        )

    def join(self, namespace: str, lease_until_ms: int, group: int = 0) -> int:
        """Retire ``namespace``'s id, give it a new one of ``group``, record its lease
        end."""
        return int(self._run("join", namespace, lease_until_ms, group))

    def reserve(self, namespace: str, group: int = 0) -> int:
        """A new id of ``group`` for ``namespace``, not yet current (a rebuild fills it
        first)."""
        return int(self._run("reserve", namespace, group))

    def switch(self, namespace: str, member: int) -> bool:
        """Make a reserved id current (retiring the old one); False if it was retired
        meanwhile (``gc`` found it orphaned)."""
        return bool(int(self._run("switch", namespace, member)))

    def check(self, namespace: str, member: int, lease_until_ms: int) -> bool:
        """Record the lease end; whether ``member`` is still the namespace's id."""
        return bool(int(self._run("check", namespace, member, lease_until_ms)))

    def current(self, namespace: str) -> int | None:
        """The namespace's current id, or None."""
        raw = self._read(lambda: self.client.hget(self.keys.members, f"ns:{namespace}"))
        return None if raw is None else int(raw)

    def live(self) -> tuple[dict[str, int], int]:
        """({live member: id}, the number of live namespaces), by the server's clock."""
        return members_from_reply(self._run("live"))

    def forget(self, namespace: str) -> bool:
        """Drop a namespace whose lease is over from the node index, retiring its id."""
        return bool(int(self._run("forget", namespace)))

    def scrub(self, page: int = 500) -> int:
        """Clear retired ids' bits from every shard, then hand the ids out again;
        returns how many were freed. O(index entries): run by ``gc``."""
        retired = [int(raw) for raw in map(_text, self._run("retired")) if raw.isdigit()]
        if not retired:
            return 0
        by_group: dict[int, list[int]] = {}
        for member in retired:
            by_group.setdefault(member % GROUPS, []).append(member // GROUPS)
        for group, local_ids in sorted(by_group.items()):
            shard = self.keys.shards[group]
            cursor = "0"
            while True:
                cursor = _text(
                    self._runner.run(
                        "index_scrub",
                        (shard,),
                        (cursor, page, *local_ids),
                        context=f"fleet index {shard!r}",
                    )
                )
                if cursor == "0":
                    break
        return int(self._run("free", *retired))

    def _read(self, command: Any) -> Any:
        from registry.errors import REDIS_ERRORS, translate

        try:
            return command()
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"fleet index {self.keys.members!r}") or exc) from exc


def _text(value: Any) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
