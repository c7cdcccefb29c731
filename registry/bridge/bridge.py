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
  (``bridge_apply`` applies a call once: one whose position, its last engine seq and
  part, is not beyond the namespace's ``bridge_seq`` and ``bridge_part`` changes
  nothing), reading on into a queue bounded in bytes; what does not fit is dropped,
  counted, and shows up as a gap. A namespace Redis lost (it came back
  empty, or from a snapshot older than the bridge's claim) is claimed again and written
  again from the follower's picture of the engine (``registry.bridge.picture``), and the
  engine's URL announced again. An unexpected error in one engine's
  follower (a bug) restarts that namespace only (``internal_errors``).

- **Bounds** (``registry.bridge.bounds``). No call carries more than
  ``MAX_BLOCKS_PER_WRITE`` blocks (a larger batch is written in parts); a large batch is
  hashed and written a ``WORK_SLICE`` at a time, the other engines served between;
  messages over ``max_message_bytes`` are refused by ZeroMQ, events over
  ``max_event_blocks`` before decoding, and an engine's queue holds at most
  ``max_queue_bytes``: what is refused or dropped is counted and logged with the
  engine's namespace.

This module holds the transport: :class:`Bridge`, the ZeroMQ sockets of every engine
on one thread. Each engine's state machine is a transport-free
``registry.bridge.follower.Follower``, composed of the stream's position
(``registry.bridge.sequence``), the own hash chain (``registry.bridge.chain``) with its
picture of the engine's cache (``registry.bridge.picture``), the
pending ``bridge_apply`` call (``registry.bridge.writes``) and the lease schedule
(``registry.bridge.liveness``); the engine it follows is an
``registry.bridge.source.EngineSource``. ``EngineSource``, ``ENGINES``, ``Follower`` and
``FollowerCounts`` are importable from here too.

ZeroMQ (``pyzmq``) and msgpack come with the ``bridge`` extra; this module imports
``zmq`` only when a :class:`Bridge` is built.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from registry.bridge.bounds import (
    DEFAULT_MAX_EVENT_BLOCKS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_QUEUE_BYTES,
)
from registry.bridge.bridge_events import BadEvent, split_replay_reply
from registry.bridge.counts import FollowerCounts as FollowerCounts
from registry.bridge.follower import DEFAULT_SILENCE_TIMEOUT
from registry.bridge.follower import Follower as Follower
from registry.bridge.sequence import Frames, Replayed, Replayer
from registry.bridge.source import ENGINES as ENGINES
from registry.bridge.source import EngineSource as EngineSource
from registry.bridge.source import checked_seconds
from registry.core.errors import RegistryError
from registry.core.keys import DEFAULT_KEY_PREFIX
from registry.core.validation import is_number
from registry.namespace.ownership import DEFAULT_LEASE_TTL
from registry.namespace.redis_registry import PrefixCacheRegistry
from registry.transport.client import bounded_options

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT = 2.0
PROBE_TIMEOUT = 0.5
"""How long a liveness probe waits for the engine's answer (a live engine on a LAN
answers in about a millisecond); unanswered probes back off."""


WORK_SLICE = 0.05
"""Seconds one engine's writes may take before the loop turns to the others (their
sockets, leases and probes); a large batch is written over many turns."""


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
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        max_event_blocks: int = DEFAULT_MAX_EVENT_BLOCKS,
    ) -> None:
        if isinstance(sources, EngineSource) or not isinstance(sources, Sequence) or not sources:
            raise TypeError("sources must be a non-empty list of EngineSource")
        for source in sources:
            if not isinstance(source, EngineSource):
                raise TypeError(f"sources must hold EngineSource, not {type(source).__name__}")
        names = [s.namespace for s in sources]
        if len(set(names)) != len(names):
            raise ValueError("each engine needs a namespace of its own; two sources share one")
        self.replay_timeout = checked_seconds(replay_timeout, "replay_timeout")
        self.poll_interval = checked_seconds(poll_interval, "poll_interval")
        checked_seconds(lease_ttl, "lease_ttl")
        checked_seconds(silence_timeout, "silence_timeout")
        if not is_number(receive_hwm, integer=True) or receive_hwm < 1:
            raise ValueError("receive_hwm must be a positive int")
        self.receive_hwm = receive_hwm
        for name, value in (
            ("max_message_bytes", max_message_bytes),
            ("max_queue_bytes", max_queue_bytes),
            ("max_event_blocks", max_event_blocks),
        ):
            if not is_number(value, integer=True) or not 1 <= value <= 1 << 40:
                raise ValueError(f"{name} must be an int in [1, 2**40], not {value!r}")
        self.max_message_bytes = max_message_bytes
        self.max_queue_bytes = max_queue_bytes
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
                max_event_blocks=max_event_blocks,
                max_queue_bytes=max_queue_bytes,
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
        monitors: list[Any] = []
        try:
            for follower in self.followers:
                sock = context.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, self.receive_hwm)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                sock.setsockopt(zmq.SUBSCRIBE, follower.source.topic.encode())
                sock.connect(follower.source.endpoint)
                sockets.append(sock)
                monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            next_start = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_start and not all(f.started for f in self.followers):
                    self._start_followers()
                    next_start = now + 1.0
                if not self.ready.is_set() and all(f.started for f in self.followers):
                    self.ready.set()
                # Sockets are read while their follower is busy or blocked too: what
                # waits is bounded in bytes (the follower's backlog), not by ZeroMQ.
                poller = zmq.Poller()
                for follower, sock in zip(self.followers, sockets, strict=True):
                    if follower.started and not follower.stopped:
                        poller.register(sock, zmq.POLLIN)
                for monitor in monitors:
                    poller.register(monitor, zmq.POLLIN)
                busy = any(f.busy for f in self.followers)
                events = dict(poller.poll(0 if busy else round(self.poll_interval * 1000)))
                for follower, sock, monitor in zip(self.followers, sockets, monitors, strict=True):
                    if monitor in events:
                        self._reconnect(follower, sock, monitor)
                    if sock in events:
                        self._guarded(follower, partial(follower.receive, self._receive(sock)))
                for follower in self.followers:
                    self._guarded(follower, partial(follower.work, WORK_SLICE))
                    self._guarded(follower, follower.tick)
        except BaseException as exc:
            self.error = exc
            log.exception("bridge stopped by an error")
            raise
        finally:
            for sock in sockets:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                sock.close(0)
            for monitor in monitors:
                monitor.close(0)
            context.term()
            self._context = None

    def _reconnect(self, follower: Follower, sock: Any, monitor: Any) -> None:
        """The connection to an engine dropped: ZeroMQ refused a message over
        ``max_message_bytes`` (it does not connect again after that), or the engine went
        away. Connect again, count it, say so; the engine's next message shows the gap."""
        zmq = self._zmq
        while monitor.poll(0, zmq.POLLIN):
            monitor.recv_multipart()
        follower.counts.disconnects += 1
        follower.log.once(
            "disconnected",
            "the engine's connection dropped (a message over the maximum message size, "
            f"{self.max_message_bytes} bytes, or the engine went away): connecting again",
            warning=True,
        )
        endpoint = follower.source.endpoint
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(endpoint)
        sock.connect(endpoint)

    @staticmethod
    def _guarded(follower: Follower, step: Callable[[], None]) -> None:
        """Run one follower's step; an unexpected error (a bug) is logged, counted, and
        restarts that follower's namespace instead of stopping every engine's."""
        try:
            step()
        except Exception:
            follower.internal_error()

    def _start_followers(self) -> None:
        """Start every follower not started yet; one that cannot (Redis) is retried."""
        for follower in self.followers:
            if follower.started:
                continue
            try:
                follower.start()
            except RegistryError as exc:
                follower.counts.redis_errors += 1
                follower.log.once(
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

        def replay(start: int) -> Replayed | None:
            return self._replay(endpoint, start, timeout=timeout, name=source.namespace)

        return replay

    def _replay(
        self,
        endpoint: str,
        start: int,
        limit: int = 1_000_000,
        timeout: float | None = None,
        name: str = "",
    ) -> Replayed | None:
        """Ask ``endpoint`` for every buffered batch from ``start`` on; None when it does
        not answer within ``timeout`` (default ``replay_timeout``; per message) or answers
        out of protocol (logged, naming the engine's namespace). Both reply forms are
        taken (``split_replay_reply``)."""
        wait = self.replay_timeout if timeout is None else timeout
        zmq = self._zmq
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            batches: Replayed = []
            size = 0
            while len(batches) < limit and size <= self.max_queue_bytes:
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
                size += len(reply[1])
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
