"""A simulated fleet of serving nodes sharing prefix-cache state through Redis.

Each node owns a namespace (``claim``), a bounded KV block pool with reference counts
and leaf-first LRU eviction (a block whose descendants are cached is never evicted),
and a Mamba slot pool (small CPU tensors) with its eviction listener. Every request is
served the way a hybrid engine would: match the KV prefix, find the farthest Mamba
checkpoint inside it and restore it, evict to make room, register the new blocks, and
checkpoint the Mamba state of the prompt's last block. A router sends each request to a
node, round-robin or by prefix (``PrefixRouter.best``). At the end the run checks that
the pools and the registry agree: no leaked slot, no wrongly freed slot, no registry
entry pointing at a freed block.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpu.listener import EvictionListener
from gpu.slot_pool import MambaSlotPool
from gpu.workload import Request, Workload, WorkloadConfig
from registry import (
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryUnavailable,
    StaleEpochError,
    block_hashes,
)
from registry.errors import unavailable_as_registry_error
from registry.keys import validate_key_prefix

ROUTERS = ("round-robin", "prefix")

MAX_NODES = 256
"""Each node runs a listener thread with its own Redis connection."""
MAX_BLOCK_SIZE = 2**31 - 1
MAX_SIMULATION_BYTES = 4 * 2**30
"""Host memory a run may ask for: Mamba slot tensors plus KV bookkeeping, all nodes."""
KV_BLOCK_BYTES = 256
"""Host memory per KV block of a ``KVBlockPool`` (its free list and dict entries), high."""
STATE_BYTES = torch.float32.itemsize
"""The simulated Mamba states are float32."""


@dataclass(frozen=True)
class FleetConfig:
    """Sizes of the simulated fleet."""

    nodes: int = 4
    kv_blocks: int = 512  # per node
    mamba_slots: int = 32  # per node
    block_size: int = 16
    layers: int = 2
    conv_shape: tuple[int, ...] = (4, 8)
    ssm_shape: tuple[int, ...] = (4, 8)
    key_prefix: str = "pcr"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


class FleetConfigError(ValueError):
    """A ``FleetConfig`` the simulation cannot run; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_fleet_config(config: FleetConfig) -> None:
    """Refuse a fleet that is malformed or would not fit in memory, before anything is
    allocated or claimed: one-line ``FleetConfigError`` (a ``ValueError``) naming the
    field, sizes computed from the requested shapes (``TypeError`` for wrong kinds)."""
    if not isinstance(config, FleetConfig):
        raise TypeError(f"config must be a FleetConfig, not {type(config).__name__}")
    nodes = _size(config.nodes, "nodes", MAX_NODES)
    kv_blocks = _size(config.kv_blocks, "kv_blocks")
    slots = _size(config.mamba_slots, "mamba_slots")
    _size(config.block_size, "block_size", MAX_BLOCK_SIZE)
    layers = _size(config.layers, "layers")
    values = _values(config.conv_shape, "conv_shape") + _values(config.ssm_shape, "ssm_shape")
    try:
        validate_key_prefix(config.key_prefix)
    except ValueError as exc:
        raise FleetConfigError("key_prefix", str(exc)) from None
    if not isinstance(config.workload, WorkloadConfig):
        raise TypeError(f"workload must be a WorkloadConfig, not {type(config.workload).__name__}")
    _size(config.workload.requests, "requests")
    limit = _bytes(MAX_SIMULATION_BYTES)
    kv_bytes = nodes * kv_blocks * KV_BLOCK_BYTES
    if kv_bytes > MAX_SIMULATION_BYTES:
        raise FleetConfigError(
            "kv_blocks",
            f"kv_blocks = {kv_blocks} is too large: {nodes} nodes x {kv_blocks} blocks x "
            f"~{KV_BLOCK_BYTES} bytes = {_bytes(kv_bytes)}, over the {limit} a simulation may use",
        )
    mamba_bytes = nodes * slots * layers * values * STATE_BYTES
    if mamba_bytes + kv_bytes > MAX_SIMULATION_BYTES:
        raise FleetConfigError(
            "mamba_slots",
            f"mamba_slots = {slots} is too large: {nodes} nodes x {slots} slots x {layers} "
            f"layers x {values} values x {STATE_BYTES} bytes = {_bytes(mamba_bytes)} "
            f"(with {_bytes(kv_bytes)} for KV blocks), over the {limit} a simulation may use",
        )


def _size(value: object, name: str, high: int | None = None) -> int:
    """A positive int (not a bool) of at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise FleetConfigError(name, f"{name} = {value} must be at least 1")
    if high is not None and value > high:
        raise FleetConfigError(name, f"{name} = {value} is too large: at most {high}")
    return value


def _values(shape: object, name: str) -> int:
    """The number of values in one slot's state of ``shape`` (positive dims)."""
    if not isinstance(shape, tuple):
        raise TypeError(f"{name} must be a tuple of ints, not {type(shape).__name__}")
    for i, dim in enumerate(shape):
        _size(dim, f"{name}[{i}]")
    return math.prod(shape)


def _bytes(count: int) -> str:
    """``count`` bytes for a message, in the largest unit that leaves at least 1."""
    if count >= 2**1000:  # past what a float holds
        return f"about 10^{len(str(count)) - 1} bytes"
    for unit, scale in (
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"


class KVBlockPool:
    """A node's KV block allocator: reference counts, parent links, and leaf-first LRU.

    Only blocks nobody uses and no cached block descends from are evictable, oldest
    use first; evicting a leaf may make its parent one.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.hash_of: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def allocate(self, h: int, parent: int | None) -> int:
        block = self.free.pop()
        self.hash_of[block] = h
        self.parent[block] = parent
        self.children[block] = 0
        self.refs[block] = 1
        if parent is not None:
            self.children[parent] += 1
            self.evictable.pop(parent, None)
        return block

    def acquire(self, block: int) -> None:
        self.refs[block] += 1
        self.evictable.pop(block, None)

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        self._maybe_evictable(block)

    def victims(self, count: int) -> list[int]:
        """Up to ``count`` evictable blocks, least recently used first (leaves only)."""
        return list(self.evictable)[:count]

    def drop(self, block: int) -> None:
        """Forget an evicted block (it must be a leaf nobody uses)."""
        assert self.refs[block] == 0, f"block {block} is in use"
        assert self.children[block] == 0, f"block {block} has cached descendants"
        self.evictable.pop(block, None)
        parent = self.parent.pop(block)
        del self.hash_of[block], self.children[block], self.refs[block]
        self.free.append(block)
        if parent is not None:
            self.children[parent] -= 1
            self._maybe_evictable(parent)

    def with_descendants(self, blocks: set[int]) -> set[int]:
        """``blocks`` and every cached block that descends from one of them."""
        result = set(blocks)
        for block in list(self.hash_of):
            chain = []
            current: int | None = block
            while current is not None and current not in result:
                chain.append(current)
                current = self.parent[current]
            if current is not None:
                result.update(chain)
        return result

    def drop_all(self, blocks: set[int]) -> None:
        """Forget ``blocks`` (none in use; closed under descendants), leaves first."""
        remaining = set(blocks)
        while remaining:
            leaves = [b for b in remaining if self.children[b] == 0]
            assert leaves, "drop_all needs a set closed under descendants"
            for block in leaves:
                self.drop(block)
                remaining.discard(block)

    def _maybe_evictable(self, block: int) -> None:
        if self.refs[block] == 0 and self.children[block] == 0:
            self.evictable[block] = None
            self.evictable.move_to_end(block)


@dataclass
class Totals:
    """What a run counted, summed over the fleet."""

    requests: int = 0
    prompt_blocks: int = 0
    kv_hit_blocks: int = 0
    usable_hit_blocks: int = 0
    prompt_tokens: int = 0
    prefill_tokens_saved: int = 0
    kv_evictions: int = 0
    mamba_restores: int = 0
    mamba_restore_misses: int = 0
    deferred_requests: int = 0  # no KV room even after eviction (all blocks in use)
    unavailable_requests: int = 0  # served without the cache: Redis unavailable
    stale_epoch_requests: int = 0  # this node's epoch was gone (server restarted empty)
    resyncs: int = 0  # after a fault: local pools checked against the registry
    reclaims: int = 0  # namespace claimed again, every local block forgotten


class Node:
    """One serving node: its registry, KV pool, Mamba slot pool and listener."""

    def __init__(self, client: Any, namespace: str, config: FleetConfig, timings: Timings) -> None:
        self.config = config
        self.timings = timings
        self.registry = PrefixCacheRegistry(client, namespace, key_prefix=config.key_prefix)
        self.registry.claim(lease_ttl=60.0)
        self.kv = KVBlockPool(config.kv_blocks)
        self.mamba = MambaSlotPool(
            self.registry, config.mamba_slots, config.layers, config.conv_shape, config.ssm_shape
        )
        self.listener = EvictionListener(
            client, namespace, self.mamba, key_prefix=config.key_prefix
        )
        self.listener.start()
        self.suspect = False  # a registry call failed: resync before the next request
        self._conv_out = torch.empty((config.layers, *config.conv_shape))
        self._ssm_out = torch.empty((config.layers, *config.ssm_shape))

    @property
    def namespace(self) -> str:
        return self.registry.namespace

    def serve(self, request: Request, totals: Totals) -> None:
        """Prefill one prompt the way a hybrid engine does, against the registry.

        When Redis is unavailable the request is served without the cache (counted) and
        the node resynchronises before its next request; when its epoch is gone (the
        server restarted empty, or another process claimed the namespace) it claims
        again and starts empty: no node keeps using mappings it cannot confirm.
        """
        totals.requests += 1
        totals.prompt_tokens += len(request.tokens)
        try:
            if self.suspect:
                self._resync(totals)
            self._serve(request, totals)
        except RegistryUnavailable:
            totals.unavailable_requests += 1
            self.suspect = True
        except StaleEpochError:
            totals.stale_epoch_requests += 1
            self.suspect = True

    def heal(self, totals: Totals) -> None:
        """What a heartbeat does for a node that saw a fault: resync (or claim again) as
        soon as Redis answers, so the router sees it live again without waiting for a
        request (a dead node gets none)."""
        if not self.suspect:
            return
        with contextlib.suppress(RegistryUnavailable, StaleEpochError):  # still away: later
            self._resync(totals)

    def _serve(self, request: Request, totals: Totals) -> None:
        size = self.config.block_size
        hashes = block_hashes(request.tokens, size)
        if not hashes:
            return
        reg, timed = self.registry, self.timings.timed
        with timed("match_kv_prefix"):
            cached, _ = reg.match_kv_prefix(hashes)
        matched = len(cached)
        usable = 0
        if matched:
            with timed("match_mamba_farthest"):
                usable = reg.match_mamba_farthest(hashes[:matched])
        acquired: list[int] = []
        allocated: list[int] = []
        try:
            for block in cached:
                self.kv.acquire(block)
                acquired.append(block)
            missing = len(hashes) - matched
            if missing > len(self.kv.free) and not self._evict(missing - len(self.kv.free), totals):
                totals.deferred_requests += 1
                return
            parent = cached[-1] if cached else None
            for h in hashes[matched:]:
                parent = self.kv.allocate(h, parent)
                allocated.append(parent)
            if missing:
                with timed("register_kv"):
                    reg.register_kv(allocated, hashes[matched:])
        except BaseException:
            for block in reversed(allocated):  # never registered (or not known to be)
                self.kv.release(block)
                self.kv.drop(block)
            allocated = []
            raise
        finally:
            for block in acquired + allocated:
                self.kv.release(block)
        blocks = cached + allocated
        if usable and self.mamba.restore(
            cached[usable - 1], self._conv_out, self._ssm_out, expected_hash=hashes[usable - 1]
        ):
            totals.mamba_restores += 1
        elif usable:
            totals.mamba_restore_misses += 1
            usable = 0
        totals.prompt_blocks += len(hashes)
        totals.kv_hit_blocks += matched
        totals.usable_hit_blocks += usable
        totals.prefill_tokens_saved += usable * size
        # Checkpoint the Mamba state at the prompt's last block (a later turn restores it).
        if not self.mamba.holds(blocks[-1], hashes[-1]):
            conv = torch.randn((self.config.layers, 1, *self.config.conv_shape))
            ssm = torch.randn((self.config.layers, 1, *self.config.ssm_shape))
            with timed("store_mamba (register_mamba)"):
                self.mamba.store([blocks[-1]], [hashes[-1]], conv, ssm)

    def _resync(self, totals: Totals) -> None:
        """After a fault: keep only what the registry and this node agree on."""
        try:
            self.registry.renew()
        except StaleEpochError:
            self._start_over(totals)
            return
        client: Any = self.registry.client
        keys = self.registry.keys
        with unavailable_as_registry_error(f"resync of {self.namespace!r}"):
            kv_entries = {int(h): int(b) for h, b in client.hgetall(keys.kv).items()}
        local = self.kv.hash_of
        doubtful = {b for b, h in local.items() if kv_entries.get(h) != b}
        doomed = self.kv.with_descendants(doubtful)
        stray = [h for h, b in kv_entries.items() if local.get(b) != h]
        confirmed_doomed = [local[b] for b in doomed if b not in doubtful]
        if stray or confirmed_doomed:
            self.registry.evict_kv(stray + confirmed_doomed)
        self.kv.drop_all(doomed)
        with unavailable_as_registry_error(f"resync of {self.namespace!r}"):
            mamba_entries = {(int(b), int(h)) for h, b in client.hgetall(keys.mamba).items()}
        unheld = [h for b, h in mamba_entries if not self.mamba.holds(b, h)]
        if unheld:
            self.registry.evict_mamba(unheld)
        self.mamba.reconcile()
        self.suspect = False
        totals.resyncs += 1

    def _start_over(self, totals: Totals) -> None:
        """The namespace is gone or taken: claim it again and forget every block."""
        self.registry.claim(lease_ttl=60.0)
        self.kv.drop_all(set(self.kv.hash_of))
        self.mamba.reconcile()
        self.suspect = False
        totals.reclaims += 1

    def _evict(self, count: int, totals: Totals) -> bool:
        """Free ``count`` KV blocks, leaves first, through the registry (cascading to
        Mamba, whose notice frees the slots); False when not enough are evictable."""
        while count > 0:
            victims = self.kv.victims(count)
            if not victims:
                return False
            with self.timings.timed("evict_kv"):
                self.registry.evict_kv([self.kv.hash_of[b] for b in victims])
            for block in victims:
                self.kv.drop(block)
            totals.kv_evictions += len(victims)
            count -= len(victims)
        return True

    def consistency(self) -> dict[str, int]:
        """Disagreements between this node's pools and the registry (all must be 0)."""
        client: Any = self.registry.client
        keys = self.registry.keys
        kv_entries = {int(h): int(b) for h, b in client.hgetall(keys.kv).items()}
        mamba_entries = {(int(b), int(h)) for h, b in client.hgetall(keys.mamba).items()}
        slots = self.mamba.pairs()
        allocated = {(b, h) for b, h in self.kv.hash_of.items()}
        return {
            "leaked_mamba_slots": len(slots - mamba_entries),
            "wrongly_freed_slots": len(mamba_entries - slots),
            "entries_pointing_at_freed_blocks": sum(
                1 for h, b in kv_entries.items() if self.kv.hash_of.get(b) != h
            ),
            "blocks_missing_from_registry": len(
                allocated - {(b, h) for h, b in kv_entries.items()}
            ),
        }

    def close(self) -> None:
        self.listener.stop()
        self.mamba.close()


class Timings:
    """Wall-clock latency of each registry operation, in milliseconds."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.samples[operation].append((time.perf_counter() - start) * 1000)

    def summary(self) -> dict[str, dict[str, float]]:
        result = {}
        for operation, samples in sorted(self.samples.items()):
            ordered = sorted(samples)
            result[operation] = {
                "calls": len(ordered),
                "p50_ms": round(statistics.median(ordered), 4),
                "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
            }
        return result


def simulate(
    client: Any,
    config: FleetConfig,
    router: str,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the workload through a fleet routed by ``router``; return the figures."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
    check_fleet_config(config)
    timings = Timings()
    tag = "rr" if router == "round-robin" else router
    nodes = [Node(client, f"sim-{tag}-node-{i}", config, timings) for i in range(config.nodes)]
    names = [n.namespace for n in nodes]
    by_name = dict(zip(names, nodes, strict=True))
    prefix_router = PrefixRouter(client, config.key_prefix)
    assigned: dict[str, int] = dict.fromkeys(names, 0)
    totals = Totals()
    route_fallbacks = 0
    started = time.perf_counter()
    try:
        for request in Workload(config.workload):
            for node in nodes:
                node.heal(totals)
            target = names[request.number % len(names)]
            if router == "prefix":
                hashes = block_hashes(request.tokens, config.block_size)
                try:
                    with timings.timed("route (score all nodes)"):
                        target = (
                            prefix_router.best(hashes, load=assigned, namespaces=names) or target
                        )
                except RegistryUnavailable:
                    route_fallbacks += 1  # round-robin while Redis is away
            assigned[target] += 1
            by_name[target].serve(request, totals)
            if progress is not None:
                progress(request.number + 1, config.workload.requests)
        elapsed = time.perf_counter() - started
        consistency = _settle(nodes)
    finally:
        for node in nodes:
            node.close()
    listener_counts = [asdict(n.listener.counts()) for n in nodes]
    pool_counts = [asdict(n.mamba.counts()) for n in nodes]
    return {
        "router": router,
        "nodes": config.nodes,
        "requests": totals.requests,
        "seed": config.workload.seed,
        "hit_rate_blocks": _ratio(totals.kv_hit_blocks, totals.prompt_blocks),
        "usable_hit_rate_blocks": _ratio(totals.usable_hit_blocks, totals.prompt_blocks),
        "hit_rate_tokens": _ratio(totals.prefill_tokens_saved, totals.prompt_tokens),
        "totals": asdict(totals),
        "requests_per_node": assigned,
        "route_fallbacks": route_fallbacks,
        "latency_ms": timings.summary(),
        "consistency": consistency,
        "mamba": {key: sum(c[key] for c in pool_counts) for key in pool_counts[0]},
        "listener": {key: sum(c[key] for c in listener_counts) for key in listener_counts[0]},
        "seconds": round(elapsed, 3),
    }


def _settle(nodes: list[Node], timeout: float = 10.0) -> dict[str, int]:
    """Let every listener catch up, then sum the disagreements (they must be 0)."""
    deadline = time.monotonic() + timeout
    while True:
        caught_up = all(n.listener.counts().last_seq >= n.registry.notice_sequence() for n in nodes)
        if caught_up or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    total: dict[str, int] = defaultdict(int)
    for node in nodes:
        for key, value in node.consistency().items():
            total[key] += value
    return dict(total)


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
