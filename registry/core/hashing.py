"""Parent-chained block hashes, the same numbers Megatron-Core's engines compute.

Only complete blocks get a hash. Tokens are packed as int64 little-endian; the chain
starts from 32 zero bytes; each block's digest is ``sha256(parent_digest + block)``,
and the whole 32-byte digest chains into the next block. The block's hash is the first
8 digest bytes read little-endian, mapped into [1, 2^63-1] (so the sentinels -1 and 0
never occur). A salt replaces the zero start with
``sha256(b"megatron-prefix-cache-salt-v1\\0" + salt)``, Megatron-Core's derivation,
so salted hashes also match the engines' and tenants cannot share or probe blocks.
Torch is not imported: tensors are read through ``.tolist()``.
"""

from __future__ import annotations

import hashlib
import operator
import sys
from array import array
from collections.abc import Iterable
from typing import Any

from registry.core.types import MAX_HASH
from registry.core.validation import is_number

ZERO_PARENT = bytes(32)
SALT_DOMAIN = b"megatron-prefix-cache-salt-v1\0"
HASH_MODULUS = MAX_HASH


def _int64_bytes(tokens: Any) -> bytes:
    """All of ``tokens`` as int64 little-endian bytes."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    kind = getattr(getattr(tokens, "dtype", None), "kind", None)
    if kind is not None and hasattr(tokens, "astype"):  # numpy: no Python loop
        if kind not in ("i", "u"):
            raise TypeError(f"tokens must hold integers, not dtype {tokens.dtype}")
        flat = tokens.reshape(-1)
        if kind == "u" and flat.size and int(flat.max()) >= 2**63:
            raise ValueError("a token id does not fit in int64")
        return bytes(flat.astype("<i8").tobytes())
    if hasattr(tokens, "tolist"):  # array.array, torch tensors, other array types
        tokens = tokens.tolist()
    if not isinstance(tokens, Iterable):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    if isinstance(tokens, (list, tuple)) and set(map(type, tokens)) <= {int}:
        try:  # plain ints (no bools, no int subclasses): packed at C speed
            packed = array("q", tokens)
        except OverflowError:
            raise ValueError("a token id does not fit in int64") from None
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    packed = array("q")
    try:
        for token in tokens:
            if isinstance(token, bool):
                raise TypeError("a token is a bool")
            packed.append(operator.index(token))
    except TypeError as exc:
        raise TypeError(f"tokens must be integers: {exc}") from None
    except OverflowError:
        raise ValueError("a token id does not fit in int64") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(tokens: Any, block_size: int, *, salt: str | bytes | None = None) -> list[int]:
    """Hashes in [1, 2^63-1] of every complete ``block_size``-token block of ``tokens``."""
    if not is_number(block_size, integer=True):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    if salt is None:
        parent = ZERO_PARENT
    elif isinstance(salt, str):
        parent = hashlib.sha256(SALT_DOMAIN + salt.encode("utf-8")).digest()
    elif isinstance(salt, bytes):
        parent = hashlib.sha256(SALT_DOMAIN + salt).digest()
    else:
        raise TypeError(f"salt must be str, bytes or None, not {type(salt).__name__}")
    return [digest_hash(d) for d in chain_digests(parent, tokens, block_size)]


def chain_digests(parent: bytes, tokens: Any, block_size: int) -> list[bytes]:
    """The 32-byte digest of every complete ``block_size``-token block of ``tokens``,
    chained from ``parent`` (``ZERO_PARENT`` at a prompt's start, or the digest of the
    block before): continuing a chain gives the same digests as hashing the whole prompt.
    """
    data = _int64_bytes(tokens)
    step = 8 * block_size
    digests = []
    for offset in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[offset : offset + step]).digest()
        digests.append(parent)
    return digests


def digest_hash(digest: bytes) -> int:
    """A block's hash from its digest: the first 8 bytes, little-endian, in [1, 2^63-1]."""
    return int.from_bytes(digest[:8], "little") % HASH_MODULUS + 1
