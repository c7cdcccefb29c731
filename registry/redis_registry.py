"""``PrefixCacheRegistry``: the registry stored in Redis, one Lua script per call.

Every method is one EVALSHA (one round trip; none for empty input) of the script
named after it in ``lua/``. Scripts are redis-py ``Script`` objects, which reload
themselves on NOSCRIPT after a restart, a failover or ``SCRIPT FLUSH``.

Thread safety: the object keeps no mutable state besides the callback, and a
redis-py client is thread-safe, so one instance may be shared by many threads.
"""

from __future__ import annotations

from typing import Any

from registry.base import RegistryBase
from registry.client import RedisClient, client_from_url
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.notices import EvictionNotice, parse_stream_entry
from registry.scripts import OPERATIONS, script_source
from registry.validation import flatten

DEFAULT_NOTICE_STREAM_MAXLEN = 10_000


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
        self._scripts = {op: client.register_script(script_source(op)) for op in OPERATIONS}
        k = self.keys
        # Fixed KEYS and leading ARGV of each script, built once.
        self._notice_args = (k.mamba_evicted_channel, notice_stream_maxlen)
        self._kv_keys = (k.kv,)
        self._mamba_keys = (k.mamba,)
        self._register_kv_keys = (k.kv, k.meta)
        self._evict_kv_keys = (k.kv, k.mamba, k.meta, k.mamba_evictions)
        self._mamba_write_keys = (k.mamba, k.meta, k.mamba_evictions)
        self._meta_keys = (k.meta,)

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
        """Connect with a URL: ``redis://``, ``rediss://``, ``unix://``, or Redis Cluster
        through ``redis+cluster://host:port`` / ``rediss+cluster://`` or ``cluster=True``.

        ``client_options`` go to redis-py (``socket_timeout``, ``decode_responses``...).
        """
        validate_namespace(namespace)
        client = client_from_url(url, cluster=cluster, **client_options)
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
        return self._scripts[operation](keys=keys, args=args)

    # -- storage primitives -----------------------------------------------------

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        return [int(b) for b in self._run("match_kv_prefix", self._kv_keys, hashes)]

    def _register_kv(self, entries: dict[int, int]) -> None:
        self._run("register_kv", self._register_kv_keys, flatten(entries))

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, mamba_ids, mamba_hashes, seq = self._run(
            "evict_kv", self._evict_kv_keys, [*self._notice_args, *hashes]
        )
        return {int(h) for h in removed}, _notice(seq, "cascade", mamba_ids, mamba_hashes)

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        return int(self._run("match_mamba_farthest", self._mamba_keys, hashes))

    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        replaced_ids, replaced_hashes, stamp = self._run(
            "register_mamba", self._mamba_write_keys, [*self._notice_args, *flatten(entries)]
        )
        # A replace notice, when there is one, is the last number the script took.
        notice = _notice(stamp if replaced_ids else 0, "replace", replaced_ids, replaced_hashes)
        return notice, int(stamp)

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed, block_ids, seq = self._run(
            "evict_mamba", self._mamba_write_keys, [*self._notice_args, *hashes]
        )
        return {int(h) for h in removed}, _notice(seq, "evict", block_ids, removed)

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        return [
            None if b is None else int(b)
            for b in self._run("mamba_block_ids", self._mamba_keys, hashes)
        ]

    def _notice_sequence(self) -> int:
        return int(self._run("notice_sequence", self._meta_keys, ()))

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        if kv and mamba:
            seq = self._run("reset", self._evict_kv_keys, self._notice_args)
        elif kv:
            self._run("clear_kv", self._kv_keys, ())
            return None
        else:
            seq = self._run("clear_mamba", self._mamba_write_keys, self._notice_args)
        return _notice(seq, "clear", (), ())

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
            entries = self.client.xrevrange(self.keys.mamba_evictions, upper, "-", count=page)
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


def _notice(seq: Any, kind: str, block_ids: Any, hashes: Any) -> EvictionNotice | None:
    """The notice a script reported (``seq`` 0: it published none)."""
    number = int(seq)
    if number == 0:
        return None
    return EvictionNotice(
        number, kind, tuple((int(b), int(h)) for b, h in zip(block_ids, hashes, strict=True))
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
