"""The consistency audit: a node's pools against the registry, every figure must be 0."""

from __future__ import annotations

from gpu.slot_pool import MambaSlotPool
from registry import PrefixCacheRegistry
from sim.kv_pool import KVBlockPool


def audit(registry: PrefixCacheRegistry, kv: KVBlockPool, mamba: MambaSlotPool) -> dict[str, int]:
    """Leaked slots, wrongly freed slots, registry entries pointing at freed blocks and
    blocks missing from the registry (read through the registry's read API)."""
    kv_entries, mamba_map = registry.entries()
    mamba_entries = {(b, h) for h, b in mamba_map.items()}
    slots = mamba.pairs()
    allocated = set(kv.hash_of.items())
    return {
        "leaked_mamba_slots": len(slots - mamba_entries),
        "wrongly_freed_slots": len(mamba_entries - slots),
        "entries_pointing_at_freed_blocks": sum(
            1 for h, b in kv_entries.items() if kv.hash_of.get(b) != h
        ),
        "blocks_missing_from_registry": len(allocated - {(b, h) for h, b in kv_entries.items()}),
    }


def audit_bridged(
    registry: PrefixCacheRegistry, kv: set[tuple[int, int]], mamba: set[tuple[int, int]]
) -> dict[str, int]:
    """The same four figures for a node fed through ``pcr bridge``: its engine's cached
    blocks ``kv`` and Mamba checkpoints ``mamba``, both as (block id, own hash) pairs
    (block id = position in the prefix, as the bridge lists them), against what the
    bridged namespace lists. A checkpoint the namespace does not list is a leaked slot
    (no router finds it), a listed one the engine dropped a wrongly freed slot."""
    kv_entries, mamba_map = registry.entries()
    listed = {(b, h) for h, b in kv_entries.items()}
    mamba_entries = {(b, h) for h, b in mamba_map.items()}
    return {
        "leaked_mamba_slots": len(mamba - mamba_entries),
        "wrongly_freed_slots": len(mamba_entries - mamba),
        "entries_pointing_at_freed_blocks": len(listed - kv),
        "blocks_missing_from_registry": len(kv - listed),
    }
