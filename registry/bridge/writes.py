"""The batches one engine's follower has decoded and not yet written, and the one
``bridge_apply`` call that writes them (:class:`PendingWrite`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from registry.bridge.counts import FollowerCounts
from registry.bridge.source import EngineSource
from registry.namespace.redis_registry import PrefixCacheRegistry

MAX_BLOCKS_PER_WRITE = 1024
"""A write carries whole batches; a new write starts once this many blocks wait (a few
milliseconds of script time, which routers' calls wait behind)."""


class PendingWrite:
    """The ``bridge_apply`` operations of whole batches, waiting to be written in one
    call (atomic, in order, never partial), and the last engine seq among them.

    ``apply`` sends one call and counts what it changed; it raises the registry's
    errors (the follower decides whether to retry, restart or stop).
    """

    def __init__(
        self, registry: PrefixCacheRegistry, source: EngineSource, counts: FollowerCounts
    ) -> None:
        self.registry = registry
        self.source = source
        self.counts = counts
        k = registry.keys
        self.keys = (k.kv, k.mamba, k.meta, k.engine_blocks)
        self.ops: list[Any] = []  # operations not yet written
        self.blocks = 0  # blocks they carry
        self.seq: int | None = None  # the last engine seq they include

    @property
    def empty(self) -> bool:
        """Whether nothing waits: no operation, no seq to record."""
        return not self.ops and self.seq is None

    @property
    def full(self) -> bool:
        """Whether enough blocks wait that a new write should start."""
        return self.blocks >= MAX_BLOCKS_PER_WRITE

    def clear(self) -> None:
        """Forget what waits (written, or the namespace restarted)."""
        self.ops = []
        self.blocks = 0
        self.seq = None

    def apply(
        self,
        ops: Sequence[Any],
        seq: int | None,
        block_size: int | None,
        groups: Sequence[Any] = (),
    ) -> None:
        """One ``bridge_apply`` call: ``ops`` up to engine seq ``seq`` (None: none, the
        call records the engine, endpoint and block size only), after ``groups`` (the
        operation naming the engine's Mamba groups, or nothing)."""
        data = (
            "" if seq is None else str(seq),
            self.source.engine,
            self.source.endpoint,
            "" if block_size is None else str(block_size),
            *(groups if ops else ()),
            *ops,
        )
        stored, removed, unknown, cleared = self.registry.run_write(
            "bridge_apply", self.keys, False, data
        )
        counts = self.counts
        counts.writes += 1
        if seq is not None:
            counts.applied_seq = seq
        counts.blocks_stored += int(stored)
        counts.blocks_removed += int(removed)
        counts.unknown_removals += int(unknown)
        counts.clears += int(cleared)
