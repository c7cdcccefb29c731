"""The bridge's own hash chain of one engine's blocks (:class:`HashChain`): each stored
block's ``token_ids`` hashed with this project's Megatron-compatible chain
(``registry.core.hashing``), continued from the parent block's digest, and a decoded
batch turned into the ``bridge_apply`` operations that list and unlist its blocks."""

from __future__ import annotations

from collections.abc import Callable
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
from registry.core.hashing import ZERO_PARENT, chain_digests, digest_hash
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

    def forget(self) -> None:
        """Drop every digest held in memory (the namespace restarts, or was cleared)."""
        self.digests.clear()

    def trim(self) -> None:
        """After a write (Redis holds every digest now): empty an oversized cache."""
        if len(self.digests) > CACHE_BLOCKS:
            self.digests.clear()

    def operations(self, batch: EventBatch) -> tuple[list[Any], int]:
        """The ``bridge_apply`` operations of one decoded batch, and how many blocks
        they carry. Raises a registry error while fetching parent digests."""
        self.counts.unknown_events += batch.unknown
        self._fetch_parents(batch)
        ops: list[Any] = []
        blocks = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
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
        bridged: another medium or group kind, extra keys or a LoRA, another size."""
        n = len(event.block_hashes)
        medium = self._medium(event.medium, n)
        if medium is None:
            return None
        kind = event.kv_cache_spec_kind
        if kind is None or kind in KV_KINDS:
            map_name = KV_MAP
        elif kind in MAMBA_KINDS:
            map_name = MAMBA_MAP
        else:
            self.counts.other_groups += n
            self.note(f"kind:{kind}", f"blocks of {kind!r} groups are not bridged")
            return None
        if event.keyed or event.lora_name is not None or event.lora_id:
            self.counts.keyed_blocks += n
            return None
        size = event.block_size
        if self.block_size is None and size is not None:
            self.block_size = size
        if size is None:
            size = self.block_size
        if size is None or size != self.block_size or len(event.token_ids) != n * size:
            self.counts.block_size_mismatch += n
            self.note(
                "block_size",
                f"a BlockStored of {n} blocks and {len(event.token_ids)} tokens does not fit "
                f"the block size {self.block_size}",
            )
            return None
        slot = self._slot(event.group_idx, medium)
        return None if slot is None else _Placement(slot, map_name, size)

    def _stored(self, event: BlockStored) -> list[Any]:
        placement = self._placement(event)
        if placement is None:
            return []
        n = len(event.block_hashes)
        if event.parent_block_hash is None:
            parent, depth = ZERO_PARENT, -1
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
        picture, slot, map_name = self.picture, placement.slot, placement.map_name
        for h, digest in zip(event.block_hashes, digests, strict=True):
            depth += 1
            self.digests[h] = (digest, depth)
            if not picture.stored(h, digest, depth, slot, map_name):
                self.counts.unpictured += 1
        # One operation per event, its per-block values packed at fixed widths
        # (lua/bridge_apply.lua): far cheaper to send and to hand to Lua than 7 per block.
        return [
            STORE,
            placement.slot,
            placement.map_name,
            depth - n + 1,
            n,
            b"".join(b"%020d" % h for h in event.block_hashes),
            b"".join(b"%019d" % digest_hash(d) for d in digests),
            b"".join(digests).hex(),
        ]

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
