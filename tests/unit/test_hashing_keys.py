"""Chains keyed by a cache salt and a LoRA adapter (``registry.core.hashing``).

Fixed vectors, computed once with hashlib in a scratch session from the specification
(never through the module), tokens [1, 2], block_size 2, block bytes
01000000000000000200000000000000:

LoRA "sql", no salt: the start is
  sha256(b"prefix-cache-registry-lora-v1\\0" + 00000003 + b"sql" + 32 zero bytes) =
      fff1849e49a5a9bcd02ab09ad7d82f671948f7f0d95f1a791d6b94c79a603a95
  sha256(start + block) = c8f1c16dc9b01d0b1d3f0349cb35236dcabc4a8f8ddc7e715850510a321861f6
  first 8 bytes little-endian % (2**63 - 1) + 1 = 800990687918158281
LoRA "sql", salt "tenant-a": the same over Megatron-Core's salted start
  (2ffbf765...f85d6d, see test_hashing.py) instead of the zero bytes =
      1500e4a61f32973b350fe14e8a8bf7f94aa55707167219b41184f102adc68f61
  sha256(start + block) = b04c3f988d8d949efed26773df09de0342f1789e57c786fb32a5f1a37d4ee482
  -> 2203541756975205554
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

import registry
from registry.core.hashing import (
    ZERO_PARENT,
    ChainKeys,
    block_hashes,
    chain_root,
    request_chain_keys,
)
from tests.support.chains import CHAIN_PATHS, chain_path

TOKENS = list(range(64))


@pytest.fixture(autouse=True, scope="module", params=CHAIN_PATHS)
def each_chain_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here holds for each way the chain is computed (pure Python, C)."""
    with chain_path(request.param) as name:
        yield name


def test_fixed_vectors() -> None:
    assert block_hashes([1, 2], 2, lora="sql") == [800990687918158281]
    assert block_hashes([1, 2], 2, salt="tenant-a", lora="sql") == [2203541756975205554]
    assert chain_root(lora="sql").hex() == (
        "fff1849e49a5a9bcd02ab09ad7d82f671948f7f0d95f1a791d6b94c79a603a95"
    )


def test_without_keys_the_chain_is_megatron_s() -> None:
    """No salt and no LoRA: the zero start, the hashes pinned in test_hashing.py."""
    assert chain_root() == ZERO_PARENT
    assert block_hashes([1, 2], 2, salt=None, lora=None) == [4233502300241348285]
    assert block_hashes([1, 2], 2, salt="tenant-a") == [435715467632292919]


def test_every_pair_of_keys_starts_its_own_chain() -> None:
    """Salts, adapters and both: no two give a shared block, nor does a name used once
    as a salt and once as an adapter, nor names whose bytes run together."""
    keys = [
        (None, None), ("a", None), ("b", None), (None, "a"), (None, "b"), ("a", "a"),
        ("a", "b"), ("b", "a"), ("", None), (None, "ab"), ("b", "ab"), ("ab", "b"),
    ]  # fmt: skip
    chains = {k: block_hashes(TOKENS, 8, salt=k[0], lora=k[1]) for k in keys}
    for one, two in itertools.combinations(keys, 2):
        assert not set(chains[one]) & set(chains[two]), (one, two)


def test_a_prefix_of_a_keyed_chain_is_the_chain_of_the_prefix() -> None:
    full = block_hashes(TOKENS, 8, salt="t", lora="x")
    assert block_hashes(TOKENS[:24], 8, salt="t", lora="x") == full[:3]


@pytest.mark.parametrize(
    ("salt", "lora", "error", "words"),
    [
        (None, 5, TypeError, "lora must be an adapter name"),
        (None, b"sql", TypeError, "lora must be an adapter name"),
        (None, "", ValueError, "non-empty"),
        (None, "x" * 1025, ValueError, "at most 1024"),
        (None, "\ud800", ValueError, "not valid Unicode"),
        ("é" * 2049, None, ValueError, "4098 bytes long in UTF-8; at most 4096"),
        (b"x" * 4097, None, ValueError, "at most 4096"),
        ("\udfff", "sql", ValueError, "salt is not valid Unicode"),
        (7, "sql", TypeError, "salt must be str, bytes or None"),
    ],
)
def test_bad_keys_fail_before_hashing(salt: object, lora: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        block_hashes(TOKENS, 8, salt=salt, lora=lora)  # type: ignore[arg-type]
    with pytest.raises(error, match=words):
        chain_root(salt, lora)  # type: ignore[arg-type]


def test_the_longest_keys_allowed_hash() -> None:
    assert len(block_hashes(TOKENS, 8, salt="s" * 4096, lora="l" * 1024)) == 8


def test_a_request_s_keys() -> None:
    """The cache salt as given; the model as the LoRA only when it is an adapter."""
    adapters = frozenset({"sql-adapter"})
    assert request_chain_keys() == ChainKeys(None, None)
    assert request_chain_keys("t1", model="base", adapters=adapters) == ChainKeys("t1", None)
    assert request_chain_keys(model="sql-adapter", adapters=adapters) == ChainKeys(
        None, "sql-adapter"
    )
    keys = request_chain_keys("t1", model="sql-adapter", adapters=["sql-adapter"])
    assert block_hashes(TOKENS, 8, salt=keys.salt, lora=keys.lora) == block_hashes(
        TOKENS, 8, salt="t1", lora="sql-adapter"
    )
    assert request_chain_keys("s" * 128) == ChainKeys("s" * 128)


@pytest.mark.parametrize(
    ("cache_salt", "adapters", "error", "words"),
    [
        (5, (), TypeError, "cache_salt must be a string"),
        (b"t", (), TypeError, "cache_salt must be a string"),
        ("", (), ValueError, "non-empty"),
        ("s" * 129, (), ValueError, "at most 128"),
        ("a/b", (), ValueError, "must not contain"),
        ("a@b", (), ValueError, "must not contain"),
        ("a\\b", (), ValueError, "must not contain"),
        ("a\0b", (), ValueError, "must not contain"),
        ("\ud800", (), ValueError, "not valid Unicode"),
        (None, "sql-adapter", TypeError, "adapters must be a collection"),
    ],
)
def test_a_request_salt_the_engine_refuses_is_refused(
    cache_salt: object, adapters: object, error: type, words: str
) -> None:
    """vLLM refuses these salts (``validate_cache_salt``): no hashes are made for them."""
    with pytest.raises(error, match=words):
        request_chain_keys(cache_salt, model="sql-adapter", adapters=adapters)  # type: ignore[arg-type]


def test_exported_from_the_package() -> None:
    assert registry.block_hashes is block_hashes
    assert registry.chain_root is chain_root
    assert registry.request_chain_keys is request_chain_keys
    assert registry.ChainKeys is ChainKeys
