"""``PrefixCacheRegistry``: the registry stored in Redis, one round trip per call.

Every write is one EVALSHA of the script named after it in ``lua/`` (through the one
``ScriptRunner``), under a fresh request id so that a re-sent copy never runs twice;
every read of one key is a single HMGET or HGET. Empty input costs no round trip. Redis
faults raise the registry's own errors (``registry.core.errors``).

Ownership (``claim``, ``renew``, the heartbeat) is in ``registry.namespace.ownership``;
reading notices back from the stream in ``registry.namespace.replay``; what ``info()``
reads, for many namespaces at once too, in ``registry.namespace.admin``; the client's
bounds (``CALL_BOUND``) in ``registry.transport.client``.

Thread safety: the object keeps no mutable state besides the callback, hooks and the
epoch it claimed, and a redis-py client is thread-safe, so one instance may be shared
by many threads.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from registry.core import observe
from registry.core.base import RegistryBase
from registry.core.errors import (
    REDIS_ERRORS,
    RegistryMisconfigured,
    RegistryPermissionError,
    translate,
)
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.core.notices import EvictionNotice, parse_notice
from registry.core.validation import checked_number, flatten, text
from registry.namespace.admin import NamespaceInfo, info_commands, info_from, memory_commands
from registry.namespace.ownership import DEFAULT_LEASE_TTL, Ownership
from registry.namespace.replay import notices_after
from registry.transport.client import RedisClient, bounded_options, client_from_url, redacted
from registry.transport.options import check_client_options
from registry.transport.scripts import ScriptRunner

log = logging.getLogger(__name__)

DEFAULT_NOTICE_STREAM_MAXLEN = 1_000
"""Notices kept in a namespace's stream for replay (each at most ~1.1 KiB there)."""

DEFAULT_WAIT_TIMEOUT = 1.0
"""Seconds a write waits for ``wait_replicas`` replicas (under the client's read
timeout, ``registry.transport.client.READ_TIMEOUT``)."""

DEFAULT_REPLY_TTL = 30.0
"""Seconds a write's reply stays recorded under its request id: longer than any one
call can keep retrying (``registry.transport.client.CALL_BOUND``), so a re-sent copy
never runs twice."""


FROM_URL_OWN = (
    "url",
    "namespace",
    "key_prefix",
    "notice_stream_maxlen",
    "reply_ttl",
    "wait_replicas",
    "wait_timeout",
    "cluster",
)
"""``PrefixCacheRegistry.from_url``'s own parameters (named when a keyword is unknown)."""


CONFIRMED_READS = {"hmget": "HMGET", "hget": "HGET", "hexists": "HEXISTS", "hlen": "HLEN"}
"""The one-key reads that ``wait_replicas`` confirms on replicas (the match and lookup
API: ``match_kv_prefix``, ``match_mamba_farthest``, ``mamba_block_ids``, the dict
views): redis-py method name -> command."""


class PrefixCacheRegistry(RegistryBase, Ownership):
    """The ``hash -> block_id`` registry of one namespace, kept in Redis.

    ``wait_replicas`` (0, off, by default): each write waits, on its own connection, for
    that many replicas to acknowledge it (``WAIT``, at most ``wait_timeout`` seconds),
    and raises ``RegistryUnavailable`` with ``outcome_unknown`` when fewer did, so that
    no write counts as done that a failover can lose; each match and lookup read
    (``CONFIRMED_READS``) is confirmed the same way before it answers, so that no read
    returns a write that a failover then loses (docs/guides/cluster.md).
    """

    mirror_factory: ClassVar[Callable[..., Any] | None] = None
    """``MirroredRegistry.from_url``, set when ``registry.mirror`` is imported (the
    package root imports it): what the deprecated ``from_url(mirror=True)`` builds. The
    namespace floor never imports the mirror above it."""

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        reply_ttl: float = DEFAULT_REPLY_TTL,
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        super().__init__()
        self.keys = NamespaceKeys(namespace, key_prefix)
        checked_number(notice_stream_maxlen, "notice_stream_maxlen", 1, 10_000_000, integer=True)
        checked_number(reply_ttl, "reply_ttl", 1, 86_400, unit=" s")
        checked_number(wait_replicas, "wait_replicas", 0, 1_000, integer=True)
        checked_number(wait_timeout, "wait_timeout", 0.001, 60, unit=" s")
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
        self._runner = ScriptRunner(
            client, wait_replicas=wait_replicas, wait_timeout=float(wait_timeout)
        )
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
        # Writes that add entries also count the other map and read the quota.
        self._register_kv_keys = (*self._kv_write_keys, k.mamba, k.quota)
        self._register_mamba_keys = (*self._mamba_write_keys, k.kv, k.quota)
        self._all_write_keys = (*self._all_keys, k.quota)
        self.adopt_epoch(None)

    def adopt_epoch(self, epoch: int | None) -> None:
        """Carry ``epoch`` in every later write: what ``claim`` does with the epoch it
        took, and what a caller resuming an owner's epoch instead of claiming one does
        (``pcr bridge``'s ``bridge_resume``). None: writes carry none (unfenced)."""
        self.epoch = epoch
        self._fence = "" if epoch is None else str(epoch)

    @property
    def all_write_keys(self) -> tuple[str, ...]:
        """The KEYS, after its reply key, of a write over both maps and the notice
        stream that may add entries (``kv``, ``mamba``, ``meta``, ``mamba_evictions``,
        ``quota``: ``mirror_apply``, ``mirror_resync``): for ``write_args``."""
        return self._all_write_keys

    def run_write(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
    ) -> Any:
        """Run the write script ``operation`` under a fresh request id (see
        ``lua/_prelude.lua``): ``keys`` after its reply key, then (``notices``) the
        notice channel and the stream's length, then ``data``; fenced by this object's
        epoch unless ``fence`` says otherwise ("": unfenced). Its reply, or a registry
        error (``StaleEpochError`` once superseded)."""
        all_keys, args = self.write_args(operation, keys, notices, data, fence=fence)
        return self._runner.run(
            operation, all_keys, args, namespace=self.keys.namespace, epoch=self.epoch
        )

    def write_args(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
    ) -> tuple[tuple[str, ...], list[Any]]:
        """The (KEYS, ARGV) of one write under a fresh request id: ``run_write`` sends
        them at once; a batching caller (the mirror's flusher) keeps them to send, and
        re-send unchanged, later: the request id makes a re-sent copy a no-op."""
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

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        reply_ttl: float = DEFAULT_REPLY_TTL,
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        cluster: bool | None = None,
        mirror: bool | None = None,
        **client_options: Any,
    ) -> PrefixCacheRegistry:
        """Connect with a URL: ``redis://``, ``rediss://``, ``unix://``, Redis Cluster
        through ``redis+cluster://host:port`` / ``rediss+cluster://`` or ``cluster=True``,
        or a Sentinel-managed master through ``redis+sentinel://h:p[,h:p]/service``.

        ``client_options`` go to redis-py (``decode_responses``, ``password``...), over
        ``DEFAULT_CLIENT_OPTIONS`` and ``default_retry()`` (``registry.transport.client``):
        with them no call blocks longer than ``CALL_BOUND`` seconds. ``wait_replicas`` and
        ``wait_timeout``: see the class (``wait_timeout`` under ``socket_timeout``).

        An owner's registry answered locally and written behind to Redis:
        ``registry.mirror.MirroredRegistry.from_url``. (``mirror=True`` still builds
        one, with a ``DeprecationWarning``, until 0.3.0.)

        A keyword that is neither one of these parameters nor a redis-py client option
        raises ``TypeError`` before anything connects.
        """
        if mirror is not None:
            warnings.warn(
                "PrefixCacheRegistry.from_url(mirror=...) is deprecated and goes in 0.3.0; "
                "use registry.mirror.MirroredRegistry.from_url(url, namespace, ...) for a "
                "mirrored owner, PrefixCacheRegistry.from_url without mirror= otherwise",
                DeprecationWarning,
                stacklevel=2,
            )
            if mirror:
                factory = PrefixCacheRegistry.mirror_factory
                if factory is None:  # registry.mirror was never imported
                    raise TypeError("from_url(mirror=True) needs registry.mirror; import it")
                options = dict(
                    key_prefix=key_prefix,
                    notice_stream_maxlen=notice_stream_maxlen,
                    reply_ttl=reply_ttl,
                    cluster=cluster,
                )
                result: PrefixCacheRegistry = factory(url, namespace, **options, **client_options)
                return result
        check_client_options(client_options, "PrefixCacheRegistry.from_url", FROM_URL_OWN)
        validate_namespace(namespace)
        bounded = bounded_options(client_options)
        read_timeout = bounded.get("socket_timeout")
        if wait_replicas and read_timeout is not None and read_timeout <= wait_timeout:
            raise ValueError(
                f"wait_timeout ({wait_timeout} s) must be shorter than socket_timeout "
                f"({read_timeout} s): the WAIT after a write is read within it"
            )
        try:  # a cluster client connects here already
            client = client_from_url(url, cluster=cluster, **bounded)
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"connecting to {redacted(url)}") or exc) from exc
        return cls(
            client,
            namespace,
            key_prefix=key_prefix,
            notice_stream_maxlen=notice_stream_maxlen,
            reply_ttl=reply_ttl,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
        )

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
        Published with its outcome and time when an observer listens
        (``registry.core.observe``)."""
        observer = observe.current
        if observer is not None:
            return observe.timed(observer, operation, self._read_now, operation, command, *args)
        return self._read_now(operation, command, *args)

    def _read_now(self, operation: str, command: Any, *args: Any) -> Any:
        try:
            if self._runner.wait_replicas:
                name = getattr(command, "__name__", "")
                if name in CONFIRMED_READS:
                    return self._confirmed(name, args)
            return command(*args)
        except REDIS_ERRORS as exc:
            error = translate(exc, f"namespace {self.namespace!r}: {operation}")
            raise (error or exc) from exc

    def _confirmed(self, name: str, args: tuple[Any, ...]) -> Any:
        """A one-key read (``CONFIRMED_READS``) confirmed on ``wait_replicas`` replicas
        (``ScriptRunner.confirmed_read``): what a failover can lose is never answered."""
        key = args[0]
        rest = list(args[1]) if name == "hmget" else list(args[1:])
        reply = self._runner.confirmed_read(key, (CONFIRMED_READS[name], key, *rest))
        return bool(reply) if name == "hexists" else reply

    # -- storage primitives -----------------------------------------------------

    # Reads of one key are a single HMGET/HGET: atomic and one round trip already, and
    # cheaper on the server than a script, which must first turn every argument into a
    # Lua string (see BENCHMARKS.md).

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        values = self._read("match_kv_prefix", self.client.hmget, self.keys.kv, hashes)
        if None in values:
            del values[values.index(None) :]
        return list(map(int, values))

    def _register_kv(self, entries: dict[int, int]) -> None:
        self.run_write("register_kv", self._register_kv_keys, False, flatten(entries, ()))

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, notice = self.run_write("evict_kv", self._all_keys, True, hashes)
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
        notice, stamp = self.run_write(
            "register_mamba", self._register_mamba_keys, True, flatten(entries, ())
        )
        return _notice(notice), int(stamp)

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        notice = _notice(self.run_write("evict_mamba", self._mamba_write_keys, True, hashes))
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
        return ("" if incarnation is None else text(incarnation)), int(seq or 0)

    # -- the dict views (registry.core.views): one command per lookup ------------------------

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
        trip (its memory: ``memory_bytes``)."""
        replies = self._pipelined("info", info_commands(self.keys))
        return info_from(self.namespace, replies)

    def memory_bytes(self) -> int | None:
        """Bytes the namespace's long-lived keys take (``MEMORY USAGE``); None where the
        server has no such command (fakeredis) or refuses it (ACL)."""
        try:
            replies = self._pipelined("memory", memory_commands(self.keys))
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
            return _notice(self.run_write("reset", self._all_keys, True))
        if kv:
            self.run_write("clear_kv", self._kv_write_keys, False)
            return None
        return _notice(self.run_write("clear_mamba", self._mamba_write_keys, True))

    def notice_page(self, upper: str, count: int) -> list[Any]:
        """One page of the notice stream, newest first: up to ``count`` (entry id,
        fields) entries at or below the entry id ``upper`` ("+": the newest; "(ID":
        below ID), in one ``XREVRANGE`` (what ``notices_after`` reads)."""
        entries: list[Any] = self._read(
            "notices_after", self.client.xrevrange, self.keys.mamba_evictions, upper, "-", count
        )
        return entries

    def notices_after(
        self, seq: int, *, incarnation: str | None = None, page: int = 500
    ) -> list[EvictionNotice] | None:
        """Every notice numbered above ``seq``, oldest first, read back from the stream;
        ``None`` when the stream cannot give all of them (see ``registry.namespace.replay``)."""
        return notices_after(self, seq, incarnation=incarnation, page=page)


def _int_map(raw: Any) -> dict[int, int]:
    return {int(h): int(b) for h, b in raw.items()}


def _notice(text: Any) -> EvictionNotice | None:
    """The notice a script published and replied with ("" when it published none)."""
    return parse_notice(text) if text else None
