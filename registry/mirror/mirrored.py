"""``MirroredRegistry``: an owner's registry answered from local dicts, written behind.

The registry applies each write to the local maps (``OwnerState``) at once, with the
seed's meaning, and queues it (``WriteQueue``); the write-behind (``WriteBehind``, sent
by the ``Flusher`` thread or ``flush()``) carries the queue to Redis. See the package's
docstring for the design.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from registry.core.base import RegistryBase
from registry.core.errors import RegistryError, StaleEpochError
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.core.notices import EvictionNotice
from registry.core.types import NoticeKind
from registry.core.validation import checked_number
from registry.mirror.flusher import Flusher
from registry.mirror.state import OwnerState
from registry.mirror.write_behind import WriteBehind
from registry.mirror.write_queue import MirrorCounts, WriteQueue
from registry.mirror.writes import Op
from registry.namespace.ownership import DEFAULT_LEASE_TTL, Heartbeat, lease_seconds, owner_label
from registry.namespace.redis_registry import (
    DEFAULT_NOTICE_STREAM_MAXLEN,
    DEFAULT_REPLY_TTL,
    FROM_URL_OWN,
    PrefixCacheRegistry,
)
from registry.transport.client import RedisClient
from registry.transport.options import check_client_options

log = logging.getLogger(__name__)

DEFAULT_MAX_DELAY = 0.0002
"""Seconds the flusher waits after a write is queued for more to join its batch (when
Redis answers, the fleet sees a write within about this plus one round trip)."""

DEFAULT_MAX_BATCH = 1_000
"""Writes sent in one round trip at most."""

DEFAULT_MAX_QUEUE = 100_000
"""Writes queued at most while Redis is away; past that the backlog is dropped and the
namespace is rewritten from the mirror (one resync) once Redis answers."""

MIRROR_OPTIONS = ("max_delay", "max_batch", "max_queue", "owner")
"""The keyword options of the mirror itself (``MirroredRegistry.from_url`` takes them
beside those of ``PrefixCacheRegistry.from_url``)."""


def default_owner_label(namespace: str) -> str:
    """``<namespace> (<host>:<pid>)``: what ``NamespaceMirrored`` names by default."""
    return f"{namespace} ({socket.gethostname()}:{os.getpid()})"


class MirroredRegistry(RegistryBase):
    """The registry of one owned namespace, answered locally and written behind to Redis.

    ``MirroredRegistry(client, namespace, ...)`` or ``MirroredRegistry.from_url(url,
    namespace)``; ``MirroredRegistry.wrap(registry)`` mirrors an existing
    ``PrefixCacheRegistry``. Call ``claim()`` before writing; ``close()`` flushes and
    stops the flusher (also a context manager).
    """

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        notice_stream_maxlen: int = DEFAULT_NOTICE_STREAM_MAXLEN,
        reply_ttl: float = DEFAULT_REPLY_TTL,
        max_delay: float = DEFAULT_MAX_DELAY,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        owner: str | None = None,
    ) -> None:
        inner = PrefixCacheRegistry(
            client,
            namespace,
            key_prefix=key_prefix,
            notice_stream_maxlen=notice_stream_maxlen,
            reply_ttl=reply_ttl,
        )
        self._setup(inner, max_delay, max_batch, max_queue, owner)

    @classmethod
    def from_url(cls, url: str, namespace: str, **options: Any) -> MirroredRegistry:
        """Connect with a URL, as ``PrefixCacheRegistry.from_url`` does (its options and
        the client's too), and mirror that registry; the mirror's own options
        (``MIRROR_OPTIONS``: ``max_delay``, ``max_batch``, ``max_queue``, ``owner``) may
        be given here as well."""
        mirror_options = {k: options.pop(k) for k in MIRROR_OPTIONS if k in options}
        own = {k: options.pop(k) for k in FROM_URL_OWN if k in options}
        check_client_options(options, "MirroredRegistry.from_url", (*FROM_URL_OWN, *MIRROR_OPTIONS))
        inner = PrefixCacheRegistry.from_url(url, namespace, **own, **options)
        return cls.wrap(inner, **mirror_options)

    @classmethod
    def wrap(
        cls,
        inner: PrefixCacheRegistry,
        *,
        max_delay: float = DEFAULT_MAX_DELAY,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        owner: str | None = None,
    ) -> MirroredRegistry:
        """Mirror ``inner`` (which must not be used for writes afterwards)."""
        if not isinstance(inner, PrefixCacheRegistry):
            raise TypeError(f"inner must be a PrefixCacheRegistry, not {type(inner).__name__}")
        self = cls.__new__(cls)
        self._setup(inner, max_delay, max_batch, max_queue, owner)
        return self

    def _setup(
        self,
        inner: PrefixCacheRegistry,
        max_delay: float,
        max_batch: int,
        max_queue: int,
        owner: str | None,
    ) -> None:
        RegistryBase.__init__(self)
        checked_number(max_delay, "max_delay", 0, 10, unit=" s")
        checked_number(max_batch, "max_batch", 1, 100_000, integer=True)
        checked_number(max_queue, "max_queue", 1, 10**8, integer=True)
        self.inner = inner
        self.owner = owner_label(default_owner_label(inner.namespace) if owner is None else owner)
        self._state = state = OwnerState(inner.namespace)
        self._queue = WriteQueue(
            inner.namespace,
            state.lock,
            max_delay=float(max_delay),
            max_batch=max_batch,
            max_queue=max_queue,
        )
        self._behind = WriteBehind(inner, state, self._queue)
        self._flusher = Flusher(self._behind, f"mirror-flusher[{inner.namespace}]")

    # -- what the wrapped registry holds --------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    @property
    def keys(self) -> NamespaceKeys:
        return self.inner.keys

    @property
    def client(self) -> Any:
        return self.inner.client

    @property
    def epoch(self) -> int | None:
        return self.inner.epoch

    @property
    def lease_ttl(self) -> float:
        return self.inner.lease_ttl

    @property
    def max_delay(self) -> float:
        """Seconds the flusher waits after a write for more to join its batch."""
        return self._queue.max_delay

    @property
    def max_batch(self) -> int:
        """Writes sent in one round trip at most."""
        return self._queue.max_batch

    @property
    def max_queue(self) -> int:
        """Writes queued at most while Redis is away."""
        return self._queue.max_queue

    def __repr__(self) -> str:
        return f"MirroredRegistry(namespace={self.namespace!r}, owner={self.owner!r})"

    # -- ownership ------------------------------------------------------------------------

    def claim(self, lease_ttl: float = DEFAULT_LEASE_TTL) -> int:
        """Become the namespace's exclusive owner (``PrefixCacheRegistry.claim`` with this
        mirror's label): a new epoch, an empty namespace and mirror, a lease; from now on
        writes by anyone else are refused (``NamespaceMirrored``) while the lease lives.
        Unflushed writes of an earlier claim are dropped. The claim's 'clear' notice goes
        to this object's hooks. Returns the epoch."""
        lease_ttl = lease_seconds(lease_ttl)
        state, queue = self._state, self._queue
        with self._behind.sending:
            with state.lock:
                if state.closed:
                    raise RuntimeError("this MirroredRegistry is closed")
                queue.discard()
            heard: list[EvictionNotice] = []
            self.inner.add_eviction_hook(heard.append)
            try:
                epoch = self.inner.claim(lease_ttl, mirror=self.owner)
            finally:
                self.inner.remove_eviction_hook(heard.append)
            notice = heard[-1]
            with state.lock:
                queue.discard()  # a write of another thread during the claim
                state.claimed(notice)
        self._notify(notice)
        self._flusher.start()
        return epoch

    def renew(self) -> float:
        """Extend the lease (``PrefixCacheRegistry.renew``); a fenced owner is marked lost."""
        self._state.check_lost()
        try:
            return self.inner.renew()
        except StaleEpochError as exc:
            self._behind.mark_lost(exc)
            raise

    def start_heartbeat(self, interval: float | None = None) -> Heartbeat:
        """Renew the lease from a daemon thread (``PrefixCacheRegistry.start_heartbeat``);
        the thread holds this registry weakly."""
        if self.inner.epoch is None:
            raise RuntimeError("start_heartbeat() needs an owner: call claim() first")
        beat = self.inner.lease_ttl / 3 if interval is None else lease_seconds(interval)
        return Heartbeat(self, beat, name=f"heartbeat[{self.namespace}]")

    @property
    def lost(self) -> bool:
        """True once a flush found this owner fenced: every call raises from then on."""
        return self._state.lost is not None

    # -- local state: reads ---------------------------------------------------------------

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        state = self._state
        with state.lock:
            if state.lost is not None:
                state.check_lost()
            kv = state.kv
            block_ids = []
            for h in hashes:
                block_id = kv.get(h)
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        state = self._state
        with state.lock:
            if state.lost is not None:
                state.check_lost()
            mamba = state.mamba
            for i in range(len(hashes) - 1, -1, -1):
                if hashes[i] in mamba:
                    return i + 1
            return 0

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        state = self._state
        with state.lock:
            state.check_lost()
            return [state.mamba.get(h) for h in hashes]

    def _notice_sequence(self) -> int:
        state = self._state
        with state.lock:
            state.check_lost()
            return state.seq

    def notice_position(self) -> tuple[str, int]:
        """(incarnation, last notice number) as the mirror numbers them (Redis reaches
        the same once the queue is flushed)."""
        state = self._state
        with state.lock:
            state.check_lost()
            return state.incarnation, state.seq

    def entries(self) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of the mirror's KV and Mamba maps (``inner.entries()`` reads Redis)."""
        state = self._state
        with state.lock:
            state.check_lost()
            return dict(state.kv), dict(state.mamba)

    def _view_map(self, kind: str) -> dict[int, int]:
        state = self._state
        state.check_lost()
        return state.kv if kind == "kv" else state.mamba

    def _view_get(self, kind: str, h: int) -> int | None:
        with self._state.lock:
            return self._view_map(kind).get(h)

    def _view_contains(self, kind: str, h: int) -> bool:
        with self._state.lock:
            return h in self._view_map(kind)

    def _view_len(self, kind: str) -> int:
        with self._state.lock:
            return len(self._view_map(kind))

    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]:
        with self._state.lock:
            return iter(list(self._view_map(kind).items()))

    # -- local state: writes, each queued ---------------------------------------------------

    def _writable(self) -> PrefixCacheRegistry:
        """Under the lock: the inner registry, if this owner may write now."""
        self._state.check_lost()
        if self._state.closed:
            raise RuntimeError("this MirroredRegistry is closed")
        if self.inner.epoch is None:
            raise RuntimeError("a mirrored registry writes only as an owner: call claim() first")
        return self.inner

    def _register_kv(self, entries: dict[int, int]) -> None:
        state = self._state
        with state.lock:
            if not state.writes_ok:
                self._writable()
            state.kv.update(entries)
            self._queue.put(Op.REGISTER_KV, entries, state.seq)  # flattened by the flusher

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        state = self._state
        with state.lock:
            if not state.writes_ok:
                self._writable()
            kv, mamba = state.kv, state.mamba
            gone = [h for h in hashes if kv.pop(h, None) is not None]
            if not gone:
                return set(), None
            notice = None
            if mamba:
                pairs = [(mamba.pop(h), h) for h in gone if h in mamba]
                if pairs:
                    notice = state.notice(NoticeKind.CASCADE, pairs)
            self._queue.put(Op.EVICT_KV, gone, state.seq)
            return set(gone), notice

    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        state = self._state
        with state.lock:
            if not state.writes_ok:
                self._writable()
            mamba = state.mamba
            replaced = [(old, h) for h, new in entries.items() if (old := mamba.get(h, new)) != new]
            mamba.update(entries)
            notice = state.notice(NoticeKind.REPLACE, replaced) if replaced else None
            self._queue.put(Op.REGISTER_MAMBA, entries, state.seq)  # flattened by the flusher
            return notice, state.seq

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        state = self._state
        with state.lock:
            if not state.writes_ok:
                self._writable()
            mamba = state.mamba
            pairs = [(mamba.pop(h), h) for h in hashes if h in mamba]
            if not pairs:
                return set(), None
            gone = [h for _, h in pairs]
            notice = state.notice(NoticeKind.EVICT, pairs)
            self._queue.put(Op.EVICT_MAMBA, gone, state.seq)
            return set(gone), notice

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        state = self._state
        with state.lock:
            if not state.writes_ok:
                self._writable()
            if kv:
                state.kv.clear()
            notice = None
            if mamba and state.mamba:
                state.mamba.clear()
                notice = state.notice(NoticeKind.CLEAR, [])
            op = Op.RESET if kv and mamba else Op.CLEAR_KV if kv else Op.CLEAR_MAMBA
            self._queue.put(op, (), state.seq)
            return notice

    # -- the write-behind -------------------------------------------------------------------

    def stop_flusher(self, timeout: float = 5.0) -> None:
        """Stop the flusher thread: writes then stay queued until ``flush()`` (or
        ``start_flusher()``). For tests and benchmarks that want the queue still."""
        self._flusher.stop(timeout)

    def start_flusher(self) -> None:
        """Start the flusher thread again after ``stop_flusher()`` (``claim`` starts it)."""
        if self.inner.epoch is None:
            raise RuntimeError("start_flusher() needs an owner: call claim() first")
        self._flusher.start()

    def load_scripts(self) -> None:
        """Load every script now (SCRIPT LOAD), so the first flush needs no retry."""
        self.inner.load_scripts()

    def flush(self, timeout: float = 30.0) -> None:
        """Send every queued write now, in order, and wait until Redis applied them (a
        resync if one is due). Raises ``RegistryUnavailable`` when Redis does not answer
        within ``timeout`` seconds (the writes stay queued), ``StaleEpochError`` when
        this owner was fenced (it is lost from then on)."""
        self._behind.flush(timeout)

    def counts(self) -> MirrorCounts:
        """A snapshot of the write-behind's counters (``MirrorCounts``)."""
        return self._behind.counts()

    # -- lifetime -----------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (within ``timeout``; a failure is logged), then stop the
        flusher. Later writes raise ``RuntimeError``; reads still answer."""
        state = self._state
        if state.lost is None and self._flusher.thread is not None:
            try:
                self.flush(timeout)
            except RegistryError:
                log.warning(
                    "mirror of %r: closing with writes unflushed", self.namespace, exc_info=True
                )
        with state.lock:
            state.closed = True
            state.writes_ok = False
        self._flusher.stop(timeout)

    def __enter__(self) -> MirroredRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# The deprecated ``PrefixCacheRegistry.from_url(mirror=True)`` builds one of these; the
# namespace floor cannot import this package, so the package hands it the factory.
PrefixCacheRegistry.mirror_factory = MirroredRegistry.from_url
