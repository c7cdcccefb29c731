"""The mirror's bounded write queue and the write-behind's accounting.

``WriteQueue`` holds the writes not yet sent, the batch to send again as it was built,
whether a resync is due (the backlog was dropped: the mirror is rewritten whole), and
the counters ``MirrorCounts`` reports. It is guarded by the mirror's one lock (given
to it, shared with the local maps): every method but ``wait_for_work`` runs under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from registry.mirror.writes import Batch, Op, QueuedWrite

log = logging.getLogger(__name__)

_record = tuple.__new__

IDLE_WAIT = 0.25
"""Seconds the idle flusher sleeps between checks that its registry still exists."""


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


class WriteQueue:
    """The writes of one mirror waiting for Redis, in order, at most ``max_queue`` of
    them (past that the backlog is dropped and a resync is due), and the counters."""

    def __init__(
        self,
        namespace: str,
        lock: threading.Lock,
        *,
        max_delay: float,
        max_batch: int,
        max_queue: int,
    ) -> None:
        self.namespace = namespace
        self.max_delay = max_delay
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.wake = threading.Condition(lock)
        """Notified when a batch may be due, or the flusher must look again."""
        self.writes: deque[QueuedWrite] = deque()
        self.pending: Batch | None = None
        """A batch to send again first, as built (its reply was lost)."""
        self.resync_due = False
        self.idle = False
        """Whether the flusher waits with nothing to do (a write then wakes it)."""
        self.flushed = self.batches = self.retries = self.dropped = 0
        self.resyncs = self.errors = 0
        self.last_lag = 0.0

    # -- what the engine's writes do ----------------------------------------------------

    def put(self, op: Op, values: Any, seq: int) -> None:
        """Queue one write (the flusher builds its commands); ``seq`` is the mirror's
        notice number after it."""
        if self.resync_due:  # the coming resync writes the whole mirror
            self.dropped += 1
            return
        writes = self.writes
        pending = self.pending
        if len(writes) + (len(pending.writes) if pending is not None else 0) >= self.max_queue:
            self.overflow()
            self.dropped += 1
            return
        # The record built by tuple.__new__, skipping its Python-level __new__: every
        # write of the engine passes here.
        writes.append(_record(QueuedWrite, (op, values, time.monotonic(), seq)))
        if self.idle or len(writes) == self.max_batch:
            self.wake.notify()

    def overflow(self) -> None:
        """Drop the backlog; the mirror is written whole later (a resync is due)."""
        self.dropped += len(self.writes)
        self.writes.clear()
        if self.pending is not None:
            self.dropped += len(self.pending.writes)
            self.pending = None
        if not self.resync_due:
            log.warning(
                "mirror of %r: queue full (%d writes), dropped; resync when Redis answers",
                self.namespace,
                self.max_queue,
            )
        self.resync_due = True

    def discard(self) -> None:
        """Forget every write and a due resync (a new claim, or this owner was fenced)."""
        self.writes.clear()
        self.pending = None
        self.resync_due = False

    # -- what the flusher does ----------------------------------------------------------

    def has_work(self) -> bool:
        """Whether anything waits to be sent: writes, a batch to send again, a resync."""
        return bool(self.writes) or self.resync_due or self.pending is not None

    def wait_for_work(self, stop: threading.Event, lost: Callable[[], bool]) -> bool:
        """The flusher's wait (takes the lock): True when a batch is due (``max_delay``
        after its oldest write, or ``max_batch`` writes, or a resync), False after an
        idle period, once ``lost()``, or on ``stop``."""
        with self.wake:
            if not self.has_work():
                self.idle = True
                self.wake.wait(IDLE_WAIT)
                self.idle = False
                if not self.has_work():
                    return False
            if lost():
                return False
            writes = self.writes
            while (
                writes
                and not self.resync_due
                and self.pending is None
                and len(writes) < self.max_batch
                and not stop.is_set()
            ):
                left = writes[0].queued_at + self.max_delay - time.monotonic()
                if left <= 0:
                    break
                self.wake.wait(left)
            return self.has_work()

    def take(self) -> Batch | list[QueuedWrite] | None:
        """The next thing to send: the batch to send again, as built, else at most
        ``max_batch`` writes taken from the queue (to be built), else None."""
        batch, self.pending = self.pending, None
        if batch is not None:
            return batch
        count = min(self.max_batch, len(self.writes))
        if not count:
            return None
        popleft = self.writes.popleft
        return [popleft() for _ in range(count)]

    def drop_for_resync(self) -> None:
        """Drop what is queued: the resync now sent covers it (counted as dropped)."""
        self.dropped += len(self.writes)
        self.writes.clear()
        self.resync_due = False

    def requeue(self, batch: Batch, *, lost: bool) -> None:
        """``batch`` was not answered: keep it to be sent again first, as it was, unless
        a resync is due or this owner is lost (then it is dropped)."""
        self.retries += 1
        if self.resync_due or lost:
            self.dropped += len(batch.writes)
            return
        self.pending = batch
        if len(self.writes) + len(batch.writes) > self.max_queue:
            self.overflow()

    def expired(self, batch: Batch) -> None:
        """Drop ``batch``, unanswered too long to be sent again (its reply records may
        have expired): the namespace is rewritten instead (a resync is due)."""
        self.dropped += len(batch.writes)
        self.overflow()

    def acknowledged(self, batch: Batch, done: float, *, refused: bool) -> None:
        """Account for ``batch``, answered by Redis at ``done`` (monotonic seconds);
        ``refused``: some call of it was refused, so a resync is due."""
        self.flushed += len(batch.writes)
        self.batches += 1
        self.last_lag = done - batch.writes[0].queued_at
        if refused:
            self.errors += 1
            self.overflow()

    def resync_failed(self, *, answered: bool) -> None:
        """Account for a resync Redis did not answer (a retry) or refused (an error):
        another is due."""
        if answered:
            self.errors += 1
        else:
            self.retries += 1
        self.overflow()

    def resynced(self) -> None:
        """Account for a resync Redis applied (one round trip)."""
        self.resyncs += 1
        self.batches += 1

    def counts(self, *, lost: bool) -> MirrorCounts:
        """A snapshot of the counters and the backlog."""
        pending = self.pending
        oldest = (
            pending.writes[0] if pending is not None else (self.writes[0] if self.writes else None)
        )
        lag = time.monotonic() - oldest.queued_at if oldest is not None else 0.0
        return MirrorCounts(
            queued=len(self.writes) + (len(pending.writes) if pending is not None else 0),
            flushed=self.flushed,
            batches=self.batches,
            retries=self.retries,
            dropped=self.dropped,
            resyncs=self.resyncs,
            errors=self.errors,
            lag_s=lag,
            last_lag_s=self.last_lag,
            lost=lost,
        )
