"""What a mirrored owner holds locally: the two maps, its notice numbering, its standing.

One ``OwnerState`` is shared by the registry (which answers from it and applies writes
to it) and the write-behind (which snapshots it for a resync and marks it lost). Its
``lock`` guards it and the write queue alike.
"""

from __future__ import annotations

import threading

from registry.core.errors import StaleEpochError
from registry.core.notices import EvictionNotice
from registry.core.types import BlockHash, BlockId, BlockPair, NoticeKind


class OwnerState:
    """The local model of one owned namespace: ``kv`` and ``mamba`` (hash -> block id),
    ``seq`` and ``incarnation`` (the notice numbering, Redis's own), and whether this
    owner is ``lost`` (fenced), ``closed``, or may write (``writes_ok``: claimed, not
    lost, not closed; the writes' fast check). Read and changed under ``lock``."""

    __slots__ = (
        "closed",
        "incarnation",
        "kv",
        "lock",
        "lost",
        "mamba",
        "namespace",
        "seq",
        "writes_ok",
    )

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lock = threading.Lock()
        self.kv: dict[int, int] = {}
        self.mamba: dict[int, int] = {}
        self.seq = 0
        self.incarnation = ""
        self.lost: StaleEpochError | None = None
        self.closed = False
        self.writes_ok = False

    def check_lost(self) -> None:
        """Raise ``StaleEpochError`` once this owner was fenced."""
        lost = self.lost
        if lost is not None:
            raise StaleEpochError(
                self.namespace,
                lost.epoch,
                f"this mirrored owner was fenced and stopped serving ({lost})",
            )

    def claimed(self, notice: EvictionNotice) -> None:
        """Under the lock: start over empty after a claim whose 'clear' is ``notice``
        (it gives the namespace's notice number and history)."""
        self.kv.clear()
        self.mamba.clear()
        self.seq = notice.seq
        self.incarnation = notice.incarnation
        self.lost = None
        self.writes_ok = not self.closed

    def notice(self, kind: NoticeKind, pairs: list[tuple[int, int]]) -> EvictionNotice:
        """Under the lock: the next notice, numbered as Redis will number it."""
        self.seq += 1
        listed = tuple(BlockPair(BlockId(b), BlockHash(h)) for b, h in pairs)
        return EvictionNotice(self.seq, kind, listed, self.incarnation)
