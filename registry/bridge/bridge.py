"""``pcr bridge``: follow vLLM / SGLang KV-event streams into bridged namespaces.

One :class:`Bridge` follows one or more engines, each into its own namespace
(:class:`EngineSource`). For every engine it subscribes to the ZeroMQ PUB socket, asks
the replay socket (when given) for what it missed, decodes each batch
(``registry.bridge.bridge_events``) and applies it with one ``bridge_apply`` script call:
atomic, in order, never partial. What a bridged namespace holds:

- **Hashes any router can compute.** The engine's own hashes are seeded per process
  and cannot be recomputed outside it. The bridge hashes each stored block's
  ``token_ids`` with this project's Megatron-compatible chain
  (``registry.core.hashing.block_hashes``), continued from the parent block's digest, so a
  router finds an engine's blocks with ``match_kv_prefix(block_hashes(tokens, bs))``.
  The engine hash -> (own hash, digest, holders) map is kept in Redis
  (``pcr:{NS}:engine-blocks``) so that ``BlockRemoved`` applies and a restarted bridge
  continues. It counts copies: vLLM does not de-duplicate (a fully cached prompt sent
  again stores its last block a second time under the same hash, and each copy gets
  its own ``BlockRemoved``), so a block stays listed until its last copy is removed.
- **Block ids** are positions: a block's id is its index in its prefix (0 for a
  prompt's first block). Events carry no block ids; a bridged namespace serves routing,
  not block tables.
- **Groups and media.** Blocks of full-attention groups (``kv_cache_spec_kind`` nil,
  ``full_attention``, ``mla_attention``, ``sink_full_attention``) go to the KV map;
  blocks of ``mamba`` groups to the Mamba map (listed while the KV map lists the block
  too). Sliding-window and unknown groups are skipped and counted, as are media not
  followed (``media``, default GPU; an event without a medium is GPU).
- **Blocks the chain cannot hash** are skipped and counted, never guessed: blocks with
  extra keys or a LoRA (the engine hash covers more than the tokens), blocks whose
  parent the bridge never saw (``orphans``; re-rooting them would give wrong hashes),
  and blocks of another block size.
- **Sequence.** A gap asks the replay socket for the missing batches. No replay socket,
  a replay that does not reach back to the gap, or a sequence that goes backwards (the
  engine restarted) makes the bridge ``claim()`` a new epoch: the namespace restarts
  empty, then takes whatever the replay still has. Applying a suffix of an engine's
  history to an empty namespace lists a subset of what the engine holds, never a block
  it dropped. A message the subscription delivers after the replay gave it already is
  a duplicate only when its payload is the replayed one too: the same seq with another
  payload comes from a restarted engine. ``AllBlocksCleared`` empties the namespace.
- **Liveness.** The bridge holds the namespace's lease while it hears from the engine:
  a message, or an answer to a replay probe (sent when the engine has been quiet for a
  third of the lease or of ``silence_timeout``, whichever is shorter; it waits
  ``PROBE_TIMEOUT`` for the answer, and an engine that does not answer is probed at
  doubling intervals, up to once per ``silence_timeout``). A probe asks from the batch
  applied last: a replay that no longer holds it (or holds another payload under its
  seq) comes from a restarted engine, and the namespace restarts at once, before the
  new process has said anything. Once the engine is silent
  for ``silence_timeout`` seconds the lease is left to run out, so routers stop
  scoring it.
- **Faults.** A batch that does not decode is counted (by kind, logged once) and
  skipped; its sequence number still counts as seen when it is the one expected next.
  Out of sequence it moves nothing (no gap, no restart): its seq may be as broken as
  its payload. While Redis is away the bridge keeps the batch and retries it
  (``bridge_apply`` applies a call once: one whose last engine seq is not above the
  namespace's ``bridge_seq`` changes nothing), reading nothing more; the engine's socket buffers
  meanwhile, and what it drops shows up as a gap. An unexpected error in one engine's
  follower (a bug) restarts that namespace only (``internal_errors``).

ZeroMQ (``pyzmq``) and msgpack come with the ``bridge`` extra; this module imports
``zmq`` only when a :class:`Bridge` is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from registry.bridge.bridge_events import (
    AllBlocksCleared,
    BadEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    split_frames,
    split_replay_reply,
)
from registry.core.errors import RegistryError, RegistryUnavailable, StaleEpochError, translate
from registry.core.hashing import ZERO_PARENT, chain_digests, digest_hash
from registry.core.keys import DEFAULT_KEY_PREFIX, validate_namespace
from registry.fleet.membership import NodeIndex, validate_engine_url
from registry.namespace.ownership import DEFAULT_LEASE_TTL
from registry.namespace.redis_registry import PrefixCacheRegistry
from registry.transport.client import bounded_options

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang")
KV_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose blocks go to the KV map (nil too)."""
MAMBA_KINDS = frozenset({"mamba"})
"""``kv_cache_spec_kind`` values whose blocks go to the Mamba map."""
MAX_SLOTS = 64
"""Holder slots per block: (group index) x (followed media) must stay below this."""
MAX_BLOCK_SIZE = 1 << 20
MAX_BLOCKS_PER_WRITE = 1024
"""A write carries whole batches; a new write starts once this many blocks wait (about
4 ms of script time: routers' calls wait behind it)."""
CACHE_BLOCKS = 262_144
"""Engine hashes whose digests the bridge keeps in memory (Redis has them all); once
past this, the cache is emptied after a write, when Redis holds every digest in it."""
WINDOW_LIMIT = 100_000
"""Replayed seqs remembered to recognise the subscription's copies of them."""
DEFAULT_MEDIUM = "GPU"
"""The medium of an event that names none."""
SEQ_LIMIT = 2**64
DEFAULT_SILENCE_TIMEOUT = 30.0
DEFAULT_REPLAY_TIMEOUT = 2.0
PROBE_TIMEOUT = 0.5
"""How long a liveness probe waits for the engine's answer (a live engine on a LAN
answers in about a millisecond); unanswered probes back off."""
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")

Frames = list[bytes]
Replayer = Callable[[int], "list[tuple[int, bytes]] | None"]


def _endpoint(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    scheme, _, address = value.partition("://")
    host, _, port = address.rpartition(":")
    if (
        not value.startswith(ENDPOINT_SCHEMES)
        or len(value) > 500
        or any(c.isspace() for c in value)
        or not address
        or (
            scheme == "tcp"
            and not (host and port.isdigit() and port.isascii() and 1 <= int(port) <= 65535)
        )
    ):
        raise ValueError(
            f"{what} {value!r} must be a ZeroMQ endpoint such as tcp://HOST:PORT "
            "(tcp://, ipc:// or inproc://, no spaces)"
        )
    return value


def _seconds(value: object, what: str) -> float:
    """A duration argument, checked: a number of seconds, 1 ms to a year."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not 0.001 <= value <= 86_400 * 365:  # NaN fails this too
        raise ValueError(f"{what} must lie between 1 ms and a year (in seconds), not {value}")
    return float(value)


def _fingerprint(payload: bytes) -> bytes:
    """What tells two payloads of one seq apart (a replayed batch from a new one)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(frozen=True)
class EngineSource:
    """One engine the bridge follows, and the namespace it feeds."""

    namespace: str
    endpoint: str
    replay_endpoint: str | None = None
    engine: str = "vllm"
    topic: str = ""
    block_size: int | None = None
    media: tuple[str, ...] = ("GPU",)
    engine_url: str | None = None
    """The engine's HTTP base URL, announced beside its lease for gateways (``pcr gateway``)."""

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if self.engine_url is not None:
            validate_engine_url(self.engine_url)
        _endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            _endpoint(self.replay_endpoint, "replay endpoint")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, not {type(self.topic).__name__}")
        if len(self.topic) > 500:
            raise ValueError("topic must be a str of at most 500 characters")
        if self.block_size is not None and (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or not 1 <= self.block_size <= MAX_BLOCK_SIZE
        ):
            raise ValueError(
                f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], not {self.block_size!r}"
            )
        media: object = self.media  # checked at run time
        if (
            not isinstance(media, tuple)
            or not media
            or len(media) > 8
            or not all(isinstance(m, str) and m and m.isprintable() for m in media)
            or len(set(media)) != len(media)
        ):
            raise ValueError(
                f"media must be a tuple of 1 to 8 distinct medium names such as ('GPU',), "
                f"not {media!r}"
            )


@dataclass
class FollowerCounts:
    """What one engine's follower did since it started."""

    messages: int = 0
    batches: int = 0
    writes: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    bad_messages: int = 0
    unknown_events: int = 0
    orphans: int = 0
    keyed_blocks: int = 0
    other_medium: int = 0
    other_groups: int = 0
    block_size_mismatch: int = 0
    unknown_removals: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    engine_restarts: int = 0
    resumed: int = 0
    redis_errors: int = 0
    renewals: int = 0
    probes: int = 0
    silent: int = 0
    superseded: int = 0
    internal_errors: int = 0
    applied_seq: int = -1  # the last engine seq written to Redis (-1: none yet)
    bad_kinds: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        values = {k: v for k, v in vars(self).items() if k != "bad_kinds"}
        values.update({f"bad:{kind}": n for kind, n in sorted(self.bad_kinds.items())})
        return values


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
    ) -> None:
        self.registry = registry
        self.source = source
        self.replay = replay if source.replay_endpoint is not None else None
        # Probes may wait less for an answer than gap replays (default: the same call).
        self.probe = (probe or replay) if source.replay_endpoint is not None else None
        self.probe_failures = 0  # probes unanswered in a row: they back off
        self.lease_ttl = _seconds(lease_ttl, "lease_ttl")
        self.silence_timeout = _seconds(silence_timeout, "silence_timeout")
        # Probes come often enough to hear an idle engine before it counts as silent.
        self.probe_interval = min(self.lease_ttl, self.silence_timeout) / 3
        self.clock = clock
        self.counts = FollowerCounts()
        self.block_size = source.block_size
        self.last: int | None = None  # last engine seq applied (or skipped as bad)
        # Its payload's fingerprint (None after a resume): a probe checks the engine's
        # replay still holds that very batch, else the engine restarted.
        self.last_fingerprint: bytes | None = None
        # Seqs applied from a replay that the subscription may deliver again, with their
        # payloads' fingerprints; emptied once the subscription passes the last of them.
        self.window: dict[int, bytes] = {}
        self.window_end = -1
        self.backlog: deque[Frames] = deque()
        self.pending: list[Any] = []  # operations not yet written
        self.pending_blocks = 0  # blocks they carry
        self.pending_seq: int | None = None
        self.blocked_until = 0.0
        self.restart_due: str | None = None
        self.stopped = False
        self.started = False
        self._digests: dict[int, tuple[bytes, int]] = {}
        self._logged: set[str] = set()
        now = clock()
        self.last_heard = now
        self.next_renewal = now
        self.next_probe = now + self.probe_interval
        k = registry.keys
        self._keys = (k.kv, k.mamba, k.meta, k.engine_blocks)

    # -- start: resume what a previous bridge left, or claim afresh ------------------------

    def start(self) -> None:
        """Take over the namespace: resume it when it is still a live bridged namespace
        of this endpoint, else claim it (empty). Raises registry errors; once it has
        taken the namespace over, Redis faults only block (``tick`` retries)."""
        lease_ms = max(1, round(self.lease_ttl * 1000))
        reply = self.registry._write(
            "bridge_resume",
            (self.registry.keys.meta,),
            False,
            (lease_ms, self.source.endpoint),
            fence="",
        )
        if (
            reply
            and self.block_size is not None
            and _text(reply[3]) not in ("", str(self.block_size))
        ):
            # Its entries were hashed with another block size: no router would find them.
            log.warning(
                "%s: the namespace was bridged with block size %s, not %d: starting it afresh",
                self._name, _text(reply[3]), self.block_size,
            )  # fmt: skip
            reply = []
        if reply:
            epoch, lease_until, seq, block_size = (_text(v) for v in reply)
            self.registry._set_epoch(int(epoch))
            self.registry.lease_ttl = self.lease_ttl
            self.registry._announce(int(lease_until))  # the lease, in the node index
            self.last = int(seq) if seq else None
            if self.block_size is None and block_size:
                self.block_size = int(block_size)
            self.counts.resumed += 1
            log.info("%s: resumed after engine seq %s", self._name, seq or "(none)")
        else:
            self._claim()
            try:
                self._write([], None)  # record the engine and endpoint for pcr stats
            except _Blocked as exc:
                raise _registry_error(exc) from None
        if self.source.engine_url is not None:  # which engine a gateway sends it to
            NodeIndex(self.registry.client, self.registry.keys.key_prefix).announce_engine(
                self.source.namespace, self.source.engine_url
            )
        self.started = True
        self.next_renewal = self.clock() + self.lease_ttl / 3
        if self.replay is not None:
            try:
                replayed = self._recover(self._next_seq(), initial=True)
            except _Blocked:  # a restart is due: tick() retries it
                self.blocked_until = self.clock() + 0.5
                return
            self.backlog.extendleft(reversed(replayed))
            self._drain()

    def _next_seq(self) -> int:
        """The seq to ask a replay for: the one after the last applied (0 at first)."""
        return 0 if self.last is None else min(self.last + 1, SEQ_LIMIT - 1)

    def _claim(self) -> None:
        self.registry.claim(self.lease_ttl)
        self.last = None  # the window stays: the subscription may still deliver copies
        self.pending = []
        self.pending_blocks = 0
        self.pending_seq = None
        self._digests.clear()

    @property
    def _name(self) -> str:
        return f"bridge[{self.source.namespace} <- {self.source.endpoint}]"

    # -- messages -------------------------------------------------------------------------

    def offer(self, messages: Iterable[Frames]) -> None:
        """Queue published messages and apply what can be applied now."""
        self.backlog.extend(messages)
        if self.backlog:
            self.last_heard = self.clock()
        self._drain()

    @property
    def blocked(self) -> bool:
        """Whether writes are waiting for Redis (the transport stops reading)."""
        return self.blocked_until > 0.0 or self.stopped

    def _drain(self) -> None:
        if self.stopped:
            return
        try:
            if self.restart_due is not None:
                self._restart(self.restart_due)
                if self.replay is not None:  # what the replay still has, as a suffix
                    self.backlog.extendleft(reversed(self._recover(0, initial=True)))
            while self.backlog:
                if self.pending_blocks >= MAX_BLOCKS_PER_WRITE:
                    self._flush()
                frames = self.backlog.popleft()
                try:
                    self._process(frames)
                except _Blocked:
                    self.backlog.appendleft(frames)
                    raise
            self._flush()
            self.blocked_until = 0.0
        except _Blocked:
            self.blocked_until = self.clock() + 0.5

    def _process(self, frames: Frames) -> None:
        """Apply one message, or deal with its sequence number first (may raise
        ``_Blocked``; then nothing of it was applied)."""
        try:
            _, seq, payload = split_frames(frames)
        except BadEvent as exc:
            self._bad("frames", exc)
            return
        last = self.last
        expected = last is None or seq == last + 1
        if not expected and self.window.get(seq) == _fingerprint(payload):
            self.counts.duplicates += 1
            return
        try:
            batch = decode_batch(payload)
        except BadEvent as exc:
            self.counts.messages += 1
            self._bad("payload", exc)
            if last is not None and seq == last + 1:
                self._advance(seq, payload)
            return
        if last is not None and seq != last + 1:
            self._flush()
            if seq > last + 1:
                log.warning("%s: gap: engine seq %d follows %d", self._name, seq, last)
                replayed = self._recover(last + 1)
                self.counts.gaps += 1
            else:
                log.warning(
                    "%s: engine seq went back from %d to %d: the engine restarted",
                    self._name,
                    last,
                    seq,
                )
                self._restart(f"the engine restarted (seq {last} -> {seq})")
                self.counts.engine_restarts += 1
                self.window, self.window_end = {}, -1  # the old engine's messages
                replayed = self._recover(0, initial=True) if seq > 0 else []
            if replayed:  # apply them first, then this message again
                self.backlog.appendleft(frames)
                self.backlog.extendleft(reversed(replayed))
                return
        if self.window and seq > self.window_end:
            self.window = {}  # the subscription went past the replay: no copies to come
        self.counts.messages += 1
        self.pending.extend(self._operations(batch))
        self._advance(seq, payload)
        self.counts.batches += 1

    def _advance(self, seq: int, payload: bytes) -> None:
        self.last = seq
        self.last_fingerprint = _fingerprint(payload)
        self.pending_seq = seq

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
                self.last_heard = self.clock()
        run = _contiguous(batches or [])
        covers = bool(run) and run[0][0] == start
        if not covers and (not initial or (self.last is not None and run)):
            self._restart(
                f"no replay reaches back to seq {start}"
                + (f" (it starts at {run[0][0]})" if run else "")
            )
        if not run:
            return []
        if self.last is None:
            self.last = run[0][0] - 1
        return self._replayed(run)

    def _replayed(self, run: list[tuple[int, bytes]]) -> list[Frames]:
        """The messages of a replay, remembered so that the subscription's copies of
        them count as duplicates."""
        self.window.update((seq, _fingerprint(payload)) for seq, payload in run)
        self.window_end = max(self.window_end, run[-1][0])
        if len(self.window) > WINDOW_LIMIT:  # a subscription that never catches up
            for seq in sorted(self.window)[: len(self.window) - WINDOW_LIMIT]:
                del self.window[seq]
        topic = self.source.topic.encode()
        return [[topic, seq.to_bytes(8, "big"), payload] for seq, payload in run]

    def _restart(self, reason: str) -> None:
        """Claim the namespace afresh: it restarts empty (may raise ``_Blocked``)."""
        self.restart_due = reason
        try:
            self._claim()
            self._write([], None)
        except StaleEpochError:  # claims are not fenced; kept for completeness
            raise _Blocked() from None
        except RegistryError as exc:
            self._redis_error(exc)
        self.restart_due = None
        self.counts.restarts += 1
        log.warning("%s: namespace restarted empty: %s", self._name, reason)

    # -- hashing ----------------------------------------------------------------------------

    def _operations(self, batch: EventBatch) -> list[Any]:
        """The ``bridge_apply`` operations of one decoded batch (may raise ``_Blocked``
        while fetching parent digests)."""
        self.counts.unknown_events += batch.unknown
        self._fetch_parents(batch)
        ops: list[Any] = []
        media = self.source.media
        for event in batch.events:
            if isinstance(event, BlockStored):
                ops.extend(self._stored(event))
            elif isinstance(event, BlockRemoved):
                medium = DEFAULT_MEDIUM if event.medium is None else event.medium
                if medium not in media:
                    self.counts.other_medium += len(event.block_hashes)
                    continue
                slot = self._slot(event.group_idx, medium)
                if slot is None:
                    continue
                if event.block_hashes:
                    packed = b"".join(b"%020d" % h for h in event.block_hashes)
                    ops.extend(("R", slot, len(event.block_hashes), packed))
                    self.pending_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                ops.append("C")
                self._digests.clear()
        return ops

    def _slot(self, group_idx: int | None, medium: str) -> int | None:
        slot = (group_idx or 0) * len(self.source.media) + self.source.media.index(medium) + 1
        if slot > MAX_SLOTS:
            self.counts.other_groups += 1
            self._once("slots", f"group {group_idx} is beyond the {MAX_SLOTS} holder slots")
            return None
        return slot

    def _stored(self, event: BlockStored) -> list[Any]:
        n = len(event.block_hashes)
        medium = DEFAULT_MEDIUM if event.medium is None else event.medium
        if medium not in self.source.media:
            self.counts.other_medium += n
            return []
        kind = event.kv_cache_spec_kind
        if kind is None or kind in KV_KINDS:
            char = "k"
        elif kind in MAMBA_KINDS:
            char = "m"
        else:
            self.counts.other_groups += n
            self._once(f"kind:{kind}", f"blocks of {kind!r} groups are not bridged")
            return []
        if event.keyed or event.lora_name is not None or event.lora_id:
            self.counts.keyed_blocks += n
            return []
        size = event.block_size
        if self.block_size is None and size is not None:
            self.block_size = size
        if size is None:
            size = self.block_size
        if size is None or size != self.block_size or len(event.token_ids) != n * size:
            self.counts.block_size_mismatch += n
            self._once(
                "block_size",
                f"a BlockStored of {n} blocks and {len(event.token_ids)} tokens does not fit "
                f"the block size {self.block_size}",
            )
            return []
        slot = self._slot(event.group_idx, medium)
        if slot is None:
            return []
        if event.parent_block_hash is None:
            parent, depth = ZERO_PARENT, -1
        else:
            known = self._digests.get(event.parent_block_hash)
            if known is None:
                self.counts.orphans += n
                return []
            parent, depth = known
        if not n:
            return []
        digests = chain_digests(parent, event.token_ids, size)
        for h, digest in zip(event.block_hashes, digests, strict=True):
            depth += 1
            self._digests[h] = (digest, depth)
        self.pending_blocks += n
        # One operation per event, its per-block values packed at fixed widths
        # (lua/bridge_apply.lua): far cheaper to send and to hand to Lua than 7 per block.
        return [
            "S",
            slot,
            char,
            depth - n + 1,
            n,
            b"".join(b"%020d" % h for h in event.block_hashes),
            b"".join(b"%019d" % digest_hash(d) for d in digests),
            b"".join(digests).hex(),
        ]

    def _fetch_parents(self, batch: EventBatch) -> None:
        """Read the digests of parents this process has not seen (after a resume) in
        one HMGET."""
        produced: set[int] = set()
        wanted: list[int] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                p = event.parent_block_hash
                if p is not None and p not in self._digests and p not in produced:
                    wanted.append(p)
                produced.update(event.block_hashes)
        if not wanted:
            return
        try:
            values = self.registry.client.hmget(self.registry.keys.engine_blocks, wanted)
        except Exception as exc:
            error = translate(exc, f"namespace {self.source.namespace!r}: bridge parents")
            if error is None:
                raise
            self._redis_error(error)
        for h, value in zip(wanted, values, strict=True):
            if value is None:
                continue
            parts = _text(value).split(" ")
            try:
                self._digests[h] = (bytes.fromhex(parts[2]), int(parts[1]))
            except (IndexError, ValueError):
                self._once("engine-blocks", f"engine-blocks holds a malformed entry for {h}")

    # -- writes ------------------------------------------------------------------------------

    def _flush(self) -> None:
        if not self.pending and self.pending_seq is None:
            return
        self._write(self.pending, self.pending_seq)
        self.pending = []
        self.pending_blocks = 0
        self.pending_seq = None
        if len(self._digests) > CACHE_BLOCKS:  # all of them are in Redis now
            self._digests.clear()

    def _write(self, ops: Sequence[Any], seq: int | None) -> None:
        """One ``bridge_apply`` call; Redis faults block, a lost namespace restarts it."""
        data = (
            "" if seq is None else str(seq),
            self.source.engine,
            self.source.endpoint,
            "" if self.block_size is None else str(self.block_size),
            *ops,
        )
        try:
            stored, removed, unknown, cleared = self.registry._write(
                "bridge_apply", self._keys, False, data
            )
        except StaleEpochError as exc:
            self._lost(exc)
            # The namespace restarted empty: the batches at hand still apply to it (a
            # suffix of the engine's history lists a subset of its blocks).
            self._write(ops, seq)
            if seq is not None:
                self.last = seq
            return
        except RegistryError as exc:
            self._redis_error(exc)
        self.counts.writes += 1
        if seq is not None:
            self.counts.applied_seq = seq
        self.counts.blocks_stored += int(stored)
        self.counts.blocks_removed += int(removed)
        self.counts.unknown_removals += int(unknown)
        self.counts.clears += int(cleared)

    def _lost(self, exc: StaleEpochError) -> None:
        """This bridge's epoch is no longer the namespace's: if the namespace is gone
        (gc, an emptied server) start it again; if another process owns it, stop."""
        try:
            current = self.registry.client.hget(self.registry.keys.meta, "epoch")
        except Exception as error:
            raise _Blocked() from error
        if current is not None:
            self.counts.superseded += 1
            self.stopped = True
            log.error(
                "%s: another process owns the namespace now; this follower stops: %s",
                self._name,
                exc,
            )
            raise _Blocked() from exc
        self._restart("the namespace was collected or lost")

    def _redis_error(self, exc: RegistryError) -> None:
        self.counts.redis_errors += 1
        self._once(f"redis:{type(exc).__name__}", f"Redis: {exc}; retrying", warning=True)
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
        quiet = now - self.last_heard
        if self.probe is not None and quiet >= self.probe_interval and now >= self.next_probe:
            try:
                self._probe()
            except _Blocked:
                self.blocked_until = self.clock() + 0.5
                return
            quiet = self.clock() - self.last_heard
        if quiet >= self.silence_timeout:
            if "silent" not in self._logged:
                self.counts.silent += 1
                self._once(
                    "silent", f"engine silent for {quiet:.0f} s; the lease runs out", warning=True
                )
            return
        self._logged.discard("silent")
        if now >= self.next_renewal and not self.blocked:
            try:
                self.registry.renew()
                self.counts.renewals += 1
                self.next_renewal = now + self.lease_ttl / 3
            except StaleEpochError as exc:
                with contextlib.suppress(_Blocked):
                    self._lost(exc)
            except RegistryError as exc:
                self.counts.redis_errors += 1
                self._once(f"renew:{type(exc).__name__}", f"lease renewal failed: {exc}")
                self.next_renewal = now + 0.5

    def _probe(self) -> None:
        """Ask a quiet engine's replay socket for its batches from the last one applied
        on: the answer proves it is alive, brings what the subscription lost, and shows
        a restart the engine has not spoken of yet (its replay no longer holds that
        batch: the namespace restarts and takes what the new process published)."""
        self.counts.probes += 1
        last = self.last
        start = SEQ_LIMIT // 2 - 1 if last is None else last
        batches = self.probe(start) if self.probe is not None else None
        # An engine that does not answer is probed less and less often (up to once per
        # silence_timeout), so dead engines cannot stall the loop that serves the others.
        self.probe_failures = self.probe_failures + 1 if batches is None else 0
        backoff = min(2 ** min(self.probe_failures, 16), self.silence_timeout / self.probe_interval)
        self.next_probe = self.clock() + self.probe_interval * max(1.0, backoff)
        if batches is None:
            return
        self.last_heard = self.clock()
        run = _contiguous(batches)
        if last is not None:
            known = self.last_fingerprint
            if not run or (
                run[0][0] == last and known is not None and _fingerprint(run[0][1]) != known
            ):
                self._quiet_restart(last)
                return
            if run[0][0] == last:
                run = run[1:]  # the batch applied last: the same engine
        if run and run[0][0] == self._next_seq():  # published, and the subscription lost it
            self.offer(self._replayed(run))
        elif run:  # a gap the replay does not reach back to: handled as one
            topic = self.source.topic.encode()
            self.offer([topic, s.to_bytes(8, "big"), p] for s, p in run)

    def _quiet_restart(self, last: int) -> None:
        """The engine's replay no longer holds batch ``last`` (or holds another one under
        that seq): a new process. Restart the namespace and take what it published."""
        log.warning(
            "%s: the engine's replay no longer holds seq %d: the engine restarted", self._name, last
        )
        self._restart(f"the engine restarted (its replay no longer holds seq {last})")
        self.counts.engine_restarts += 1
        self.window, self.window_end = {}, -1  # the old engine's messages
        self.last_fingerprint = None
        replayed = self._recover(0, initial=True)
        if replayed:
            self.offer(replayed)

    # -- logging -----------------------------------------------------------------------------

    def _bad(self, kind: str, exc: BadEvent) -> None:
        self.counts.bad_messages += 1
        self.counts.bad_kinds[kind] = self.counts.bad_kinds.get(kind, 0) + 1
        self._once(f"bad:{kind}", f"skipping a bad message ({kind}): {exc}", warning=True)

    def _once(self, key: str, message: str, *, warning: bool = False) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        (log.warning if warning else log.info)("%s: %s (logged once)", self._name, message)


def _contiguous(batches: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The leading run of consecutive seqs of a replay."""
    run: list[tuple[int, bytes]] = []
    for seq, payload in batches:
        if run and seq != run[-1][0] + 1:
            break
        run.append((seq, payload))
    return run


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Bridge:
    """Follows engines' KV-event streams into their namespaces (see the module text).

    ``redis`` is a redis-py style client or a URL (then ``from_url``'s bounded
    timeouts apply). ``run()`` blocks until ``stop()``; ``start()`` runs it on a daemon
    thread; as a context manager the bridge starts, waits until it has subscribed, and
    stops on leaving. ``counts()`` says what each follower did. One thread does all the
    work, so one slow Redis call delays every engine of this bridge by as much.
    """

    def __init__(
        self,
        redis: Any,
        sources: Sequence[EngineSource],
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        silence_timeout: float = DEFAULT_SILENCE_TIMEOUT,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
        receive_hwm: int = 100_000,
        poll_interval: float = 0.05,
    ) -> None:
        if isinstance(sources, EngineSource) or not isinstance(sources, Sequence) or not sources:
            raise TypeError("sources must be a non-empty list of EngineSource")
        for source in sources:
            if not isinstance(source, EngineSource):
                raise TypeError(f"sources must hold EngineSource, not {type(source).__name__}")
        names = [s.namespace for s in sources]
        if len(set(names)) != len(names):
            raise ValueError("each engine needs a namespace of its own; two sources share one")
        self.replay_timeout = _seconds(replay_timeout, "replay_timeout")
        self.poll_interval = _seconds(poll_interval, "poll_interval")
        _seconds(lease_ttl, "lease_ttl")
        _seconds(silence_timeout, "silence_timeout")
        if isinstance(receive_hwm, bool) or not isinstance(receive_hwm, int) or receive_hwm < 1:
            raise ValueError("receive_hwm must be a positive int")
        self.receive_hwm = receive_hwm
        try:
            self._zmq: Any = importlib.import_module("zmq")
        except ImportError as exc:
            raise ImportError(
                "pcr bridge needs pyzmq: pip install 'prefix-cache-registry[bridge]'"
            ) from exc
        if isinstance(redis, str):
            from registry.transport.client import client_from_url

            redis = client_from_url(redis, **bounded_options({}))
        self.client = redis
        self.followers = [
            Follower(
                PrefixCacheRegistry(redis, s.namespace, key_prefix=key_prefix),
                s,
                replay=self._replayer(s),
                probe=self._replayer(s, timeout=min(self.replay_timeout, PROBE_TIMEOUT)),
                lease_ttl=lease_ttl,
                silence_timeout=silence_timeout,
            )
            for s in sources
        ]
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: Any = None

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        """Follow every engine until ``stop()``."""
        zmq = self._zmq
        self._context = context = zmq.Context()
        sockets: list[Any] = []
        try:
            for follower in self.followers:
                sock = context.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, self.receive_hwm)
                sock.setsockopt(zmq.SUBSCRIBE, follower.source.topic.encode())
                sock.connect(follower.source.endpoint)
                sockets.append(sock)
            next_start = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_start and not all(f.started for f in self.followers):
                    self._start_followers()
                    next_start = now + 1.0
                if not self.ready.is_set() and all(f.started for f in self.followers):
                    self.ready.set()
                poller = zmq.Poller()
                for follower, sock in zip(self.followers, sockets, strict=True):
                    if follower.started and not follower.blocked:
                        poller.register(sock, zmq.POLLIN)
                events = dict(poller.poll(round(self.poll_interval * 1000)))
                for follower, sock in zip(self.followers, sockets, strict=True):
                    if sock in events:
                        self._guarded(follower, partial(follower.offer, self._receive(sock)))
                for follower in self.followers:
                    self._guarded(follower, follower.tick)
        except BaseException as exc:
            self.error = exc
            log.exception("bridge stopped by an error")
            raise
        finally:
            for sock in sockets:
                sock.close(0)
            context.term()
            self._context = None

    @staticmethod
    def _guarded(follower: Follower, step: Callable[[], None]) -> None:
        """Run one follower's step; an unexpected error (a bug) is logged, counted, and
        restarts that follower's namespace instead of stopping every engine's."""
        try:
            step()
        except Exception:
            follower.counts.internal_errors += 1
            if "internal" not in follower._logged:
                follower._logged.add("internal")
                log.exception("%s: internal error; its namespace restarts", follower._name)
            follower.backlog.clear()
            follower.restart_due = "an internal error"
            follower.blocked_until = follower.clock() + 1.0

    def _start_followers(self) -> None:
        for follower in self.followers:
            if follower.started:
                continue
            try:
                follower.start()
            except RegistryError as exc:
                follower.counts.redis_errors += 1
                follower._once(
                    f"start:{type(exc).__name__}", f"cannot start yet: {exc}", warning=True
                )

    def _receive(self, sock: Any, limit: int = 256) -> list[Frames]:
        """Every message waiting on ``sock``, up to ``limit``."""
        zmq = self._zmq
        messages: list[Frames] = []
        while len(messages) < limit:
            try:
                messages.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return messages

    def _replayer(self, source: EngineSource, timeout: float | None = None) -> Replayer | None:
        if source.replay_endpoint is None:
            return None
        endpoint = source.replay_endpoint

        def replay(start: int) -> list[tuple[int, bytes]] | None:
            return self._replay(endpoint, start, timeout=timeout, name=source.namespace)

        return replay

    def _replay(
        self,
        endpoint: str,
        start: int,
        limit: int = 1_000_000,
        timeout: float | None = None,
        name: str = "",
    ) -> list[tuple[int, bytes]] | None:
        """Ask ``endpoint`` for every buffered batch from ``start`` on; None when it does
        not answer within ``timeout`` (default ``replay_timeout``; per message) or answers
        out of protocol (logged, naming the engine's namespace). Both reply forms are
        taken (``split_replay_reply``)."""
        wait = self.replay_timeout if timeout is None else timeout
        zmq = self._zmq
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            batches: list[tuple[int, bytes]] = []
            while len(batches) < limit:
                if not sock.poll(round(wait * 1000), zmq.POLLIN):
                    log.info("replay from %s: no answer in %.2f s", endpoint, wait)
                    return None
                try:
                    reply = split_replay_reply(sock.recv_multipart())
                except BadEvent as exc:
                    log.warning(
                        "%s: replay from %s answered out of protocol: %s", name, endpoint, exc
                    )
                    return None
                if reply is None:
                    return batches
                batches.append(reply)
            return batches
        except zmq.ZMQError as exc:
            log.warning("replay from %s failed: %s", endpoint, exc)
            return None
        finally:
            sock.close(0)

    # -- control ------------------------------------------------------------------------------

    def start(self) -> Bridge:
        """Run on a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("this bridge was started already")
        self._thread = threading.Thread(target=self._run_quietly, name="pcr-bridge", daemon=True)
        self._thread.start()
        return self

    def _run_quietly(self) -> None:
        with contextlib.suppress(BaseException):  # recorded in self.error and logged
            self.run()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop following (the leases then run out unless renewed otherwise)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Bridge:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until every engine's namespace is taken over and its socket connected;
        False after ``timeout`` seconds, or at once when the bridge's thread has died
        (``error`` says why)."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            thread = self._thread
            if time.monotonic() >= deadline or (thread is not None and not thread.is_alive()):
                return self.ready.is_set()
        return True

    def counts(self) -> dict[str, dict[str, int]]:
        """Per namespace: what its follower did (``FollowerCounts``)."""
        return {f.source.namespace: f.counts.as_dict() for f in self.followers}
