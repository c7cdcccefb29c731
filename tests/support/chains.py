"""The ways ``registry.core.hashing`` can compute a chain, for tests that must hold
for each: pure Python, the C extension on the CPU's SHA-256 (SHA-NI where the CPU has
it) and the C extension's portable SHA-256. A path whose extension is not built is
skipped, never passed silently: ``test_hashing_native`` checks CI built it."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from registry.core import hashing
from registry.core.hashing import ZERO_PARENT


def specification(tokens: list[int], block_size: int, parent: bytes = ZERO_PARENT) -> list[int]:
    """Megatron-Core's chain written out with hashlib and struct, block by block."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(int.from_bytes(parent[:8], "little") % (2**63 - 1) + 1)
    return hashes


NATIVE = hashing._blockhash
"""The C extension as imported, or None where it was not built."""


class _PortableOnly:
    """The C extension with its portable SHA-256 whatever the CPU offers."""

    SHA256 = "portable"

    @staticmethod
    def chain(parent: bytes, tokens: Any, block_size: int, digests: bool, portable: bool) -> Any:
        assert NATIVE is not None
        return NATIVE.chain(parent, tokens, block_size, digests, True)

    @staticmethod
    def memo(on: bool | None) -> Any:
        assert NATIVE is not None
        return NATIVE.memo(on)

    @staticmethod
    def prompt_ids(raw: bytes, limit: int) -> Any:
        assert NATIVE is not None
        return NATIVE.prompt_ids(raw, limit)


_NO_EXTENSION = pytest.mark.skipif(NATIVE is None, reason="C extension not built")
CHAIN_PATHS = [
    pytest.param("python", id="python"),
    pytest.param("c", id="c", marks=_NO_EXTENSION),
    pytest.param("c-portable", id="c-portable", marks=_NO_EXTENSION),
]


@contextmanager
def chain_path(name: str) -> Iterator[str]:
    """``registry.core.hashing`` computing chains the ``name`` way inside the block."""
    chosen = {"python": None, "c": NATIVE, "c-portable": _PortableOnly}[name]
    saved = hashing._blockhash
    hashing._blockhash = chosen  # type: ignore[assignment]
    try:
        yield name
    finally:
        hashing._blockhash = saved
