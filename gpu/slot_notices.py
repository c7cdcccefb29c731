"""``SlotNotices``: the rule by which eviction notices free a ``MambaSlotPool``'s slots.

A notice frees an occupant only if it names the occupant's exact (block_id, hash), or
clears the map, and is numbered above the occupant's stamp. An occupant whose
registration is in flight has no stamp yet: the notice is held on it and applied when
the store commits. A previous occupant that a store is evicting is marked gone, so that
a failed eviction does not bring it back. Called under the pool's lock.
"""

from __future__ import annotations

from gpu.slot_table import Pair, SlotTable
from registry import EvictionNotice


class SlotNotices:
    """Applies notices, and the pool's own frees, to a slot table by the stamp rule."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table

    def apply(self, notice: EvictionNotice) -> list[Pair]:
        """Free what ``notice`` removed from the registry; hold it on the in-flight
        occupants it names; return the pairs freed."""
        table = self.table
        if notice.cleared:
            candidates = [s for s, o in enumerate(table.occupants) if o is not None]
        else:
            candidates = []
            for block_id, h in notice.pairs:
                slot = table.holding(block_id, h)
                if slot is not None:
                    candidates.append(slot)
        if table.claimed:  # being evicted by a store: if its eviction fails, stay gone
            removed = {(b, h) for b, h in notice.pairs}
            for previous in table.claimed.values():
                assert previous.stamp is not None
                if previous.stamp < notice.seq and (
                    notice.cleared or (previous.block_id, previous.hash) in removed
                ):
                    previous.gone = True
        freed: list[Pair] = []
        for slot in candidates:
            occupant = table.occupants[slot]
            assert occupant is not None
            if occupant.stamp is None:
                if notice not in occupant.held:  # the hook and a listener both deliver it
                    occupant.held.append(notice)
            elif occupant.stamp < notice.seq:
                freed.append(table.release(slot))
        return freed

    def forget(self, pairs: list[Pair]) -> None:
        """The pool freed ``pairs`` itself: a store evicting one of them must not give
        it back if its eviction fails."""
        if self.table.claimed:
            dropped = set(pairs)
            for previous in self.table.claimed.values():
                if (previous.block_id, previous.hash) in dropped:
                    previous.gone = True

    def apply_held(self, slot: int) -> list[Pair]:
        """Apply the notices a just-registered occupant held while in flight, to it alone.

        Each held notice already reached every other occupant when it arrived (the other
        in-flight ones hold their own copy), so applying it pool-wide again would hand
        every store still in flight one more copy per commit: the copies would multiply.
        """
        occupant = self.table.occupants[slot]
        if occupant is None or not occupant.held:
            return []
        held, occupant.held = occupant.held, []
        assert occupant.stamp is not None
        if any(occupant.stamp < notice.seq for notice in held):
            return [self.table.release(slot)]
        return []
