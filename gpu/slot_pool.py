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

Every public method checks all its arguments first (``gpu.checks``) and refuses a bad
call with ``TypeError``/``ValueError`` before any slot, tensor or Redis key changes.

A store *claims* the slots it needs in one step under the pool's lock: free slots
first, then the least recently used registered ones (its victims), which from then on
belong to that store alone; so concurrent stores never take each other's evicted slots,
and each eviction is counted once. A store that fails part way leaves a consistent
state (see ``store``).

Freeing is host-side bookkeeping only (no device synchronisation). All methods are
thread-safe: the engine threads and a listener thread may call them at once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gpu import checks
from registry import EvictionNotice, RegistryBase

Pair = tuple[int, int]
"""(block_id, hash)."""

log = logging.getLogger(__name__)

MAX_HASH = 2**63 - 1
MAX_POOL_BYTES = 2**63 - 1
"""Above this the element count of the state tensors overflows torch's int64 sizes."""


class PoolExhausted(RuntimeError):
    """Too few slots are free or evictable for a store: the others are held by stores
    still in flight (or are the very blocks being stored)."""


@dataclass(eq=False)
class _Occupant:
    block_id: int
    hash: int
    generation: int
    stamp: int | None = None  # None while the registration is in flight
    held: list[EvictionNotice] = field(default_factory=list)  # notices awaiting the stamp
    recheck: bool = False  # a reconcile ran while in flight: check the registry at commit
    gone: bool = False  # claimed by a store, and its entry left the registry meanwhile
    last_use: int = 0  # its LRU tick when a store claimed it (to put it back in place)


@dataclass(frozen=True)
class _Reservation:
    """A slot a store claimed: its new in-flight occupant, and what the slot held before
    (an LRU victim, or an older state of the same block id) until the store evicts it."""

    slot: int
    occupant: _Occupant
    previous: _Occupant | None


@dataclass(frozen=True)
class PoolCounts:
    """Slot usage and what has happened to the pool so far.

    ``stored`` counts registered blocks and ``freed`` the registered blocks dropped since
    (by notice, ``free``, reconcile, LRU eviction, or being stored again), each once;
    so when no store is in flight, ``stored == in_use + freed``. ``evicted`` counts the
    LRU victims this pool evicted to make room (each once; they are also ``freed``).
    """

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
    ``ssm_states (layers, slots, *ssm_shape)`` on one device, tied to one registry.

    ``dtype`` is any floating-point dtype (float32, bfloat16, float16, float64, the
    float8 kinds); ``device`` is ``"cpu"`` or a CUDA device (``"cuda"`` means the current
    one). Tensors passed to ``store`` and ``restore`` must match the pool exactly: shape
    (no broadcasting), device, strided layout, and dtype; ``cast=True`` lets a call
    convert another floating dtype instead (lossy, so restores are then not bit-exact).
    """

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
        if not isinstance(registry, RegistryBase):
            raise TypeError(
                f"registry must be a registry (PrefixCacheRegistry, LocalPrefixCacheRegistry), "
                f"not {type(registry).__name__}"
            )
        num_slots = checks.count(num_slots, "num_slots")
        num_layers = checks.count(num_layers, "num_layers")
        conv_dims = checks.state_shape(conv_shape, "conv_shape")
        ssm_dims = checks.state_shape(ssm_shape, "ssm_shape")
        dtype = checks.float_dtype(dtype)
        where = checks.pool_device(device)
        if on_free is not None and not callable(on_free):
            raise TypeError(f"on_free must be callable or None, not {type(on_free).__name__}")
        size = (
            num_layers * num_slots * (math.prod(conv_dims) + math.prod(ssm_dims)) * dtype.itemsize
        )
        if size > MAX_POOL_BYTES:
            raise ValueError(
                f"the pool would take {size} bytes ({num_layers} layers x {num_slots} slots x "
                f"{conv_dims} + {ssm_dims} x {dtype.itemsize} bytes), above 2^63-1"
            )
        self.registry = registry
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.device = where
        self.dtype = dtype
        self.conv_shape = conv_dims
        self.ssm_shape = ssm_dims
        self.conv_states = torch.zeros(
            (num_layers, num_slots, *conv_dims), dtype=dtype, device=where
        )
        self.ssm_states = torch.zeros((num_layers, num_slots, *ssm_dims), dtype=dtype, device=where)
        self.on_free = on_free
        self._lock = threading.RLock()
        self._occupants: list[_Occupant | None] = [None] * num_slots
        self._slot_of_block: dict[int, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # Registered slots, oldest use first, each with the tick of its last use.
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._tick = 0
        self._claimed: dict[int, _Occupant] = {}  # by generation: being evicted by a store
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
        *,
        cast: bool = False,
    ) -> list[int]:
        """Copy ``conv (layers, n, *conv_shape)`` and ``ssm (layers, n, *ssm_shape)``
        into slots for the n blocks and register them; return the slots used.

        Block ids and hashes must be distinct within the call. A full pool evicts its
        least recently used slots; a block id already stored has its old entry evicted
        too (even with the same hash: its slot is about to be overwritten). One
        ``evict_mamba`` does both, then the copy, then ``register_mamba_stamped``.
        ``PoolExhausted`` (nothing changed) when too few slots are free or evictable.

        A failure leaves a consistent state. If the eviction fails, the pool is as it
        was: each claimed slot is back with its state and LRU place (unless a notice
        removed its entry meanwhile). If the copy fails, what was evicted is gone from
        both the pool and Redis, and the new blocks are in neither. If the registration
        fails, the new blocks' slots go back; entries that landed with a lost reply are
        withdrawn by the next ``reconcile``.
        """
        cast = checks.flag(cast, "cast")
        ids, hash_list = checks.block_ids_and_hashes(block_ids, hashes, self.num_slots)
        conv = self._incoming(conv, "conv", (len(ids), *self.conv_shape), cast)
        ssm = self._incoming(ssm, "ssm", (len(ids), *self.ssm_shape), cast)
        reservations = self._reserve(ids, hash_list)
        slots = [r.slot for r in reservations]
        claimed = [r.previous.hash for r in reservations if r.previous is not None]
        if claimed:
            try:
                self.registry.evict_mamba(claimed)
            except BaseException:
                self._undo(reservations)
                raise
            self._drop_claimed(reservations)
        try:
            with torch.no_grad():
                index = torch.tensor(slots, dtype=torch.long, device=self.device)
                self.conv_states[:, index] = conv
                self.ssm_states[:, index] = ssm
        except BaseException:
            self._abandon(slots)
            raise
        try:
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
        cast: bool = False,
    ) -> bool:
        """Copy a block's states into ``conv_out (layers, *conv_shape)`` and ``ssm_out``.

        Returns False, copying nothing, when the block has no registered state (or
        holds another hash than ``expected_hash``): the engine then zeroes its state.
        The outputs must match the pool (see the class) and not share memory with each
        other or with the pool's states.
        """
        block = checks.block_id(block_id)
        expected = (
            None if expected_hash is None else checks.real_hash(expected_hash, "expected_hash")
        )
        cast = checks.flag(cast, "cast")
        outputs = (
            ("conv_out", conv_out, self.conv_shape),
            ("ssm_out", ssm_out, self.ssm_shape),
        )
        for name, tensor, shape in outputs:
            checks.state_tensor(
                tensor,
                name,
                (self.num_layers, *shape),
                self.dtype,
                self.device,
                cast=cast,
                output=True,
            )
            for states in (self.conv_states, self.ssm_states):
                if checks.overlaps(tensor, states):
                    raise ValueError(f"{name} shares memory with the pool's states")
        if checks.overlaps(conv_out, ssm_out):
            raise ValueError("conv_out and ssm_out share memory")
        with self._lock:
            slot = self._slot_of_block.get(block)
            occupant = None if slot is None else self._occupants[slot]
            if slot is None or occupant is None or occupant.stamp is None:
                return False
            if expected is not None and occupant.hash != expected:
                return False
            with torch.no_grad():
                conv_out.copy_(self.conv_states[:, slot])
                ssm_out.copy_(self.ssm_states[:, slot])
            self._touch(slot)
            self._restored += 1
            return True

    # -- freeing ----------------------------------------------------------------------

    def free(self, pairs: Iterable[Pair]) -> int:
        """Free the slots still holding exactly these (block_id, hash) pairs; idempotent
        (a pair may repeat). Every pair is checked before any slot is freed."""
        wanted = checks.pair_list(pairs)
        freed: list[Pair] = []
        with self._lock:
            for block_id, h in wanted:
                slot = self._slot_of_block.get(block_id)
                occupant = None if slot is None else self._occupants[slot]
                if occupant is not None and occupant.hash == h and occupant.stamp is not None:
                    freed.append(self._release(slot))  # type: ignore[arg-type]
            if self._claimed:  # a store is evicting it: it must not come back
                dropped = set(wanted)
                for previous in self._claimed.values():
                    if (previous.block_id, previous.hash) in dropped:
                        previous.gone = True
        self._announce(freed)
        return len(freed)

    def apply_notice(self, notice: EvictionNotice) -> int:
        """Free what an eviction notice removed; return the number of slots freed.

        Safe to apply the same notice twice, late, or out of order: only occupants
        registered before the notice (stamp < seq) with the exact pair are freed.
        """
        checks.notice(notice)
        with self._lock:
            freed = self._apply_locked(notice)
        self._announce(freed)
        return len(freed)

    def reconcile(self, registry: RegistryBase | None = None) -> list[Pair]:
        """Free every registered slot whose pair is no longer in the registry's Mamba
        map (one atomic read), and withdraw the entries of failed stores that landed
        anyway; return the pairs freed."""
        if registry is not None and not isinstance(registry, RegistryBase):
            raise TypeError(f"registry must be a registry or None, not {type(registry).__name__}")
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
            doubtful = [(b, h) for b, h in self._doubtful if not self._held_or_in_flight(b, h)]
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
        block = checks.block_id(block_id)
        with self._lock:
            return self._slot_of_block.get(block)

    def holds(self, block_id: int, h: int) -> bool:
        """True if a registered slot holds exactly (block_id, h)."""
        block, wanted = checks.block_id(block_id), checks.real_hash(h, "h")
        with self._lock:
            slot = self._slot_of_block.get(block)
            occupant = None if slot is None else self._occupants[slot]
            return occupant is not None and occupant.hash == wanted and occupant.stamp is not None

    # -- internals --------------------------------------------------------------------

    def _incoming(
        self, tensor: torch.Tensor, name: str, shape: tuple[int, ...], cast: bool
    ) -> torch.Tensor:
        """A checked ``store`` input, converted (``cast``) and copied if it is a view of
        the pool's own states (a slot it reads may be one this store overwrites)."""
        checks.state_tensor(
            tensor,
            name,
            (self.num_layers, *shape),
            self.dtype,
            self.device,
            cast=cast,
            output=False,
        )
        if tensor.dtype != self.dtype:
            return tensor.to(self.dtype)
        if checks.overlaps(tensor, self.conv_states) or checks.overlaps(tensor, self.ssm_states):
            return tensor.clone()
        return tensor

    def _reserve(self, ids: list[int], hashes: list[int]) -> list[_Reservation]:
        """Claim a slot per block in one step: its own slot for a block id already
        stored, else a free slot, else the least recently used registered slot of
        another block. Claimed slots hold the new in-flight occupants; their previous
        occupants wait in ``_claimed`` until the store evicts them (or gives them back).
        Raises (changing nothing) when a block is being stored by another call, or
        ``PoolExhausted`` when too few slots are free or evictable."""
        with self._lock:
            missing = 0
            for i, block_id in enumerate(ids):
                slot = self._slot_of_block.get(block_id)
                if slot is None:
                    missing += 1
                elif self._occupants[slot].stamp is None:  # type: ignore[union-attr]
                    raise RuntimeError(
                        f"block_ids[{i}] = {block_id} is being stored by another call"
                    )
            shortfall = missing - len(self._free_slots)
            victims: list[int] = []
            if shortfall > 0:
                wanted = set(ids)
                for slot in self._lru:  # oldest use first
                    occupant = self._occupants[slot]
                    assert occupant is not None
                    if occupant.block_id not in wanted:
                        victims.append(slot)
                        if len(victims) == shortfall:
                            break
                if len(victims) < shortfall:
                    in_flight = sum(1 for o in self._occupants if o is not None and o.stamp is None)
                    raise PoolExhausted(
                        f"store needs {missing} new slots: {len(self._free_slots)} free, "
                        f"{len(victims)} evictable, {in_flight} held by stores in flight "
                        f"(of {self.num_slots})"
                    )
            spare = iter(victims)
            reservations = []
            for block_id, h in zip(ids, hashes, strict=True):
                previous: _Occupant | None = None
                slot_or_none = self._slot_of_block.get(block_id)
                if slot_or_none is not None:
                    slot = slot_or_none
                    previous = self._occupants[slot]
                elif self._free_slots:
                    slot = self._free_slots.pop()
                else:
                    slot = next(spare)
                    previous = self._occupants[slot]
                    assert previous is not None
                    del self._slot_of_block[previous.block_id]
                if previous is not None:
                    previous.last_use = self._lru.pop(slot)
                    self._claimed[previous.generation] = previous
                self._generation += 1
                occupant = _Occupant(block_id, h, self._generation)
                self._occupants[slot] = occupant
                self._slot_of_block[block_id] = slot
                reservations.append(_Reservation(slot, occupant, previous))
            return reservations

    def _drop_claimed(self, reservations: list[_Reservation]) -> None:
        """The store evicted what its slots held before: count and announce them."""
        freed: list[Pair] = []
        with self._lock:
            for r in reservations:
                previous = r.previous
                if previous is None:
                    continue
                del self._claimed[previous.generation]
                self._freed += 1
                if previous.block_id != r.occupant.block_id:
                    self._evicted += 1
                freed.append((previous.block_id, previous.hash))
        self._announce(freed)

    def _undo(self, reservations: list[_Reservation]) -> None:
        """The store's eviction failed before anything was copied: give every claimed
        slot back to its previous occupant, unless a notice removed that one meanwhile
        or its block id was stored again elsewhere (then it is freed, and its entry, if
        still in the registry, is withdrawn at the next reconcile)."""
        freed: list[Pair] = []
        with self._lock:
            for r in reservations:  # in flight: no one else has touched these slots
                assert self._occupants[r.slot] is r.occupant
                self._occupants[r.slot] = None
                del self._slot_of_block[r.occupant.block_id]
            reinstated = False
            for r in reservations:
                previous = r.previous
                if previous is None:
                    self._free_slots.append(r.slot)
                    continue
                del self._claimed[previous.generation]
                if not previous.gone and previous.block_id not in self._slot_of_block:
                    self._occupants[r.slot] = previous
                    self._slot_of_block[previous.block_id] = r.slot
                    self._lru[r.slot] = previous.last_use
                    reinstated = True
                    continue
                self._free_slots.append(r.slot)
                self._freed += 1
                freed.append((previous.block_id, previous.hash))
                if not previous.gone:
                    self._doubtful.add((previous.block_id, previous.hash))
            if reinstated:  # back in their places: order by last use (rare, so sort)
                self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1]))
        self._announce(freed)

    def _commit(self, slots: list[int], stamp: int) -> None:
        freed: list[Pair] = []
        recheck: list[tuple[int, int, int, int]] = []
        with self._lock:
            for slot in slots:
                occupant = self._occupants[slot]
                assert occupant is not None
                assert occupant.stamp is None
                occupant.stamp = stamp
                self._touch(slot)
                if occupant.recheck:
                    recheck.append((slot, occupant.generation, occupant.block_id, occupant.hash))
            self._stored += len(slots)
            for slot in slots:
                freed.extend(self._apply_held(slot))
        self._announce(freed)
        if recheck:  # rare: a reconcile skipped these while they were in flight
            try:
                reclaimed = self._free_unregistered(self.registry, recheck)
            except Exception:  # the store is done; the next reconcile checks them
                log.warning("re-checking stored slots against the registry failed", exc_info=True)
                return
            with self._lock:
                self._reconciled += len(reclaimed)

    def _apply_held(self, slot: int) -> list[Pair]:
        """Apply the notices a just-registered occupant held while in flight, to it alone.

        Each held notice already reached every other occupant when it arrived (the other
        in-flight ones hold their own copy), so applying it pool-wide again would hand
        every store still in flight one more copy per commit: the copies would multiply.
        """
        occupant = self._occupants[slot]
        if occupant is None or not occupant.held:
            return []
        held, occupant.held = occupant.held, []
        assert occupant.stamp is not None
        if any(occupant.stamp < notice.seq for notice in held):
            return [self._release(slot)]
        return []

    def _abandon(self, slots: list[int]) -> None:
        """A store failed: its in-flight slots hold nothing registered; free them."""
        with self._lock:
            for slot in slots:
                occupant = self._occupants[slot]
                if occupant is not None and occupant.stamp is None:
                    self._occupants[slot] = None
                    del self._slot_of_block[occupant.block_id]
                    self._free_slots.append(slot)

    def _touch(self, slot: int) -> None:
        """Mark a registered slot as the most recently used."""
        self._tick += 1
        self._lru[slot] = self._tick
        self._lru.move_to_end(slot)

    def _held_or_in_flight(self, block_id: int, h: int) -> bool:
        slot = self._slot_of_block.get(block_id)
        occupant = None if slot is None else self._occupants[slot]
        return occupant is not None and occupant.hash == h

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
        if self._claimed:  # being evicted by a store: if its eviction fails, stay gone
            removed = {(b, h) for b, h in notice.pairs}
            for previous in self._claimed.values():
                assert previous.stamp is not None
                if previous.stamp < notice.seq and (
                    notice.cleared or (previous.block_id, previous.hash) in removed
                ):
                    previous.gone = True
        for slot in candidates:
            occupant = self._occupants[slot]
            assert occupant is not None
            if occupant.stamp is None:
                if notice not in occupant.held:  # the hook and a listener both deliver it
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
