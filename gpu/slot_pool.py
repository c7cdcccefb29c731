"""``MambaSlotPool``: a fixed pool of GPU slots holding Mamba state checkpoints.

Each slot holds the conv and SSM states of one block, for every layer. The pool is
the owner of those slots; the registry is the shared truth of which (block_id, hash)
pairs have state. The two must never disagree in the harmful directions:

* a slot whose pair left the registry is freed (else GPU memory leaks), and
* a slot is never freed because of an older notice about the same pair or block id
  (block ids are reused, so a late notice must not free a newer state).

Every occupant therefore carries the registry's notice number at the moment it was
registered (its *stamp*, from ``register_mamba_stamped``): a notice can free it only if
the notice is numbered above the stamp. A clear notice frees every occupant stamped
below it. Notices about an occupant whose registration is still in flight are held
until its stamp is known. A per-slot generation makes ``reconcile`` safe against a
slot being reused while the registry is read.

Freeing is host-side bookkeeping only (no device synchronisation). All methods are
thread-safe: the engine thread and a listener thread may call them at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from registry import EvictionNotice, RegistryBase
from registry.validation import as_int

Pair = tuple[int, int]
"""(block_id, hash)."""

log = logging.getLogger(__name__)

MAX_HASH = 2**63 - 1


class PoolExhausted(RuntimeError):
    """Every slot is in use by a store still in flight: nothing can be evicted."""


@dataclass
class _Occupant:
    block_id: int
    hash: int
    generation: int
    stamp: int | None = None  # None while the registration is in flight
    held: list[EvictionNotice] = field(default_factory=list)  # notices awaiting the stamp
    recheck: bool = False  # a reconcile ran while in flight: check the registry at commit


@dataclass(frozen=True)
class PoolCounts:
    """Slot usage and what has happened to the pool so far."""

    slots: int
    in_use: int
    free: int
    stored: int
    restored: int
    freed: int
    reconciled: int
    evicted: int


class MambaSlotPool:
    """Preallocated ``conv_states (layers, slots, *conv_shape)`` and
    ``ssm_states (layers, slots, *ssm_shape)`` on one device, tied to one registry."""

    def __init__(
        self,
        registry: RegistryBase,
        num_slots: int,
        num_layers: int,
        conv_shape: Sequence[int],
        ssm_shape: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_free: Callable[[list[Pair]], None] | None = None,
    ) -> None:
        for name, value in (("num_slots", num_slots), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        self.registry = registry
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.conv_shape = tuple(int(d) for d in conv_shape)
        self.ssm_shape = tuple(int(d) for d in ssm_shape)
        self.conv_states = torch.zeros(
            (num_layers, num_slots, *self.conv_shape), dtype=dtype, device=self.device
        )
        self.ssm_states = torch.zeros(
            (num_layers, num_slots, *self.ssm_shape), dtype=dtype, device=self.device
        )
        self.on_free = on_free
        self._lock = threading.RLock()
        self._occupants: list[_Occupant | None] = [None] * num_slots
        self._slot_of_block: dict[int, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered slots, oldest use first
        self._generation = 0
        self._doubtful: set[Pair] = set()  # registrations whose outcome is unknown
        self._stored = self._restored = self._freed = self._reconciled = self._evicted = 0
        registry.add_eviction_hook(self.apply_notice)

    def close(self) -> None:
        """Detach from the registry's in-process notices."""
        self.registry.remove_eviction_hook(self.apply_notice)

    # -- store / restore ------------------------------------------------------------

    def store(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[int],
        conv: torch.Tensor,
        ssm: torch.Tensor,
    ) -> list[int]:
        """Copy ``conv (layers, n, *conv_shape)`` and ``ssm (layers, n, *ssm_shape)``
        into slots for the n blocks and register them; return the slots used.

        A full pool evicts its least recently used slots through the registry's
        ``evict_mamba``, so the whole cluster learns. A block id already stored is
        overwritten in place (with a new hash, its old entry is evicted first).
        """
        ids, hash_list = self._check_store(block_ids, hashes, conv, ssm)
        slots, replaced = self._reserve(ids, hash_list)
        try:
            if replaced:
                self.registry.evict_mamba(replaced)
            index = torch.tensor(slots, dtype=torch.long, device=self.device)
            self.conv_states[:, index] = conv.to(device=self.device, dtype=self.dtype)
            self.ssm_states[:, index] = ssm.to(device=self.device, dtype=self.dtype)
            stamp = self.registry.register_mamba_stamped(ids, hash_list)
        except BaseException:
            self._abandon(slots)
            with self._lock:  # the registration may have landed with its reply lost
                self._doubtful.update(zip(ids, hash_list, strict=True))
            raise
        self._commit(slots, stamp)
        return slots

    def restore(
        self,
        block_id: int,
        conv_out: torch.Tensor,
        ssm_out: torch.Tensor,
        *,
        expected_hash: int | None = None,
    ) -> bool:
        """Copy a block's states into ``conv_out (layers, *conv_shape)`` and ``ssm_out``.

        Returns False, copying nothing, when the block has no registered state (or
        holds another hash than ``expected_hash``): the engine then zeroes its state.
        """
        with self._lock:
            slot = self._slot_of_block.get(block_id)
            occupant = None if slot is None else self._occupants[slot]
            if slot is None or occupant is None or occupant.stamp is None:
                return False
            if expected_hash is not None and occupant.hash != expected_hash:
                return False
            conv_out.copy_(self.conv_states[:, slot])
            ssm_out.copy_(self.ssm_states[:, slot])
            self._lru.move_to_end(slot)
            self._restored += 1
            return True

    # -- freeing ----------------------------------------------------------------------

    def free(self, pairs: Iterable[Pair]) -> int:
        """Free the slots still holding exactly these (block_id, hash) pairs; idempotent."""
        freed: list[Pair] = []
        with self._lock:
            for block_id, h in pairs:
                slot = self._slot_of_block.get(block_id)
                occupant = None if slot is None else self._occupants[slot]
                if occupant is not None and occupant.hash == h and occupant.stamp is not None:
                    freed.append(self._release(slot))  # type: ignore[arg-type]
        self._announce(freed)
        return len(freed)

    def apply_notice(self, notice: EvictionNotice) -> int:
        """Free what an eviction notice removed; return the number of slots freed.

        Safe to apply the same notice twice, late, or out of order: only occupants
        registered before the notice (stamp < seq) with the exact pair are freed.
        """
        with self._lock:
            freed = self._apply_locked(notice)
        self._announce(freed)
        return len(freed)

    def reconcile(self, registry: RegistryBase | None = None) -> list[Pair]:
        """Free every registered slot whose pair is no longer in the registry's Mamba
        map (one atomic read); return the pairs freed."""
        source = self.registry if registry is None else registry
        with self._lock:
            snapshot = []
            for slot, occupant in enumerate(self._occupants):
                if occupant is None:
                    continue
                if occupant.stamp is None:
                    occupant.recheck = True  # its registration may predate the read
                else:
                    snapshot.append((slot, occupant.generation, occupant.block_id, occupant.hash))
        freed = self._free_unregistered(source, snapshot)
        with self._lock:
            self._reconciled += len(freed)
        self._withdraw_doubtful(source)
        return freed

    def _withdraw_doubtful(self, source: RegistryBase) -> None:
        """Remove from the registry the entries of failed stores that landed anyway (the
        reply was lost): they would name state this pool does not hold."""
        with self._lock:
            doubtful = [(b, h) for b, h in self._doubtful if not self.holds(b, h)]
            self._doubtful.clear()
        if not doubtful:
            return
        try:
            current = source.mamba_block_ids([h for _, h in doubtful])
            landed = [h for (b, h), now in zip(doubtful, current, strict=True) if now == b]
            if landed:
                source.evict_mamba(landed)
        except Exception:
            with self._lock:  # try again at the next reconcile
                self._doubtful.update(doubtful)
            raise

    def _free_unregistered(
        self, source: RegistryBase, snapshot: list[tuple[int, int, int, int]]
    ) -> list[Pair]:
        """Free each (slot, generation, block_id, hash) whose pair the registry lacks,
        unless the slot was reused since the snapshot."""
        if not snapshot:
            return []
        current = source.mamba_block_ids([h for _, _, _, h in snapshot])
        freed: list[Pair] = []
        with self._lock:
            for (slot, generation, block_id, _h), registered in zip(snapshot, current, strict=True):
                occupant = self._occupants[slot]
                if registered != block_id and occupant and occupant.generation == generation:
                    freed.append(self._release(slot))
        self._announce(freed)
        return freed

    # -- inspection -------------------------------------------------------------------

    def counts(self) -> PoolCounts:
        """Slots in use and free, and the running totals."""
        with self._lock:
            free = len(self._free_slots)
            return PoolCounts(
                slots=self.num_slots,
                in_use=self.num_slots - free,
                free=free,
                stored=self._stored,
                restored=self._restored,
                freed=self._freed,
                reconciled=self._reconciled,
                evicted=self._evicted,
            )

    def pairs(self) -> set[Pair]:
        """The (block_id, hash) pairs of every registered slot."""
        with self._lock:
            return {
                (o.block_id, o.hash)
                for o in self._occupants
                if o is not None and o.stamp is not None
            }

    def slot_of(self, block_id: int) -> int | None:
        """The slot holding ``block_id``'s state (registered or in flight), or None."""
        with self._lock:
            return self._slot_of_block.get(block_id)

    def holds(self, block_id: int, h: int) -> bool:
        """True if a registered slot holds exactly (block_id, h)."""
        with self._lock:
            slot = self._slot_of_block.get(block_id)
            occupant = None if slot is None else self._occupants[slot]
            return occupant is not None and occupant.hash == h and occupant.stamp is not None

    # -- internals --------------------------------------------------------------------

    def _check_store(
        self, block_ids: Sequence[int], hashes: Sequence[int], conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        ids = [as_int(b, "block_ids", i) for i, b in enumerate(block_ids)]
        hash_list = [as_int(h, "hashes", i) for i, h in enumerate(hashes)]
        if len(ids) != len(hash_list):
            raise ValueError(
                f"block_ids and hashes differ in length ({len(ids)} != {len(hash_list)})"
            )
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids repeat a block id")
        if not 0 < len(ids) <= self.num_slots:
            raise ValueError(f"store takes 1 to {self.num_slots} blocks, not {len(ids)}")
        for i, (b, h) in enumerate(zip(ids, hash_list, strict=True)):
            if b < 0:
                raise ValueError(f"block_ids[{i}] = {b} is negative")
            if not 1 <= h <= MAX_HASH:
                raise ValueError(f"hashes[{i}] = {h} is outside [1, 2^63-1]")
        layers = self.conv_states.shape[0]
        for name, tensor, shape in (("conv", conv, self.conv_shape), ("ssm", ssm, self.ssm_shape)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor")
            expected = (layers, len(ids), *shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")
        return ids, hash_list

    def _reserve(self, ids: list[int], hashes: list[int]) -> tuple[list[int], list[int]]:
        """Mark a slot per block as in flight, evicting LRU slots through the registry
        when too few are free. Returns (slots, old hashes of re-stored block ids)."""
        wanted = set(ids)
        for _attempt in range(8):
            with self._lock:
                for block_id in ids:
                    slot = self._slot_of_block.get(block_id)
                    if slot is not None and self._occupants[slot].stamp is None:  # type: ignore[union-attr]
                        raise RuntimeError(f"block {block_id} is being stored by another call")
                missing = sum(1 for b in ids if b not in self._slot_of_block)
                if missing <= len(self._free_slots):
                    return self._take(ids, hashes)
                victims = [
                    (slot, o.generation, o.hash)
                    for slot in self._lru
                    if (o := self._occupants[slot]) is not None and o.block_id not in wanted
                ][: missing - len(self._free_slots)]
            if not victims:
                raise PoolExhausted(f"all {self.num_slots} slots are held by stores in flight")
            self.registry.evict_mamba([h for _, _, h in victims])  # the hook frees them
            freed: list[Pair] = []
            with self._lock:
                self._evicted += len(victims)
                # A victim whose hash had already left the registry got no notice.
                for slot, generation, _h in victims:
                    occupant = self._occupants[slot]
                    if occupant is not None and occupant.generation == generation:
                        freed.append(self._release(slot))
            self._announce(freed)
        raise PoolExhausted("other calls keep taking the slots this store frees")

    def _take(self, ids: list[int], hashes: list[int]) -> tuple[list[int], list[int]]:
        slots, replaced = [], []
        for block_id, h in zip(ids, hashes, strict=True):
            slot = self._slot_of_block.get(block_id)
            if slot is None:
                slot = self._free_slots.pop()
                self._slot_of_block[block_id] = slot
            else:
                old = self._occupants[slot]
                assert old is not None
                if old.hash != h:
                    replaced.append(old.hash)
                self._lru.pop(slot, None)
            self._generation += 1
            self._occupants[slot] = _Occupant(block_id, h, self._generation)
            slots.append(slot)
        return slots, replaced

    def _commit(self, slots: list[int], stamp: int) -> None:
        freed: list[Pair] = []
        recheck: list[tuple[int, int, int, int]] = []
        with self._lock:
            for slot in slots:
                occupant = self._occupants[slot]
                assert occupant is not None
                assert occupant.stamp is None
                occupant.stamp = stamp
                self._lru[slot] = None
                if occupant.recheck:
                    recheck.append((slot, occupant.generation, occupant.block_id, occupant.hash))
            self._stored += len(slots)
            for slot in slots:
                occupant = self._occupants[slot]
                if occupant is not None and occupant.held:
                    held, occupant.held = occupant.held, []
                    for notice in held:
                        freed.extend(self._apply_locked(notice))
        self._announce(freed)
        if recheck:  # rare: a reconcile skipped these while they were in flight
            reclaimed = self._free_unregistered(self.registry, recheck)
            with self._lock:
                self._reconciled += len(reclaimed)

    def _abandon(self, slots: list[int]) -> None:
        """A store failed: its in-flight slots hold nothing registered; free them."""
        with self._lock:
            for slot in slots:
                occupant = self._occupants[slot]
                if occupant is not None and occupant.stamp is None:
                    self._occupants[slot] = None
                    del self._slot_of_block[occupant.block_id]
                    self._free_slots.append(slot)

    def _apply_locked(self, notice: EvictionNotice) -> list[Pair]:
        freed: list[Pair] = []
        if notice.cleared:
            candidates = [s for s, o in enumerate(self._occupants) if o is not None]
        else:
            candidates = []
            for block_id, h in notice.pairs:
                slot = self._slot_of_block.get(block_id)
                occupant = None if slot is None else self._occupants[slot]
                if slot is not None and occupant is not None and occupant.hash == h:
                    candidates.append(slot)
        for slot in candidates:
            occupant = self._occupants[slot]
            assert occupant is not None
            if occupant.stamp is None:
                occupant.held.append(notice)
            elif occupant.stamp < notice.seq:
                freed.append(self._release(slot))
        return freed

    def _release(self, slot: int) -> Pair:
        occupant = self._occupants[slot]
        assert occupant is not None
        self._occupants[slot] = None
        del self._slot_of_block[occupant.block_id]
        self._lru.pop(slot, None)
        self._free_slots.append(slot)
        self._freed += 1
        return occupant.block_id, occupant.hash

    def _announce(self, freed: list[Pair]) -> None:
        if freed and self.on_free is not None:
            try:
                self.on_free(freed)
            except Exception:
                log.exception("on_free callback failed")
