"""``PrefixCacheRegistry``: the registry stored in Redis, one round trip per call.

Every write is one EVALSHA of the script named after it in ``lua/`` (loaded again on
NOSCRIPT after a restart, a failover or ``SCRIPT FLUSH``); every read of one key is a
single HMGET or HGET. Empty input costs no round trip. Redis faults raise
``RegistryUnavailable``.

An owner (the serving node whose GPU holds the blocks) calls ``claim()`` once at
start: its writes then carry its epoch and fail with ``StaleEpochError`` once another
process claimed the namespace. Readers (routers, tools) and operators do not claim.

Thread safety: the object keeps no mutable state besides the callback, hooks and the
epoch it claimed, and a redis-py client is thread-safe, so one instance may be shared
by many threads.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from registry.base import RegistryBase
from registry.client import RedisClient, client_from_url
from registry.errors import UNAVAILABLE, StaleEpochError, registry_unavailable
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.membership import DEFAULT_LEASE_TTL, Heartbeat, NodeIndex
from registry.notices import EvictionNotice, parse_notice, parse_stream_entry
from registry.scripts import register_scripts
from registry.validation import flatten

DEFAULT_NOTICE_STREAM_MAXLEN = 10_000

DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 2.0,
    "socket_timeout": 5.0,
    "health_check_interval": 30,
}
"""``from_url`` defaults (any may be overridden): bounded waits, so a serving node sees
``RegistryUnavailable`` within seconds instead of hanging on a dead server."""


class PrefixCacheRegistry(RegistryBase):
    """The ``hash -> block_id`` registry of one namespace, kept in Redis."""

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
    ) -> None:
        super().__init__()
        self.keys = NamespaceKeys(namespace, key_prefix)
        if isinstance(notice_stream_maxlen, bool) or not isinstance(notice_stream_maxlen, int):
            raise TypeError("notice_stream_maxlen must be an int")
        if notice_stream_maxlen < 1:
            raise ValueError("notice_stream_maxlen must be at least 1")
        if not callable(getattr(client, "register_script", None)):
            raise TypeError(
                f"client must be a redis-py style client (redis.Redis, RedisCluster, "
                f"fakeredis.FakeRedis), not {type(client).__name__}"
            )
        self.client = client
        self.notice_stream_maxlen = notice_stream_maxlen
        self.epoch: int | None = None
        self.lease_ttl = DEFAULT_LEASE_TTL
        self._scripts = register_scripts(client)
        self._index: NodeIndex | None = None
        k = self.keys
        # Fixed KEYS and leading ARGV of each script, built once (and on claim).
        self._kv_write_keys = (k.kv, k.meta)
        self._evict_kv_keys = (k.kv, k.mamba, k.meta, k.mamba_evictions)
        self._mamba_write_keys = (k.mamba, k.meta, k.mamba_evictions)
        self._meta_keys = (k.meta,)
        self._set_epoch(None)

    def _set_epoch(self, epoch: int | None) -> None:
        self.epoch = epoch
        fence = "" if epoch is None else str(epoch)
        self._fence_args = (fence,)
        self._notice_args = (fence, self.keys.mamba_evicted_channel, self.notice_stream_maxlen)

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        cluster: bool | None = None,
        **client_options: Any,
    ) -> PrefixCacheRegistry:
        """Connect with a URL: ``redis://``, ``rediss://``, ``unix://``, Redis Cluster
        through ``redis+cluster://host:port`` / ``rediss+cluster://`` or ``cluster=True``,
        or a Sentinel-managed master through ``redis+sentinel://h:p[,h:p]/service``.

        ``client_options`` go to redis-py (``decode_responses``, ``password``...), over
        ``DEFAULT_CLIENT_OPTIONS`` (bounded timeouts) and three quick retries.
        """
        validate_namespace(namespace)
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        options = {**DEFAULT_CLIENT_OPTIONS, **client_options}
        scheme = url.lower().split("://")[0]
        if "retry" not in options and not (cluster or scheme.endswith(("cluster", "sentinel"))):
            # A few quick retries with backoff (redis-py's default tries ten times, up to
            # seconds): connection errors and timeouts, then RegistryUnavailable.
            from redis.backoff import ExponentialWithJitterBackoff
            from redis.retry import Retry

            options["retry"] = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), 3)
        client = client_from_url(url, cluster=cluster, **options)
        return cls(
            client, namespace, key_prefix=key_prefix, notice_stream_maxlen=notice_stream_maxlen
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
        for script in self._scripts.values():
            script.sha = self.client.script_load(script.script)

    def _run(self, operation: str, keys: tuple[str, ...], args: Any) -> Any:
        """EVALSHA the operation's script; on NOSCRIPT (a restart, a failover, SCRIPT
        FLUSH) load it and retry once, as redis-py's Script does, without its copies."""
        script = self._scripts[operation]
        try:
            try:
                return self.client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                script.sha = self.client.script_load(script.script)
                return self.client.evalsha(script.sha, len(keys), *keys, *args)
        except UNAVAILABLE as exc:  # a plain try: this is every call's path
            raise registry_unavailable(f"namespace {self.namespace!r}: {operation}", exc) from exc
        except ResponseError as exc:
            if str(exc).startswith("STALE_EPOCH"):
                raise StaleEpochError(self.namespace, self.epoch, str(exc)) from None
            raise

    # -- ownership ----------------------------------------------------------------------

    def claim(self, lease_ttl: float = DEFAULT_LEASE_TTL) -> int:
        """Become the namespace's owner: take a new epoch, drop the previous incarnation's
        entries (a 'clear' notice tells listeners), start a lease and announce it.

        From now on this object's writes carry the epoch; once another process claims
        the namespace (or the lease runs out and ``gc`` removes it) they raise
        ``StaleEpochError`` and change nothing. Returns the epoch.
        """
        self.lease_ttl = _lease_seconds(lease_ttl)
        epoch, lease_until = self._run(
            "claim",
            self._evict_kv_keys,
            (self.keys.mamba_evicted_channel, self.notice_stream_maxlen, self._lease_ms()),
        )
        self._set_epoch(int(epoch))
        self._read("claim", self._node_index().announce, self.namespace, int(lease_until))
        return int(epoch)

    def renew(self) -> float:
        """Extend the lease by ``lease_ttl``; return its end (server clock, Unix seconds).

        Raises ``StaleEpochError`` when superseded, ``RuntimeError`` before ``claim``.
        """
        if self.epoch is None:
            raise RuntimeError("renew() needs an owner: call claim() first")
        lease_until = int(self._run("renew", self._meta_keys, (self.epoch, self._lease_ms())))
        self._read("renew", self._node_index().announce, self.namespace, lease_until)
        return lease_until / 1000

    def start_heartbeat(self, interval: float | None = None) -> Heartbeat:
        """Renew the lease from a daemon thread every ``interval`` s (default: a third of
        the lease). ``Heartbeat.stop()`` ends it; ``Heartbeat.lost`` is set if superseded."""
        if self.epoch is None:
            raise RuntimeError("start_heartbeat() needs an owner: call claim() first")
        beat = self.lease_ttl / 3 if interval is None else _lease_seconds(interval)
        return Heartbeat(self.renew, beat, name=f"heartbeat[{self.namespace}]")

    def _read(self, operation: str, command: Any, *args: Any) -> Any:
        """Run one read command, turning "Redis is not there" into RegistryUnavailable."""
        try:
            return command(*args)
        except UNAVAILABLE as exc:
            raise registry_unavailable(f"namespace {self.namespace!r}: {operation}", exc) from exc

    def _lease_ms(self) -> int:
        return max(1, round(self.lease_ttl * 1000))

    def _node_index(self) -> NodeIndex:
        if self._index is None:
            self._index = NodeIndex(self.client, self.keys.key_prefix)
        return self._index

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
        self._run("register_kv", self._kv_write_keys, flatten(entries, self._fence_args))

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, notice = self._run("evict_kv", self._evict_kv_keys, [*self._notice_args, *hashes])
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
        notice, stamp = self._run(
            "register_mamba", self._mamba_write_keys, flatten(entries, self._notice_args)
        )
        return _notice(notice), int(stamp)

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        notice = _notice(
            self._run("evict_mamba", self._mamba_write_keys, [*self._notice_args, *hashes])
        )
        return ({h for _, h in notice.pairs} if notice else set()), notice

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        values = self._read("mamba_block_ids", self.client.hmget, self.keys.mamba, hashes)
        return [None if b is None else int(b) for b in values]

    def _notice_sequence(self) -> int:
        return int(
            self._read("notice_sequence", self.client.hget, self.keys.meta, "notice_seq") or 0
        )

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        if kv and mamba:
            return _notice(self._run("reset", self._evict_kv_keys, self._notice_args))
        if kv:
            self._run("clear_kv", self._kv_write_keys, self._fence_args)
            return None
        return _notice(self._run("clear_mamba", self._mamba_write_keys, self._notice_args))

    # -- reading the notice stream ------------------------------------------------

    def notices_after(self, seq: int, *, page: int = 500) -> list[EvictionNotice] | None:
        """Every notice numbered above ``seq``, oldest first, read back from the stream.

        ``None`` when the capped stream no longer holds all of them (it was trimmed,
        or the namespace was wiped and its numbers restarted): reconcile instead.
        """
        newest = self.notice_sequence()
        if newest <= seq:
            return [] if newest == seq else None
        found: list[EvictionNotice] = []
        upper = "+"
        reached = False
        while not reached:
            entries = self._read(
                "notices_after", self.client.xrevrange, self.keys.mamba_evictions, upper, "-", page
            )
            for _entry_id, fields in entries:
                notice = parse_stream_entry(fields)
                if notice.seq <= seq:
                    reached = True
                    break
                found.append(notice)
            if len(entries) < page:
                break
            upper = "(" + _text(entries[-1][0])
        found.reverse()
        numbers = [n.seq for n in found]
        if not found or numbers != list(range(seq + 1, seq + 1 + len(found))):
            return None
        return found if numbers[-1] >= newest else None


def _notice(text: Any) -> EvictionNotice | None:
    """The notice a script published and replied with ("" when it published none)."""
    return parse_notice(text) if text else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lease_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a lease length must be a number of seconds, not {type(value).__name__}")
    if not 0.001 <= value <= 86_400 * 365:
        raise ValueError(f"a lease length must lie between 1 ms and a year, not {value}")
    return float(value)
