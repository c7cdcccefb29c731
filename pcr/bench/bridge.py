"""``pcr bench``'s bridge rows: engine KV events through a ``Bridge`` into Redis.

The bridge (one ``EngineSource``, block size 16, with the replay endpoint) runs in a
process of its own, as ``pcr bridge`` would, so that the measuring side (publishing,
polling Redis) never competes with it for the GIL. This process plays the engine: an
:class:`~sim.engine_events.EnginePublisher` (XPUB and replay ROUTER, vLLM's map layout)
on loopback TCP. One bridge follows it through every phase.

- **Stored blocks per second.** Conversations as an engine serves them: each starts from
  one shared 16-block system prompt, and each ``BlockStored`` event extends one
  conversation by 16 new blocks (256 tokens at block size 16), chained to its previous
  event; a batch (one engine step) carries 8 events of 8 different conversations. Every
  payload is packed before the clock starts; the clock runs from the first publish until
  the namespace's KV hash (``HLEN``) holds every block. Fresh blocks every trial; the
  median of the trials is reported.
- **Removed blocks per second.** The same blocks removed again, newest first, 16 hashes
  per ``BlockRemoved`` event, 8 events per batch, until ``HLEN`` is 0.
- **Publish to visible.** While background batches (2 events, 32 blocks) go out every
  5 ms, one event of 16 new blocks extending the system prompt is published and
  ``PrefixRouter.score`` is polled until it sees the 32-block prefix; p50 and p99 over
  the samples, one every 10 ms.

A phase that does not end (a block the bridge lost, a bridge that stopped) makes the rows
an ``error`` instead of a figure. Needs the ``bridge`` extra (pyzmq, msgpack); without
it the rows are ``skipped``.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import redis

from registry import PrefixRouter
from registry.core.hashing import block_hashes
from registry.core.keys import NamespaceKeys

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 8
CONVERSATIONS = 64
NAMESPACE = "bench-bridge"
BACKGROUND_EVENTS = 2
BACKGROUND_INTERVAL = 0.005
SAMPLE_GAP = 0.010
"""Seconds between two visibility samples (background batches keep coming meanwhile)."""
PHASE_TIMEOUT = 60.0
START_TIMEOUT = 60.0
SKIP_REASON = "needs the bridge extra (pyzmq, msgpack): pip install 'prefix-cache-registry[bridge]'"
COUNTS = ("batches", "writes", "orphans", "gaps", "restarts", "bad_messages", "redis_errors")
"""The bridge's own counts the rows keep (all but batches and writes should be 0)."""


class BridgeBenchError(RuntimeError):
    """A bridge phase did not end as it should (the rows then report it)."""


@dataclass(frozen=True)
class BridgeEffort:
    """How hard to measure the bridge."""

    trials: int
    events: int  # BlockStored events per trial (and a system prompt's)
    samples: int  # publish-to-visible samples


QUICK = BridgeEffort(trials=3, events=2048, samples=100)
FULL = BridgeEffort(trials=5, events=4096, samples=400)


def missing_dependency() -> str | None:
    """Why the bridge rows cannot run here, or None when they can."""
    for module in ("zmq", "msgpack"):
        try:
            importlib.import_module(module)
        except ImportError:
            return SKIP_REASON
    return None


# -- the bridge's process -----------------------------------------------------------------


def _bridge_process(url: str, conn: Any) -> None:
    """Follow the engine whose endpoints come first down ``conn``; answer whether the
    bridge started; on "stop", send its counts back."""
    from registry.bridge.bridge import Bridge, EngineSource

    first = conn.recv()
    if first == "stop":  # the bench failed before it had an engine to follow
        return
    endpoint, replay_endpoint = first
    source = EngineSource(NAMESPACE, endpoint, replay_endpoint, block_size=BLOCK_SIZE)
    bridge = Bridge(url, [source])
    bridge.start()
    conn.send(bridge.wait_ready(START_TIMEOUT))
    conn.recv()
    counts = bridge.counts()[NAMESPACE]
    bridge.stop()
    conn.send((counts, None if bridge.error is None else repr(bridge.error)))


class _BridgeProcess:
    """A bridge in a process of its own. It is forked before this process makes any
    ZeroMQ context (``follow`` then gives it the engine to follow), so the child shares
    no socket or I/O thread with this one; fork needs no ``__main__`` guard in the
    caller's script, as spawn would."""

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_bridge_process, args=(url, child), daemon=True)
        self.process.start()
        child.close()
        self.stopped = False

    def _answer(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise BridgeBenchError(
                    f"the bench's bridge exited ({self.process.exitcode}) {what}"
                )
            if time.monotonic() > deadline:
                raise BridgeBenchError(
                    f"the bench's bridge did not answer in {timeout:.0f} s {what}"
                )
        return self.conn.recv()

    def follow(self, publisher: Any) -> None:
        """Follow ``publisher``; returns once the bridge has subscribed and started."""
        self.conn.send((publisher.endpoint, publisher.replay_endpoint))
        if not self._answer(START_TIMEOUT, "while starting"):
            raise BridgeBenchError("the bench's bridge did not start")
        try:
            publisher.wait_subscribed(START_TIMEOUT)
        except TimeoutError:
            raise BridgeBenchError("the bench's bridge never subscribed") from None

    def stop(self) -> tuple[dict[str, int], str | None]:
        """Stop the bridge: its counts, and the error that stopped it early if any."""
        self.stopped = True
        self.conn.send("stop")
        counts, error = self._answer(30, "when stopped")
        return counts, error

    def close(self) -> None:
        if not self.stopped and self.process.is_alive():
            self.stopped = True
            with contextlib.suppress(OSError):
                self.conn.send("stop")
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


# -- workloads ------------------------------------------------------------------------------


@dataclass
class _Workload:
    """One trial's packed batches and what they leave in the namespace."""

    stores: list[bytes]
    removals: list[bytes]
    blocks: int


class _Blocks:
    """Fresh engine hashes and token ids."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.next_token = 0

    def hashes(self) -> list[int]:
        return [self.random.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]

    def tokens(self) -> list[int]:
        start = self.next_token
        self.next_token += BLOCKS_PER_EVENT * BLOCK_SIZE
        return [t % 50_000 for t in range(start, self.next_token)]


def _workload(engine: Any, fresh: _Blocks, events: int) -> _Workload:
    """A system prompt, then ``events`` BlockStored events spread over the conversations
    (``EVENTS_PER_BATCH`` conversations per batch), and the removals of all of it."""
    system = fresh.hashes()
    stored_events = [engine.stored(system, None, fresh.tokens(), BLOCK_SIZE)]
    chains = [system] * CONVERSATIONS
    order: list[list[int]] = [system]
    for i in range(events):
        c = i % CONVERSATIONS
        hashes = fresh.hashes()
        stored_events.append(engine.stored(hashes, chains[c][-1], fresh.tokens(), BLOCK_SIZE))
        chains[c] = hashes
        order.append(hashes)
    removed_events = [engine.removed(hashes[::-1]) for hashes in reversed(order)]
    return _Workload(
        stores=_batches(engine, stored_events),
        removals=_batches(engine, removed_events),
        blocks=len(order) * BLOCKS_PER_EVENT,
    )


def _batches(engine: Any, events: list[Any]) -> list[bytes]:
    return [
        engine.batch(events[i : i + EVENTS_PER_BATCH])
        for i in range(0, len(events), EVENTS_PER_BATCH)
    ]


# -- phases -----------------------------------------------------------------------------------


def _wait_for(client: Any, keys: NamespaceKeys, length: int, last_seq: int) -> float:
    """Poll until the KV hash holds ``length`` entries; the time it got there. The
    bridge records the engine seq in the same script as the blocks, so once it shows
    ``last_seq`` the hash is final: another length then is a loss, not a delay."""
    deadline = time.perf_counter() + PHASE_TIMEOUT
    while True:
        with client.pipeline(transaction=False) as pipe:
            pipe.hlen(keys.kv)
            pipe.hget(keys.meta, "bridge_seq")
            held, seq = pipe.execute()
        if held == length:
            return time.perf_counter()
        if seq is not None and int(seq) >= last_seq:
            raise BridgeBenchError(
                f"the bridge applied every batch but {keys.kv} holds {held} entries, not {length}"
            )
        if time.perf_counter() > deadline:
            raise BridgeBenchError(
                f"the bridge did not bring {keys.kv} to {length} entries in {PHASE_TIMEOUT:.0f} s"
            )
        time.sleep(0.001)


def _rate(publisher: Any, client: Any, payloads: list[bytes], blocks: int, to: int) -> float:
    """Blocks per second from the first publish until the KV hash holds ``to``."""
    started = time.perf_counter()
    last = -1
    for payload in payloads:
        last = publisher.publish_raw(payload)
    done = _wait_for(client, NamespaceKeys(NAMESPACE), to, last)
    return blocks / (done - started)


def _visibility(engine: Any, publisher: Any, client: Any, samples: int) -> dict[str, Any]:
    """Publish-to-visible in ``PrefixRouter.score`` over background batches."""
    fresh = _Blocks(1_000_000)
    router = PrefixRouter(client)
    system_tokens = fresh.tokens()
    system = fresh.hashes()
    publisher.publish([engine.stored(system, None, system_tokens, BLOCK_SIZE)])
    background_parent = system[-1]
    background_blocks = 0
    latencies: list[float] = []
    polls = 0
    began = next_background = time.perf_counter()
    for _ in range(samples):
        tokens = fresh.tokens()
        payload = engine.batch([engine.stored(fresh.hashes(), system[-1], tokens, BLOCK_SIZE)])
        own = block_hashes(system_tokens + tokens, BLOCK_SIZE)
        pause_until = time.perf_counter() + SAMPLE_GAP
        while True:  # background steps until the sample is due
            now = time.perf_counter()
            if now >= next_background:
                events = []
                for _ in range(BACKGROUND_EVENTS):
                    hashes = fresh.hashes()
                    events.append(
                        engine.stored(hashes, background_parent, fresh.tokens(), BLOCK_SIZE)
                    )
                    background_parent = hashes[-1]
                background_blocks += BACKGROUND_EVENTS * BLOCKS_PER_EVENT
                publisher.publish(events)
                next_background += BACKGROUND_INTERVAL
            if now >= pause_until:
                break
            time.sleep(max(0.0, min(next_background, pause_until) - time.perf_counter()))
        router.score(own, [NAMESPACE])  # warm: the script loaded, the connection open
        started = time.perf_counter()
        publisher.publish_raw(payload)
        while True:
            polls += 1
            score = router.score(own, [NAMESPACE]).get(NAMESPACE)
            if score is not None and score.kv_prefix >= len(own):
                break
            if time.perf_counter() - started > PHASE_TIMEOUT:
                raise BridgeBenchError("the bridge never made a published block visible")
        latencies.append((time.perf_counter() - started) * 1000)
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3),
        "max_ms": round(latencies[-1], 3),
        "samples": len(latencies),
        "polls_per_sample": round(polls / len(latencies), 1),
        "background_blocks_per_s": round(background_blocks / elapsed),
    }


def measure(url: str, *, quick: bool) -> dict[str, Any]:
    """The bridge rows against the server at ``url``: ``{"skipped": why}`` without the
    bridge extra, ``{"error": what}`` when a phase did not end, else the figures."""
    reason = missing_dependency()
    if reason is not None:
        return {"skipped": reason}
    try:
        return _measure(url, QUICK if quick else FULL)
    except BridgeBenchError as exc:
        return {"error": str(exc)}


def _measure(url: str, effort: BridgeEffort) -> dict[str, Any]:
    engine = importlib.import_module("sim.engine_events")
    client = redis.Redis.from_url(url)
    stored_rates: list[float] = []
    removed_rates: list[float] = []
    bridge = _BridgeProcess(url)  # forked before the publisher's ZeroMQ context exists
    try:
        with engine.EnginePublisher(buffer_steps=100_000) as publisher:
            bridge.follow(publisher)
            for trial in range(effort.trials):
                work = _workload(engine, _Blocks(trial), effort.events)
                stored_rates.append(_rate(publisher, client, work.stores, work.blocks, work.blocks))
                removed_rates.append(_rate(publisher, client, work.removals, work.blocks, 0))
            visible = _visibility(engine, publisher, client, effort.samples)
            counts, error = bridge.stop()
    finally:
        bridge.close()
        client.close()
    if error is not None:
        raise BridgeBenchError(f"the bridge stopped: {error}")
    return {
        "block_size": BLOCK_SIZE,
        "blocks_per_event": BLOCKS_PER_EVENT,
        "events_per_batch": EVENTS_PER_BATCH,
        "blocks_per_trial": (effort.events + 1) * BLOCKS_PER_EVENT,
        "stored_blocks_per_s": round(statistics.median(stored_rates)),
        "stored_runs": [round(r) for r in stored_rates],
        "removed_blocks_per_s": round(statistics.median(removed_rates)),
        "removed_runs": [round(r) for r in removed_rates],
        "publish_to_visible": visible,
        "bridge_counts": {name: counts.get(name, 0) for name in COUNTS},
    }


def format_rows(bridge: dict[str, Any] | None) -> list[str]:
    """The bridge rows as report lines."""
    if bridge is None:
        return []
    if "skipped" in bridge:
        return [f"bridge: skipped ({bridge['skipped']})"]
    if "error" in bridge:
        return [f"bridge: FAILED: {bridge['error']}"]
    stored, removed = bridge["stored_runs"], bridge["removed_runs"]
    visible = bridge["publish_to_visible"]
    return [
        f"bridge, {bridge['blocks_per_event']}-block BlockStored events, "
        f"{bridge['events_per_batch']} per batch, {bridge['blocks_per_trial']:,} blocks "
        f"per trial: stored {bridge['stored_blocks_per_s']:,} blocks/s "
        f"({min(stored):,} to {max(stored):,}), "
        f"removed {bridge['removed_blocks_per_s']:,} blocks/s "
        f"({min(removed):,} to {max(removed):,})",
        f"bridge publish to visible in score: p50 {visible['p50_ms']:.3f} ms, "
        f"p99 {visible['p99_ms']:.3f} ms ({visible['samples']} samples, background "
        f"{visible['background_blocks_per_s']:,} blocks/s)",
    ]
