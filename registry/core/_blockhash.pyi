"""Megatron-Core's block-hash chain at native speed (``_blockhash.c``); see
``registry.core.hashing``, which is its only caller."""

from typing import Literal, overload

SHA256: str
"""``"sha-ni"`` where the CPU's SHA extensions hash, else ``"portable"``."""

@overload
def chain(
    parent: bytes,
    tokens: list[int] | tuple[int, ...] | bytes,
    block_size: int,
    digests: Literal[True],
    portable: bool,
    /,
) -> list[bytes] | None: ...
@overload
def chain(
    parent: bytes,
    tokens: list[int] | tuple[int, ...] | bytes,
    block_size: int,
    digests: Literal[False],
    portable: bool,
    /,
) -> list[int] | None: ...
@overload
def chain(
    parent: bytes,
    tokens: list[int] | tuple[int, ...] | bytes,
    block_size: int,
    digests: bool,
    portable: bool,
    /,
) -> list[bytes] | list[int] | None: ...
def token_ids(values: list[object], limit: int, /) -> bool:
    """Whether ``values`` is a non-empty list of ints (not bools), each in ``[0, limit)``."""
