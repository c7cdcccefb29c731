"""The write-behind: one mirror's queue sent to Redis in order, one batch in flight.

``WriteBehind`` takes the next run of queued writes (or the batch to send again, as it
was built, or the due resync), sends it in one round trip and accounts for the reply:
a lost reply keeps the batch to be sent again; a fenced owner is marked lost (every
later call raises); a write Redis refused for another reason makes a resync due. Both
the flusher thread and ``flush()`` send through it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from registry.core.errors import RegistryError, RegistryUnavailable, StaleEpochError
from registry.mirror.resync import Resync
from registry.mirror.state import OwnerState
from registry.mirror.wire import MirrorWire
from registry.mirror.write_queue import MirrorCounts, WriteQueue
from registry.mirror.writes import Batch, BatchEncoder
from registry.namespace.redis_registry import PrefixCacheRegistry

log = logging.getLogger(__name__)

RETRY_MIN = 0.01
RETRY_MAX = 1.0
"""The backoff between tries while Redis is away (seconds, doubling)."""


class WriteBehind:
    """Sends one mirror's ``queue`` to Redis through the wrapped registry's keys and
    request ids; ``sending`` keeps one batch in flight at a time, in order."""

    def __init__(self, inner: PrefixCacheRegistry, state: OwnerState, queue: WriteQueue) -> None:
        self.inner = inner
        self.state = state
        self.queue = queue
        self.encoder = BatchEncoder(inner)
        self.wire = MirrorWire(inner.client, inner.namespace)
        self.resync = Resync(inner, state, queue, self.encoder, self.wire)
        self.sending = threading.Lock()

    @property
    def lost(self) -> bool:
        """Whether this owner was fenced."""
        return self.state.lost is not None

    def mark_lost(self, exc: StaleEpochError) -> None:
        """This owner was fenced: every later call raises, the queue is forgotten."""
        with self.state.lock:
            self._lost_locked(exc)

    def _lost_locked(self, exc: StaleEpochError) -> None:
        state = self.state
        if state.lost is None:
            log.error("mirrored owner of %r fenced: %s", self.inner.namespace, exc)
        state.lost = exc
        state.writes_ok = False
        self.queue.discard()
        self.queue.wake.notify_all()

    def wait_for_work(self, stop: threading.Event) -> bool:
        """The flusher's wait (``WriteQueue.wait_for_work``): True when a batch is due."""
        state = self.state
        return self.queue.wait_for_work(stop, lambda: state.lost is not None)

    def counts(self) -> MirrorCounts:
        """A snapshot of the write-behind's counters (``MirrorCounts``)."""
        with self.state.lock:
            return self.queue.counts(lost=self.state.lost is not None)

    def flush(self, timeout: float) -> None:
        """Send every queued write now, in order, and wait until Redis applied them (a
        resync if one is due). Raises ``RegistryUnavailable`` when Redis does not answer
        within ``timeout`` seconds (the writes stay queued), ``StaleEpochError`` when
        this owner was fenced (it is lost from then on)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.sending:  # waits for a batch in flight
                with self.state.lock:
                    self.state.check_lost()
                    if not self.queue.has_work():
                        return
                try:
                    self._send_next()
                    continue
                except RegistryUnavailable:
                    if time.monotonic() >= deadline:
                        raise
            time.sleep(RETRY_MIN)

    def send_once(self) -> None:
        """The flusher's step: send the next batch (or the due resync)."""
        with self.sending:
            self._send_next()

    def _send_next(self) -> None:
        """Under ``sending``: send the next batch (or the due resync) and account for it.
        Raises what Redis raised: ``RegistryUnavailable`` (the batch is kept, to be sent
        again as it was), ``StaleEpochError`` (lost), another ``RegistryError`` (a resync
        is then due)."""
        with self.state.lock:
            self.state.check_lost()
            if self.queue.resync_due:
                try:
                    self.resync.send()
                except StaleEpochError as exc:
                    self._lost_locked(exc)
                    raise
                return
            taken = self.queue.take()
        if taken is None:
            return
        # Built outside the lock: the engine goes on.
        batch = taken if isinstance(taken, Batch) else self.encoder.batch(taken)
        self._send_batch(batch)

    def _send_batch(self, batch: Batch) -> None:
        """Under ``sending``: ``batch``'s round trip; on failure it is kept to be sent
        again first, from its first call (each answers for itself once applied), unless
        the queue was dropped meanwhile."""
        now = time.monotonic()
        if batch.first_sent is None:
            batch.first_sent = now
        elif now - batch.first_sent > self.inner.reply_ttl / 2:
            # Its reply records may expire before another copy lands: send no copy,
            # rewrite the namespace instead.
            with self.state.lock:
                self.queue.expired(batch)
            return
        try:
            replies = self.wire.run(batch.commands)
        except RegistryError:
            with self.state.lock:
                self.queue.requeue(batch, lost=self.state.lost is not None)
            raise
        refused: RegistryError | None = None
        for call in batch.calls:
            reply = replies[call.position]
            if isinstance(reply, Exception):
                error = self.wire.refusal(reply, "mirror_apply", self.inner.epoch)
                if isinstance(error, StaleEpochError):
                    self.mark_lost(error)
                    raise error
                refused = refused or error
                continue
            self._check_numbering(reply, batch.writes[call.last].seq)
        done = time.monotonic()
        with self.state.lock:
            self.queue.acknowledged(batch, done, refused=refused is not None)
        if refused is not None:
            log.warning(
                "mirror of %r: Redis refused a write (%s); resync due",
                self.inner.namespace,
                refused,
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
                self.inner.namespace,
                seq,
                expected,
            )
