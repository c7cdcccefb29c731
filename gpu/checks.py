"""Argument checks for the slot pool and the eviction listener.

Every public call of ``gpu`` checks all of its arguments with these before it takes a
slot, writes a tensor or sends anything to Redis, so a refused call changes nothing.
Wrong kinds of value raise ``TypeError``, right kinds with wrong values ``ValueError``;
each message names the argument (and its position in a list). Integers follow the
registry's rules (``registry.core.validation``): integer-like values such as ``numpy.int64``
are accepted, ``bool``, ``float`` and strings are refused.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Iterable

import torch

from registry.core.notices import KINDS, EvictionNotice
from registry.core.validation import MAX_BLOCK_ID, MAX_HASH, int_list

DEVICE_TYPES = ("cpu", "cuda")
"""Device types a pool may live on."""


def scalar_int(value: object, what: str, low: int, high: int, bounds: str) -> int:
    """``value`` as an int within [low, high]; the messages name ``what``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{what} is a bool; expected an int")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} is {type(value).__name__} {value!r:.40}; expected an int"
        ) from None
    if not low <= number <= high:
        raise ValueError(f"{what} = {number} is outside {bounds}")
    return number


def block_id(value: object, what: str = "block_id") -> int:
    """A block id: an int in [0, 2^63-1]."""
    return scalar_int(value, what, 0, MAX_BLOCK_ID, "[0, 2^63-1]")


def real_hash(value: object, what: str = "hash") -> int:
    """A block hash that can be stored: an int in [1, 2^63-1] (no -1/0 sentinel)."""
    return scalar_int(value, what, 1, MAX_HASH, "[1, 2^63-1]")


def block_ids_and_hashes(
    block_ids: object, hashes: object, most: int
) -> tuple[list[int], list[int]]:
    """The (block_ids, hashes) of one store: 1 to ``most`` pairs, block ids distinct
    (one slot each) and hashes distinct (the registry keeps one block per hash, so a
    repeated hash would leave a slot that no notice ever frees)."""
    ids = int_list(block_ids, "block_ids", 0, MAX_BLOCK_ID, "[0, 2^63-1]")
    hash_list = int_list(hashes, "hashes", 1, MAX_HASH, "[1, 2^63-1]")
    if len(ids) != len(hash_list):
        raise ValueError(f"block_ids and hashes differ in length ({len(ids)} != {len(hash_list)})")
    if not 1 <= len(ids) <= most:
        raise ValueError(f"store takes 1 to {most} blocks (the pool's slots), not {len(ids)}")
    distinct(ids, "block_ids")
    distinct(hash_list, "hashes")
    return ids, hash_list


def distinct(values: list[int], what: str) -> None:
    """``ValueError`` naming both positions if a value repeats."""
    if len(set(values)) == len(values):
        return
    first: dict[int, int] = {}
    for i, value in enumerate(values):
        if value in first:
            raise ValueError(f"{what}[{i}] = {value} repeats {what}[{first[value]}]")
        first[value] = i


def pair_list(pairs: object) -> list[tuple[int, int]]:
    """``free``'s argument: (block_id, hash) pairs, every one checked."""
    if isinstance(pairs, (str, bytes, bytearray, torch.Tensor)) or not isinstance(pairs, Iterable):
        raise TypeError(
            f"pairs must be an iterable of (block_id, hash), not {type(pairs).__name__}"
        )
    result = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes, bytearray)) or not isinstance(pair, (tuple, list)):
            raise TypeError(
                f"pairs[{i}] is {type(pair).__name__}; expected a (block_id, hash) pair"
            )
        if len(pair) != 2:
            raise ValueError(f"pairs[{i}] has {len(pair)} items; expected (block_id, hash)")
        result.append((block_id(pair[0], f"pairs[{i}][0]"), real_hash(pair[1], f"pairs[{i}][1]")))
    return result


def notice(value: object) -> EvictionNotice:
    """An eviction notice whose number, kind and pairs are well formed."""
    if not isinstance(value, EvictionNotice):
        raise TypeError(f"notice must be an EvictionNotice, not {type(value).__name__}")
    scalar_int(value.seq, "notice.seq", 0, 2**64 - 1, "[0, 2^64-1]")
    if value.kind not in KINDS:
        raise ValueError(f"notice.kind {value.kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(value.pairs, (tuple, list)):
        raise TypeError(f"notice.pairs is {type(value.pairs).__name__}; expected a tuple")
    for i, pair in enumerate(value.pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"notice.pairs[{i}] is not a (block_id, hash) pair")
        block_id(pair[0], f"notice.pairs[{i}][0]")
        real_hash(pair[1], f"notice.pairs[{i}][1]")
    return value


def count(value: object, what: str) -> int:
    """A size argument: an int of at least 1."""
    return scalar_int(value, what, 1, 2**63 - 1, "[1, 2^63-1]")


def state_shape(value: object, what: str) -> tuple[int, ...]:
    """A per-slot state shape: a sequence of ints, each at least 1."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a sequence of ints, not {type(value).__name__}")
    return tuple(
        scalar_int(d, f"{what}[{i}]", 1, 2**63 - 1, "[1, 2^63-1]") for i, d in enumerate(value)
    )


def float_dtype(value: object, what: str = "dtype") -> torch.dtype:
    """A floating-point torch dtype (float32, bfloat16, float16, float64, float8...)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype, not {type(value).__name__}")
    if not value.is_floating_point:
        raise ValueError(f"{what} = {value} is not a floating-point dtype")
    return value


def pool_device(value: object) -> torch.device:
    """A device the pool can allocate on now, with its index (``cuda`` -> ``cuda:N``),
    so it compares equal to the ``device`` of the tensors allocated there."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, not {type(value).__name__}")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"device {value!r} is not a torch device") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device {value!r}: the pool lives on one of {', '.join(DEVICE_TYPES)}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {value!r}: CUDA is not available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"device {value!r}: there are only {torch.cuda.device_count()} CUDA devices"
        )
    return torch.device("cuda", index)


def flag(value: object, what: str) -> bool:
    """A keyword switch: a real bool (a truthy string must not switch anything on)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, not {type(value).__name__}")
    return value


def state_tensor(
    value: object,
    what: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    cast: bool,
    output: bool,
) -> torch.Tensor:
    """A state tensor matching the pool: exact shape (no broadcasting), strided, on the
    pool's device, and of its dtype (any floating dtype when ``cast``). An output must
    also be writable element by element: no expanded (stride 0) dimension."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{what} has layout {value.layout}; expected a dense (strided) tensor")
    if tuple(value.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {shape}")
    if value.device != device:
        raise ValueError(f"{what} is on {value.device}, the pool on {device}")
    if value.dtype != dtype:
        if not cast:
            raise TypeError(
                f"{what} has dtype {value.dtype}, the pool {dtype} (pass cast=True to convert)"
            )
        if not value.dtype.is_floating_point:
            raise TypeError(f"{what} has dtype {value.dtype}; cast=True converts floating dtypes")
    if output and any(
        stride == 0 and size > 1 for size, stride in zip(value.shape, value.stride(), strict=True)
    ):
        raise ValueError(f"{what} is an expanded view (stride 0): its elements share memory")
    return value


def _span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) that ``tensor`` can touch."""
    if tensor.numel() == 0:
        return tensor.untyped_storage().data_ptr(), 0, 0
    extent = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    start = tensor.data_ptr()
    return tensor.untyped_storage().data_ptr(), start, start + extent * tensor.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the two tensors may share memory (same storage, intersecting bytes)."""
    storage_a, start_a, end_a = _span(a)
    storage_b, start_b, end_b = _span(b)
    return storage_a == storage_b and start_a < end_b and start_b < end_a


def seconds(value: object, what: str, *, infinite: bool = False) -> float:
    """A positive duration in seconds, at most what ``threading`` can wait (or
    infinite, where allowed: never). Any ``numbers.Real`` but a bool is taken, numpy's
    scalars among them: wider than ``registry.core.validation.is_number`` (int and
    float only), so that check is not used here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{what} = {value} is longer than the longest wait allowed") from None
    if math.isnan(number) or number <= 0:
        raise ValueError(f"{what} = {value} must be a positive number of seconds")
    if number > threading.TIMEOUT_MAX and not (infinite and math.isinf(number)):
        raise ValueError(f"{what} = {value} is longer than the longest wait allowed")
    return number
