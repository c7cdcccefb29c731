"""GPU side of the registry: Mamba state slots and the eviction listener (torch).

Imports ``registry``; ``registry`` never imports this package.
"""

from __future__ import annotations

from gpu.listener import EvictionListener, ListenerCounts
from gpu.slot_pool import MambaSlotPool, Pair, PoolCounts, PoolExhausted

__all__ = [
    "EvictionListener",
    "ListenerCounts",
    "MambaSlotPool",
    "Pair",
    "PoolCounts",
    "PoolExhausted",
]
