"""GPU side of the registry: Mamba state slots and the eviction listener (torch).

Imports ``registry`` only; ``sim`` and ``pcr`` import it, ``registry`` never does (the
import-linter contracts in pyproject.toml hold that; ARCHITECTURE.md shows the layers).
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
