"""The bridge's own hash chain of one engine's blocks (:class:`HashChain`): each stored
block's ``token_ids`` hashed with this project's Megatron-compatible chain
(``registry.core.hashing``), continued from the parent block's digest, and a decoded
batch turned into the ``bridge_apply`` operations that list and unlist its blocks.

Hybrid engines (vLLM 0.32, Mamba groups in ``align`` mode) publish one ``BlockStored``
per group and step whose ``token_ids`` span every block the step filled while a Mamba
group's ``block_hashes`` list only the blocks that hold a state (the step's last full
block, the prompt's last block boundary; none at all on other steps). Such a hash is
placed by the position its engine hash has in the chain (the attention group lists the
same hash for the same block, in this batch or before), never guessed.

A prompt's chain starts where ``block_hashes`` starts it for the event's cache salt
(the first block's extra keys) and LoRA name (``lora_name``): ``chain_root``. A Mamba
event that does not list a prompt's first block shows no salt; its blocks take the
digests the attention group's blocks have (known, or started in the same batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from registry.bridge.bridge_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from registry.bridge.counts import FollowerCounts
from registry.bridge.picture import STORE, EnginePicture
from registry.bridge.source import EngineSource
from registry.core.errors import translate
from registry.core.hashing import chain_digests, chain_root, digest_hash
from registry.core.validation import text
from registry.namespace.redis_registry import PrefixCacheRegistry

KV_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose blocks go to the KV map (nil too)."""
MAMBA_KINDS = frozenset({"mamba"})
"""``kv_cache_spec_kind`` values whose blocks go to the Mamba map."""
MAX_SLOTS = 64
"""Holder slots per block: (group index) x (followed media) must stay below this."""
CACHE_BLOCKS = 262_144
"""Engine hashes whose digests the bridge keeps in memory (Redis has them all); once
past this, the cache is emptied after a write, when Redis holds every digest in it."""
DEFAULT_MEDIUM = "GPU"
"""The medium of an event that names none."""

# bridge_apply's operation codes and map names (lua/bridge_apply.lua); STORE comes
# from the picture, which writes stores of its own.
REMOVE: Final = "R"
CLEAR: Final = "C"
MAMBA_GROUPS: Final = "G"
KV_MAP: Final = "k"
MAMBA_MAP: Final = "m"


@dataclass(frozen=True)
class _Placement:
    """Where a stored event's blocks go: holder slot, map, block size."""

    slot: int
    map_name: str
    block_size: int


class HashChain:
    """One engine's blocks under the hashes any router can compute.

    Keeps engine hash -> (digest, depth) for the blocks it hashed (Redis keeps them all,
    in ``pcr:{NS}:engine-blocks``; parents this process has not seen are read from
    there) and the block size, learnt from the first event that names one when the
    source does not. What it cannot hash is skipped and counted, never guessed.
    ``note`` logs a message once per key. ``picture`` follows every store, removal and
    clear it turns into an operation (``registry.bridge.picture``): what the engine
    holds, for writing a lost namespace again.
    """

    def __init__(
        self,
        registry: PrefixCacheRegistry,
        source: EngineSource,
        counts: FollowerCounts,
        note: Callable[[str, str], None],
    ) -> None:
        self.registry = registry
        self.source = source
        self.counts = counts
        self.note = note
        self.block_size = source.block_size
        self.digests: dict[int, tuple[bytes, int]] = {}
        self.picture = EnginePicture()
        self.mamba_groups: set[int] = set()
        """The engine's Mamba groups (``group_idx``), learnt from its stored events and
        from what Redis held at a resume: a block is usable only while every one of
        them holds its state."""

    def forget(self) -> None:
        """Drop every digest held in memory (the namespace restarts, or was cleared);
        the Mamba groups are those the picture still shows (none after a restart)."""
        self.digests.clear()
        self.mamba_groups.clear()
        self.learn_slots(self.picture.mamba_slots())

    def learn_slots(self, slots: Iterable[int]) -> None:
        """Learn Mamba groups from holder slots that hold Mamba state."""
        media = len(self.source.media)
        self.mamba_groups.update((slot - 1) // media for slot in slots)

    def mamba_slots(self) -> str:
        """The operation that tells ``bridge_apply`` the Mamba groups: each group's
        holder slots (one per followed medium) comma-separated, groups space-separated;
        empty while none is known (then any Mamba slot makes a block usable)."""
        media = len(self.source.media)
        groups = [[g * media + i + 1 for i in range(media)] for g in sorted(self.mamba_groups)]
        return " ".join(",".join(map(str, s)) for s in groups if s[-1] <= MAX_SLOTS)

    def group_operation(self) -> list[Any]:
        """``["G", slots]`` to send before a write's operations, or nothing."""
        slots = self.mamba_slots()
        return [MAMBA_GROUPS, slots] if slots else []

    def trim(self) -> None:
        """After a write (Redis holds every digest now): empty an oversized cache."""
        if len(self.digests) > CACHE_BLOCKS:
            self.digests.clear()

    def operations(self, batch: EventBatch) -> tuple[list[Any], int]:
        """The ``bridge_apply`` operations of one decoded batch, and how many blocks
        they carry. Raises a registry error while fetching parent digests."""
        self.counts.unknown_events += batch.unknown
        self._learn_groups(batch)
        self._fetch_parents(batch)
        positions = self._sparse_positions(batch)
        roots = self._batch_roots(batch)
        ops: list[Any] = []
        blocks = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored = self._stored(event, positions, roots)
                ops.extend(stored)
                blocks += len(event.block_hashes) if stored else 0
            elif isinstance(event, BlockRemoved):
                removed = self._removed(event)
                ops.extend(removed)
                blocks += len(event.block_hashes) if removed else 0
            elif isinstance(event, AllBlocksCleared):
                ops.append(CLEAR)
                self.digests.clear()
                self.picture.clear()
        return ops, blocks

    def _medium(self, medium: str | None, n: int) -> str | None:
        """The event's medium when it is followed; else the blocks count as skipped."""
        medium = DEFAULT_MEDIUM if medium is None else medium
        if medium not in self.source.media:
            self.counts.other_medium += n
            return None
        return medium

    def _slot(self, group_idx: int | None, medium: str) -> int | None:
        media = self.source.media
        slot = (group_idx or 0) * len(media) + media.index(medium) + 1
        if slot > MAX_SLOTS:
            self.counts.other_groups += 1
            self.note("slots", f"group {group_idx} is beyond the {MAX_SLOTS} holder slots")
            return None
        return slot

    def _removed(self, event: BlockRemoved) -> list[Any]:
        medium = self._medium(event.medium, len(event.block_hashes))
        if medium is None:
            return []
        slot = self._slot(event.group_idx, medium)
        if slot is None or not event.block_hashes:
            return []
        picture = self.picture
        for h in event.block_hashes:
            picture.removed(h, slot)
        packed = b"".join(b"%020d" % h for h in event.block_hashes)
        return [REMOVE, slot, len(event.block_hashes), packed]

    def _placement(self, event: BlockStored) -> _Placement | None:
        """Where a stored event's blocks go, or None (counted) when they are not
        bridged: another medium or group kind, extra keys the chain cannot fold in (or
        a LoRA known only by its id), another size."""
        n = len(event.block_hashes)
        medium = self._medium(event.medium, n)
        if medium is None:
            return None
        kind = event.kv_cache_spec_kind
        if kind is None or kind in KV_KINDS:
            map_name = KV_MAP
        elif kind in MAMBA_KINDS:
            map_name = MAMBA_MAP
            if not n:  # a step that left no checkpoint
                self.counts.empty_mamba_events += 1
                return None
        else:
            self.counts.other_groups += n
            self.note(f"kind:{kind}", f"blocks of {kind!r} groups are not bridged")
            return None
        if event.keyed or (event.lora_id and event.lora_name is None):
            self.counts.keyed_blocks += n
            return None
        size = event.block_size
        if self.block_size is None and size is not None:
            self.block_size = size
        if size is None:
            size = self.block_size
        tokens = len(event.token_ids)
        if (
            size is None
            or size != self.block_size
            or not (tokens == n * size or (map_name == MAMBA_MAP and _spans(tokens, n, size)))
        ):
            self.counts.block_size_mismatch += n
            self.note(
                "block_size",
                f"a BlockStored of {n} blocks and {len(event.token_ids)} tokens does not fit "
                f"the block size {self.block_size}",
            )
            return None
        slot = self._slot(event.group_idx, medium)
        return None if slot is None else _Placement(slot, map_name, size)

    def _stored(
        self, event: BlockStored, positions: dict[int, int], roots: dict[int, bytes]
    ) -> list[Any]:
        placement = self._placement(event)
        if placement is None:
            return []
        n = len(event.block_hashes)
        if event.parent_block_hash is None:
            root = self._start(event, roots)
            if root is None:
                return []
            parent, depth = root, -1
        else:
            known = self.digests.get(event.parent_block_hash)
            if known is None:
                known = self.picture.digest(event.parent_block_hash)
            if known is None:
                self.counts.orphans += n
                return []
            parent, depth = known
        if not n:
            return []
        digests = chain_digests(parent, event.token_ids, placement.block_size)
        if len(digests) == n:
            return self._store(event.block_hashes, digests, depth + 1, placement)
        return self._store_states(event.block_hashes, digests, depth + 1, placement, positions)

    def _root(self, event: BlockStored) -> bytes | None:
        """Where a prompt's chain starts for the event's salt and LoRA name; None (the
        blocks counted as keyed) for a salt or name ``chain_root`` refuses."""
        try:
            return chain_root(event.salt, event.lora_name)
        except (TypeError, ValueError) as exc:
            self.counts.keyed_blocks += len(event.block_hashes)
            self.note("chain_root", f"blocks whose chain cannot start: {exc}")
            return None

    def _start(self, event: BlockStored, roots: dict[int, bytes]) -> bytes | None:
        """The chain start of an event without a parent: its own salt's and LoRA's, or,
        for a Mamba event listing no salt, the start the batch's attention blocks of the
        same hashes have (a salt shows only on a prompt's first block)."""
        if event.salt is None:
            for h in event.block_hashes:
                if h in roots:
                    return roots[h]
        return self._root(event)

    def _batch_roots(self, batch: EventBatch) -> dict[int, bytes]:
        """Engine hash -> chain start of the blocks that the batch's events listing every
        block chain from a prompt's start; empty unless a Mamba event without a parent
        lists fewer blocks than it spans (the only events that may hide their salt)."""
        if not any(
            isinstance(e, BlockStored) and e.parent_block_hash is None and self._sparse(e)
            for e in batch.events
        ):
            return {}
        roots: dict[int, bytes] = {}
        for event in batch.events:
            if not isinstance(event, BlockStored) or event.keyed or self._sparse(event):
                continue
            p = event.parent_block_hash
            if p is None:
                try:
                    root: bytes | None = chain_root(event.salt, event.lora_name)
                except (TypeError, ValueError):
                    continue
            else:
                root = roots.get(p)
            if root is not None:
                roots.update(dict.fromkeys(event.block_hashes, root))
        return roots

    def _store_states(
        self,
        hashes: Sequence[int],
        digests: list[bytes],
        first: int,
        placement: _Placement,
        positions: dict[int, int],
    ) -> list[Any]:
        """A Mamba event listing fewer blocks than its tokens span: each hash stored at
        the position its engine hash has (``first`` is the position of the tokens'
        first block), in runs of consecutive positions; a hash at no known position
        inside the span, or out of order, is counted and left out. A hash whose digest
        this process knows keeps it (the chain start a Mamba event shows may lack the
        salt of the prompt's first block)."""
        digests = list(digests)
        ops: list[Any] = []
        run: list[int] = []
        start = last = first - 1
        for h in hashes:
            at = self._depth(h, positions)
            if at is None or not last < at < first + len(digests):
                self.counts.unplaced_mamba_blocks += 1
                continue
            if run and at != last + 1:
                ops += self._store(run, digests[start - first : last - first + 1], start, placement)
                run = []
            if not run:
                start = at
            known = self.digests.get(h) or self.picture.digest(h)
            if known is not None and known[1] == at:
                digests[at - first] = known[0]
            run.append(h)
            last = at
        if run:
            ops += self._store(run, digests[start - first : last - first + 1], start, placement)
        return ops

    def _store(
        self, hashes: Sequence[int], digests: list[bytes], first: int, placement: _Placement
    ) -> list[Any]:
        """The ``STORE`` of blocks at consecutive positions from ``first``."""
        picture, slot, map_name = self.picture, placement.slot, placement.map_name
        for depth, (h, digest) in enumerate(zip(hashes, digests, strict=True), first):
            self.digests[h] = (digest, depth)
            if not picture.stored(h, digest, depth, slot, map_name):
                self.counts.unpictured += 1
        # One operation per event, its per-block values packed at fixed widths
        # (lua/bridge_apply.lua): far cheaper to send and to hand to Lua than 7 per block.
        return [
            STORE,
            slot,
            map_name,
            first,
            len(hashes),
            b"".join(b"%020d" % h for h in hashes),
            b"".join(b"%019d" % digest_hash(d) for d in digests),
            b"".join(digests).hex(),
        ]

    def _depth(self, engine_hash: int, positions: dict[int, int]) -> int | None:
        """The position of a block this process knows, or None."""
        known = self.digests.get(engine_hash)
        if known is None:
            known = self.picture.digest(engine_hash)
        if known is not None:
            return known[1]
        return positions.get(engine_hash)

    def _learn_groups(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.kv_cache_spec_kind in MAMBA_KINDS:
                self.mamba_groups.add(event.group_idx or 0)

    def _sparse(self, event: BlockStored) -> bool:
        """Whether a stored event lists fewer blocks than its tokens span."""
        size = event.block_size or self.block_size
        return bool(event.block_hashes) and (
            size is None or len(event.token_ids) != len(event.block_hashes) * size
        )

    def _sparse_positions(self, batch: EventBatch) -> dict[int, int]:
        """The positions of the hashes that Mamba events of fewer blocks than tokens
        list and that this process does not know: from the batch's other stored events
        (each listing a hash per block, chained from a parent of known position), then
        from ``engine-blocks``. Raises a registry error while reading Redis."""
        wanted = {
            h
            for event in batch.events
            if isinstance(event, BlockStored)
            and event.kv_cache_spec_kind in MAMBA_KINDS
            and self._sparse(event)
            for h in event.block_hashes
            if self._depth(h, {}) is None
        }
        if not wanted:
            return {}
        depths: dict[int, int] = {}
        for event in batch.events:
            if not isinstance(event, BlockStored) or not event.block_hashes or self._sparse(event):
                continue
            p = event.parent_block_hash
            parent = -1 if p is None else depths.get(p, self._depth(p, {}))
            if parent is None:
                continue
            for depth, h in enumerate(event.block_hashes, parent + 1):
                depths[h] = depth
        found: dict[int, int] = {h: depths[h] for h in wanted if h in depths}
        self._fetch([h for h in wanted if h not in found])
        return found

    def _fetch_parents(self, batch: EventBatch) -> None:
        """Read the digests of parents this process has not seen (after a resume) in
        one HMGET."""
        produced: set[int] = set()
        wanted: list[int] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                p = event.parent_block_hash
                if (
                    p is not None
                    and p not in self.digests
                    and p not in produced
                    and self.picture.digest(p) is None
                ):
                    wanted.append(p)
                produced.update(event.block_hashes)
        self._fetch(wanted)

    def _fetch(self, wanted: list[int]) -> None:
        """Read the digests and positions of these engine hashes from
        ``engine-blocks`` into memory (those it holds), in one HMGET."""
        if not wanted:
            return
        try:
            values = self.registry.client.hmget(self.registry.keys.engine_blocks, wanted)
        except Exception as exc:
            error = translate(exc, f"namespace {self.source.namespace!r}: bridge parents")
            if error is None:
                raise
            raise error from exc
        for h, value in zip(wanted, values, strict=True):
            if value is None:
                continue
            parts = text(value).split(" ")
            try:
                self.digests[h] = (bytes.fromhex(parts[2]), int(parts[1]))
            except (IndexError, ValueError):
                self.note("engine-blocks", f"engine-blocks holds a malformed entry for {h}")


def _spans(tokens: int, n: int, size: int) -> bool:
    """Whether ``tokens`` are whole blocks, at least ``n`` of them (a Mamba event lists
    a hash only for the blocks holding a state)."""
    return tokens % size == 0 and tokens >= n * size
