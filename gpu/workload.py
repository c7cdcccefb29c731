"""Moved to ``sim.workload``; kept while the CLI is being moved (removed with it)."""

from __future__ import annotations

from sim.workload import Request, Workload, WorkloadConfig

__all__ = ["Request", "Workload", "WorkloadConfig"]
