"""Tests for registry.hashing.block_hashes against its specification.

The fixed vectors below were computed once, by hand, with hashlib and struct in a
scratch session that followed the specification step by step (it never called
block_hashes), and are hard-coded here as literal integers.

Derivation of the smallest case, tokens [1, 2] with block_size 2:
  block bytes (two int64 LE):  01000000000000000200000000000000
  sha256(32 zero bytes + block bytes) =
      bc46af79e96bc03a3b5a1a88aeab5079b0dd4c6dfc5f9c14e318fec7de310f6b
  first 8 bytes bc46af79e96bc03a read little-endian = 4233502300241348284
  4233502300241348284 % (2**63 - 1) = 4233502300241348284 (already below the modulus)
  + 1 = 4233502300241348285

Salted case (salt "tenant-a"): the start parent is
  sha256(b"megatron-prefix-cache-salt-v1\\0" + b"tenant-a") =
      2ffbf765b9eda9db59a0839f077246a808f294ee6d41a6f617826c0f73f85d6d
  sha256(parent + 01000000000000000200000000000000) =
      35b45dc7e8f80b8622fc5b1c62dbb47298025dc7c32fb0f1b53049ae6ed15c2f
  first 8 bytes LE = 9659087504487068725, which is >= 2**63 - 1, so the modulo
  matters here: 9659087504487068725 % (2**63 - 1) = 435715467632292918, + 1 =
  435715467632292919.

Large/negative tokens [2**40 + 7, -3]: the block bytes are
  0700000000010000 fdffffffffffffff (int64 two's complement, little-endian).
"""

from __future__ import annotations

import subprocess
import sys
from array import array
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.core.hashing import block_hashes
from tests.support import REPO_ROOT
from tests.support.chains import CHAIN_PATHS, chain_path

MAX_HASH = 2**63 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
REPO_ROOT = REPO_ROOT


@pytest.fixture(autouse=True, scope="module", params=CHAIN_PATHS)
def each_chain_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here holds for each way the chain is computed (pure Python, C)."""
    with chain_path(request.param) as name:
        yield name


# ---------------------------------------------------------------------------
# 1. Fixed vectors, derived from the specification (see the module docstring).
# ---------------------------------------------------------------------------

VECTOR_A = [4233502300241348285]
VECTOR_B = [4233502300241348285, 2039082787298172998]
VECTOR_C = [
    4832768347186360981,
    8533535913844734714,
    3905928356911304714,
    4807357989344363593,
]
VECTOR_D = [5305464092133997801]
VECTOR_E = [435715467632292919]


@pytest.mark.parametrize(
    ("tokens", "block_size", "salt", "expected"),
    [
        pytest.param([1, 2], 2, None, VECTOR_A, id="a-one-block"),
        pytest.param([1, 2, 3, 4, 5], 2, None, VECTOR_B, id="b-trailing-token-ignored"),
        pytest.param(list(range(16)), 4, None, VECTOR_C, id="c-four-blocks"),
        pytest.param([2**40 + 7, -3], 2, None, VECTOR_D, id="d-large-and-negative"),
        pytest.param([1, 2], 2, "tenant-a", VECTOR_E, id="e-salted"),
    ],
)
def test_fixed_vectors(tokens, block_size, salt, expected):
    assert block_hashes(tokens, block_size, salt=salt) == expected


def test_first_block_is_independent_of_later_blocks():
    # (a) and (b) share their first block, so their first hash must agree.
    assert VECTOR_A[0] == VECTOR_B[0]


def test_prefix_property():
    bs = 4
    tokens = list(range(100, 120))
    assert block_hashes(tokens[: 2 * bs], bs) == block_hashes(tokens, bs)[:2]


def test_changing_block_zero_changes_every_later_hash():
    bs = 4
    tokens = list(range(100, 120))
    changed = list(tokens)
    changed[1] += 1
    before = block_hashes(tokens, bs)
    after = block_hashes(changed, bs)
    assert len(before) == len(after) == 5
    for old, new in zip(before, after, strict=True):
        assert old != new


def test_changing_a_later_block_keeps_earlier_hashes():
    bs = 4
    tokens = list(range(100, 120))
    changed = list(tokens)
    changed[2 * bs] += 1  # first token of block 2
    before = block_hashes(tokens, bs)
    after = block_hashes(changed, bs)
    assert before[:2] == after[:2]
    assert all(old != new for old, new in zip(before[2:], after[2:], strict=True))


# ---------------------------------------------------------------------------
# 2. Input types.
# ---------------------------------------------------------------------------


class OnlyToList:
    """An array-like object that exposes nothing but ``.tolist()``."""

    def __init__(self, values):
        self._values = list(values)

    def tolist(self):
        return list(self._values)


SMALL_TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # fits in uint16 and int32


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(list, id="list"),
        pytest.param(tuple, id="tuple"),
        pytest.param(lambda t: array("q", t), id="array-q"),
        pytest.param(lambda t: array("i", t), id="array-i"),
        pytest.param(lambda t: np.array(t, dtype=np.int64), id="numpy-int64"),
        pytest.param(lambda t: np.array(t, dtype=np.int32), id="numpy-int32"),
        pytest.param(lambda t: np.array(t, dtype=np.uint16), id="numpy-uint16"),
        pytest.param(lambda t: np.array(t, dtype=">i4"), id="numpy-big-endian-int32"),
        pytest.param(lambda t: np.array([t], dtype=np.int64), id="numpy-2d-1xn"),
        pytest.param(lambda t: (x for x in t), id="generator"),
        pytest.param(OnlyToList, id="only-tolist"),
        pytest.param(lambda t: [np.int64(x) for x in t], id="list-of-np-int64"),
    ],
)
def test_input_types_give_identical_results(make):
    bs = 4
    expected = block_hashes(list(SMALL_TOKENS), bs)
    assert len(expected) == len(SMALL_TOKENS) // bs
    assert block_hashes(make(SMALL_TOKENS), bs) == expected


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: array("q", t), id="array-q"),
        pytest.param(lambda t: np.array(t, dtype=np.int64), id="numpy-int64"),
        pytest.param(lambda t: [np.int64(x) for x in t], id="list-of-np-int64"),
        pytest.param(OnlyToList, id="only-tolist"),
    ],
)
def test_input_types_match_fixed_vector_with_large_and_negative(make):
    assert block_hashes(make([2**40 + 7, -3]), 2) == VECTOR_D


# ---------------------------------------------------------------------------
# 3. Edge cases.
# ---------------------------------------------------------------------------


def test_fewer_tokens_than_block_size():
    assert block_hashes([1, 2, 3], 4) == []


@pytest.mark.parametrize(
    "empty",
    [[], (), array("q"), np.array([], dtype=np.int64), np.array([], dtype=np.uint64)],
    ids=["list", "tuple", "array-q", "numpy-int64", "numpy-uint64"],
)
def test_empty_tokens(empty):
    assert block_hashes(empty, 4) == []


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_size_not_positive(block_size):
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3, 4], block_size)


@pytest.mark.parametrize("block_size", [True, False, 2.0, 1.5])
def test_block_size_wrong_type(block_size):
    with pytest.raises(TypeError, match="block_size"):
        block_hashes([1, 2, 3, 4], block_size)


@pytest.mark.parametrize(
    "bad",
    [1.0, "1", None, True, False],
    ids=["float", "str", "None", "True", "False"],
)
def test_token_of_wrong_type(bad):
    with pytest.raises(TypeError):
        block_hashes([1, bad, 3, 4], 2)


@pytest.mark.parametrize("bad", [2**63, 2**64, INT64_MIN - 1, -(2**70)])
def test_token_out_of_int64_range(bad):
    with pytest.raises(ValueError, match="int64"):
        block_hashes([1, bad], 2)


def test_int64_bounds_are_accepted():
    hashes = block_hashes([INT64_MIN, INT64_MAX], 2)
    assert len(hashes) == 1
    assert 1 <= hashes[0] <= MAX_HASH


def test_numpy_uint64_above_int64_range():
    with pytest.raises(ValueError, match="int64"):
        block_hashes(np.array([1, 2**63], dtype=np.uint64), 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.bool_, object])
def test_numpy_non_integer_dtype(dtype):
    with pytest.raises(TypeError):
        block_hashes(np.array([1, 2], dtype=dtype), 2)


@pytest.mark.parametrize("tokens", ["1234", b"\x01\x02", bytearray(b"\x01\x02")])
def test_str_or_bytes_as_tokens(tokens):
    with pytest.raises(TypeError):
        block_hashes(tokens, 2)


def test_non_iterable_tokens():
    with pytest.raises(TypeError):
        block_hashes(12, 2)


@pytest.mark.parametrize("salt", [1, 1.5, bytearray(b"x"), ["x"]])
def test_salt_of_wrong_type(salt):
    with pytest.raises(TypeError, match="salt"):
        block_hashes([1, 2], 2, salt=salt)


# ---------------------------------------------------------------------------
# 4. Salt isolation.
# ---------------------------------------------------------------------------


def test_salts_give_pairwise_disjoint_hashes():
    tokens = list(range(1000, 1064))
    bs = 16
    plain = block_hashes(tokens, bs)
    tenant_a = block_hashes(tokens, bs, salt="tenant-a")
    tenant_b = block_hashes(tokens, bs, salt="tenant-b")
    for hashes in (plain, tenant_a, tenant_b):
        assert len(hashes) == 4
    assert not set(plain) & set(tenant_a)
    assert not set(plain) & set(tenant_b)
    assert not set(tenant_a) & set(tenant_b)


def test_str_salt_equals_utf8_bytes_salt():
    tokens = list(range(32))
    assert block_hashes(tokens, 8, salt="x") == block_hashes(tokens, 8, salt=b"x")
    assert block_hashes(tokens, 8, salt="ünï") == block_hashes(tokens, 8, salt="ünï".encode())


def test_empty_salt_differs_from_no_salt():
    # An empty salt still goes through the salt domain, so it is not the zero start.
    assert block_hashes([1, 2], 2, salt="") != block_hashes([1, 2], 2)


# ---------------------------------------------------------------------------
# 5. Range and structure, property-based.
# ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=INT64_MIN, max_value=INT64_MAX), max_size=200),
    block_size=st.integers(min_value=1, max_value=32),
)
def test_hash_range_count_and_prefix(tokens, block_size):
    hashes = block_hashes(tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    assert all(1 <= h <= MAX_HASH for h in hashes)
    for k in range(len(hashes) + 1):
        assert block_hashes(tokens[: k * block_size], block_size) == hashes[:k]


# ---------------------------------------------------------------------------
# 6. No torch import.
# ---------------------------------------------------------------------------


def test_import_does_not_pull_in_torch():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import registry.core.hashing, sys; assert 'torch' not in sys.modules",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_plain_int_lists_and_other_sequences_hash_alike() -> None:
    """Lists and tuples of plain ints take a C-speed packing path; every other form
    (generators, ranges, int subclasses) the checked loop; the hashes agree."""
    import enum

    class Token(enum.IntEnum):
        A = 7

    tokens = [3, -5, 2**63 - 1, -(2**63), 0, 7, 11, 13]
    expected = block_hashes(iter(tokens), 4)
    assert block_hashes(tokens, 4) == expected
    assert block_hashes(tuple(tokens), 4) == expected
    assert block_hashes([*tokens[:5], Token.A, 11, 13], 4) == expected
    with pytest.raises(ValueError, match="int64"):
        block_hashes([1, 2**63], 1)
    with pytest.raises(TypeError, match="bool"):
        block_hashes([1, True], 1)
