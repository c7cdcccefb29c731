"""What the registry's numbers are: block hashes, block ids, their pairs, notice kinds.

A hash and a block id are both plain ``int`` at run time; the ``NewType``s let the type
checker tell them apart, and the sentinels and ranges are defined here once.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, NewType

BlockHash = NewType("BlockHash", int)
"""A block's parent-chained hash, in [1, MAX_HASH]; -1 and 0 are sentinels."""

BlockId = NewType("BlockId", int)
"""A block's id in its node's KV (or Mamba state) pool, in [0, MAX_BLOCK_ID]."""

NO_HASH = -1
"""Hash sentinel: this position has no hash (skipped, never matching)."""
NO_PARENT = 0
"""Hash sentinel: no parent / no match."""
MAX_HASH = 2**63 - 1
"""The largest hash (a signed 64-bit integer's largest value)."""
MAX_BLOCK_ID = 2**63 - 1
"""The largest block id."""


class BlockPair(NamedTuple):
    """One Mamba entry as a notice names it: which block held state for which hash.

    The maps are ``hash -> block id``; a pair puts the block id first, as the slot pool
    looks slots up by block id.
    """

    block_id: BlockId
    hash: BlockHash


class NoticeKind(str, Enum):
    """Why Mamba entries left the registry (the second word of a notice)."""

    EVICT = "evict"  # evict_mamba
    CASCADE = "cascade"  # evict_kv took the Mamba entries of the same hashes
    REPLACE = "replace"  # register_mamba moved a hash to another block id
    CLEAR = "clear"  # clear_mamba, reset or claim: every entry went (no pairs listed)

    def __str__(self) -> str:
        return self.value
