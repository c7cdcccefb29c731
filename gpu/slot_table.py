"""``SlotTable``: which state each slot of a ``MambaSlotPool`` holds, and how slots are
handed out.

The table keeps the occupant of every slot, the slot of every block id, the free list,
the least-recently-used order of registered slots, and the previous occupants that a
store has claimed and is evicting. It is host-side bookkeeping only (no tensors, no
Redis) and not thread-safe: the pool calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from registry import EvictionNotice

Pair = tuple[int, int]
"""(block_id, hash)."""


class PoolExhausted(RuntimeError):
    """Too few slots are free or evictable for a store: the others are held by stores
    still in flight (or are the very blocks being stored)."""


@dataclass(eq=False)
class Occupant:
    """The state one slot holds: its block and hash, the slot's generation when it came,
    and the registry's notice number when it was registered (its stamp)."""

    block_id: int
    hash: int
    generation: int
    stamp: int | None = None  # None while the registration is in flight
    held: list[EvictionNotice] = field(default_factory=list)  # notices awaiting the stamp
    recheck: bool = False  # a reconcile ran while in flight: check the registry at commit
    gone: bool = False  # claimed by a store, and its entry left the registry meanwhile
    last_use: int = 0  # its LRU tick when a store claimed it (to put it back in place)


@dataclass(frozen=True)
class Reservation:
    """A slot a store claimed: its new in-flight occupant, and what the slot held before
    (an LRU victim, or an older state of the same block id) until the store evicts it."""

    slot: int
    occupant: Occupant
    previous: Occupant | None


@dataclass(frozen=True)
class SlotSnapshot:
    """A registered occupant as seen at one moment, to compare with the registry later:
    freed only if its slot still holds the same generation then."""

    slot: int
    generation: int
    block_id: int
    hash: int


@dataclass
class Totals:
    """The pool's running totals (``PoolCounts`` says what each counts)."""

    stored: int = 0
    restored: int = 0
    freed: int = 0
    reconciled: int = 0
    evicted: int = 0


class SlotTable:
    """The slots' occupants, the block id index, the free list and the LRU order."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.occupants: list[Occupant | None] = [None] * num_slots
        self.slot_of_block: dict[int, int] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # Registered slots, oldest use first, each with the tick of its last use.
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.tick = 0
        self.claimed: dict[int, Occupant] = {}  # by generation: being evicted by a store
        self.generation = 0
        self.totals = Totals()

    # -- looking up ---------------------------------------------------------------------

    def holding(self, block_id: int, h: int, *, registered: bool = False) -> int | None:
        """The slot whose occupant is exactly (block_id, h), in flight or (with
        ``registered``) registered only; None if there is none."""
        slot = self.slot_of_block.get(block_id)
        occupant = None if slot is None else self.occupants[slot]
        if occupant is None or occupant.hash != h:
            return None
        if registered and occupant.stamp is None:
            return None
        return slot

    def registered_slot(self, block_id: int) -> int | None:
        """The slot of ``block_id``'s registered occupant, or None."""
        slot = self.slot_of_block.get(block_id)
        occupant = None if slot is None else self.occupants[slot]
        return None if occupant is None or occupant.stamp is None else slot

    def registered_pairs(self) -> set[Pair]:
        """The (block_id, hash) pairs of every registered slot."""
        return {
            (o.block_id, o.hash) for o in self.occupants if o is not None and o.stamp is not None
        }

    def in_flight(self) -> int:
        """How many slots hold a state whose registration is in flight."""
        return sum(1 for o in self.occupants if o is not None and o.stamp is None)

    # -- changing -----------------------------------------------------------------------

    def touch(self, slot: int) -> None:
        """Mark a registered slot as the most recently used."""
        self.tick += 1
        self.lru[slot] = self.tick
        self.lru.move_to_end(slot)

    def release(self, slot: int) -> Pair:
        """Free ``slot`` and count it freed; return the pair it held."""
        occupant = self.occupants[slot]
        assert occupant is not None
        self.occupants[slot] = None
        del self.slot_of_block[occupant.block_id]
        self.lru.pop(slot, None)
        self.free_slots.append(slot)
        self.totals.freed += 1
        return occupant.block_id, occupant.hash

    def reserve(self, ids: list[int], hashes: list[int]) -> list[Reservation]:
        """Claim a slot per block in one step: its own slot for a block id already
        stored, else a free slot, else the least recently used registered slot of
        another block. Claimed slots hold the new in-flight occupants; their previous
        occupants wait in ``claimed`` until the store evicts them (or gives them back).
        Raises (changing nothing) when a block is being stored by another call, or
        ``PoolExhausted`` when too few slots are free or evictable."""
        spare = iter(self._victims(ids))
        reservations = []
        for block_id, h in zip(ids, hashes, strict=True):
            previous: Occupant | None = None
            slot_or_none = self.slot_of_block.get(block_id)
            if slot_or_none is not None:
                slot = slot_or_none
                previous = self.occupants[slot]
            elif self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot = next(spare)
                previous = self.occupants[slot]
                assert previous is not None
                del self.slot_of_block[previous.block_id]
            if previous is not None:
                previous.last_use = self.lru.pop(slot)
                self.claimed[previous.generation] = previous
            self.generation += 1
            occupant = Occupant(block_id, h, self.generation)
            self.occupants[slot] = occupant
            self.slot_of_block[block_id] = slot
            reservations.append(Reservation(slot, occupant, previous))
        return reservations

    def _victims(self, ids: list[int]) -> list[int]:
        """The least recently used registered slots a store of ``ids`` must evict (none
        while enough are free); refuses as ``reserve`` says."""
        missing = 0
        for i, block_id in enumerate(ids):
            slot = self.slot_of_block.get(block_id)
            if slot is None:
                missing += 1
            elif self.occupants[slot].stamp is None:  # type: ignore[union-attr]
                raise RuntimeError(f"block_ids[{i}] = {block_id} is being stored by another call")
        shortfall = missing - len(self.free_slots)
        victims: list[int] = []
        if shortfall <= 0:
            return victims
        wanted = set(ids)
        for slot in self.lru:  # oldest use first
            occupant = self.occupants[slot]
            assert occupant is not None
            if occupant.block_id not in wanted:
                victims.append(slot)
                if len(victims) == shortfall:
                    return victims
        raise PoolExhausted(
            f"store needs {missing} new slots: {len(self.free_slots)} free, "
            f"{len(victims)} evictable, {self.in_flight()} held by stores in flight "
            f"(of {self.num_slots})"
        )

    def drop_claimed(self, reservations: list[Reservation]) -> list[Pair]:
        """The store evicted what its slots held before: count them; return their pairs."""
        freed: list[Pair] = []
        for r in reservations:
            previous = r.previous
            if previous is None:
                continue
            del self.claimed[previous.generation]
            self.totals.freed += 1
            if previous.block_id != r.occupant.block_id:
                self.totals.evicted += 1
            freed.append((previous.block_id, previous.hash))
        return freed

    def give_back(self, reservations: list[Reservation]) -> tuple[list[Pair], list[Pair]]:
        """The store's eviction failed before anything was copied: give every claimed
        slot back to its previous occupant, unless a notice removed that one meanwhile
        or its block id was stored again elsewhere (then it is freed). Returns the pairs
        freed, and those of them whose entries may still be in the registry."""
        freed: list[Pair] = []
        doubtful: list[Pair] = []
        for r in reservations:  # in flight: no one else has touched these slots
            assert self.occupants[r.slot] is r.occupant
            self.occupants[r.slot] = None
            del self.slot_of_block[r.occupant.block_id]
        reinstated = False
        for r in reservations:
            previous = r.previous
            if previous is None:
                self.free_slots.append(r.slot)
                continue
            del self.claimed[previous.generation]
            if not previous.gone and previous.block_id not in self.slot_of_block:
                self.occupants[r.slot] = previous
                self.slot_of_block[previous.block_id] = r.slot
                self.lru[r.slot] = previous.last_use
                reinstated = True
                continue
            self.free_slots.append(r.slot)
            self.totals.freed += 1
            freed.append((previous.block_id, previous.hash))
            if not previous.gone:
                doubtful.append((previous.block_id, previous.hash))
        if reinstated:  # back in their places: order by last use (rare, so sort)
            self.lru = OrderedDict(sorted(self.lru.items(), key=lambda item: item[1]))
        return freed, doubtful

    def abandon(self, slots: list[int]) -> None:
        """A store failed: its in-flight slots hold nothing registered; free them."""
        for slot in slots:
            occupant = self.occupants[slot]
            if occupant is not None and occupant.stamp is None:
                self.occupants[slot] = None
                del self.slot_of_block[occupant.block_id]
                self.free_slots.append(slot)

    def commit(self, slots: list[int], stamp: int) -> list[SlotSnapshot]:
        """A store's registration landed with ``stamp``: its slots are registered and
        the most recently used. Returns those a reconcile skipped while they were in
        flight (to compare with the registry now)."""
        recheck: list[SlotSnapshot] = []
        for slot in slots:
            occupant = self.occupants[slot]
            assert occupant is not None
            assert occupant.stamp is None
            occupant.stamp = stamp
            self.touch(slot)
            if occupant.recheck:
                recheck.append(
                    SlotSnapshot(slot, occupant.generation, occupant.block_id, occupant.hash)
                )
        self.totals.stored += len(slots)
        return recheck
