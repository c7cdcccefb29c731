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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from registry import metrics as _metrics
from registry.base import RegistryBase
from registry.client import RedisClient, client_from_url
from registry.errors import (
    REDIS_ERRORS,
    RegistryMisconfigured,
    RegistryPermissionError,
    translate,
)
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.membership import NodeIndex
from registry.notices import EvictionNotice, parse_notice
from registry.ownership import DEFAULT_LEASE_TTL, Ownership
from registry.replay import notices_after
from registry.scripts import ScriptRunner, run_batched
from registry.validation import flatten

if TYPE_CHECKING:
    from registry.mirror import MirroredRegistry

log = logging.getLogger(__name__)

DEFAULT_NOTICE_STREAM_MAXLEN = 1_000
"""Notices kept in a namespace's stream for replay (each at most ~1.1 KiB there)."""

DEFAULT_REPLY_TTL = 30.0
"""Seconds a write's reply stays recorded under its request id: longer than any one
call can keep retrying (``CALL_BOUND``), so a re-sent copy never runs twice."""

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
    ) -> Any:
        """Run a write script under a fresh request id (see ``lua/_prelude.lua``)."""
        all_keys, args = self._write_args(operation, keys, notices, data, fence=fence)
        return self._runner.run(
            operation, all_keys, args, namespace=self.keys.namespace, epoch=self.epoch
        )

    def _write_args(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
    ) -> tuple[tuple[str, ...], list[Any]]:
        """The (KEYS, ARGV) of one write under a fresh request id: ``_write`` sends them
        at once; a batching caller (the mirror's flusher) keeps them to send, and re-send
        unchanged, later: the request id makes a re-sent copy a no-op."""
        number = f"{next(self._requests):x}"
        head: list[Any] = [
            self._fence if fence is None else fence,
            f"{self._request_prefix}-{number}",
            self._reply_ms,
        ]
        if notices:
            head += [self.keys.mamba_evicted_channel, self.notice_stream_maxlen]
        head.extend(data)
        return (self._reply_prefix + number, *keys), head

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
        self._write("register_kv", self._kv_write_keys, False, flatten(entries, ()))

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, notice = self._write("evict_kv", self._all_keys, True, hashes)
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
        notice, stamp = self._write(
            "register_mamba", self._mamba_write_keys, True, flatten(entries, ())
        )
        return _notice(notice), int(stamp)

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        notice = _notice(self._write("evict_mamba", self._mamba_write_keys, True, hashes))
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
        if kv and mamba:
            return _notice(self._write("reset", self._all_keys, True))
        if kv:
            self._write("clear_kv", self._kv_write_keys, False)
            return None
        return _notice(self._write("clear_mamba", self._mamba_write_keys, True))

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
