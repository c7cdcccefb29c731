"""What one engine holds, as its events said (:class:`EnginePicture`): the bridge's own
copy of the engine's cache, so that a namespace Redis lost (a restart without its data)
is written again at once instead of waiting for the engine to store every block anew.

The picture follows the operations the follower sends to ``bridge_apply`` and keeps
exactly what the script keeps in ``pcr:{NS}:engine-blocks``: per engine hash the
block's chain digest, its depth (block id) and, per holder slot, which map it lists
the block in (``k`` / ``m``) and how many copies the slot holds. ``rewrite`` turns it
back into ``STORE`` operations, parents before children, in writes of at most
``MAX_BLOCKS_PER_WRITE`` blocks.

Memory is bounded: at most ``PICTURE_BLOCKS`` engine hashes (a few hundred bytes
each). Blocks stored once it is full are not pictured (the follower counts them,
``unpictured``):
the picture is then a subset of what the engine holds, and a namespace written again
from it lists a subset too, never a block the engine dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from registry.bridge import writes
from registry.core.hashing import digest_hash

PICTURE_BLOCKS = 262_144
"""Engine hashes one follower's picture holds at most (an engine's GPU block pool
rarely holds more)."""

STORE = "S"  # bridge_apply's operation code (registry.bridge.chain.STORE)


class _Held:
    """One pictured block: its chain digest and depth, and its holder slots as
    ``bridge_apply`` keeps them (one character per slot, copies where above one)."""

    __slots__ = ("copies", "depth", "digest", "holders")

    def __init__(self, digest: bytes, depth: int) -> None:
        self.digest = digest
        self.depth = depth
        self.holders = ""  # '0' not held, else the map the slot lists it in: 'k' or 'm'
        self.copies: dict[int, int] | None = None  # slot -> copies, where above one

    def held(self, slot: int) -> bool:
        return len(self.holders) >= slot and self.holders[slot - 1] != "0"

    def set_slot(self, slot: int, char: str) -> None:
        holders = self.holders.ljust(slot, "0")
        self.holders = (holders[: slot - 1] + char + holders[slot:]).rstrip("0")


class EnginePicture:
    """Engine hash -> what the engine holds of that block, updated with every
    ``STORE``, ``REMOVE`` and ``CLEAR`` the follower produces (the same rules as
    ``lua/bridge_apply.lua``: a store to a slot that holds the block already is one
    more copy; a removal takes one copy off; the last copy frees the slot)."""

    def __init__(self) -> None:
        self.blocks: dict[int, _Held] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def digest(self, engine_hash: int) -> tuple[bytes, int] | None:
        """(chain digest, depth) of a pictured block, or None."""
        held = self.blocks.get(engine_hash)
        return None if held is None else (held.digest, held.depth)

    def stored(self, engine_hash: int, digest: bytes, depth: int, slot: int, map_name: str) -> bool:
        """The engine stored a block in holder ``slot`` (listed in ``map_name``); False
        when it is a new block and the picture is full (it is not pictured)."""
        held = self.blocks.get(engine_hash)
        if held is None:
            if len(self.blocks) >= PICTURE_BLOCKS:
                return False
            held = self.blocks[engine_hash] = _Held(digest, depth)
        else:
            held.digest, held.depth = digest, depth
        if held.held(slot):
            copies = held.copies if held.copies is not None else {}
            copies[slot] = copies.get(slot, 1) + 1
            held.copies = copies
        else:
            held.set_slot(slot, map_name)
        return True

    def removed(self, engine_hash: int, slot: int) -> None:
        """The engine removed one copy of a block from holder ``slot``."""
        held = self.blocks.get(engine_hash)
        if held is None or not held.held(slot):
            return
        copies = held.copies
        if copies is not None and copies.get(slot, 1) > 1:
            copies[slot] -= 1
            if copies[slot] == 1:
                del copies[slot]
            return
        held.set_slot(slot, "0")
        if not held.holders:
            del self.blocks[engine_hash]

    def load_entry(self, engine_hash: int, entry: str) -> bool:
        """Picture a block as ``bridge_apply`` wrote it in ``engine-blocks``: ``"<own>
        <block id> <digest hex> <holders>[ <slot>=<copies>,...]"``; False when it is new
        and the picture is full. Raises ``ValueError`` for an entry of another shape."""
        parts = entry.split(" ")
        if len(parts) not in (4, 5) or len(parts[2]) != 64:
            raise ValueError(f"not an engine-blocks entry: {entry[:100]!r}")
        if engine_hash not in self.blocks and len(self.blocks) >= PICTURE_BLOCKS:
            return False
        held = _Held(bytes.fromhex(parts[2]), int(parts[1]))
        held.holders = "".join(c if c in "km" else "0" for c in parts[3]).rstrip("0")
        if len(parts) == 5:
            copies = {}
            for item in parts[4].split(","):
                slot, _, count = item.partition("=")
                if held.held(int(slot)) and int(count) > 1:
                    copies[int(slot)] = int(count)
            held.copies = copies or None
        if held.holders:
            self.blocks[engine_hash] = held
        return True

    def mamba_slots(self) -> set[int]:
        """The holder slots that hold Mamba state of some pictured block."""
        slots: set[int] = set()
        for held in self.blocks.values():
            if "m" in held.holders:
                slots.update(i for i, c in enumerate(held.holders, 1) if c == "m")
        return slots

    def clear(self) -> None:
        """The engine dropped everything (``AllBlocksCleared``), or restarted."""
        self.blocks.clear()

    def rewrite(self, limit: int | None = None) -> Iterator[tuple[list[Any], int]]:
        """The picture as ``bridge_apply`` operations: one list per write of at most
        ``limit`` stored blocks (default ``MAX_BLOCKS_PER_WRITE``; a copy counts as one),
        with its number of blocks. Shallower blocks first: every write lists only blocks
        whose parents an earlier write (or the same) listed."""
        limit = writes.MAX_BLOCKS_PER_WRITE if limit is None else limit
        ops: list[Any] = []
        blocks = 0
        for engine_hash, held in sorted(self.blocks.items(), key=_depth):
            packed = b"%020d" % engine_hash
            own = b"%019d" % digest_hash(held.digest)
            digest = held.digest.hex()
            copies = held.copies or {}
            for slot, char in enumerate(held.holders, 1):
                if char == "0":
                    continue
                for _ in range(copies.get(slot, 1)):
                    ops.extend((STORE, slot, char, held.depth, 1, packed, own, digest))
                    blocks += 1
                    if blocks >= limit:
                        yield ops, blocks
                        ops, blocks = [], 0
        if ops:
            yield ops, blocks


def _depth(item: tuple[int, _Held]) -> int:
    return item[1].depth
