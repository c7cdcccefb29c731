"""The fleet simulation behind ``pcr simulate``: a workload, serving nodes with KV and
Mamba pools, routers, and the consistency audit. Uses ``gpu`` and ``registry``; with a
``BridgeConfig`` the nodes publish engine KV events that ``pcr bridge`` follows instead
(``sim.bridged``, needs the ``bridge`` extra).

The names below load on first use, so that the torch-free modules (the traces,
``sim.trace``; the engine cache, ``sim.engine_cache``; the trace replay) import without
torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.config import (
        BridgeConfig,
        BridgeStalled,
        FleetConfig,
        FleetConfigError,
        check_fleet_config,
    )
    from sim.fleet import simulate
    from sim.workload import Workload, WorkloadConfig

_HOMES = {
    "BridgeConfig": "sim.config",
    "BridgeStalled": "sim.config",
    "FleetConfig": "sim.config",
    "FleetConfigError": "sim.config",
    "check_fleet_config": "sim.config",
    "simulate": "sim.fleet",
    "Workload": "sim.workload",
    "WorkloadConfig": "sim.workload",
}

__all__ = [
    "BridgeConfig",
    "BridgeStalled",
    "FleetConfig",
    "FleetConfigError",
    "Workload",
    "WorkloadConfig",
    "check_fleet_config",
    "simulate",
]


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'sim' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
