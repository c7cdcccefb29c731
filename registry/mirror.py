"""``MirroredRegistry``: an owner's registry at memory speed, written behind to Redis.

The owner of a namespace (the serving node whose GPU holds its blocks) is the only
process that reuses them, so its own view can be authoritative and Redis the shared
copy. A ``MirroredRegistry`` wraps a ``PrefixCacheRegistry`` (which keeps the client,
the keys, the epoch and the write path):

* reads (``match_kv_prefix``, ``match_mamba_farthest``, ``find_mamba_backoff``,
  ``mamba_block_ids``, the dict views) answer from two local dicts;
* writes apply to them at once with the seed's meaning: return values, the Mamba
  callback and the eviction hooks fire in the call, as ``LocalPrefixCacheRegistry`` does;
  each write is then queued as it was given (an operation code and its values: the
  engine's thread does no more), for the flusher to encode;
* a flusher thread sends the queue in order, in batches of at most ``max_batch`` writes,
  one round trip per batch (per Redis node), at most ``max_delay`` after a write was
  queued when Redis answers. A batch is a few calls of ``lua/mirror_apply.lua`` (at most
  ``CALL_WRITES`` writes each), which applies a run of writes in order with exactly the
  effects of the one-per-write scripts (entries, numbered notices, stream, change
  records), fenced once per call. A batch is built once: sent again after a lost reply,
  it carries the same request ids, one per call, so each call applies at most once.

Notice numbers are Redis's own: the claim's 'clear' notice gives the namespace's number
and history, and since no one else may write the namespace (``claim(mirror=...)``, see
``NamespaceMirrored``), Redis publishes exactly the notices the mirror numbers locally,
in the same order. So a stamp from ``register_mamba_stamped`` and the notices the hooks
get carry the numbers Redis will publish, and a slot pool stays correct whether it
hears them through the hook or through a listener.

Faults. Redis away: reads and writes go on locally; the queue holds at most
``max_queue`` writes, past that it is dropped and, once Redis answers, the namespace is
rewritten from the mirror in one fenced script (``lua/mirror_resync.lua``: one resync,
counted). Fenced (another claim, ``gc``, a lost ``meta``): the next flush gets
``StaleEpochError``, the mirror marks itself lost and every later call raises it, so a
zombie cannot go on serving. Thread-safe: one lock guards the local state and the queue.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from registry.core.base import RegistryBase
from registry.core.errors import (
    REDIS_ERRORS,
    RegistryError,
    RegistryUnavailable,
    StaleEpochError,
    translate,
)
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.core.notices import EvictionNotice, parse_notice
from registry.core.types import BlockHash, BlockId, BlockPair, NoticeKind
from registry.core.validation import flatten
from registry.namespace.ownership import DEFAULT_LEASE_TTL, Heartbeat, lease_seconds, owner_label
from registry.namespace.redis_registry import (
    DEFAULT_NOTICE_STREAM_MAXLEN,
    DEFAULT_REPLY_TTL,
    PrefixCacheRegistry,
)
from registry.transport.client import RedisClient
from registry.transport.scripts import (
    ScriptRunner,
    direct_pool,
    packed_commands,
    read_replies,
    run_batched,
    script_sha,
)

log = logging.getLogger(__name__)


DEFAULT_MAX_DELAY = 0.0002
"""Seconds the flusher waits after a write is queued for more to join its batch (when
Redis answers, the fleet sees a write within about this plus one round trip)."""

DEFAULT_MAX_BATCH = 1_000
"""Writes sent in one round trip at most."""

DEFAULT_MAX_QUEUE = 100_000
"""Writes queued at most while Redis is away; past that the backlog is dropped and the
namespace is rewritten from the mirror (one resync) once Redis answers."""

CALL_WRITES = 100
CALL_VALUES = 2_000
"""Bounds of one ``lua/mirror_apply.lua`` call, so that it holds the server briefly: at
most ``CALL_WRITES`` writes, and no write starts in a call that already carries
``CALL_VALUES`` values (hashes and block ids; a single larger write gets a call of its
own, as one script it always was). A batch is sent as several such calls in one round
trip. Measured here: a call of 100 single-block ``register_kv`` writes holds the server
about 0.2 ms; of 100 engine-cycle writes (8-block registrations, checkpoints, evictions
with their notices) about 0.7 ms."""

RETRY_MIN = 0.01
RETRY_MAX = 1.0
"""The flusher's backoff between tries while Redis is away (seconds, doubling)."""

IDLE_WAIT = 0.25
"""Seconds the idle flusher sleeps between checks that its registry still exists."""

Routed = tuple[str, tuple[Any, ...]]

MIRROR_OPTIONS = ("max_delay", "max_batch", "max_queue", "owner")
"""The keyword options of the mirror itself (``MirroredRegistry.from_url`` takes them
beside those of ``PrefixCacheRegistry.from_url``)."""


@dataclass(frozen=True)
class MirrorCounts:
    """What the write-behind has done so far, and how far behind it is now.

    ``flushed`` counts writes Redis applied (or answered for), ``batches`` the round
    trips that carried them, ``retries`` batches sent again after Redis was away,
    ``dropped`` writes dropped from a full queue (or queued while a resync was due;
    the resync covers them), ``resyncs`` namespace rewrites, ``errors`` writes Redis
    refused for another reason than fencing (each triggers a resync). ``queued`` is the
    backlog now and ``lag_s`` the age of its oldest write; ``last_lag_s`` is the
    queue-to-acknowledged time of the oldest write of the last batch."""

    queued: int
    flushed: int
    batches: int
    retries: int
    dropped: int
    resyncs: int
    errors: int
    lag_s: float
    last_lag_s: float
    lost: bool


_Entry = tuple[str, Any, float, int]
"""A queued write: (code, values, time queued, the mirror's notice number after it).
Codes as ``lua/mirror_apply.lua`` reads them: "k" register_kv and "m" register_mamba
(values: the hash -> block id dict), "e" evict_kv and "x" evict_mamba (values: the
hashes removed), "K" clear_kv, "M" clear_mamba, "R" reset."""


class _Batch:
    """Writes taken from the queue, with their commands built once: a batch sent again
    after a lost reply re-sends the same commands, request ids included, so each
    ``mirror_apply`` call in it applies at most once."""

    __slots__ = ("calls", "commands", "first_sent", "writes")

    def __init__(
        self, writes: list[_Entry], commands: list[Routed], calls: list[tuple[int, int]]
    ) -> None:
        self.writes = writes
        self.commands = commands
        self.calls = calls
        """Per ``mirror_apply`` call: (its position in ``commands``, the index in
        ``writes`` of its last write)."""
        self.first_sent: float | None = None


def build_batch(inner: PrefixCacheRegistry, writes: list[_Entry]) -> _Batch:
    """``writes`` as ``mirror_apply`` calls of at most ``CALL_WRITES`` writes and about
    ``CALL_VALUES`` values each (one request id per call), sent in one round trip."""
    sha = script_sha("mirror_apply")
    commands: list[Routed] = []
    calls: list[tuple[int, int]] = []
    start = 0
    while start < len(writes):
        values: list[Any] = []
        append = values.append
        stop = start
        while stop < len(writes) and stop - start < CALL_WRITES and len(values) < CALL_VALUES:
            code, data, _queued, _seq = writes[stop]
            append(code)
            append(len(data))
            if code in "km":
                for item in data.items():
                    values += item
            elif data:
                values += data
            stop += 1
        all_keys, args = inner._write_args("mirror_apply", inner._all_keys, True, values)
        calls.append((len(commands), stop - 1))
        commands.append((all_keys[0], ("EVALSHA", sha, len(all_keys), *all_keys, *args)))
        start = stop
    return _Batch(writes, commands, calls)


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
        return cls.wrap(PrefixCacheRegistry.from_url(url, namespace, **options), **mirror_options)

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
        if isinstance(max_delay, bool) or not isinstance(max_delay, (int, float)):
            raise TypeError("max_delay must be a number of seconds")
        if not 0 <= max_delay <= 10:
            raise ValueError(f"max_delay must lie between 0 and 10 s, not {max_delay}")
        for name, value, top in (
            ("max_batch", max_batch, 100_000),
            ("max_queue", max_queue, 10**8),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int")
            if not 1 <= value <= top:
                raise ValueError(f"{name} must lie between 1 and {top:,}, not {value}")
        self.inner = inner
        self.owner = owner_label(default_owner_label(inner.namespace) if owner is None else owner)
        self.max_delay = float(max_delay)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sending = threading.Lock()  # one batch in flight at a time, in order
        self._kv: dict[int, int] = {}
        self._mamba: dict[int, int] = {}
        self._seq = 0
        self._incarnation = ""
        self._queue: deque[_Entry] = deque()
        self._pending: _Batch | None = None  # a batch to send again, as built
        self._resync_due = False
        self._lost: StaleEpochError | None = None
        self._closed = False
        self._writes_ok = False  # claimed, not lost, not closed: the writes' fast check
        self._idle = False
        self._flushed = self._batches = self._retries = self._dropped = 0
        self._resyncs = self._errors = 0
        self._last_lag = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        runner = ScriptRunner(inner.client)
        self._runner = runner
        self._plain: Any = None  # the pool of a plain redis-py client, or False

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
        with self._sending:
            with self._lock:
                if self._closed:
                    raise RuntimeError("this MirroredRegistry is closed")
                self._queue.clear()
                self._pending = None
                self._resync_due = False
            heard: list[EvictionNotice] = []
            self.inner.add_eviction_hook(heard.append)
            try:
                epoch = self.inner.claim(lease_ttl, mirror=self.owner)
            finally:
                self.inner.remove_eviction_hook(heard.append)
            notice = heard[-1]
            with self._lock:
                self._queue.clear()  # a write of another thread during the claim
                self._pending = None
                self._resync_due = False
                self._kv.clear()
                self._mamba.clear()
                self._seq = notice.seq
                self._incarnation = notice.incarnation
                self._lost = None
                self._writes_ok = not self._closed
        self._notify(notice)
        self._start_flusher()
        return epoch

    def renew(self) -> float:
        """Extend the lease (``PrefixCacheRegistry.renew``); a fenced owner is marked lost."""
        self._check_lost()
        try:
            return self.inner.renew()
        except StaleEpochError as exc:
            self._mark_lost(exc)
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
        return self._lost is not None

    def _check_lost(self) -> None:
        lost = self._lost
        if lost is not None:
            raise StaleEpochError(
                self.namespace,
                lost.epoch,
                f"this mirrored owner was fenced and stopped serving ({lost})",
            )

    def _mark_lost(self, exc: StaleEpochError) -> None:
        with self._lock:
            if self._lost is None:
                log.error("mirrored owner of %r fenced: %s", self.namespace, exc)
            self._lost = exc
            self._writes_ok = False
            self._queue.clear()
            self._pending = None
            self._resync_due = False
            self._wake.notify_all()

    # -- local state: reads ---------------------------------------------------------------

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        with self._lock:
            if self._lost is not None:
                self._check_lost()
            kv = self._kv
            block_ids = []
            for h in hashes:
                block_id = kv.get(h)
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        with self._lock:
            if self._lost is not None:
                self._check_lost()
            mamba = self._mamba
            for i in range(len(hashes) - 1, -1, -1):
                if hashes[i] in mamba:
                    return i + 1
            return 0

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        with self._lock:
            self._check_lost()
            return [self._mamba.get(h) for h in hashes]

    def _notice_sequence(self) -> int:
        with self._lock:
            self._check_lost()
            return self._seq

    def notice_position(self) -> tuple[str, int]:
        """(incarnation, last notice number) as the mirror numbers them (Redis reaches
        the same once the queue is flushed)."""
        with self._lock:
            self._check_lost()
            return self._incarnation, self._seq

    def entries(self) -> tuple[dict[int, int], dict[int, int]]:
        """Copies of the mirror's KV and Mamba maps (``inner.entries()`` reads Redis)."""
        with self._lock:
            self._check_lost()
            return dict(self._kv), dict(self._mamba)

    def _view_map(self, kind: str) -> dict[int, int]:
        self._check_lost()
        return self._kv if kind == "kv" else self._mamba

    def _view_get(self, kind: str, h: int) -> int | None:
        with self._lock:
            return self._view_map(kind).get(h)

    def _view_contains(self, kind: str, h: int) -> bool:
        with self._lock:
            return h in self._view_map(kind)

    def _view_len(self, kind: str) -> int:
        with self._lock:
            return len(self._view_map(kind))

    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]:
        with self._lock:
            return iter(list(self._view_map(kind).items()))

    # -- local state: writes, each queued ---------------------------------------------------

    def _writable(self) -> PrefixCacheRegistry:
        """Under the lock: the inner registry, if this owner may write now."""
        self._check_lost()
        if self._closed:
            raise RuntimeError("this MirroredRegistry is closed")
        if self.inner.epoch is None:
            raise RuntimeError("a mirrored registry writes only as an owner: call claim() first")
        return self.inner

    def _notice(self, kind: NoticeKind, pairs: list[tuple[int, int]]) -> EvictionNotice:
        self._seq += 1
        listed = tuple(BlockPair(BlockId(b), BlockHash(h)) for b, h in pairs)
        return EvictionNotice(self._seq, kind, listed, self._incarnation)

    def _queue_write(self, code: str, data: Any = ()) -> None:
        """Under the lock: queue one write (the flusher builds its commands)."""
        if self._resync_due:  # the coming resync writes the whole mirror
            self._dropped += 1
            return
        queue = self._queue
        pending = self._pending
        if len(queue) + (len(pending.writes) if pending is not None else 0) >= self.max_queue:
            self._overflow()
            self._dropped += 1
            return
        queue.append((code, data, time.monotonic(), self._seq))
        if self._idle or len(queue) == self.max_batch:
            self._wake.notify()

    def _overflow(self) -> None:
        """Under the lock: drop the backlog; the mirror is written whole later."""
        self._dropped += len(self._queue)
        self._queue.clear()
        if self._pending is not None:
            self._dropped += len(self._pending.writes)
            self._pending = None
        if not self._resync_due:
            log.warning(
                "mirror of %r: queue full (%d writes), dropped; resync when Redis answers",
                self.namespace,
                self.max_queue,
            )
        self._resync_due = True

    def _register_kv(self, entries: dict[int, int]) -> None:
        with self._lock:
            if not self._writes_ok:
                self._writable()
            self._kv.update(entries)
            self._queue_write("k", entries)  # flattened by the flusher

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        with self._lock:
            if not self._writes_ok:
                self._writable()
            kv, mamba = self._kv, self._mamba
            gone = [h for h in hashes if kv.pop(h, None) is not None]
            if not gone:
                return set(), None
            notice = None
            if mamba:
                pairs = [(mamba.pop(h), h) for h in gone if h in mamba]
                if pairs:
                    notice = self._notice(NoticeKind.CASCADE, pairs)
            self._queue_write("e", gone)
            return set(gone), notice

    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        with self._lock:
            if not self._writes_ok:
                self._writable()
            mamba = self._mamba
            replaced = [(old, h) for h, new in entries.items() if (old := mamba.get(h, new)) != new]
            mamba.update(entries)
            notice = self._notice(NoticeKind.REPLACE, replaced) if replaced else None
            self._queue_write("m", entries)  # flattened by the flusher
            return notice, self._seq

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        with self._lock:
            if not self._writes_ok:
                self._writable()
            mamba = self._mamba
            pairs = [(mamba.pop(h), h) for h in hashes if h in mamba]
            if not pairs:
                return set(), None
            gone = [h for _, h in pairs]
            notice = self._notice(NoticeKind.EVICT, pairs)
            self._queue_write("x", gone)
            return set(gone), notice

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        with self._lock:
            if not self._writes_ok:
                self._writable()
            if kv:
                self._kv.clear()
            notice = None
            if mamba and self._mamba:
                self._mamba.clear()
                notice = self._notice(NoticeKind.CLEAR, [])
            self._queue_write("R" if kv and mamba else "K" if kv else "M")
            return notice

    # -- the write-behind -------------------------------------------------------------------

    def _start_flusher(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_flusher,
                args=(weakref.ref(self), self._stop),
                name=f"mirror-flusher[{self.namespace}]",
                daemon=True,
            )
            self._thread.start()

    def stop_flusher(self, timeout: float = 5.0) -> None:
        """Stop the flusher thread: writes then stay queued until ``flush()`` (or
        ``start_flusher()``). For tests and benchmarks that want the queue still."""
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def start_flusher(self) -> None:
        """Start the flusher thread again after ``stop_flusher()`` (``claim`` starts it)."""
        if self.inner.epoch is None:
            raise RuntimeError("start_flusher() needs an owner: call claim() first")
        self._start_flusher()

    def load_scripts(self) -> None:
        """Load every script now (SCRIPT LOAD), so the first flush needs no retry."""
        self.inner.load_scripts()

    def _wait_for_work(self) -> bool:
        """The flusher's wait: True when a batch is due (``max_delay`` after its oldest
        write, or ``max_batch`` writes, or a resync), False after an idle period."""
        with self._lock:
            if not self._queue and not self._resync_due and self._pending is None:
                self._idle = True
                self._wake.wait(IDLE_WAIT)
                self._idle = False
                if not self._queue and not self._resync_due and self._pending is None:
                    return False
            if self._lost is not None:
                return False
            while (
                self._queue
                and not self._resync_due
                and self._pending is None
                and len(self._queue) < self.max_batch
                and not self._stop.is_set()
            ):
                left = self._queue[0][2] + self.max_delay - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            return bool(self._queue) or self._resync_due or self._pending is not None

    def flush(self, timeout: float = 30.0) -> None:
        """Send every queued write now, in order, and wait until Redis applied them (a
        resync if one is due). Raises ``RegistryUnavailable`` when Redis does not answer
        within ``timeout`` seconds (the writes stay queued), ``StaleEpochError`` when
        this owner was fenced (it is lost from then on)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._sending:  # waits for a batch in flight
                with self._lock:
                    self._check_lost()
                    if not self._queue and not self._resync_due and self._pending is None:
                        return
                try:
                    self._send_next()
                    continue
                except RegistryUnavailable:
                    if time.monotonic() >= deadline:
                        raise
            time.sleep(RETRY_MIN)

    def _send_once(self) -> None:
        """The flusher's step: send the next batch (or the due resync)."""
        with self._sending:
            self._send_next()

    def _send_next(self) -> None:
        """Under ``_sending``: send the next batch (or the due resync) and account for it.
        Raises what Redis raised: ``RegistryUnavailable`` (the batch is kept, to be sent
        again as it was), ``StaleEpochError`` (lost), another ``RegistryError`` (a resync
        is then due)."""
        with self._lock:
            self._check_lost()
            if self._resync_due:
                self._resync_locked_then_send()
                return
            batch, self._pending = self._pending, None
            if batch is None:
                count = min(self.max_batch, len(self._queue))
                if not count:
                    return
                popleft = self._queue.popleft
                writes = [popleft() for _ in range(count)]
        if batch is None:
            batch = build_batch(self.inner, writes)  # outside the lock: the engine goes on
        self._send_batch(batch)

    def _send_batch(self, batch: _Batch) -> None:
        """Under ``_sending``: ``batch``'s round trip; on failure it is kept to be sent
        again first, from its first call (each answers for itself once applied), unless
        the queue was dropped meanwhile."""
        now = time.monotonic()
        if batch.first_sent is None:
            batch.first_sent = now
        elif now - batch.first_sent > self.inner.reply_ttl / 2:
            # Its reply records may expire before another copy lands: send no copy,
            # rewrite the namespace instead.
            with self._lock:
                self._dropped += len(batch.writes)
                self._overflow()
            return
        try:
            replies = self._run(functools.partial(iter, [batch.commands]))
        except RegistryError:
            self._requeue(batch)
            raise
        refused: RegistryError | None = None
        for position, last in batch.calls:
            reply = replies[position]
            if isinstance(reply, Exception):
                error = self._runner._error(
                    reply, "mirror_apply", "", True, self.namespace, self.inner.epoch
                )
                if isinstance(error, StaleEpochError):
                    self._mark_lost(error)
                    raise error
                refused = refused or error
                continue
            self._check_numbering(reply, batch.writes[last][3])
        done = time.monotonic()
        with self._lock:
            self._flushed += len(batch.writes)
            self._batches += 1
            self._last_lag = done - batch.writes[0][2]
            if refused is not None:
                self._errors += 1
                self._overflow()
        if refused is not None:
            log.warning(
                "mirror of %r: Redis refused a write (%s); resync due", self.namespace, refused
            )
            raise refused

    def _check_numbering(self, reply: Any, expected: int) -> None:
        """Warn when Redis's notice number after a call is not the mirror's (nothing
        else may write the namespace, so it never should be)."""
        try:
            seq = int(reply[1])
        except (TypeError, ValueError, IndexError):
            seq = None
        if seq != expected:
            log.warning(
                "mirror of %r: Redis numbers its notices at %s, the mirror at %d",
                self.namespace,
                seq,
                expected,
            )

    def _requeue(self, batch: _Batch) -> None:
        with self._lock:
            self._retries += 1
            if self._resync_due or self._lost is not None:
                self._dropped += len(batch.writes)
                return
            self._pending = batch
            if len(self._queue) + len(batch.writes) > self.max_queue:
                self._overflow()

    def _batched(self, chunks: Callable[[], Iterator[list[Routed]]]) -> list[Any]:
        """``run_batched`` of every chunk's commands, or on a standalone redis-py client
        the same batch on one connection, packed by hiredis, written at once and its
        replies read (several times less client time per write than a redis-py
        pipeline; one write and one read also keep the flusher from taking the engine's
        interpreter lock more often than it must)."""
        client = self.inner.client
        if self._plain is None:
            self._plain = _plain_connection_pool(client)
        pool = self._plain
        if not pool:
            return run_batched(client, [call for part in chunks() for call in part])
        commands = [command for part in chunks() for _, command in part]
        connection = pool.get_connection()
        healthy = False
        try:
            connection.send_packed_command(packed_commands(connection, commands))
            replies = read_replies(connection, len(commands))
            healthy = True
            return replies
        finally:
            if not healthy:
                connection.disconnect()  # a half-read connection must not be reused
            pool.release(connection)

    def _run(self, chunks: Callable[[], Iterator[list[Routed]]]) -> list[Any]:
        """One batch (one round trip per node) of the commands ``chunks()`` yields; a
        NOSCRIPT loads the scripts and sends the whole batch again (request ids make the
        re-sent copies no-ops)."""
        try:
            replies = self._batched(chunks)
            if any(isinstance(r, NoScriptError) for r in replies):
                self._runner.load()
                replies = self._batched(chunks)
        except REDIS_ERRORS as exc:
            error = translate(exc, f"namespace {self.namespace!r}: mirror flush", write=True)
            raise (error or exc) from exc
        return replies

    def _resync_locked_then_send(self) -> None:
        """Under ``_sending`` and the lock (released here): rewrite the namespace from a
        snapshot of the mirror. The notice numbers skip one (see the script)."""
        inner = self.inner
        kv, mamba = flatten(self._kv, ()), flatten(self._mamba, ())
        continue_from = self._seq + 1
        self._seq += 2  # the script publishes its clear as continue_from + 1
        self._dropped += len(self._queue)
        self._queue.clear()
        self._resync_due = False
        all_keys, args = inner._write_args(
            "mirror_resync",
            inner._all_keys,
            True,
            (str(continue_from), len(kv) // 2, *kv, *mamba),
        )
        self._lock.release()
        try:
            try:
                command = ("EVALSHA", script_sha("mirror_resync"), len(all_keys), *all_keys, *args)
                reply = self._run(lambda: iter([[(all_keys[0], command)]]))[0]
            except RegistryError:
                with self._lock:
                    self._retries += 1
                    self._overflow()
                raise
            if isinstance(reply, Exception):
                error = self._runner._error(
                    reply, "mirror_resync", "", True, self.namespace, inner.epoch
                )
                if isinstance(error, StaleEpochError):
                    self._mark_lost(error)
                else:
                    with self._lock:
                        self._errors += 1
                        self._overflow()
                raise error
            notice = parse_notice(reply)
            with self._lock:
                self._resyncs += 1
                self._batches += 1
                if notice.seq != continue_from + 1:
                    log.warning(
                        "mirror of %r: resync notice %d, expected %d",
                        self.namespace,
                        notice.seq,
                        continue_from + 1,
                    )
        finally:
            self._lock.acquire()

    def counts(self) -> MirrorCounts:
        """A snapshot of the write-behind's counters (``MirrorCounts``)."""
        with self._lock:
            pending = self._pending
            oldest = (
                pending.writes[0]
                if pending is not None
                else (self._queue[0] if self._queue else None)
            )
            lag = time.monotonic() - oldest[2] if oldest is not None else 0.0
            return MirrorCounts(
                queued=len(self._queue) + (len(pending.writes) if pending is not None else 0),
                flushed=self._flushed,
                batches=self._batches,
                retries=self._retries,
                dropped=self._dropped,
                resyncs=self._resyncs,
                errors=self._errors,
                lag_s=lag,
                last_lag_s=self._last_lag,
                lost=self._lost is not None,
            )

    # -- lifetime -----------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (within ``timeout``; a failure is logged), then stop the
        flusher. Later writes raise ``RuntimeError``; reads still answer."""
        if self._lost is None and self._thread is not None:
            try:
                self.flush(timeout)
            except RegistryError:
                log.warning(
                    "mirror of %r: closing with writes unflushed", self.namespace, exc_info=True
                )
        self._stop.set()
        with self._lock:
            self._closed = True
            self._writes_ok = False
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> MirroredRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plain_connection_pool(client: Any) -> Any:
    """The connection pool of a standalone redis-py client whose connections speak RESP
    on a socket (not a cluster, not fakeredis), or False."""
    pool = direct_pool(client)
    if pool is None:
        return False
    connection_class = getattr(pool, "connection_class", None)
    module = getattr(connection_class, "__module__", "")
    return pool if module == "redis.connection" else False


def _flusher(ref: weakref.ReferenceType[MirroredRegistry], stop: threading.Event) -> None:
    """The flusher thread: holds its registry weakly, so it ends once the registry is
    garbage (or ``close()`` stops it)."""
    backoff = RETRY_MIN
    while not stop.is_set():
        owner = ref()
        if owner is None or owner.lost:
            return  # gone, or fenced: every later call raises
        pause = 0.0
        try:
            if owner._wait_for_work() and not stop.is_set():
                owner._send_once()
            backoff = RETRY_MIN
        except StaleEpochError:
            return  # lost: every later call raises
        except RegistryError:
            pause, backoff = backoff, min(backoff * 2, RETRY_MAX)
        except Exception:
            log.exception("mirror flusher failed; retrying")
            pause, backoff = backoff, min(backoff * 2, RETRY_MAX)
        finally:
            del owner
        if pause:
            stop.wait(pause)
