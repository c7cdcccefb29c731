"""``EvictionListener``: frees a pool's slots when their Mamba entries leave Redis.

Pub/sub is a hint, not the truth: it drops messages while the subscriber is away.
So the listener

* subscribes first, then catches up (reconciles on its first start), so nothing
  published during start-up is lost;
* applies notices in sequence order; on a gap it replays the missing notices from the
  capped stream, or reconciles against the registry when the stream no longer has them;
* reconciles at once when a notice comes from a new incarnation of the namespace (its
  history restarted: ``meta`` was lost and notice numbers count anew);
* after every (re)subscription, which redis-py performs by itself after a dropped
  connection, and every ``resync_interval`` seconds, it reconciles: a restarted or
  failed-over server may have lost writes that no notice will ever report;
* skips and counts malformed messages.

It never frees blindly: the pool frees a slot only for the exact (block_id, hash) and
only if the notice is newer than the slot's registration.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from gpu import checks
from gpu.slot_pool import MambaSlotPool
from registry import EvictionNotice, PrefixCacheRegistry, parse_notice
from registry.core import observe
from registry.core.errors import RegistryUnavailable
from registry.core.keys import DEFAULT_KEY_PREFIX, validate_key_prefix, validate_namespace
from registry.core.validation import text
from registry.transport.client import bounded_options, client_from_url

log = logging.getLogger(__name__)

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError, RegistryUnavailable)
"""A lost or unreachable server, raw from pub/sub or mapped by a registry read."""


@dataclass(frozen=True)
class ListenerCounts:
    """What the listener has done since it was created."""

    applied: int  # notices applied in order from the channel
    duplicates: int  # notices already covered (seen before, or by a catch-up)
    gaps: int  # sequence gaps detected on the channel
    replays: int  # catch-ups served from the stream
    reconciles: int  # catch-ups that reconciled against the registry
    reconnects: int  # re-subscriptions after the first
    connection_losses: int  # pub/sub connections lost (each is followed by a reconnect)
    malformed: int  # channel messages that were not notices
    errors: int  # other failures in the loop (logged)
    last_seq: int  # the notice number everything up to which is applied
    restarts: int = 0  # new incarnations seen (the namespace's history restarted)


class EvictionListener:
    """A background thread applying a namespace's eviction notices to a slot pool."""

    def __init__(
        self,
        client_or_url: Any,
        namespace: str,
        pool: MambaSlotPool,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        poll_interval: float = 0.05,
        resync_interval: float = 30.0,
        max_backoff: float = 2.0,
    ) -> None:
        check_listener_arguments(
            client_or_url, namespace, pool, key_prefix, poll_interval, resync_interval, max_backoff
        )
        if isinstance(client_or_url, str):
            client = client_from_url(client_or_url, **bounded_options({}))
        else:
            client = client_or_url
        self._owns_client = isinstance(client_or_url, str)
        self.client = client
        self.registry = PrefixCacheRegistry(client, namespace, key_prefix=key_prefix)
        self.channel = self.registry.keys.mamba_evicted_channel
        self.pool = pool
        self.poll_interval = poll_interval
        self.resync_interval = resync_interval
        self.max_backoff = max_backoff
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_seq: int | None = None
        self._incarnation: str | None = None
        self._restarts = 0
        self._subscriptions = 0
        self._applied = self._duplicates = self._gaps = self._replays = 0
        self._reconciles = self._malformed = self._errors = self._connection_losses = 0

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> EvictionListener:
        """Start the thread; return once it is subscribed and caught up."""
        if self._thread is not None:
            raise RuntimeError("the listener was already started")
        self._thread = threading.Thread(
            target=self._run, name=f"eviction-listener[{self.registry.namespace}]", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the listener did not subscribe within {timeout} s")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("eviction listener did not stop within %.1f s", timeout)
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> EvictionListener:
        """Start (unless already started); ``__exit__`` stops."""
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def counts(self) -> ListenerCounts:
        with self._lock:
            return ListenerCounts(
                applied=self._applied,
                duplicates=self._duplicates,
                gaps=self._gaps,
                replays=self._replays,
                reconciles=self._reconciles,
                reconnects=max(0, self._subscriptions - 1),
                connection_losses=self._connection_losses,
                malformed=self._malformed,
                errors=self._errors,
                last_seq=self._last_seq or 0,
                restarts=self._restarts,
            )

    @property
    def incarnation(self) -> str:
        """The namespace's history that ``counts().last_seq`` counts in ("" before start)."""
        with self._lock:
            return self._incarnation or ""

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        pubsub: Any = None
        backoff = self.poll_interval
        next_resync = time.monotonic() + self.resync_interval
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.client.pubsub()
                    pubsub.subscribe(self.channel)
                message = pubsub.get_message(timeout=self.poll_interval)
                if message is not None:
                    kind = text(message["type"])
                    if kind == "subscribe":
                        with self._lock:
                            self._subscriptions += 1
                        self._catch_up(reconcile=True)
                        self._ready.set()
                        backoff = self.poll_interval
                    elif kind == "message":
                        self._handle(message["data"])
                if self._ready.is_set() and time.monotonic() >= next_resync:
                    next_resync = time.monotonic() + self.resync_interval
                    self._catch_up(reconcile=True)
            except Exception as exc:
                lost = isinstance(exc, CONNECTION_ERRORS)
                if lost:
                    log.info("eviction listener lost its connection (%s)", type(exc).__name__)
                else:
                    log.exception("eviction listener error")
                with self._lock:
                    if lost:
                        self._connection_losses += 1
                    else:
                        self._errors += 1
                _close(pubsub)  # start over: a new connection, subscription and catch-up
                pubsub = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                if lost:
                    self._refresh_cluster_map()
        _close(pubsub)

    def _refresh_cluster_map(self) -> None:
        """On Redis Cluster, re-read which node owns which slot: the channel's node may
        have failed over, and a pub/sub connection never learns that by itself."""
        nodes_manager = getattr(self.client, "nodes_manager", None)
        if nodes_manager is None:
            return
        try:
            nodes_manager.initialize()
        except Exception:  # the cluster is still electing; try again after the next wait
            log.debug("cluster map refresh failed", exc_info=True)

    def _handle(self, data: Any) -> None:
        try:
            notice = parse_notice(data)
        except ValueError as exc:
            log.warning("skipping a malformed message on %s: %s", self.channel, exc)
            with self._lock:
                self._malformed += 1
            return
        if (
            self._incarnation is not None
            and notice.incarnation
            and notice.incarnation != self._incarnation
        ):
            self._catch_up(reconcile=True)  # a restarted history: numbers do not compare
            return
        last = self._last_seq
        if last is not None and notice.seq <= last:
            with self._lock:
                self._duplicates += 1
            return
        if last is not None and notice.seq == last + 1:
            self.pool.apply_notice(notice)
            _freed(notice)
            with self._lock:
                self._applied += 1
                self._last_seq = notice.seq
            return
        with self._lock:
            self._gaps += 1
        self._catch_up()

    def _catch_up(self, *, reconcile: bool = False) -> None:
        """Bring the pool up to the registry's latest notice: replay the notices after
        the last applied one from the stream, or reconcile when that is impossible or
        asked for (after a reconnect, and periodically: a failover can lose writes that
        no notice will ever report, so only a comparison with the registry finds them)."""
        incarnation, newest = self.registry.notice_position()
        last = self._last_seq
        replay: list[EvictionNotice] | None = None
        same_history = incarnation == self._incarnation
        if last is not None and same_history and newest >= last and not reconcile:
            replay = self.registry.notices_after(last, incarnation=incarnation)
        if replay is None:
            # First start, a new incarnation, or a trimmed stream: compare with the truth.
            # The registry is read after ``newest``, so it reflects every notice <= newest.
            self.pool.reconcile(self.registry)
            with self._lock:
                if self._incarnation and not same_history:  # "": no history had begun
                    self._restarts += 1
                self._reconciles += 1
                self._last_seq = newest
                self._incarnation = incarnation
            return
        for notice in replay:
            self.pool.apply_notice(notice)
            _freed(notice)
        with self._lock:
            if replay:
                self._replays += 1
                self._last_seq = replay[-1].seq


def check_listener_arguments(
    client_or_url: object,
    namespace: object,
    pool: object,
    key_prefix: object,
    poll_interval: object,
    resync_interval: object,
    max_backoff: object,
) -> None:
    """``EvictionListener``'s arguments, checked before it creates a client.

    The pool must be one whose registry is the same namespace: a listener on another
    namespace would free the pool's slots because of another node's evictions.
    """
    if not isinstance(client_or_url, str) and not callable(getattr(client_or_url, "pubsub", None)):
        raise TypeError(
            f"client_or_url must be a Redis URL or a redis-py client, "
            f"not {type(client_or_url).__name__}"
        )
    validate_namespace(namespace)
    validate_key_prefix(key_prefix)
    if not isinstance(pool, MambaSlotPool):
        raise TypeError(f"pool must be a MambaSlotPool, not {type(pool).__name__}")
    registry: Any = pool.registry
    if isinstance(registry, PrefixCacheRegistry) and (
        registry.keys.namespace != namespace or registry.keys.key_prefix != key_prefix
    ):
        raise ValueError(
            f"pool belongs to namespace {registry.keys.namespace!r} (key prefix "
            f"{registry.keys.key_prefix!r}), not {namespace!r} (key prefix {key_prefix!r})"
        )
    checks.seconds(poll_interval, "poll_interval")
    checks.seconds(resync_interval, "resync_interval", infinite=True)
    checks.seconds(max_backoff, "max_backoff")


def _freed(notice: EvictionNotice) -> None:
    """Publish the publish-to-free time of an applied notice when an observer listens
    (``registry.core.observe``): this host's clock against the server's publish time (so
    their skew is part of it)."""
    observer = observe.current
    if observer is not None and notice.published_ms is not None:
        observer.listener_lag(max(0.0, time.time() - notice.published_ms / 1000))


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            pubsub.close()
        except Exception:  # the connection is already gone
            log.debug("closing a broken pubsub failed", exc_info=True)
