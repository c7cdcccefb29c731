"""Argument checks shared by the Redis and the in-memory registry.

Everything is checked before anything reaches Redis: a bad call raises a clear
``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) and
changes nothing. Integer-like values (``numpy.int64``...) are accepted through
``operator.index``; ``bool``, ``float`` and strings are refused.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

NO_HASH = -1
"""Hash sentinel: this position has no hash (skipped or never matching)."""
NO_PARENT = 0
"""Hash sentinel: no parent / no match."""
MAX_HASH = 2**63 - 1
MAX_BLOCK_ID = 2**63 - 1


def as_int(value: object, what: str, position: int) -> int:
    """``value`` as an int (``operator.index``); ``TypeError`` naming ``what[position]``."""
    if isinstance(value, bool):
        raise TypeError(f"{what}[{position}] is a bool; expected an int")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what}[{position}] is {type(value).__name__} {value!r:.40}; expected an int"
        ) from None


def _as_list(values: object, what: str) -> list[object]:
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of ints, not {type(values).__name__}")
    return list(values)


def lookup_hashes(hashes: object, what: str = "hashes") -> list[int]:
    """Hashes to look up or evict: real hashes, or the sentinels -1 / 0 (never stored)."""
    result = [as_int(h, what, i) for i, h in enumerate(_as_list(hashes, what))]
    for i, h in enumerate(result):
        if not NO_HASH <= h <= MAX_HASH:
            raise ValueError(f"{what}[{i}] = {h} is outside [-1, 2^63-1]")
    return result


def eviction_hashes(hashes: object) -> list[int]:
    """Distinct real hashes to evict, in first-seen order; sentinels -1 and 0 dropped."""
    return [h for h in dict.fromkeys(lookup_hashes(hashes)) if h > NO_PARENT]


def registration(block_ids: object, hashes: object, *, skip_sentinels: bool) -> dict[int, int]:
    """``{hash: block_id}`` for a bulk register, last value winning for a repeated hash.

    With ``skip_sentinels`` (Mamba), pairs whose hash is -1 or 0 are dropped; without
    it (KV), every hash must be a real one in [1, 2^63-1].
    """
    id_list = _as_list(block_ids, "block_ids")
    hash_list = _as_list(hashes, "hashes")
    if len(id_list) != len(hash_list):
        raise ValueError(
            f"block_ids and hashes differ in length ({len(id_list)} != {len(hash_list)})"
        )
    entries: dict[int, int] = {}
    lowest = NO_HASH if skip_sentinels else 1
    for i, (raw_id, raw_hash) in enumerate(zip(id_list, hash_list, strict=True)):
        block_id = as_int(raw_id, "block_ids", i)
        h = as_int(raw_hash, "hashes", i)
        if not 0 <= block_id <= MAX_BLOCK_ID:
            raise ValueError(f"block_ids[{i}] = {block_id} is outside [0, 2^63-1]")
        if not lowest <= h <= MAX_HASH:
            bounds = "[-1, 2^63-1]" if skip_sentinels else "[1, 2^63-1]"
            raise ValueError(f"hashes[{i}] = {h} is outside {bounds}")
        if h > NO_PARENT:
            entries[h] = block_id
    return entries


def search_length(search_len: object) -> int:
    """The ``search_len`` argument of ``find_mamba_backoff``: an int (not a bool)."""
    if isinstance(search_len, bool):
        raise TypeError("search_len is a bool; expected an int")
    try:
        return operator.index(search_len)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"search_len must be an int, not {type(search_len).__name__}") from None


def flatten(entries: dict[int, int]) -> list[int]:
    """``[hash1, id1, hash2, id2, ...]``: the argument order of HSET."""
    flat: list[int] = []
    for h, block_id in entries.items():
        flat.append(h)
        flat.append(block_id)
    return flat
