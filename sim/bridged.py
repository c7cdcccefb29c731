"""The fleet fed through ``pcr bridge`` (``pcr simulate --bridge``).

Each node here is an engine, as vLLM or SGLang run it: it keeps its own KV block pool
(reference counts, leaf-first LRU eviction) and its own Mamba checkpoint slots, looks
its prompts up in its own prefix cache under its own block hashes (a chain seeded per
process, ``engine_events.engine_chain``, which no router can recompute), and never
calls the registry. What it caches and drops it publishes as vLLM KV events through
its own ``EnginePublisher`` (ZeroMQ XPUB plus a replay ROUTER), one batch per request:

- ``BlockStored`` for newly cached blocks, with their ``token_ids`` and the parent's
  engine hash (attention group: ``group_idx`` 0, ``kv_cache_spec_kind``
  ``"full_attention"``), and for a new Mamba checkpoint (``group_idx`` 1, ``"mamba"``);
- ``BlockRemoved`` for evicted blocks (group 0) and freed checkpoints (group 1; a block's
  checkpoint goes with the block, as the registry's ``evict_kv`` cascades).

One ``registry.bridge.bridge.Bridge`` follows every node into its namespace, hashing the
blocks with the registry's own chain, and the prefix router scores the nodes from Redis
exactly as in the normal mode. After the workload the run waits until the bridge has
applied every batch published (each namespace's ``bridge_seq``), then audits each node:
its cached blocks, translated to the registry's hashes with ``block_hashes`` over their
prefixes' tokens, against what its bridged namespace lists (``sim.audit.audit_bridged``).

Only which blocks hold a Mamba checkpoint is modelled here, not the states: they never
leave the engine, and the events carry none.

Needs the ``bridge`` extra (pyzmq, msgpack).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from registry import PrefixCacheRegistry, block_hashes, metrics
from registry.bridge.bridge import Bridge, EngineSource
from sim.audit import audit_bridged
from sim.checkpoints import hit_limit, prefill
from sim.config import BridgeConfig, BridgeStalled, FleetConfig
from sim.driver import drive, figures, router_tag
from sim.engine_events import EnginePublisher, engine_chain, removed, shared_context, stored
from sim.kv_pool import KVBlockPool
from sim.node import Totals
from sim.timings import Timings
from sim.workload import Request

ATTENTION, MAMBA = 0, 1
"""The engine's KV cache groups: full attention, then Mamba (``group_idx``)."""
START_TIMEOUT = 60.0
"""How long the bridge may take to take over the namespaces and subscribe (only a
bridge that cannot start reaches it)."""


class MambaCheckpoints:
    """An engine's Mamba checkpoint slots: which cached block each holds, least recently
    used first (a full pool gives up its LRU checkpoint for a new one)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.free = list(range(slots - 1, -1, -1))
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # block -> slot, LRU first
        self.stored = self.restored = self.freed = self.evicted = 0

    def holds(self, block: int) -> bool:
        return block in self.slot_of

    def restore(self, block: int) -> None:
        self.slot_of.move_to_end(block)
        self.restored += 1

    def store(self, block: int) -> int | None:
        """Checkpoint ``block``; returns the block whose checkpoint made room, if any."""
        victim = None
        if self.free:
            slot = self.free.pop()
        else:
            victim, slot = self.slot_of.popitem(last=False)
            self.evicted += 1
            self.freed += 1
        self.slot_of[block] = slot
        self.stored += 1
        return victim

    def drop(self, block: int) -> bool:
        """Free ``block``'s checkpoint; False when it has none."""
        slot = self.slot_of.pop(block, None)
        if slot is None:
            return False
        self.free.append(slot)
        self.freed += 1
        return True

    def counts(self) -> dict[str, int]:
        """The keys of ``gpu.slot_pool.PoolCounts``."""
        return {
            "slots": self.slots,
            "in_use": len(self.slot_of),
            "free": len(self.free),
            "stored": self.stored,
            "restored": self.restored,
            "freed": self.freed,
            "reconciled": 0,
            "evicted": self.evicted,
        }


class EngineNode:
    """One simulated engine: local KV pool and Mamba checkpoints, KV events out."""

    def __init__(
        self,
        namespace: str,
        config: FleetConfig,
        timings: Timings,
        publisher: EnginePublisher,
        *,
        drop_every: int = 0,
        duplicate_blocks: bool = False,
    ) -> None:
        self.namespace = namespace
        self.duplicate_blocks = duplicate_blocks
        self.copies: dict[int, list[int]] = {}  # engine hash -> its blocks besides block_of's
        self.copied = 0  # second copies stored
        self.config = config
        self.timings = timings
        self.publisher = publisher
        self.drop_every = drop_every
        self.seed = namespace.encode() + os.urandom(8)  # per process, as an engine's
        self.kv = KVBlockPool(config.kv_blocks)  # hash_of: the engine's own hashes
        self.mamba = MambaCheckpoints(config.mamba_slots)
        self.block_of: dict[int, int] = {}  # engine hash -> block
        self.tokens: dict[int, tuple[int, ...]] = {}  # block -> its token ids
        self.published = 0
        self.dropped = 0
        self.on_sent: Callable[[int], None] | None = None  # with each sent batch's seq

    def heal(self, totals: Totals) -> None:
        """Nothing to heal: an engine never talks to Redis (the bridge does)."""

    def serve(self, request: Request, totals: Totals) -> None:
        """Prefill one prompt against the engine's own cache, publishing what changed."""
        totals.requests += 1
        totals.prompt_tokens += len(request.tokens)
        events: list[Any] = []
        try:
            self._serve(request, totals, events)
        finally:  # what changed is published even when the request could not be served
            if events:
                self._publish(events)

    def _serve(self, request: Request, totals: Totals, events: list[Any]) -> None:
        """Match the prompt against the engine's blocks, allocate the rest, restore the
        farthest Mamba checkpoint, checkpoint where the rule says (``sim.checkpoints``;
        ``events``: what changed)."""
        size = self.config.block_size
        tokens = list(request.tokens)
        hashes = engine_chain(tokens, size, self.seed)
        n = len(hashes)
        if not n:
            return
        matched = 0
        while matched < n and hashes[matched] in self.block_of:
            matched += 1
        cached = [self.block_of[h] for h in hashes[:matched]]
        recomputed = 0  # vLLM computes a fully cached prompt's last block again
        if self.duplicate_blocks and matched == n and len(tokens) == n * size:
            self._copy_last(hashes, tokens, cached, events)
            recomputed = 1
        rule = self.config.mamba_checkpoints
        hits = min(matched - recomputed, hit_limit(rule, len(tokens), size))
        usable = next((i + 1 for i in range(hits - 1, -1, -1) if self.mamba.holds(cached[i])), 0)
        allocated = self._allocate(hashes, tokens, cached, totals, events)
        if allocated is None:
            totals.deferred_requests += 1
            return
        if usable:
            self.mamba.restore(cached[usable - 1])
            totals.mamba_restores += 1
        plan = prefill(rule, len(tokens), size, hits, usable)
        totals.prompt_blocks += n
        totals.kv_hit_blocks += hits
        totals.usable_hit_blocks += usable
        totals.prefill_tokens_saved += usable * size
        blocks = cached + allocated
        for i in plan.checkpoints[-self.config.mamba_slots :]:  # where the rule keeps state
            self._checkpoint(hashes, tokens, i, blocks[i], events)

    def _allocate(
        self,
        hashes: list[int],
        tokens: list[int],
        cached: list[int],
        totals: Totals,
        events: list[Any],
    ) -> list[int] | None:
        """The blocks of the prompt past its ``cached`` ones, allocated (evicting what it
        takes) and announced in one stored event; None where even eviction leaves too few
        free blocks (the request is deferred)."""
        size, n, matched = self.config.block_size, len(hashes), len(cached)
        allocated: list[int] = []
        for block in cached:
            self.kv.acquire(block)
        try:
            missing = n - matched
            free = len(self.kv.free)
            if missing > free and not self._evict(missing - free, totals, events):
                return None
            parent = cached[-1] if cached else None
            for i in range(matched, n):
                parent = self.kv.allocate(hashes[i], parent)
                self.block_of[hashes[i]] = parent
                self.tokens[parent] = tuple(tokens[i * size : (i + 1) * size])
                allocated.append(parent)
            if missing:
                events.append(
                    stored(
                        hashes[matched:],
                        hashes[matched - 1] if matched else None,
                        tokens[matched * size : n * size],
                        size,
                        group_idx=ATTENTION,
                        kind="full_attention",
                    )
                )
        finally:
            for block in cached + allocated:
                self.kv.release(block)
        return allocated

    def _checkpoint(
        self, hashes: list[int], tokens: list[int], i: int, block: int, events: list[Any]
    ) -> None:
        """The Mamba state at the prompt's block ``i`` (``block``), stored unless held (a
        victim's removal announced first)."""
        if self.mamba.holds(block):
            return
        size = self.config.block_size
        victim = self.mamba.store(block)
        if victim is not None:
            events.append(removed([self.kv.hash_of[victim]], group_idx=MAMBA))
        events.append(
            stored(
                [hashes[i]],
                hashes[i - 1] if i else None,
                tokens[i * size : (i + 1) * size],
                size,
                group_idx=MAMBA,
                kind="mamba",
            )
        )

    def _copy_last(
        self, hashes: list[int], tokens: list[int], cached: list[int], events: list[Any]
    ) -> None:
        """A second copy of a fully cached prompt's last block, as vLLM stores one (when
        a block is free: the copy is what vLLM computes into a newly allocated block)."""
        if not self.kv.free:
            return
        size, h = self.config.block_size, hashes[-1]
        parent = cached[-2] if len(cached) > 1 else None
        copy = self.kv.allocate(h, parent)
        self.tokens[copy] = tuple(tokens[-size:])
        self.copies.setdefault(h, []).append(copy)
        self.kv.release(copy)
        self.copied += 1
        events.append(
            stored(
                [h],
                hashes[-2] if len(hashes) > 1 else None,
                tokens[-size:],
                size,
                group_idx=ATTENTION,
                kind="full_attention",
            )
        )

    def _forget(self, block: int, h: int) -> None:
        """An evicted block leaves the engine's map; another copy takes its place."""
        copies = self.copies.get(h)
        if self.block_of.get(h) == block:
            if copies:
                self.block_of[h] = copies.pop()
            else:
                del self.block_of[h]
        elif copies is not None:
            copies.remove(block)
        if copies == []:
            del self.copies[h]
        del self.tokens[block]

    def _evict(self, count: int, totals: Totals, events: list[Any]) -> bool:
        """Free ``count`` KV blocks, leaves first, with their Mamba checkpoints; False
        when not enough are evictable."""
        while count > 0:
            victims = self.kv.victims(count)
            if not victims:
                return False
            hashes = [self.kv.hash_of[b] for b in victims]
            checkpoints = [self.kv.hash_of[b] for b in victims if self.mamba.drop(b)]
            if checkpoints:
                events.append(removed(checkpoints, group_idx=MAMBA))
            events.append(removed(hashes, group_idx=ATTENTION))
            for block, h in zip(victims, hashes, strict=True):
                self._forget(block, h)
                self.kv.drop(block)
            totals.kv_evictions += len(victims)
            count -= len(victims)
        return True

    def _publish(self, events: list[Any]) -> None:
        self.published += 1
        send = not (self.drop_every and self.published % self.drop_every == 0)
        with self.timings.timed("publish KV events (one batch)"):
            seq = self.publisher.publish(events, send=send)
        if not send:
            self.dropped += 1
            return
        if self.on_sent is not None:
            self.on_sent(seq)

    def cached(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The engine's cached blocks and Mamba checkpoints as (block id, own hash):
        each block's prefix tokens hashed with ``block_hashes``, the block id its
        position in that prefix (as a bridged namespace lists it)."""
        own: dict[int, tuple[int, int]] = {}
        kv = self.kv
        for leaf in [b for b, children in kv.children.items() if children == 0]:
            chain: list[int] = []
            current: int | None = leaf
            while current is not None:
                chain.append(current)
                current = kv.parent[current]
            chain.reverse()
            prefix = [t for block in chain for t in self.tokens[block]]
            hashes = block_hashes(prefix, self.config.block_size)
            for position, (block, h) in enumerate(zip(chain, hashes, strict=True)):
                own[block] = (position, h)
        return set(own.values()), {own[block] for block in self.mamba.slot_of}


def simulate_bridged(
    client: Any,
    config: FleetConfig,
    router: str,
    bridge_config: BridgeConfig,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """``sim.fleet.simulate`` with the nodes fed through ``pcr bridge``."""
    timings = Timings()
    names = [f"sim-{router_tag(router)}-engine-{i}" for i in range(config.nodes)]
    context = shared_context()  # one for all the engines' sockets
    with contextlib.ExitStack() as stack:
        stack.callback(context.term)  # last: after every socket closed
        publishers, bridge = _start_bridge(stack, context, client, config, bridge_config, names)
        nodes = [
            EngineNode(
                name,
                config,
                timings,
                p,
                drop_every=bridge_config.drop_every,
                duplicate_blocks=bridge_config.duplicate_blocks,
            )
            for name, p in zip(names, publishers, strict=True)
        ]
        registries = [PrefixCacheRegistry(client, n, key_prefix=config.key_prefix) for n in names]
        if bridge_config.lockstep:
            for node, registry in zip(nodes, registries, strict=True):
                node.on_sent = _lockstep(bridge, registry, timings, bridge_config)
        totals = Totals()
        assigned, route_fallbacks, elapsed = drive(
            client, config, router, nodes, timings, totals, progress
        )
        started = time.perf_counter()
        _catch_up(
            bridge,
            [(r, n.publisher.seq - 1) for n, r in zip(nodes, registries, strict=True)],
            bridge_config.catch_up_timeout,
        )
        catch_up = time.perf_counter() - started
        consistency = _audit(nodes, registries)
        bridge.stop()  # its counts are final from here on
        bridge_counts = _summed(bridge.counts().values())
    mamba_counts = [n.mamba.counts() for n in nodes]
    return {
        **figures(router, config, totals, assigned, route_fallbacks, timings),
        "consistency": consistency,
        "mamba": {key: sum(c[key] for c in mamba_counts) for key in mamba_counts[0]},
        "bridge": _bridge_figures(nodes, catch_up, bridge_counts),
        "namespaces": {
            r.namespace: {"kv_entries": info.kv_entries, "mamba_entries": info.mamba_entries}
            for r in registries
            for info in [r.info()]
        },
        "seconds": round(elapsed, 3),
    }


def _start_bridge(
    stack: contextlib.ExitStack,
    context: Any,
    client: Any,
    config: FleetConfig,
    bridge_config: BridgeConfig,
    names: list[str],
) -> tuple[list[EnginePublisher], Bridge]:
    """One engine publisher per name and one bridge following them all, started, owning
    its namespaces and subscribed to every engine; all closed when ``stack`` is."""
    publishers = [
        stack.enter_context(
            EnginePublisher(context=context, replay_frames=bridge_config.replay_frames)
        )
        for _ in names
    ]
    sources = [
        EngineSource(name, p.endpoint, p.replay_endpoint, block_size=config.block_size)
        for name, p in zip(names, publishers, strict=True)
    ]
    bridge = Bridge(
        client, sources, key_prefix=config.key_prefix, lease_ttl=bridge_config.lease_ttl
    )
    bridge.start()
    metrics.register_bridge(bridge)  # a no-op unless metrics are on
    stack.callback(bridge.stop)
    _wait_started(bridge, publishers)
    return publishers, bridge


def _bridge_figures(
    nodes: list[EngineNode], catch_up: float, bridge_counts: dict[str, int]
) -> dict[str, Any]:
    """The engines' batches and copies, the final catch-up and the bridge's counts."""
    return {
        "batches_published": sum(n.published for n in nodes),
        "batches_dropped": sum(n.dropped for n in nodes),
        "copies_stored": sum(n.copied for n in nodes),
        "catch_up_seconds": round(catch_up, 3),
        **bridge_counts,
    }


def _audit(nodes: list[EngineNode], registries: list[PrefixCacheRegistry]) -> dict[str, int]:
    """The consistency audit of every node's cache against its namespace, summed."""
    return _summed(
        audit_bridged(registry, *node.cached())
        for node, registry in zip(nodes, registries, strict=True)
    )


def _summed(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counts of several parts added up, key by key."""
    total: dict[str, int] = defaultdict(int)
    for part in counts:
        for key, value in part.items():
            total[key] += value
    return dict(total)


def _wait_started(bridge: Bridge, publishers: list[EnginePublisher]) -> None:
    """Until the bridge has taken over every namespace and subscribed to every engine."""
    if not bridge.wait_ready(START_TIMEOUT):
        raise BridgeStalled(
            f"the bridge did not take over its namespaces in {START_TIMEOUT:.0f} s"
            + (f": {bridge.error}" if bridge.error else "")
            + f"; its counts: {_troubles(bridge)}"
        )
    for publisher in publishers:
        try:
            publisher.wait_subscribed(START_TIMEOUT)
        except TimeoutError:
            raise BridgeStalled(
                f"the bridge did not subscribe to {publisher.endpoint} in {START_TIMEOUT:.0f} s"
            ) from None


def _lockstep(
    bridge: Bridge, registry: PrefixCacheRegistry, timings: Timings, config: BridgeConfig
) -> Callable[[int], None]:
    def wait(seq: int) -> None:
        with timings.timed("bridge lockstep wait"):
            _catch_up(bridge, [(registry, seq)], config.catch_up_timeout)

    return wait


def _catch_up(
    bridge: Bridge, wanted: list[tuple[PrefixCacheRegistry, int]], timeout: float
) -> None:
    """Until each namespace records (``bridge_seq``, written with the batch) that the
    bridge applied its engine's batch ``seq`` (-1: none published).
    Lost batches come back through the replay socket: at the engine's next batch, or when
    the bridge probes the quiet engine (after a third of the lease)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        if bridge.error is not None:
            raise BridgeStalled(f"the bridge stopped: {bridge.error!r}") from bridge.error
        taken = sorted(ns for ns, c in bridge.counts().items() if c["superseded"])
        if taken:
            raise BridgeStalled(f"another process took over {', '.join(taken)}")
        counts = bridge.counts()
        wanted = [(r, seq) for r, seq in wanted if seq >= 0 and not _applied(r, seq, counts)]
        if not wanted:
            return
        if time.monotonic() > deadline:
            behind = {r.namespace: f"{r.info().bridge_seq} of {seq}" for r, seq in wanted}
            raise BridgeStalled(
                f"the bridge did not apply every batch in {timeout:.0f} s (applied: {behind}); "
                f"its counts: {_troubles(bridge)}"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def _applied(registry: PrefixCacheRegistry, seq: int, counts: dict[str, Any]) -> bool:
    """Whether Redis records batch ``seq`` as applied and the bridge has counted it
    (``applied_seq``, set once its ``bridge_apply`` call returned)."""
    applied = registry.info().bridge_seq
    if applied is None or applied < seq:
        return False
    follower = counts.get(registry.namespace)
    return follower is None or int(follower["applied_seq"]) >= seq


def _troubles(bridge: Bridge) -> dict[str, dict[str, int]]:
    """The nonzero counts of each follower (for an error message)."""
    return {ns: {k: v for k, v in c.items() if v} for ns, c in bridge.counts().items()}
