"""``Reconciler``: a ``MambaSlotPool``'s slots compared with the registry's Mamba map.

Pub/sub can lose notices, and a failed store's registration can land with its reply
lost; only a comparison with the registry finds either. The reconciler frees every
registered slot whose pair the registry no longer holds (unless the slot was reused
while the registry was read: generations tell), and withdraws from the registry the
entries of failed stores that landed anyway (*doubtful* pairs). Registry reads happen
outside the pool's lock; the table is touched only under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpu.slot_table import Pair, SlotSnapshot, SlotTable
from registry import RegistryBase


class Reconciler:
    """Frees the slots the registry no longer names and withdraws doubtful entries."""

    def __init__(
        self,
        table: SlotTable,
        lock: threading.RLock,
        announce: Callable[[list[Pair]], None],
    ) -> None:
        self.table = table
        self.lock = lock
        self.announce = announce
        self.doubtful: set[Pair] = set()  # registrations whose outcome is unknown

    def doubt(self, pairs: list[Pair]) -> None:
        """Remember pairs whose registration may have landed unseen (under the lock)."""
        self.doubtful.update(pairs)

    def reconcile(self, source: RegistryBase) -> list[Pair]:
        """Free every registered slot whose pair ``source`` lacks (one atomic read), then
        withdraw the doubtful entries that landed; return the pairs freed."""
        with self.lock:
            snapshot = []
            for slot, occupant in enumerate(self.table.occupants):
                if occupant is None:
                    continue
                if occupant.stamp is None:
                    occupant.recheck = True  # its registration may predate the read
                else:
                    snapshot.append(
                        SlotSnapshot(slot, occupant.generation, occupant.block_id, occupant.hash)
                    )
        freed = self.free_unregistered(source, snapshot)
        self._withdraw_doubtful(source)
        return freed

    def free_unregistered(self, source: RegistryBase, snapshot: list[SlotSnapshot]) -> list[Pair]:
        """Free each snapshot whose pair the registry lacks, unless its slot was reused
        since; count them reconciled, announce and return them."""
        if not snapshot:
            return []
        current = source.mamba_block_ids([seen.hash for seen in snapshot])
        freed: list[Pair] = []
        table = self.table
        with self.lock:
            for seen, registered in zip(snapshot, current, strict=True):
                occupant = table.occupants[seen.slot]
                if (
                    registered != seen.block_id
                    and occupant
                    and occupant.generation == seen.generation
                ):
                    freed.append(table.release(seen.slot))
        self.announce(freed)
        with self.lock:
            table.totals.reconciled += len(freed)
        return freed

    def _withdraw_doubtful(self, source: RegistryBase) -> None:
        """Remove from the registry the entries of failed stores that landed anyway (the
        reply was lost): they would name state this pool does not hold."""
        with self.lock:
            doubtful = [(b, h) for b, h in self.doubtful if self.table.holding(b, h) is None]
            self.doubtful.clear()
        if not doubtful:
            return
        try:
            current = source.mamba_block_ids([h for _, h in doubtful])
            landed = [h for (b, h), now in zip(doubtful, current, strict=True) if now == b]
            if landed:
                source.evict_mamba(landed)
        except Exception:
            with self.lock:  # try again at the next reconcile
                self.doubtful.update(doubtful)
            raise
