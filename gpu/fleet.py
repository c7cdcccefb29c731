"""Moved to the ``sim`` package; kept while the CLI is being moved (removed with it)."""

from __future__ import annotations

from sim.config import FleetConfig, FleetConfigError, check_fleet_config
from sim.fleet import simulate

__all__ = ["FleetConfig", "FleetConfigError", "check_fleet_config", "simulate"]
