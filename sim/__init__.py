"""The fleet simulation behind ``pcr simulate``: a workload, serving nodes with KV and
Mamba pools, routers, and the consistency audit. Uses ``gpu`` and ``registry``; with a
``BridgeConfig`` the nodes publish engine KV events that ``pcr bridge`` follows instead
(``sim.bridged``, needs the ``bridge`` extra)."""

from __future__ import annotations

from sim.config import (
    BridgeConfig,
    BridgeStalled,
    FleetConfig,
    FleetConfigError,
    check_fleet_config,
)
from sim.fleet import simulate
from sim.workload import Workload, WorkloadConfig

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
