"""One simulated serving node: its registry, KV pool, Mamba slot pool and listener,
serving requests as a hybrid engine would and healing after Redis faults."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from gpu.listener import EvictionListener
from gpu.slot_pool import MambaSlotPool
from registry import (
    MirroredRegistry,
    PrefixCacheRegistry,
    RegistryUnavailable,
    StaleEpochError,
    block_hashes,
    metrics,
)
from sim.audit import audit
from sim.checkpoints import hit_limit, prefill
from sim.config import FleetConfig
from sim.kv_pool import KVBlockPool
from sim.timings import Timings
from sim.workload import Request


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
        self.registry: PrefixCacheRegistry | MirroredRegistry
        if config.mirror:  # answered locally, written behind; no one else may write
            self.registry = MirroredRegistry(client, namespace, key_prefix=config.key_prefix)
        else:
            self.registry = PrefixCacheRegistry(client, namespace, key_prefix=config.key_prefix)
        self.registry.claim(lease_ttl=60.0)
        self.kv = KVBlockPool(config.kv_blocks)
        self.mamba = MambaSlotPool(
            self.registry, config.mamba_slots, config.layers, config.conv_shape, config.ssm_shape
        )
        # A mirrored namespace needs no listener: every removal in it is this node's own
        # and reaches the pool through the registry's hook, in the call.
        self.listener: EvictionListener | None = None
        if not config.mirror:
            self.listener = EvictionListener(
                client, namespace, self.mamba, key_prefix=config.key_prefix
            )
            self.listener.start()
        # Read at scrape time when metrics are on (pcr simulate --metrics-port); else no-ops.
        metrics.register_owner(self.registry)
        metrics.register_pool(self.mamba)
        if self.listener is not None:
            metrics.register_listener(self.listener)
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
        rule = self.config.mamba_checkpoints
        reach = min(matched, hit_limit(rule, len(request.tokens), size))
        usable = 0
        if reach:
            with timed("match_mamba_farthest"):
                usable = reg.match_mamba_farthest(hashes[:reach])
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
        plan = prefill(rule, len(request.tokens), size, matched, usable)
        totals.prompt_blocks += len(hashes)
        totals.kv_hit_blocks += plan.kv_hit
        totals.usable_hit_blocks += usable
        totals.prefill_tokens_saved += usable * size
        self._checkpoint([(blocks[i], hashes[i]) for i in plan.checkpoints])

    def _checkpoint(self, points: list[tuple[int, int]]) -> None:
        """Keep the Mamba state at ``points`` (block, hash) not held yet, where the rule
        puts them (``sim.checkpoints``): a later request restores it. A pool smaller than
        the points keeps the farthest ones."""
        wanted = [(b, h) for b, h in points if not self.mamba.holds(b, h)]
        wanted = wanted[-self.config.mamba_slots :]
        if not wanted:
            return
        layers, count = self.config.layers, len(wanted)
        conv = torch.randn((layers, count, *self.config.conv_shape))
        ssm = torch.randn((layers, count, *self.config.ssm_shape))
        with self.timings.timed("store_mamba (register_mamba)"):
            self.mamba.store([b for b, _ in wanted], [h for _, h in wanted], conv, ssm)

    def _resync(self, totals: Totals) -> None:
        """After a fault: keep only what the registry and this node agree on."""
        try:
            self.registry.renew()
        except StaleEpochError:
            self._start_over(totals)
            return
        kv_entries, mamba_map = self.registry.entries()
        local = self.kv.hash_of
        doubtful = {b for b, h in local.items() if kv_entries.get(h) != b}
        doomed = self.kv.with_descendants(doubtful)
        stray = [h for h, b in kv_entries.items() if local.get(b) != h]
        confirmed_doomed = [local[b] for b in doomed if b not in doubtful]
        if stray or confirmed_doomed:
            self.registry.evict_kv(stray + confirmed_doomed)
        self.kv.drop_all(doomed)
        unheld = [h for h, b in mamba_map.items() if not self.mamba.holds(b, h)]
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
        """Disagreements between this node's pools and the registry (all must be 0); a
        mirrored node's is audited against Redis once its writes are flushed."""
        if isinstance(self.registry, MirroredRegistry):
            self.registry.flush()
            return audit(self.registry.inner, self.kv, self.mamba)
        return audit(self.registry, self.kv, self.mamba)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()
        self.mamba.close()
        if isinstance(self.registry, MirroredRegistry):
            self.registry.close()
