"""The fleet simulation behind ``pcr simulate``: a workload, serving nodes with KV and
Mamba pools, routers, and the consistency audit. Uses ``gpu`` and ``registry``."""

from __future__ import annotations

from sim.config import FleetConfig, FleetConfigError, check_fleet_config
from sim.fleet import simulate
from sim.workload import Workload, WorkloadConfig

__all__ = [
    "FleetConfig",
    "FleetConfigError",
    "Workload",
    "WorkloadConfig",
    "check_fleet_config",
    "simulate",
]
