"""One engine's follower (:class:`Follower`): the state machine between an engine's
KV-event stream and its namespace. Transport-free: the bridge hands it messages, a
replay function and clock ticks; ``registry.bridge.bridge`` owns the sockets.

It composes what it keeps: where the stream stands (``EngineSequence``), the own hash
chain (``HashChain``), the batch waiting for its ``bridge_apply`` call
(``PendingWrite``) and the lease schedule (``Liveness``); what it decides itself is
what a gap, a restart, a lost namespace or a Redis fault does to them.

Two restarts differ in what the engine still holds. An engine that restarted (its seq
went back, or its replay no longer holds the batch applied last), a gap no replay
reaches back to, or an internal error: the namespace restarts empty and the chain's
picture of the engine (``registry.bridge.picture``) is dropped with it. A namespace
Redis lost while the engine kept its cache (Redis restarted empty, the namespace
collected, or an older copy of it restored): the namespace is claimed again and written
again from the picture, parents first, in writes of at most ``MAX_BLOCKS_PER_WRITE``
blocks, and the engine's URL is announced again, so routing by prefix resumes at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from registry.bridge.bounds import (
    DEFAULT_MAX_EVENT_BLOCKS,
    DEFAULT_MAX_QUEUE_BYTES,
    Backlog,
    pieces,
)
from registry.bridge.bridge_events import BadEvent, EventBatch, decode_batch, split_frames
from registry.bridge.chain import HashChain
from registry.bridge.counts import FollowerCounts, OnceLog
from registry.bridge.liveness import RETRY_DELAY, Liveness
from registry.bridge.sequence import (
    SEQ_LIMIT,
    EngineSequence,
    Frames,
    Replayed,
    Replayer,
    as_messages,
    contiguous,
)
from registry.bridge.source import EngineSource
from registry.bridge.writes import MAX_BLOCKS_PER_WRITE, PendingWrite, without_stores
from registry.core.errors import (
    RegistryError,
    RegistryQuotaExceeded,
    RegistryUnavailable,
    StaleEpochError,
    translate,
)
from registry.core.validation import text
from registry.fleet.membership import NodeIndex
from registry.namespace.ownership import DEFAULT_LEASE_TTL
from registry.namespace.redis_registry import PrefixCacheRegistry

# One logger for the whole bridge: its name is what operators configure (and what
# ``pcr simulate`` filters the expected gap warnings on).
log = logging.getLogger("registry.bridge.bridge")

DEFAULT_SILENCE_TIMEOUT = 30.0


@dataclass
class _InParts:
    """A batch being hashed and written piece by piece (``registry.bridge.bounds``)."""

    seq: int
    payload: bytes
    pieces: deque[EventBatch]


class _Blocked(Exception):
    """Redis refused or did not answer: keep everything and try again later."""


def _registry_error(blocked: _Blocked) -> RegistryError:
    """The registry error behind ``blocked``, for callers that expect one."""
    cause = blocked.__cause__
    if isinstance(cause, RegistryError):
        return cause
    return RegistryUnavailable(f"Redis unavailable: {cause}")


class Follower:
    """One engine's state machine: sequence, hashing, writes and lease. Transport-free:
    the bridge hands it messages (``offer``), a replay function and clock ticks."""

    def __init__(
        self,
        registry: PrefixCacheRegistry,
        source: EngineSource,
        *,
        replay: Replayer | None = None,
        probe: Replayer | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        silence_timeout: float = DEFAULT_SILENCE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        max_event_blocks: int = DEFAULT_MAX_EVENT_BLOCKS,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
    ) -> None:
        self.registry = registry
        self.source = source
        self.replay = replay if source.replay_endpoint is not None else None
        # Probes may wait less for an answer than gap replays (default: the same call).
        self.probe = (probe or replay) if source.replay_endpoint is not None else None
        self.liveness = Liveness(lease_ttl, silence_timeout, clock)
        self.clock = clock
        self.counts = FollowerCounts()
        self.log = OnceLog(log, f"bridge[{source.namespace} <- {source.endpoint}]")
        self.sequence = EngineSequence()
        self.chain = HashChain(registry, source, self.counts, self.log.once)
        self.pending = PendingWrite(registry, source, self.counts)
        self.max_event_blocks = max_event_blocks
        self.backlog = Backlog(max_queue_bytes)
        self.in_parts: _InParts | None = None  # a large batch being written piece by piece
        self.dropping = False  # the backlog is dropping messages (logged once per episode)
        self.blocked_until = 0.0
        self.restart_due: str | None = None
        self.rewrite_due = False  # the restart due writes the picture again
        self.stopped = False
        self.started = False

    @property
    def lease_ttl(self) -> float:
        """The lease this follower holds the namespace by, in seconds."""
        return self.liveness.lease_ttl

    @property
    def busy(self) -> bool:
        """Whether messages or pieces of a batch wait to be applied (and Redis is not
        being waited for): the transport gives it another turn at once."""
        return bool(self.backlog or self.in_parts) and not self.blocked

    @property
    def blocked(self) -> bool:
        """Whether writes are waiting for Redis (the transport stops reading)."""
        return self.blocked_until > 0.0 or self.stopped

    # -- start: resume what a previous bridge left, or claim afresh ------------------------

    def start(self) -> None:
        """Take over the namespace: resume it when it is still a live bridged namespace
        of this endpoint, else claim it (empty). Raises registry errors; once it has
        taken the namespace over, Redis faults only block (``tick`` retries)."""
        if not self._resume():
            self._claim()
            try:
                self._write([], None)  # record the engine and endpoint for pcr stats
            except _Blocked as exc:
                raise _registry_error(exc) from None
        self._announce()
        self.started = True
        self.liveness.renewed(self.clock())
        if self.replay is not None:
            try:
                replayed = self._recover(self.sequence.next_seq(), initial=True)
            except _Blocked:  # a restart is due: tick() retries it
                self.blocked_until = self.clock() + RETRY_DELAY
                return
            self.backlog.put_back(replayed)
            self._drain()

    def _resume(self) -> bool:
        """Resume the namespace where a previous bridge of this endpoint left it, when
        it is still live and hashed with this block size; False when it is not."""
        lease_ms = max(1, round(self.lease_ttl * 1000))
        reply = self.registry.run_write(
            "bridge_resume",
            (self.registry.keys.meta,),
            False,
            (lease_ms, self.source.endpoint),
            fence="",
        )
        if not reply:
            return False
        size = self.chain.block_size
        if size is not None and text(reply[3]) not in ("", str(size)):
            # Its entries were hashed with another block size: no router would find them.
            log.warning(
                "%s: the namespace was bridged with block size %s, not %d: starting it afresh",
                self.log.name, text(reply[3]), size,
            )  # fmt: skip
            return False
        epoch, lease_until, seq, block_size = (text(v) for v in reply)
        self.registry.adopt_epoch(int(epoch))
        self.registry.lease_ttl = self.lease_ttl
        self.registry.announce(int(lease_until))  # the lease, in the node index
        self.sequence.last = int(seq) if seq else None
        self._resume_part(seq)
        if size is None and block_size:
            self.chain.block_size = int(block_size)
        self.counts.resumed += 1
        self._picture_from_redis()
        log.info("%s: resumed after engine seq %s", self.log.name, seq or "(none)")
        return True

    def _resume_part(self, seq: str) -> None:
        """A batch the previous bridge wrote in part (it stopped in the middle): applied
        again from the replay, without the blocks written already."""
        if not seq:
            return
        try:
            part = self.registry.client.hget(self.registry.keys.meta, "bridge_part")
        except Exception as exc:
            error = translate(exc, f"namespace {self.source.namespace!r}: bridge_part")
            if error is None:
                raise
            raise error from exc
        if part is not None and int(seq) > 0:
            self.sequence.last = int(seq) - 1
            self.pending.resume_after(int(seq), int(text(part)))
            log.info("%s: resuming inside engine seq %s (%s blocks written)",
                     self.log.name, seq, text(part))  # fmt: skip

    def _picture_from_redis(self) -> None:
        """A resumed namespace's ``engine-blocks`` as the picture of the engine: what the
        previous bridge wrote is what the engine held at the seq it resumes after; the
        slots holding Mamba state there name the engine's Mamba groups."""
        picture = self.chain.picture
        picture.clear()
        key = self.registry.keys.engine_blocks
        try:
            for field, value in self.registry.client.hscan_iter(key, count=1000):
                if not picture.load_entry(int(field), text(value)):
                    self.counts.unpictured += 1
            self.chain.learn_slots(picture.mamba_slots())
        except ValueError:
            picture.clear()
            self.log.once("picture", "engine-blocks holds a malformed entry; no picture kept")
        except Exception as exc:
            error = translate(exc, f"namespace {self.source.namespace!r}: engine-blocks")
            if error is None:
                raise
            raise error from exc

    def _announce(self) -> None:
        """Say which engine serves the namespace (``--engine-url``), for gateways."""
        if self.source.engine_url is not None:
            NodeIndex(self.registry.client, self.registry.keys.key_prefix).announce_engine(
                self.source.namespace, self.source.engine_url
            )

    def _claim(self) -> None:
        self.registry.claim(self.lease_ttl)
        self.sequence.last = None  # the window stays: the subscription may still deliver copies
        self.pending.clear()
        self.pending.skip = None
        self.chain.forget()

    # -- messages -------------------------------------------------------------------------

    def offer(self, messages: Iterable[Frames]) -> None:
        """Queue published messages and apply what can be applied now."""
        self.receive(messages)
        self._drain()

    def receive(self, messages: Iterable[Frames]) -> None:
        """Queue published messages (without applying them). What does not fit in the
        backlog's bytes is dropped, counted and logged; the engine's next message then
        shows the gap, which is resynced as any other."""
        dropped = 0
        for frames in messages:
            self.liveness.heard()
            if self.backlog.put(frames):
                continue
            dropped += 1
            self.counts.dropped_messages += 1
            self.counts.dropped_bytes += sum(len(f) for f in frames)
        if dropped and not self.dropping:
            log.warning(
                "%s: queue full (%d bytes waiting, max %d): dropping messages; the gap is "
                "resynced", self.log.name, self.backlog.bytes, self.backlog.max_bytes,
            )  # fmt: skip
        self.dropping = bool(dropped) or (self.dropping and bool(self.backlog))

    def work(self, budget: float | None = None) -> None:
        """Apply what waits, for about ``budget`` seconds at most (None: all of it);
        what is left waits for the next call. Nothing while blocked (``tick`` retries)."""
        if not self.blocked:
            self._drain(budget)

    def _drain(self, budget: float | None = None) -> None:
        if self.stopped:
            return
        deadline = None if budget is None else self.clock() + budget
        try:
            if self.restart_due is not None:
                rewrite = self.rewrite_due
                self._restart(self.restart_due, rewrite=rewrite)
                if self.replay is not None and not rewrite:  # what the replay still has
                    self.backlog.put_back(self._recover(0, initial=True))
            while self.backlog or self.in_parts:
                if self.pending.full:
                    self._flush()
                if deadline is not None and self.clock() >= deadline:
                    break
                if self.in_parts is not None:
                    self._next_piece(self.in_parts)
                    continue
                frames = self.backlog.take()
                try:
                    self._process(frames)
                except _Blocked:
                    self.backlog.put_back([frames])
                    raise
            self._flush()
            self.blocked_until = 0.0
        except _Blocked:
            self.blocked_until = self.clock() + RETRY_DELAY

    def _process(self, frames: Frames) -> None:
        """Apply one message, or deal with its sequence number first (may raise
        ``_Blocked``; then nothing of it was applied)."""
        try:
            _, seq, payload = split_frames(frames)
        except BadEvent as exc:
            self._bad("frames", exc)
            return
        sequence = self.sequence
        last = sequence.last
        if sequence.is_copy(seq, payload):
            self.counts.duplicates += 1
            return
        try:
            batch = decode_batch(payload, self.max_event_blocks)
        except BadEvent as exc:
            self.counts.messages += 1
            self._bad("payload", exc)
            if last is not None and seq == last + 1:
                self._advance(seq, payload)
            return
        if last is not None and seq != last + 1:
            self._flush()
            replayed = self._out_of_sequence(seq, last)
            if replayed:  # apply them first, then this message again
                self.backlog.put_back([*replayed, frames])
                return
        sequence.passed(seq)
        self.counts.messages += 1
        if batch.refused:
            self.counts.refused_events += batch.refused
            self.counts.refused_blocks += batch.refused_blocks
            log.warning(
                "%s: engine seq %d: %d events listing more than %d blocks refused "
                "(%d blocks; see --max-event-blocks)",
                self.log.name, seq, batch.refused, self.max_event_blocks, batch.refused_blocks,
            )  # fmt: skip
        parts = pieces(batch, MAX_BLOCKS_PER_WRITE)
        if len(parts) > 1:  # hashed and written piece by piece, between other work
            self.in_parts = _InParts(seq, payload, deque(parts))
            return
        ops, blocks = self._operations(batch)
        self.pending.add(ops, blocks, seq)
        self._advance(seq, payload)
        self.counts.batches += 1

    def _next_piece(self, batch: _InParts) -> None:
        """Hash and queue the next piece of a batch written in parts (may raise
        ``_Blocked``; then the piece waits)."""
        ops, blocks = self._operations(batch.pieces[0])
        batch.pieces.popleft()
        whole = not batch.pieces
        self.pending.add(ops, blocks, batch.seq, whole=whole)
        if whole:
            self.in_parts = None
            self._advance(batch.seq, batch.payload)
            self.counts.batches += 1

    def _out_of_sequence(self, seq: int, last: int) -> list[Frames]:
        """A gap after ``last`` (the replay brings what is missing) or a seq that went
        back (the engine restarted: the namespace restarts); the replayed messages."""
        if seq > last + 1:
            log.warning("%s: gap: engine seq %d follows %d", self.log.name, seq, last)
            replayed = self._recover(last + 1)
            self.counts.gaps += 1
            return replayed
        log.warning(
            "%s: engine seq went back from %d to %d: the engine restarted", self.log.name, last, seq
        )
        self._restart(f"the engine restarted (seq {last} -> {seq})")
        self.counts.engine_restarts += 1
        self.sequence.forget_engine()
        return self._recover(0, initial=True) if seq > 0 else []

    def _advance(self, seq: int, payload: bytes) -> None:
        self.sequence.advance(seq, payload)
        self.pending.seq = seq
        self.pending.part = None

    def _recover(self, start: int, *, initial: bool = False) -> list[Frames]:
        """The replayed messages from ``start`` on, to apply before anything newer. A
        gap the replay cannot reach back to restarts the namespace first; so does, at
        ``initial`` (a start or an engine restart), a replay that begins after ``start``
        on a namespace that already holds entries."""
        batches = None
        if self.replay is not None:
            self.counts.replays += 1
            batches = self.replay(start)
            if batches is None:
                self.counts.replay_failures += 1
            else:
                self.liveness.heard()
        run = contiguous(batches or [])
        covers = bool(run) and run[0][0] == start
        if not covers and (not initial or (self.sequence.last is not None and run)):
            self._restart(
                f"no replay reaches back to seq {start}"
                + (f" (it starts at {run[0][0]})" if run else "")
            )
        if not run:
            return []
        if self.sequence.last is None:
            self.sequence.last = run[0][0] - 1
        return self._replayed(run)

    def _replayed(self, run: Replayed) -> list[Frames]:
        """The messages of a replay, remembered so that the subscription's copies of
        them count as duplicates."""
        self.sequence.remember(run)
        return as_messages(self.source.topic, run)

    def _restart(self, reason: str, *, rewrite: bool = False) -> None:
        """Claim the namespace afresh: it restarts empty, or with ``rewrite`` (Redis
        lost it, the engine did not lose its cache) holding what the picture says the
        engine holds; the engine is announced again (may raise ``_Blocked``)."""
        self.restart_due, self.rewrite_due = reason, rewrite
        if not rewrite:
            self.chain.picture.clear()
        try:
            self._claim()
            self._write([], None)
            blocks = self._rewrite() if rewrite else 0
            self._announce()
        except StaleEpochError:  # claims are not fenced; kept for completeness
            raise _Blocked() from None
        except RegistryError as exc:
            self._redis_error(exc)
        self.restart_due, self.rewrite_due = None, False
        self.counts.restarts += 1
        if rewrite:
            log.warning(
                "%s: namespace claimed again and written from the engine's picture "
                "(%d blocks): %s",
                self.log.name, blocks, reason,
            )  # fmt: skip
        else:
            log.warning("%s: namespace restarted empty: %s", self.log.name, reason)

    def _rewrite(self) -> int:
        """Write the picture into the freshly claimed namespace, parents first, in writes
        of at most ``MAX_BLOCKS_PER_WRITE`` blocks; the blocks written. The operations
        waiting to be written are dropped, their effect being in the picture already
        (their seq stays, for the next write to record). Raises registry errors."""
        blocks = 0
        chain = self.chain
        writes = chain.picture.rewrite()
        for ops, n in writes:
            try:
                self.pending.apply(ops, None, chain.block_size, chain.group_operation())
            except RegistryQuotaExceeded as exc:  # parents first: the deepest blocks left out
                self._quota_refused(exc, n + sum(left for _, left in writes))
                break
            blocks += n
        self.pending.ops, self.pending.blocks = [], 0
        self.pending.queued.clear()
        self.counts.rewrites += 1
        self.counts.rewritten_blocks += blocks
        return blocks

    # -- writes ------------------------------------------------------------------------------

    def _operations(self, batch: EventBatch) -> tuple[list[Any], int]:
        """The ``bridge_apply`` operations of one decoded batch and their blocks (may
        raise ``_Blocked`` while fetching parent digests)."""
        try:
            return self.chain.operations(batch)
        except RegistryError as exc:
            self._redis_error(exc)

    def _flush(self) -> None:
        """Write every call that waits, oldest first (each one leaves the queue once
        written: a fault resends only what did not get through)."""
        pending = self.pending
        if pending.empty:
            return
        while pending.queued:
            call = pending.queued[0]
            self._write(call.ops, call.seq, call.part)
            if pending.queued and pending.queued[0] is call:
                pending.queued.popleft()
        if pending.ops or pending.seq is not None:
            self._write(pending.ops, pending.seq, pending.part)
        pending.clear()
        self.chain.trim()

    def _write(self, ops: Sequence[Any], seq: int | None, part: int | None = None) -> None:
        """One ``bridge_apply`` call; Redis faults block, a lost namespace restarts it, a
        call over the namespace's entry quota is written without its stores."""
        try:
            self.pending.apply(ops, seq, self.chain.block_size, self.chain.group_operation(), part)
            if "quota" in self.log:
                self.log.again("quota")  # a call fitted again: say so next time it does not
        except RegistryQuotaExceeded as exc:
            kept, dropped = without_stores(ops)
            if not dropped:  # a call that stores nothing adds nothing: not the quota's
                self._redis_error(exc)
            self._quota_refused(exc, dropped)
            self._write(kept, seq, part)
        except StaleEpochError as exc:
            self._lost(exc)
            # The namespace was written again from the picture, which holds what these
            # operations did already (and the calls queued after them, now dropped):
            # only their seq is left to record.
            self._write([], seq, part)
            if seq is not None and part is None:
                self.sequence.last = seq
        except RegistryError as exc:
            self._redis_error(exc)

    def _lost(self, exc: StaleEpochError) -> None:
        """This bridge's epoch is no longer the namespace's: if the namespace is gone
        (gc, an emptied server) or holds an older epoch than this bridge's (Redis came
        back from an older snapshot), claim it again and write what the engine holds;
        if another process owns it (a newer epoch), stop."""
        try:
            current = self.registry.client.hget(self.registry.keys.meta, "epoch")
        except Exception as error:
            raise _Blocked() from error
        if current is not None and not self._older(text(current)):
            self.counts.superseded += 1
            self.stopped = True
            log.error(
                "%s: another process owns the namespace now; this follower stops: %s",
                self.log.name,
                exc,
            )
            raise _Blocked() from exc
        self._restart(
            "Redis lost the namespace (emptied, collected or restored from an older copy)",
            rewrite=True,
        )

    def _older(self, epoch: str) -> bool:
        """Whether ``epoch`` (the namespace's, as Redis holds it) was taken before this
        follower's own: epochs grow with the server clock, so a namespace holding an
        older one came back from a snapshot taken before this follower's claim."""
        own = self.registry.epoch
        return own is not None and epoch.isdigit() and int(epoch) < own

    def _quota_refused(self, exc: RegistryQuotaExceeded, blocks: int) -> None:
        """The namespace's entry quota refused a call (nothing of it applied): its
        ``blocks`` stored blocks are dropped, counted and logged with the namespace once
        per episode. The engine keeps them, and the picture with it: Redis lists fewer
        blocks than the engine holds, which routing tolerates (its prefixes end sooner)."""
        self.counts.quota_refusals += 1
        self.counts.quota_refused_blocks += blocks
        self.log.once(
            "quota",
            f"{exc}; blocks stored past the quota are dropped and counted "
            "(quota_refused_blocks), removals still written",
            warning=True,
        )

    def _redis_error(self, exc: RegistryError) -> NoReturn:
        self.counts.redis_errors += 1
        self.log.once(f"redis:{type(exc).__name__}", f"Redis: {exc}; retrying", warning=True)
        raise _Blocked() from exc

    # -- time: retries, lease, probes --------------------------------------------------------

    def tick(self) -> None:
        """Retry blocked writes, renew the lease while the engine is heard, probe a quiet
        engine through its replay socket."""
        if self.stopped or not self.started:
            return
        now = self.clock()
        if self.blocked_until and now >= self.blocked_until:
            self._drain()
            if self.blocked:
                return
        liveness = self.liveness
        quiet = liveness.quiet(now)
        if self.probe is not None and liveness.probe_due(now):
            try:
                self._probe()
            except _Blocked:
                self.blocked_until = self.clock() + RETRY_DELAY
                return
            quiet = liveness.quiet(self.clock())
        if liveness.silent(quiet):
            if "silent" not in self.log:
                self.counts.silent += 1
                self.log.once(
                    "silent", f"engine silent for {quiet:.0f} s; the lease runs out", warning=True
                )
            return
        self.log.again("silent")
        if liveness.renewal_due(now) and not self.blocked:
            self._renew(now)

    def _renew(self, now: float) -> None:
        try:
            self.registry.renew()
            self.counts.renewals += 1
            self.liveness.renewed(now)
            self._announce()  # again: a Redis that lost the engine table alone learns it
        except StaleEpochError as exc:
            try:
                self._lost(exc)
            except _Blocked:
                if not self.stopped:
                    self.blocked_until = self.clock() + RETRY_DELAY
        except RegistryError as exc:
            self.counts.redis_errors += 1
            self.log.once(f"renew:{type(exc).__name__}", f"lease renewal failed: {exc}")
            self.liveness.renewal_failed(now)

    def _probe(self) -> None:
        """Ask a quiet engine's replay socket for its batches from the last one applied
        on: the answer proves it is alive, brings what the subscription lost, and shows
        a restart the engine has not spoken of yet (its replay no longer holds that
        batch: the namespace restarts and takes what the new process published)."""
        self.counts.probes += 1
        sequence = self.sequence
        last = sequence.last
        start = SEQ_LIMIT // 2 - 1 if last is None else last
        batches = self.probe(start) if self.probe is not None else None
        self.liveness.probed(batches is not None)
        if batches is None:
            return
        run = contiguous(batches)
        if last is not None:
            if sequence.replay_shows_restart(run):
                self._quiet_restart(last)
                return
            if run[0][0] == last:
                run = run[1:]  # the batch applied last: the same engine
        if run and run[0][0] == sequence.next_seq():  # published, and the subscription lost it
            self.offer(self._replayed(run))
        elif run:  # a gap the replay does not reach back to: handled as one
            self.offer(as_messages(self.source.topic, run))

    def _quiet_restart(self, last: int) -> None:
        """The engine's replay no longer holds batch ``last`` (or holds another one under
        that seq): a new process. Restart the namespace and take what it published."""
        log.warning(
            "%s: the engine's replay no longer holds seq %d: the engine restarted",
            self.log.name,
            last,
        )
        self._restart(f"the engine restarted (its replay no longer holds seq {last})")
        self.counts.engine_restarts += 1
        self.sequence.forget_engine()
        self.sequence.last_fingerprint = None
        replayed = self._recover(0, initial=True)
        if replayed:
            self.offer(replayed)

    # -- faults -------------------------------------------------------------------------------

    def internal_error(self) -> None:
        """A step raised an unexpected error (a bug; call while handling it): logged
        once with its traceback, counted, and the namespace restarts."""
        self.counts.internal_errors += 1
        self.log.exception("internal", "internal error; its namespace restarts")
        self.backlog.clear()
        self.in_parts = None
        self.pending.end_batch()
        self.restart_due, self.rewrite_due = "an internal error", False
        self.blocked_until = self.clock() + 1.0

    def _bad(self, kind: str, exc: BadEvent) -> None:
        self.counts.bad_messages += 1
        self.counts.bad_kinds[kind] = self.counts.bad_kinds.get(kind, 0) + 1
        self.log.once(f"bad:{kind}", f"skipping a bad message ({kind}): {exc}", warning=True)
