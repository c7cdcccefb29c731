"""Typed exceptions the scripts' status replies turn into."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class of the registry's own errors (bad input raises TypeError/ValueError)."""


class StaleEpochError(RegistryError):
    """A write from an owner whose epoch was superseded: another process claimed the
    namespace, or its lease ran out and the namespace was garbage-collected. Nothing
    was changed; the process must stop writing (or claim again and start empty)."""

    def __init__(self, namespace: str, epoch: int | None, detail: str) -> None:
        super().__init__(f"namespace {namespace!r}: {detail}")
        self.namespace = namespace
        self.epoch = epoch
