"""``PrefixCacheRegistry``: the registry stored in Redis, one round trip per call.

Every write is one EVALSHA of the script named after it in ``lua/`` (through the one
``ScriptRunner``), under a fresh request id so that a re-sent copy never runs twice;
every read of one key is a single HMGET or HGET. Empty input costs no round trip. Redis
faults raise the registry's own errors (``registry.errors``).

Ownership (``claim``, ``renew``, the heartbeat) is in ``registry.ownership``; reading
notices back from the stream in ``registry.replay``.

Thread safety: the object keeps no mutable state besides the callback, hooks and the
epoch it claimed, and a redis-py client is thread-safe, so one instance may be shared
by many threads.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from registry import metrics as _metrics
from registry.base import RegistryBase
from registry.client import RedisClient, client_from_url
from registry.errors import (
    REDIS_ERRORS,
    RegistryError,
    RegistryMisconfigured,
    RegistryPermissionError,
    StaleEpochError,
    translate,
)
from registry.fleet import (
    GROUPS,
    REBUILD_CHUNK,
    FleetKeys,
    FleetMembers,
    home_group,
    stamp_calls,
    update_calls,
)
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.membership import NodeIndex
from registry.notices import EvictionNotice, parse_notice
from registry.ownership import DEFAULT_LEASE_TTL, Ownership
from registry.replay import notices_after
from registry.scripts import ScriptRunner, is_cluster, run_batched, script_sha
from registry.validation import flatten

if TYPE_CHECKING:
    from registry.mirror import MirroredRegistry

log = logging.getLogger(__name__)

NO_UPKEEP = ("", "")
"""An owner write's fleet-index arguments when its script keeps no bits itself."""

DEFAULT_NOTICE_STREAM_MAXLEN = 1_000
"""Notices kept in a namespace's stream for replay (each at most ~1.1 KiB there)."""

DEFAULT_REPLY_TTL = 30.0
"""Seconds a write's reply stays recorded under its request id: longer than any one
call can keep retrying (``CALL_BOUND``), so a re-sent copy never runs twice."""

OPERATOR_LOOKUP_TTL = 1.0
"""Seconds a writer that owns nothing keeps the namespace's fleet-index id."""

CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 2.0
RETRIES = 1
RETRY_BACKOFF_CAP = 0.25
CALL_BOUND = (RETRIES + 1) * (CONNECT_TIMEOUT + 2 * READ_TIMEOUT) + RETRIES * RETRY_BACKOFF_CAP
"""The longest a call on a ``from_url`` client blocks before raising (10.25 s): each
attempt may connect, send its handshake and read one reply, and there is one retry."""

DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": CONNECT_TIMEOUT,
    "socket_timeout": READ_TIMEOUT,
    "health_check_interval": 30,
}
"""``from_url`` defaults (any may be overridden): bounded waits (``CALL_BOUND``), so a
serving node sees ``RegistryUnavailable`` within seconds instead of hanging."""


def default_retry() -> Any:
    """The ``from_url`` retry policy: one quick retry with jittered backoff."""
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.retry import Retry

    return Retry(ExponentialWithJitterBackoff(base=0.02, cap=RETRY_BACKOFF_CAP), RETRIES)


class PrefixCacheRegistry(RegistryBase, Ownership):
    """The ``hash -> block_id`` registry of one namespace, kept in Redis."""

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        reply_ttl: float = DEFAULT_REPLY_TTL,
        fleet_index: bool = True,
    ) -> None:
        super().__init__()
        self.keys = NamespaceKeys(namespace, key_prefix)
        if isinstance(notice_stream_maxlen, bool) or not isinstance(notice_stream_maxlen, int):
            raise TypeError("notice_stream_maxlen must be an int")
        if not 1 <= notice_stream_maxlen <= 10_000_000:
            raise ValueError("notice_stream_maxlen must lie between 1 and 10,000,000")
        if isinstance(reply_ttl, bool) or not isinstance(reply_ttl, (int, float)):
            raise TypeError("reply_ttl must be a number of seconds")
        if not 1 <= reply_ttl <= 86_400:
            raise ValueError(f"reply_ttl must lie between 1 s and a day, not {reply_ttl}")
        if not callable(getattr(client, "evalsha", None)):
            raise TypeError(
                f"client must be a redis-py style client (redis.Redis, RedisCluster, "
                f"fakeredis.FakeRedis), not {type(client).__name__}"
            )
        self.client = client
        self.notice_stream_maxlen = notice_stream_maxlen
        self.reply_ttl = float(reply_ttl)
        self.epoch: int | None = None
        self.lease_ttl = DEFAULT_LEASE_TTL
        self._runner = ScriptRunner(client)
        self._index: NodeIndex | None = None
        # Request ids: a random prefix per object, then a counter (next() is atomic).
        self._request_prefix = secrets.token_hex(6)
        self._requests = itertools.count(1)
        self._reply_prefix = f"{self.keys.base}:reply:{self._request_prefix}-"
        self._reply_ms = str(round(self.reply_ttl * 1000))
        k = self.keys
        # Fixed KEYS of each script after its reply key, built once.
        self._kv_write_keys = (k.kv, k.meta)
        self._all_keys = (k.kv, k.mamba, k.meta, k.mamba_evictions)
        self._mamba_write_keys = (k.mamba, k.meta, k.mamba_evictions)
        self._set_epoch(None)
        # The fleet index (registry.fleet): whether this object keeps it up, the ids its
        # bits go under (its member id; two while a rebuild fills a new one) and whether
        # they may be wrong (then the heartbeat rebuilds them).
        if not isinstance(fleet_index, bool):
            raise TypeError("fleet_index must be True or False")
        self.fleet_index = fleet_index
        self._fleet = FleetKeys(k.key_prefix)
        self._fleet_members: FleetMembers | None = None
        self._index_ids: tuple[int, ...] = ()
        self._index_dirty = False
        self._operator_lookup: tuple[float, tuple[int, ...]] = (float("-inf"), ())
        # (member id, its group's shard when that is on the node of this namespace's
        # keys, else None): where an owner's write keeps the index in its own
        # script (``_upkeep_here``).
        self._upkeep_shard: tuple[int, str | None] = (-1, None)

    def _set_epoch(self, epoch: int | None) -> None:
        self.epoch = epoch
        self._fence = "" if epoch is None else str(epoch)

    def _write(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
        upkeep: tuple[str, str] | tuple[()] = (),
    ) -> Any:
        """Run a write script under a fresh request id (see ``lua/_prelude.lua``)."""
        all_keys, args = self._write_args(
            operation, keys, notices, data, fence=fence, upkeep=upkeep
        )
        try:
            return self._runner.run(
                operation, all_keys, args, namespace=self.keys.namespace, epoch=self.epoch
            )
        except StaleEpochError:
            self._index_ids = ()  # superseded: send no more index bits under its id
            raise

    def _write_args(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
        upkeep: tuple[str, str] | tuple[()] = (),
    ) -> tuple[tuple[str, ...], list[Any]]:
        """The (KEYS, ARGV) of one write under a fresh request id: ``_write`` sends them
        at once; a batching caller (the mirror's flusher) keeps them to send, and re-send
        unchanged, later: the request id makes a re-sent copy a no-op. ``upkeep``: an
        owner write's two fleet-index arguments (``finish_indexed`` in
        ``lua/_prelude.lua``), put before ``data``."""
        number = f"{next(self._requests):x}"
        head: list[Any] = [
            self._fence if fence is None else fence,
            f"{self._request_prefix}-{number}",
            self._reply_ms,
        ]
        if notices:
            head += [self.keys.mamba_evicted_channel, self.notice_stream_maxlen]
        head.extend(upkeep)
        head.extend(data)
        return (self._reply_prefix + number, *keys), head

    # -- the fleet index (registry.fleet) -------------------------------------------------

    def _members(self) -> FleetMembers:
        if self._fleet_members is None:
            self._fleet_members = FleetMembers(self.client, self.keys.key_prefix)
        return self._fleet_members

    def _home_group(self) -> int:
        """The fleet-index group this namespace joins (``registry.fleet.home_group``)."""
        return home_group(self.client, self._fleet, self.keys.kv)

    def _index_calls(self, change: str, hashes: list[int]) -> list[tuple[Any, tuple[Any, ...]]]:
        """The fleet-index upkeep of one write, as (routing key, command) pairs to send in
        the write's own round trip. ``change``: "kv+", "kv-", "mamba+" or "mamba-"."""
        return update_calls(self._fleet, self._upkeep_ids(), change, hashes, epoch=self._fence)

    def _upkeep_ids(self) -> tuple[int, ...]:
        """The member ids a write's index bits go under: this owner's (two while a
        rebuild fills a new one); a writer that owns nothing looks the namespace's id up."""
        if not self.fleet_index:
            return ()
        ids = self._index_ids
        if not ids and self.epoch is None:
            ids = self._operator_ids()
        return ids

    def _upkeep_here(self, ids: tuple[int, ...]) -> tuple[str, str] | None:
        """(local id, shard) for a write script that keeps the index itself
        (``finish_indexed`` in ``lua/_prelude.lua``: one script call instead of two,
        which is most of what the index costs a small write): there is one id, and its
        group's shard is on the node of this namespace's keys (always, on a
        standalone server; on a cluster, by the client's slot map, checked once per id).
        None: the upkeep goes as ``index_update`` calls in the write's round trip."""
        if len(ids) != 1:
            return None
        member = ids[0]
        if self._upkeep_shard[0] != member:
            shard: str | None = self._fleet.shards[member % GROUPS]
            if is_cluster(self.client):
                try:
                    node = self.client.get_node_from_key
                    if node(shard).name != node(self.keys.kv).name:
                        shard = None
                except Exception:  # a layout being refreshed: the separate call is correct
                    shard = None
            self._upkeep_shard = (member, shard)
        shard = self._upkeep_shard[1]
        return None if shard is None else (str(member // GROUPS), shard)

    def _upkept(self, operation: str, outcome: Any, change: str, hashes: list[int]) -> None:
        """After a write that kept the index in its own script: its ``index_change``
        outcome. -1: the shard refused (the bits are rebuilt at the next renewal); -2:
        the script could not reach the shard (on a cluster, not on the write's node
        after all; or an ACL, or a key that is not a hash): the upkeep goes as
        ``index_update`` calls now, and so from now on under this id, which land or
        leave the bits to be rebuilt."""
        if not isinstance(outcome, int) or outcome >= 0:
            return
        if outcome == -2:
            self._upkeep_shard = (self._upkeep_shard[0], None)
            try:
                replies = self._index_batch(operation, self._index_calls(change, hashes))
            except RegistryError as exc:
                replies = [exc]
            if not any(isinstance(r, Exception) for r in replies):
                return
        self._upkeep_failed()

    def _upkeep_failed(self) -> None:
        """This owner's bits may be wrong: rebuilt at its next renewal."""
        self._index_dirty = True
        log.warning(
            "namespace %r: a fleet-index update failed; rebuilt at the next renewal",
            self.namespace,
        )

    def _operator_ids(self) -> tuple[int, ...]:
        """The namespace's member id for a writer that owns nothing, looked up at most
        once a second (one extra read then; an id retired meanwhile only makes the
        update land where no router looks)."""
        looked_at, ids = self._operator_lookup
        now = time.monotonic()
        if now - looked_at >= OPERATOR_LOOKUP_TTL:
            try:
                current = self._members().current(self.namespace)
            except RegistryError:
                return ()  # the write itself will tell (Redis away), or an ACL without it
            ids = () if current is None else (current,)
            self._operator_lookup = (now, ids)
        return ids

    def _write_indexed(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any,
        change: str,
        hashes: list[int],
    ) -> Any:
        """A write and its index upkeep in one round trip; the write's reply. The write
        script keeps the index itself where the shard is on its node (its reply then
        comes as { reply, the upkeep's outcome }); else ``index_update`` follows the
        write on the same connection. An upkeep that failed leaves the bits dirty,
        rebuilt at the next renewal."""
        here = self._upkeep_here(self._upkeep_ids())
        if here is not None:
            reply, outcome = self._write(operation, keys, notices, data, upkeep=here)
            self._upkept(operation, outcome, change, hashes)
            return reply
        calls = self._index_calls(change, hashes)
        if not calls:
            return self._write(operation, keys, notices, data, upkeep=NO_UPKEEP)
        all_keys, args = self._write_args(operation, keys, notices, data, upkeep=NO_UPKEEP)
        command = ("EVALSHA", script_sha(operation), len(all_keys), *all_keys, *args)
        try:
            replies = self._runner.batch(
                operation,
                [(all_keys[0], command), *calls],
                scripts=(operation, "index_update"),
                context=f"namespace {self.namespace!r}",
                owner=(self.namespace, self.epoch),
            )
        except StaleEpochError:
            self._index_ids = ()  # superseded: send no more index bits under its id
            raise
        reply = replies[0]
        if any(isinstance(r, Exception) for r in replies[1:]):
            self._upkeep_failed()
        return reply

    def _index_batch(self, operation: str, calls: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
        """Fleet-index commands alone, in one round trip per Redis node; their replies,
        error replies as exception objects (a lost connection raises)."""
        return self._runner.batch(
            operation, calls, scripts=("index_update",), context=f"namespace {self.namespace!r}"
        )

    def reindex(self) -> int | None:
        """Rebuild this namespace's fleet-index bits from its maps: a reserved member id
        gets a bit for every entry, then becomes the namespace's id in one step (routers
        never see it half filled). Writes meanwhile go under both ids. Returns the new id
        (None with ``fleet_index`` off). O(entries): for healing, not the hot path."""
        if not self.fleet_index:
            return None
        members = self._members()
        for _attempt in range(3):
            self._index_dirty = False
            fresh = members.reserve(self.namespace, self._home_group())
            self._index_ids = (*self._index_ids[:1], fresh)
            try:
                kv, mamba = self.entries()
                calls = stamp_calls(self._fleet, fresh, self._fence)
                mamba_hashes = list(mamba)
                if not mamba_hashes and self._read(
                    "reindex", self.client.hget, self.keys.meta, "mamba_seen"
                ):
                    mamba_hashes = [0]  # a hybrid model's node without an entry now: field 0
                for change, hashes in (("kv+", list(kv)), ("mamba+", mamba_hashes)):
                    for first in range(0, len(hashes), REBUILD_CHUNK):
                        part = hashes[first : first + REBUILD_CHUNK]
                        calls += update_calls(
                            self._fleet,
                            (fresh,),
                            change,
                            part,
                            epoch=self._fence,
                        )
                if calls:
                    replies = self._index_batch("reindex", calls)
                    for reply in replies:
                        if isinstance(reply, Exception):
                            raise self._runner.error(reply, "reindex", self.namespace, None)
                switched = members.switch(self.namespace, fresh)
            except BaseException:
                self._index_ids = self._index_ids[:1]
                self._index_dirty = True
                raise
            if switched:
                self._index_ids = (fresh,)
                return fresh
            self._index_ids = self._index_ids[:1]
        self._index_dirty = True
        return None

    def _joined(self, lease_until_ms: int) -> None:
        """After a claim: join the fleet index with a new member id (retiring the old
        one) and record the lease, in one call; or only announce the lease."""
        if not self.fleet_index:
            self._node_index().announce(self.namespace, lease_until_ms)
            return
        member = self._members().join(self.namespace, lease_until_ms, self._home_group())
        self._index_ids = (member,)
        self._index_dirty = False
        # The id's stamp on its group's shard, before any bit: the shard applies this
        # owner's updates only under it (lua/index_update.lua, "Fencing").
        stamps = stamp_calls(self._fleet, member, self._fence)
        try:
            replies = self._index_batch("index_stamp", stamps)
        except RegistryError as exc:
            replies = [exc]
        if any(isinstance(r, Exception) for r in replies):
            self._index_dirty = True  # rebuilt (a new id, stamped) at the next renewal
            log.warning(
                "namespace %r: stamping its fleet-index id failed; rebuilt at the next renewal",
                self.namespace,
            )

    def _renewed(self, lease_until_ms: int) -> None:
        """After a renewal: record the lease and check the member id in one call;
        rebuild the index bits when they may be wrong (dirty, or the id was lost)."""
        if not self.fleet_index or not self._index_ids:
            self._node_index().announce(self.namespace, lease_until_ms)
            if not self.fleet_index:
                return
        else:
            member = self._index_ids[0]
            current = self._members().check(self.namespace, member, lease_until_ms)
            if current and not self._index_dirty and member % GROUPS == self._home_group():
                return
            # Rebuilt: the id was lost, the bits may be wrong, or (after a resharding)
            # the group's shard is no longer on this namespace's node.
        try:
            self.reindex()
        except RegistryError:
            self._index_dirty = True
            log.warning(
                "namespace %r: fleet-index rebuild failed; retried at the next renewal",
                self.namespace,
                exc_info=True,
            )

    @overload
    @classmethod
    def from_url(
        cls, url: str, namespace: str, *, mirror: Literal[True], **options: Any
    ) -> MirroredRegistry: ...

    @overload
    @classmethod
    def from_url(
        cls, url: str, namespace: str, *, mirror: Literal[False] = False, **options: Any
    ) -> PrefixCacheRegistry: ...

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str,
        *,
        mirror: bool = False,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        reply_ttl: float = DEFAULT_REPLY_TTL,
        cluster: bool | None = None,
        fleet_index: bool = True,
        **client_options: Any,
    ) -> PrefixCacheRegistry | MirroredRegistry:
        """Connect with a URL: ``redis://``, ``rediss://``, ``unix://``, Redis Cluster
        through ``redis+cluster://host:port`` / ``rediss+cluster://`` or ``cluster=True``,
        or a Sentinel-managed master through ``redis+sentinel://h:p[,h:p]/service``.

        ``client_options`` go to redis-py (``decode_responses``, ``password``...), over
        ``DEFAULT_CLIENT_OPTIONS`` and ``default_retry()``: with them no call blocks
        longer than ``CALL_BOUND`` seconds.

        ``mirror=True`` returns a ``registry.mirror.MirroredRegistry`` (an owner's
        registry answered locally and written behind); its options (``max_delay``,
        ``max_batch``, ``max_queue``, ``owner``) may be given here too.
        """
        validate_namespace(namespace)
        mirror_options: dict[str, Any] = {}
        if mirror:
            from registry.mirror import MIRROR_OPTIONS

            mirror_options = {
                k: client_options.pop(k) for k in MIRROR_OPTIONS if k in client_options
            }
        try:  # a cluster client connects here already
            client = client_from_url(url, cluster=cluster, **bounded_options(client_options))
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"connecting to {redacted(url)}") or exc) from exc
        registry = cls(
            client,
            namespace,
            key_prefix=key_prefix,
            notice_stream_maxlen=notice_stream_maxlen,
            reply_ttl=reply_ttl,
            fleet_index=fleet_index,
        )
        if mirror:
            from registry.mirror import MirroredRegistry

            return MirroredRegistry.wrap(registry, **mirror_options)
        return registry

    @property
    def namespace(self) -> str:
        """The namespace (block pool) this registry reads and writes."""
        return self.keys.namespace

    def __repr__(self) -> str:
        return (
            f"PrefixCacheRegistry(namespace={self.namespace!r}, "
            f"key_prefix={self.keys.key_prefix!r})"
        )

    def load_scripts(self) -> None:
        """Load every script now (SCRIPT LOAD), so the first calls need no retry."""
        self._runner.load()

    def _read(self, operation: str, command: Any, *args: Any) -> Any:
        """Run one read command; a Redis fault becomes the registry error for it.
        Counted and timed when metrics are on (``registry.metrics``)."""
        observer = _metrics.active
        if observer is not None:
            return observer.timed(operation, self._read_now, operation, command, *args)
        return self._read_now(operation, command, *args)

    def _read_now(self, operation: str, command: Any, *args: Any) -> Any:
        try:
            return command(*args)
        except REDIS_ERRORS as exc:
            error = translate(exc, f"namespace {self.namespace!r}: {operation}")
            raise (error or exc) from exc

    # -- storage primitives -----------------------------------------------------

    # Reads of one key are a single HMGET/HGET: atomic and one round trip already, and
    # several times cheaper on the server than a script, which must first turn every
    # argument into a Lua string (measured in BENCHMARKS.md).

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        values = self._read("match_kv_prefix", self.client.hmget, self.keys.kv, hashes)
        if None in values:
            del values[values.index(None) :]
        return list(map(int, values))

    def _register_kv(self, entries: dict[int, int]) -> None:
        self._write_indexed(
            "register_kv", self._kv_write_keys, False, flatten(entries, ()), "kv+", list(entries)
        )

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, notice = self._write_indexed(
            "evict_kv", self._all_keys, True, hashes, "kv-", hashes
        )
        # The script lists the removed hashes only when some were missing.
        gone = set(hashes) if isinstance(removed, int) else set(map(int, removed))
        return gone, _notice(notice)

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        values = self._read("match_mamba_farthest", self.client.hmget, self.keys.mamba, hashes)
        if values.count(None) == len(values):
            return 0
        farthest = len(values)
        while values[farthest - 1] is None:
            farthest -= 1
        return farthest

    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        notice, stamp = self._write_indexed(
            "register_mamba",
            self._mamba_write_keys,
            True,
            flatten(entries, ()),
            "mamba+",
            list(entries),
        )
        return _notice(notice), int(stamp)

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        notice = _notice(
            self._write_indexed(
                "evict_mamba", self._mamba_write_keys, True, hashes, "mamba-", hashes
            )
        )
        return ({h for _, h in notice.pairs} if notice else set()), notice

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        values = self._read("mamba_block_ids", self.client.hmget, self.keys.mamba, hashes)
        return [None if b is None else int(b) for b in values]

    def _notice_sequence(self) -> int:
        return self.notice_position()[1]

    def notice_position(self) -> tuple[str, int]:
        """(incarnation, number of the last notice) of the namespace, in one read:
        ``("", 0)`` before its first write. Numbers compare only within an incarnation."""
        incarnation, seq = self._read(
            "notice_position", self.client.hmget, self.keys.meta, ["incarnation", "notice_seq"]
        )
        return ("" if incarnation is None else _text(incarnation)), int(seq or 0)

    # -- the dict views (registry.views): one command per lookup ------------------------

    def _view_key(self, kind: str) -> str:
        return self.keys.kv if kind == "kv" else self.keys.mamba

    def _view_get(self, kind: str, h: int) -> int | None:
        value = self._read(f"{kind}_hash_to_block_id", self.client.hget, self._view_key(kind), h)
        return None if value is None else int(value)

    def _view_contains(self, kind: str, h: int) -> bool:
        return bool(
            self._read(f"{kind}_hash_to_block_id", self.client.hexists, self._view_key(kind), h)
        )

    def _view_len(self, kind: str) -> int:
        return int(self._read(f"{kind}_hash_to_block_id", self.client.hlen, self._view_key(kind)))

    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]:
        key, cursor, seen = self._view_key(kind), 0, set()
        while True:
            cursor, page = self._read(
                f"{kind}_hash_to_block_id", self.client.hscan, key, cursor, None, 1000
            )
            for field, block_id in page.items():
                h = int(field)
                if h not in seen:  # HSCAN may return an entry twice (a rehash)
                    seen.add(h)
                    yield h, int(block_id)
            if int(cursor) == 0:
                return

    # -- reading a whole namespace (tools, audits) ----------------------------------------

    def entries(self) -> tuple[dict[int, int], dict[int, int]]:
        """The whole KV and Mamba maps (``hash -> block id``), read in one round trip.
        O(entries): for audits and tools, not for an engine's hot path."""
        kv, mamba = self._pipelined(
            "entries", [("HGETALL", self.keys.kv), ("HGETALL", self.keys.mamba)]
        )
        return _int_map(kv), _int_map(mamba)

    def info(self) -> NamespaceInfo:
        """Sizes, owner epoch, lease and notice position of the namespace, in one round
        trip (plus one ``MEMORY USAGE`` per key when ``memory`` is wanted)."""
        replies = self._pipelined("info", _info_commands(self.keys))
        return _info_from(self.namespace, replies)

    def memory_bytes(self) -> int | None:
        """Bytes the namespace's long-lived keys take (``MEMORY USAGE``); None where the
        server has no such command (fakeredis) or refuses it (ACL)."""
        try:
            replies = self._pipelined("memory", _memory_commands(self.keys))
        except (RegistryMisconfigured, RegistryPermissionError):
            return None
        return sum(int(r or 0) for r in replies)

    def scan_entries(
        self, kind: str = "kv", cursor: int = 0, count: int = 50
    ) -> tuple[int, list[tuple[int, int]]]:
        """One ``HSCAN`` page of the ``kind`` ("kv" or "mamba") map: (next cursor, sorted
        (hash, block id) pairs); cursor 0 again means the scan is complete."""
        if kind not in ("kv", "mamba"):
            raise ValueError(f"kind must be 'kv' or 'mamba', not {kind!r}")
        key = self.keys.kv if kind == "kv" else self.keys.mamba
        following, page = self._read("scan_entries", self.client.hscan, key, cursor, None, count)
        return int(following), sorted((int(h), int(b)) for h, b in page.items())

    def _pipelined(self, operation: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Several commands on this namespace's keys in one round trip (one slot)."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies: list[Any] = pipe.execute()
            return replies

        result: list[Any] = self._read(operation, run)
        return result

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        if self.fleet_index and self.epoch is None:
            return self._operator_clear(kv=kv, mamba=mamba)
        notice = self._clear_maps(kv=kv, mamba=mamba)
        if self.fleet_index and self._index_ids:
            self._rebuild_after_clear()
        return notice

    def _clear_maps(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        if kv and mamba:
            return _notice(self._write("reset", self._all_keys, True))
        if kv:
            self._write("clear_kv", self._kv_write_keys, False)
            return None
        return _notice(self._write("clear_mamba", self._mamba_write_keys, True))

    def _operator_clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        """A clear by a writer that owns nothing: the owner keeps its member id (a
        rebuild would take a new one, and the owner's writes would go under the old one
        until it noticed), so the cleared entries' bits are cleared instead, read just
        before the clear (an entry added meanwhile may keep its bits: an over-count, a
        suboptimal route at worst, until it is evicted)."""
        ids = self._operator_ids()
        held_kv, held_mamba = self.entries() if ids else ({}, {})
        notice = self._clear_maps(kv=kv, mamba=mamba)
        calls = []
        if kv and held_kv:
            calls += update_calls(self._fleet, ids, "kv-", list(held_kv))
        if mamba and held_mamba:
            calls += update_calls(self._fleet, ids, "mamba-", list(held_mamba))
        if calls:
            replies = self._index_batch("clear", calls)
            if any(isinstance(r, Exception) for r in replies):
                log.warning(
                    "namespace %r: a fleet-index update failed after a clear", self.namespace
                )
        return notice

    def _rebuild_after_clear(self) -> None:
        """A clear drops bits of every entry: rebuild them (what is left), or mark them
        dirty for the heartbeat when Redis refuses now (the clear itself happened)."""
        try:
            if self.epoch is None and self._members().current(self.namespace) is None:
                return  # an operator clearing a namespace that is in no index
            self.reindex()
        except RegistryError:
            self._index_dirty = True
            log.warning(
                "namespace %r: fleet-index rebuild after a clear failed; retried "
                "at the next renewal",
                self.namespace,
                exc_info=True,
            )

    def notices_after(
        self, seq: int, *, incarnation: str | None = None, page: int = 500
    ) -> list[EvictionNotice] | None:
        """Every notice numbered above ``seq``, oldest first, read back from the stream;
        ``None`` when the stream cannot give all of them (see ``registry.replay``)."""
        return notices_after(self, seq, incarnation=incarnation, page=page)


def redacted(url: str) -> str:
    """``url`` without its user name and password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "the Redis URL"
    return f"{scheme}://{rest.rpartition('@')[2]}"


def bounded_options(client_options: dict[str, Any]) -> dict[str, Any]:
    """``client_options`` over the bounded defaults (timeouts and one quick retry)."""
    options = {**DEFAULT_CLIENT_OPTIONS, **client_options}
    options.setdefault("retry", default_retry())
    return options


@dataclass(frozen=True)
class NamespaceInfo:
    """What ``PrefixCacheRegistry.info()`` reads about a namespace."""

    namespace: str
    kv_entries: int
    mamba_entries: int
    epoch: int | None  # the owner's epoch; None if never claimed (or not a number)
    incarnation: str  # its history ("" before the first write)
    notice_seq: int | None  # the last notice number (None: meta holds something else)
    lease_until_ms: int | None  # the owner's lease end (server clock); None if never claimed
    server_ms: int  # the server's clock when read
    # Set on namespaces fed by ``pcr bridge`` (registry.bridge): which engine, where,
    # its block size and the last engine sequence number applied.
    bridge_engine: str | None = None
    bridge_endpoint: str | None = None
    bridge_block_size: int | None = None
    bridge_seq: int | None = None

    @property
    def state(self) -> str:
        """ "live", "dead" (lease over) or "no lease"."""
        if self.lease_until_ms is None:
            return "no lease"
        return "live" if self.lease_until_ms > self.server_ms else "dead"

    @property
    def lease_left_s(self) -> float | None:
        """Seconds of lease left (negative: ran out that long ago); None if no lease."""
        if self.lease_until_ms is None:
            return None
        return (self.lease_until_ms - self.server_ms) / 1000


def _info_commands(keys: NamespaceKeys) -> list[tuple[Any, ...]]:
    return [("HLEN", keys.kv), ("HLEN", keys.mamba), ("HGETALL", keys.meta), ("TIME",)]


def _memory_commands(keys: NamespaceKeys) -> list[tuple[Any, ...]]:
    return [("MEMORY", "USAGE", key) for key in keys.all_keys()]


def _info_from(namespace: str, replies: list[Any]) -> NamespaceInfo:
    kv, mamba, meta, now = replies
    fields = {_text(k): _text(v) for k, v in meta.items()}
    seconds, micros = now
    return NamespaceInfo(
        namespace=namespace,
        kv_entries=int(kv),
        mamba_entries=int(mamba),
        epoch=_whole(fields.get("epoch")),
        incarnation=fields.get("incarnation", ""),
        notice_seq=_whole(fields.get("notice_seq", "0")),
        lease_until_ms=_whole(fields.get("lease_until")),
        server_ms=int(seconds) * 1000 + int(micros) // 1000,
        bridge_engine=fields.get("bridge_engine"),
        bridge_endpoint=fields.get("bridge_endpoint"),
        bridge_block_size=_whole(fields.get("bridge_block_size")),
        bridge_seq=_whole(fields.get("bridge_seq")),
    )


def namespace_infos(
    client: Any,
    namespaces: list[str],
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    memory: bool = True,
) -> list[tuple[NamespaceInfo, int | None]]:
    """``info()`` and ``memory_bytes()`` of many namespaces in one round trip per Redis
    node (for ``pcr stats``): a pipeline on a standalone server, one batch per primary on
    a cluster. Memory is None where the server has no ``MEMORY USAGE`` or refuses it."""
    routed: list[tuple[str, tuple[Any, ...]]] = []
    for namespace in namespaces:
        keys = NamespaceKeys(namespace, key_prefix)
        commands = _info_commands(keys) + (_memory_commands(keys) if memory else [])
        routed += [(keys.meta, command) for command in commands]
    if not routed:
        return []
    try:
        replies = run_batched(client, routed)
    except REDIS_ERRORS as exc:
        raise (translate(exc, f"reading {len(namespaces)} namespaces") or exc) from exc
    per = len(routed) // len(namespaces)
    result = []
    for i, namespace in enumerate(namespaces):
        mine = replies[i * per : (i + 1) * per]
        for reply in mine[:4]:
            if isinstance(reply, Exception):
                raise (translate(reply, f"namespace {namespace!r}: info") or reply) from reply
        used = None
        if memory and not any(isinstance(r, Exception) for r in mine[4:]):
            used = sum(int(r or 0) for r in mine[4:])
        result.append((_info_from(namespace, mine[:4]), used))
    return result


def _whole(text: str | None) -> int | None:
    """A meta field as an int; None when absent or written as something else."""
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _int_map(raw: Any) -> dict[int, int]:
    return {int(h): int(b) for h, b in raw.items()}


def _notice(text: Any) -> EvictionNotice | None:
    """The notice a script published and replied with ("" when it published none)."""
    return parse_notice(text) if text else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
