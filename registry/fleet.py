"""The fleet index: per block hash, which live namespaces hold it, sharded by block hash.

Routers answer ``score``/``best`` from it in one round trip per Redis node, whatever the
number of namespaces: one HMGET per index shard for the prompt's hashes and one
``fleet_members since`` call, the leases checked by the server's clock in that same
round trip. A router keeps the member list (``MemberList``) by the member table's
version, so a decision carries only the members whose lease ended. It is a *derived*
view: each namespace's own maps stay the truth, and the engine's own
``match_kv_prefix`` stays exact, so a stale index costs at most a suboptimal route.

Layout (``FleetKeys``; the README's data layout shows it with ``redis-cli``):

* ``pcr:{index-NN.x}:blocks`` (on Redis Cluster 16 shards, a block hash goes to shard
  ``hash % 16``; the tags put the shards' slots 1,024 apart, so any even split of the
  slots over the primaries spreads them evenly; on a standalone server only the first):
  HASH block hash -> bitmap of holders in hex, bit ``2*id`` for the KV block of member
  ``id``, ``2*id+1`` for its Mamba state; ``@<id>`` -> the epoch of the ownership the id
  belongs to (its stamp).
* ``{pcr:nodes}:members`` / ``:retired`` / ``:free`` (in the node index's slot, so that
  joining, renewing and listing the live members are each one atomic call with the
  leases): member ids, handed to a namespace per ownership (``lua/fleet_members.lua``).

Consistency rules (ARCHITECTURE.md, "The fleet index"):

* An owner writes its index bits in the same round trip as the write itself
  (``lua/index_update.lua``, sent after the write, on the same connection on a
  standalone server); evictions clear the bits of every hash asked for.
* Member ids are per ownership: ``claim`` retires the namespace's old id, joins with a
  new one and stamps it on every shard with its epoch, so the bits of a superseded
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from registry.keys import (
    DEFAULT_KEY_PREFIX,
    node_index_key,
    validate_key_prefix,
    validate_namespace,
)
from registry.scripts import ScriptRunner, script_sha

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

SHARDS = len(SHARD_TAGS)
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

    @property
    def nodes(self) -> str:
        """The node index (ZSET namespace -> lease end), ``pcr:nodes``."""
        return node_index_key(self.key_prefix)

    @property
    def members(self) -> str:
        """HASH ``ns:<namespace>`` -> id, ``id:<id>`` -> namespace, ``next``."""
        return f"{{{self.nodes}}}:members"

    @property
    def live(self) -> str:
        """ZSET ``"<id> <namespace>"`` of current members -> lease end (server ms)."""
        return f"{{{self.nodes}}}:live"

    @property
    def retired(self) -> str:
        """SET of retired ids whose bits may still be in the shards."""
        return f"{{{self.nodes}}}:retired"

    @property
    def free(self) -> str:
        """SET of ids scrubbed from the shards, handed out again first."""
        return f"{{{self.nodes}}}:free"

    @property
    def member_keys(self) -> tuple[str, str, str, str, str]:
        """The KEYS of ``lua/fleet_members.lua``."""
        return (self.nodes, self.members, self.live, self.retired, self.free)

    @property
    def shards(self) -> tuple[str, ...]:
        """The index shards, ``pcr:{index-NN.x}:blocks``."""
        return tuple(f"{self.key_prefix}:{{{tag}}}:blocks" for tag in SHARD_TAGS)

    def all_keys(self) -> tuple[str, ...]:
        """Every key of the index (for tools and tests)."""
        return (self.members, self.live, self.retired, self.free, *self.shards)


def shard_count(cluster: bool) -> int:
    """How many index shards a deployment uses: 16 on Redis Cluster, where the shards
    let every primary answer its share at once; 1 on a standalone server (or Sentinel),
    where more keys would only add commands. Every client of one deployment agrees,
    since it decides by the kind of server it talks to."""
    return SHARDS if cluster else 1


def by_shard(hashes: Iterable[int], cluster: bool = True) -> dict[int, list[int]]:
    """Hashes grouped by index shard (``hash % shard_count``), each group in input order."""
    count = shard_count(cluster)
    groups: dict[int, list[int]] = {}
    for h in hashes:
        groups.setdefault(h % count, []).append(h)
    return groups


def update_calls(
    fleet: FleetKeys,
    ids: Sequence[int],
    change: str,
    hashes: Sequence[int],
    *,
    cluster: bool,
    epoch: str = "",
) -> list[Routed]:
    """The ``index_update`` commands setting or clearing ``change`` for ``hashes`` under
    each member id in ``ids``, by the owner of ``epoch`` ('' for an operator): one call
    per id on a standalone server (its one shard), one per (id, shard) on a cluster,
    which ``registry.scripts.run_per_node`` merges into one call per (id, primary) when
    it sends them. A shard applies one only while the id is stamped there with that
    epoch (``stamp_calls``)."""
    if change not in CHANGES:
        raise ValueError(f"change must be one of {', '.join(CHANGES)}, not {change!r}")
    if not hashes or not ids:
        return []
    sha = script_sha("index_update")
    shards = fleet.shards
    if not cluster:  # one shard: one call per id (the usual one id), no grouping
        key = shards[0]
        return [
            (key, ("EVALSHA", sha, 1, key, m, change, epoch, len(hashes), *hashes)) for m in ids
        ]
    groups = sorted(by_shard(hashes, cluster).items())
    calls: list[Routed] = []
    for member in ids:  # on a cluster: one call per shard (a script stays in one slot)
        for shard, group in groups:
            key = shards[shard]
            command = ("EVALSHA", sha, 1, key, member, change, epoch, len(group), *group)
            calls.append((key, command))
    return calls


def stamp_calls(fleet: FleetKeys, member: int, epoch: str, *, cluster: bool) -> list[Routed]:
    """The ``index_update`` commands stamping ``member`` with its owner's ``epoch`` on
    every shard: sent when the owner joins with the id or reserves it, before any bit."""
    sha = script_sha("index_update")
    return [
        (key, ("EVALSHA", sha, 1, key, member, "stamp", epoch, 0))
        for key in fleet.shards[: shard_count(cluster)]
    ]


def lookup_calls(
    fleet: FleetKeys, hashes: Sequence[int], cluster: bool = True
) -> tuple[list[Routed], list[list[int]] | None]:
    """One HMGET per index shard the prompt touches, and for each the prompt positions
    its replies belong to (None with one shard: the reply is in prompt order)."""
    shards = fleet.shards
    if not hashes:
        return [], []
    if shard_count(cluster) == 1:
        key = shards[0]
        return [(key, ("HMGET", key, *hashes))], None
    positions: dict[int, list[int]] = {}
    for position, h in enumerate(hashes):
        positions.setdefault(h % SHARDS, []).append(position)
    calls: list[Routed] = []
    where: list[list[int]] = []
    for shard, places in sorted(positions.items()):
        key = shards[shard]
        calls.append((key, ("HMGET", key, *(hashes[p] for p in places))))
        where.append(places)
    return calls, where


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
    mask: int = 0
    """``kv_mask`` of every member's id."""

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
    return MemberList(version, members, entries, time.monotonic(), kv_mask(members.values()))


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
    start: int, values: Sequence[Any], *, hybrid: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """For the members whose KV bits are set in ``start``: ({id: where its KV prefix
    ends}, {id: one past its farthest Mamba checkpoint inside that prefix}) over the
    index ``values`` of a prompt's positions; a member missing from the first ran to the
    end, one missing from the second has no checkpoint. Each distinct value is parsed
    once, and a run of equal values (a chain the same members hold) costs a comparison
    per position."""
    alive = start
    kv_end: dict[int, int] = {}
    if not alive:
        return kv_end, {}
    checkpoints: list[tuple[int, int]] = []
    parsed: dict[Any, int] = {}
    previous: Any = _NOTHING
    held = 0
    for position, value in enumerate(values):
        if value != previous:
            previous = value
            bits = parsed.get(value)
            if bits is None:
                bits = parsed[value] = bitmap(value)
            still = alive & bits
            if still != alive:
                gone = alive ^ still
                while gone:
                    lowest = gone & -gone
                    kv_end[(lowest.bit_length() - 1) >> 1] = position
                    gone ^= lowest
                alive = still
                if not alive:
                    break
            held = (bits >> 1) & alive if hybrid else 0
        if held:
            checkpoints.append((position, held))
    mamba_end: dict[int, int] = {}
    found = 0
    for position, held in reversed(checkpoints):
        fresh = held & ~found
        if fresh:
            found |= held
            while fresh:
                lowest = fresh & -fresh
                mamba_end[(lowest.bit_length() - 1) >> 1] = position + 1
                fresh ^= lowest
    return kv_end, mamba_end


_NOTHING = object()


def kv_mask(ids: Iterable[int]) -> int:
    """The KV bits of member ``ids``."""
    mask = 0
    for member in ids:
        mask |= 1 << (2 * member)
    return mask


def prefixes(
    ids: Iterable[int], values: Sequence[Any], *, hybrid: bool
) -> dict[int, tuple[int, int]]:
    """Per member id, (KV prefix, Mamba-aware prefix) of the prompt whose positions have
    the index ``values`` (one per position, in order): the KV prefix ends at the first
    position whose KV bit is clear; the Mamba prefix is one past the farthest position
    inside it with the Mamba bit (0 with ``hybrid`` off): the same answer as
    ``lua/score.lua`` gives from the namespace's own maps."""
    ids = list(ids)
    kv_end, mamba_end = prefix_ends(kv_mask(ids), values, hybrid=hybrid)
    everything = len(values)
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

    def join(self, namespace: str, lease_until_ms: int) -> int:
        """Retire ``namespace``'s id, give it a new one, record its lease end."""
        return int(self._run("join", namespace, lease_until_ms))

    def reserve(self, namespace: str) -> int:
        """A new id for ``namespace``, not yet current (a rebuild fills it first)."""
        return int(self._run("reserve", namespace))

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
        retired = [int(_text(i)) for i in self._run("retired")]
        if not retired:
            return 0
        for shard in self.keys.shards:
            cursor = "0"
            while True:
                cursor = _text(
                    self._runner.run(
                        "index_scrub",
                        (shard,),
                        (cursor, page, *retired),
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
