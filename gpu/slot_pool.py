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

The pool owns the tensors and the lock, and composes three parts: the slots'
bookkeeping and allocation (``gpu.slot_table.SlotTable``), the stamp rule by which
notices free slots (``gpu.slot_notices.SlotNotices``), and the comparison with the
registry (``gpu.slot_reconcile.Reconciler``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from gpu import checks
from gpu.slot_notices import SlotNotices
from gpu.slot_reconcile import Reconciler
from gpu.slot_table import Pair as Pair
from gpu.slot_table import PoolExhausted as PoolExhausted
from gpu.slot_table import Reservation, SlotTable
from registry import EvictionNotice, RegistryBase

log = logging.getLogger(__name__)

MAX_HASH = 2**63 - 1
MAX_POOL_BYTES = 2**63 - 1
"""Above this the element count of the state tensors overflows torch's int64 sizes."""


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
        self._table = SlotTable(num_slots)
        self._notices = SlotNotices(self._table)
        self._reconciler = Reconciler(self._table, self._lock, self._announce)
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
        with self._lock:
            reservations = self._table.reserve(ids, hash_list)
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
                self._reconciler.doubt(list(zip(ids, hash_list, strict=True)))
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
        table = self._table
        with self._lock:
            slot = table.registered_slot(block)
            if slot is None:
                return False
            if expected is not None and table.holding(block, expected) is None:
                return False
            with torch.no_grad():
                conv_out.copy_(self.conv_states[:, slot])
                ssm_out.copy_(self.ssm_states[:, slot])
            table.touch(slot)
            table.totals.restored += 1
            return True

    # -- freeing ----------------------------------------------------------------------

    def free(self, pairs: Iterable[Pair]) -> int:
        """Free the slots still holding exactly these (block_id, hash) pairs; idempotent
        (a pair may repeat). Every pair is checked before any slot is freed."""
        wanted = checks.pair_list(pairs)
        freed: list[Pair] = []
        with self._lock:
            for block_id, h in wanted:
                slot = self._table.holding(block_id, h, registered=True)
                if slot is not None:
                    freed.append(self._table.release(slot))
            self._notices.forget(wanted)  # a store is evicting it: it must not come back
        self._announce(freed)
        return len(freed)

    def apply_notice(self, notice: EvictionNotice) -> int:
        """Free what an eviction notice removed; return the number of slots freed.

        Safe to apply the same notice twice, late, or out of order: only occupants
        registered before the notice (stamp < seq) with the exact pair are freed.
        """
        checks.notice(notice)
        with self._lock:
            freed = self._notices.apply(notice)
        self._announce(freed)
        return len(freed)

    def reconcile(self, registry: RegistryBase | None = None) -> list[Pair]:
        """Free every registered slot whose pair is no longer in the registry's Mamba
        map (one atomic read), and withdraw the entries of failed stores that landed
        anyway; return the pairs freed."""
        if registry is not None and not isinstance(registry, RegistryBase):
            raise TypeError(f"registry must be a registry or None, not {type(registry).__name__}")
        source = self.registry if registry is None else registry
        return self._reconciler.reconcile(source)

    # -- inspection -------------------------------------------------------------------

    def counts(self) -> PoolCounts:
        """Slots in use and free, and the running totals."""
        with self._lock:
            free = len(self._table.free_slots)
            totals = self._table.totals
            return PoolCounts(
                slots=self.num_slots,
                in_use=self.num_slots - free,
                free=free,
                stored=totals.stored,
                restored=totals.restored,
                freed=totals.freed,
                reconciled=totals.reconciled,
                evicted=totals.evicted,
            )

    def pairs(self) -> set[Pair]:
        """The (block_id, hash) pairs of every registered slot."""
        with self._lock:
            return self._table.registered_pairs()

    def slot_of(self, block_id: int) -> int | None:
        """The slot holding ``block_id``'s state (registered or in flight), or None."""
        block = checks.block_id(block_id)
        with self._lock:
            return self._table.slot_of_block.get(block)

    def holds(self, block_id: int, h: int) -> bool:
        """True if a registered slot holds exactly (block_id, h)."""
        block, wanted = checks.block_id(block_id), checks.real_hash(h, "h")
        with self._lock:
            return self._table.holding(block, wanted, registered=True) is not None

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

    def _drop_claimed(self, reservations: list[Reservation]) -> None:
        """The store evicted what its slots held before: count and announce them."""
        with self._lock:
            freed = self._table.drop_claimed(reservations)
        self._announce(freed)

    def _undo(self, reservations: list[Reservation]) -> None:
        """The store's eviction failed before anything was copied: give every claimed
        slot back (``SlotTable.give_back``); the entries of those freed instead, if still
        in the registry, are withdrawn at the next reconcile."""
        with self._lock:
            freed, doubtful = self._table.give_back(reservations)
            self._reconciler.doubt(doubtful)
        self._announce(freed)

    def _commit(self, slots: list[int], stamp: int) -> None:
        """The store's registration landed: stamp its slots, apply the notices they held
        in flight, and compare with the registry those a reconcile skipped meanwhile."""
        freed: list[Pair] = []
        with self._lock:
            recheck = self._table.commit(slots, stamp)
            for slot in slots:
                freed.extend(self._notices.apply_held(slot))
        self._announce(freed)
        if recheck:  # rare: a reconcile skipped these while they were in flight
            try:
                self._reconciler.free_unregistered(self.registry, recheck)
            except Exception:  # the store is done; the next reconcile checks them
                log.warning("re-checking stored slots against the registry failed", exc_info=True)

    def _abandon(self, slots: list[int]) -> None:
        """A store failed: its in-flight slots hold nothing registered; free them."""
        with self._lock:
            self._table.abandon(slots)

    def _announce(self, freed: list[Pair]) -> None:
        """Tell ``on_free`` which pairs were freed (its failures are logged, never raised)."""
        if freed and self.on_free is not None:
            try:
                self.on_free(freed)
            except Exception:
                log.exception("on_free callback failed")
