"""Argument checks shared by the Redis and the in-memory registry.

Everything is checked before anything reaches Redis: a bad call raises a clear
``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) and
changes nothing. Integer-like values (``numpy.int64``...) are accepted through
``operator.index``; ``bool``, ``float`` and strings are refused.

These checks sit on every call's path, so lists of plain ints take a fast path made
of C-level passes (``map``, ``set``, ``min``, ``max``); anything else falls back to an
element-by-element check that also names the offending position.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from registry.core.types import MAX_BLOCK_ID as MAX_BLOCK_ID
from registry.core.types import MAX_HASH as MAX_HASH
from registry.core.types import NO_HASH as NO_HASH
from registry.core.types import NO_PARENT as NO_PARENT

_INT_ONLY = {int}


def is_number(value: object, *, integer: bool = False) -> bool:
    """Whether ``value`` is a plain number: an int, or with ``integer`` False a float
    too; never a bool (a bool is an int to Python, never a number to a caller)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if integer else isinstance(value, (int, float))


def checked_number(
    value: object,
    what: str,
    low: float,
    high: float,
    *,
    integer: bool = False,
    unit: str = "",
) -> float:
    """``value`` if it is a number (an int with ``integer``; never a bool) within
    [low, high], else ``TypeError`` or ``ValueError`` naming ``what`` (NaN lies in no
    range). ``unit`` follows the bounds in the message (" s")."""
    if not is_number(value, integer=integer):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{what} must be {kind}, not {type(value).__name__}")
    number: float = value  # type: ignore[assignment]
    if not low <= number <= high:
        raise ValueError(f"{what} must lie between {low:,} and {high:,}{unit}, not {number}")
    return number


def text(value: object) -> str:
    """A Redis reply value as text: bytes decoded as UTF-8 (anything undecodable
    escaped, never an error), anything else through ``str``."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


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
    """``values`` as a list; a list comes back as itself (never mutated by the checks)."""
    if type(values) is list:
        return values
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of ints, not {type(values).__name__}")
    return list(values)


def int_list(values: object, what: str, low: int, high: int, bounds: str) -> list[int]:
    """``values`` as a new list of ints within [low, high]; TypeError/ValueError otherwise."""
    items: list[Any] = _as_list(values, what)
    if not items:
        return items
    if set(map(type, items)) <= _INT_ONLY and low <= min(items) and max(items) <= high:
        return items
    result = [as_int(v, what, i) for i, v in enumerate(items)]
    for i, v in enumerate(result):
        if not low <= v <= high:
            raise ValueError(f"{what}[{i}] = {v} is outside {bounds}")
    return result


def lookup_hashes(hashes: object, what: str = "hashes") -> list[int]:
    """Hashes to look up or evict: real hashes, or the sentinels -1 / 0 (never stored)."""
    return int_list(hashes, what, NO_HASH, MAX_HASH, "[-1, 2^63-1]")


def prefix_hashes(hashes: object) -> list[int]:
    """Hashes for a prefix lookup, cut before the first sentinel (it can never match)."""
    items: list[Any] = _as_list(hashes, "hashes")
    # The hot path: plain ints, all real hashes (three C-level passes, nothing else).
    if items and set(map(type, items)) <= _INT_ONLY and min(items) >= 1 and max(items) <= MAX_HASH:
        return items
    wanted = lookup_hashes(items)
    if wanted and min(wanted) <= NO_PARENT:
        wanted = wanted[: next(i for i, h in enumerate(wanted) if h <= NO_PARENT)]  # a copy
    return wanted


def eviction_hashes(hashes: object) -> list[int]:
    """Distinct real hashes to evict, in first-seen order; sentinels -1 and 0 dropped."""
    distinct = list(dict.fromkeys(lookup_hashes(hashes)))
    if distinct and min(distinct) <= NO_PARENT:
        distinct = [h for h in distinct if h > NO_PARENT]
    return distinct


def registration(block_ids: object, hashes: object, *, skip_sentinels: bool) -> dict[int, int]:
    """``{hash: block_id}`` for a bulk register, last value winning for a repeated hash.

    With ``skip_sentinels`` (Mamba), pairs whose hash is -1 or 0 are dropped; without
    it (KV), every hash must be a real one in [1, 2^63-1].
    """
    id_list = int_list(block_ids, "block_ids", 0, MAX_BLOCK_ID, "[0, 2^63-1]")
    if skip_sentinels:
        hash_list = int_list(hashes, "hashes", NO_HASH, MAX_HASH, "[-1, 2^63-1]")
    else:
        hash_list = int_list(hashes, "hashes", 1, MAX_HASH, "[1, 2^63-1]")
    if len(id_list) != len(hash_list):
        raise ValueError(
            f"block_ids and hashes differ in length ({len(id_list)} != {len(hash_list)})"
        )
    entries = dict(zip(hash_list, id_list, strict=True))
    if skip_sentinels and entries and min(entries) <= NO_PARENT:
        entries.pop(NO_HASH, None)
        entries.pop(NO_PARENT, None)
    return entries


def search_length(search_len: object) -> int:
    """The ``search_len`` argument of ``find_mamba_backoff``: an int (not a bool)."""
    if isinstance(search_len, bool):
        raise TypeError("search_len is a bool; expected an int")
    try:
        return operator.index(search_len)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"search_len must be an int, not {type(search_len).__name__}") from None


def flatten(entries: dict[int, int], head: tuple[Any, ...] = ()) -> list[Any]:
    """``[*head, hash1, id1, hash2, id2, ...]``: script arguments in HSET order."""
    start = len(head)
    flat: list[Any] = [*head, *[0] * (2 * len(entries))]
    flat[start::2] = entries.keys()
    flat[start + 1 :: 2] = entries.values()
    return flat
