"""The C extension of ``registry.core.hashing`` against its pure-Python chain and the
specification: the same hashes and digests for every input form, salt and adapter,
the same refusals, on every SHA-256 it may run (the CPU's, portable C), from threads.
test_hashing.py and test_hashing_keys.py also run whole on each path."""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.core.hashing import (
    block_hashes,
    chain_digests,
    chain_root,
    implementation,
)
from tests.support.chains import NATIVE, chain_path, specification

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
PATHS = ("python", "c", "c-portable")
needs_extension = pytest.mark.skipif(NATIVE is None, reason="C extension not built")


def on_each_path(call: Any) -> dict[str, Any]:
    """``call()``'s result (or the exception's type and text) on every built path."""
    results: dict[str, Any] = {}
    for name in PATHS:
        if name != "python" and NATIVE is None:
            continue
        with chain_path(name):
            try:
                results[name] = call()
            except (TypeError, ValueError) as exc:
                results[name] = (type(exc), str(exc))
    return results


def all_equal(results: dict[str, Any]) -> Any:
    values = list(results.values())
    assert all(v == values[0] for v in values), results
    return values[0]


@needs_extension
def test_each_path_is_the_one_it_names() -> None:
    assert NATIVE is not None
    with chain_path("python"):
        assert implementation() == "python"
    with chain_path("c"):
        assert implementation() == f"c ({NATIVE.SHA256})"
    with chain_path("c-portable"):
        assert implementation() == "c (portable)"


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(INT64, max_size=300),
    block_size=st.integers(min_value=1, max_value=70),
    form=st.sampled_from(["list", "tuple", "numpy"]),
    salt=st.none() | st.text(max_size=8) | st.binary(max_size=8),
    lora=st.none() | st.text(min_size=1, max_size=8),
)
def test_paths_agree_with_the_specification(
    tokens: list[int], block_size: int, form: str, salt: Any, lora: Any
) -> None:
    """Block sizes 1-70 put the padded message across every 64-byte boundary."""
    shaped: Any = {"list": list, "tuple": tuple, "numpy": lambda t: np.array(t, np.int64)}[form]
    hashes = all_equal(
        on_each_path(lambda: block_hashes(shaped(tokens), block_size, salt=salt, lora=lora))
    )
    assert hashes == specification(tokens, block_size, chain_root(salt, lora))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(INT64, max_size=200),
    block_size=st.integers(min_value=1, max_value=40),
    parent=st.binary(min_size=32, max_size=32),
    cut=st.integers(min_value=0, max_value=10),
)
def test_chain_digests_agree_and_continue(
    tokens: list[int], block_size: int, parent: bytes, cut: int
) -> None:
    """The bridge's call: digests from any parent, and a chain continued from a digest
    equals the whole chain."""
    digests = all_equal(on_each_path(lambda: chain_digests(parent, tokens, block_size)))
    assert all(len(d) == 32 for d in digests)
    head = min(cut, len(digests))
    rest = tokens[head * block_size :]
    middle = digests[head - 1] if head else parent
    tail = all_equal(on_each_path(lambda: chain_digests(middle, rest, block_size)))
    assert digests[:head] + tail == digests


@pytest.mark.parametrize("block_size", [16, 32])
def test_long_prompts_agree(block_size: int) -> None:
    """512 blocks: the extension hashes these without the GIL."""
    rng = np.random.default_rng(block_size)
    tokens = rng.integers(0, 152_000, 512 * block_size).tolist()
    hashes = all_equal(on_each_path(lambda: block_hashes(tokens, block_size)))
    assert len(hashes) == 512
    assert hashes == specification(tokens, block_size)


def test_a_parent_of_another_length_still_chains() -> None:
    """``chain_digests`` accepted any bytes as the parent; the extension takes 32."""
    for parent in (b"", b"x" * 31, b"y" * 64):
        digests = all_equal(on_each_path(lambda p=parent: chain_digests(p, [1, 2, 3, 4], 2)))
        assert digests[0] == hashlib.sha256(parent + struct.pack("<2q", 1, 2)).digest()


class Index:
    """Not an int, but usable as one (``__index__``)."""

    def __index__(self) -> int:
        return 5


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([1, 2.0, 3, 4], id="float"),
        pytest.param([1, True, 3, 4], id="bool"),
        pytest.param((1, 2, False, 4), id="bool-in-tuple"),
        pytest.param([1, "2", 3, 4], id="str"),
        pytest.param([1, None], id="none"),
        pytest.param([1, 2, 3, 2**63], id="too-big-in-the-tail"),
        pytest.param([-(2**63) - 1, 1], id="too-small"),
        pytest.param([2**64, True], id="too-big-before-a-bool"),
        pytest.param([True, 2**64], id="bool-before-too-big"),
        pytest.param([1, 2, 3, 4, 5.5], id="float-in-the-partial-block"),
        pytest.param([1, Index(), 3, 4], id="index-object"),
        pytest.param([np.int64(7), 2**40, -3, 0], id="numpy-scalars"),
        pytest.param(np.array([1.0, 2.0]), id="numpy-floats"),
        pytest.param(np.array([1, 2**63], dtype=np.uint64), id="numpy-uint64-too-big"),
        pytest.param(b"\x01\x02", id="bytes"),
        pytest.param(12, id="not-iterable"),
    ],
)
def test_refusals_and_acceptances_are_alike(tokens: Any) -> None:
    results = on_each_path(lambda: block_hashes(tokens, 2))
    all_equal(results)


def test_threads_hash_alike() -> None:
    """Four threads hashing long prompts at once (the GIL released meanwhile) each get
    the hashes one thread gets."""
    prompts = [list(range(k, k + 512 * 16)) for k in range(4)]
    with chain_path("python"):
        expected = [block_hashes(p, 16) for p in prompts]
    got: dict[int, list[list[int]]] = {}

    def work(k: int) -> None:
        got[k] = [block_hashes(prompts[k], 16) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(got[k] == [expected[k]] * 20 for k in range(4))


TOKEN_LISTS: list[tuple[Any, bool]] = [
    ([0, 1, 2**31 - 1], True),
    ([5], True),
    ([], False),
    ([1, True], False),  # a bool is not a token id, though an int to Python
    ([1, 2.0], False),
    ([1, "2"], False),
    ([1, None], False),
    ([1, -1], False),
    ([1, 2**31], False),
    ([1, 2**64], False),  # past 64 bits
    ([1, -(2**70)], False),
    ([1, [2]], False),
]


@pytest.mark.parametrize("path", ["python", "c"])
@pytest.mark.parametrize(("values", "expected"), TOKEN_LISTS)
def test_token_ids_checks_the_same_on_both_paths(path: str, values: Any, expected: bool) -> None:
    """``token_ids``: a non-empty list of ints (not bools), each in ``[0, limit)``, the
    same answer in C and in Python."""
    from registry.core.hashing import token_ids

    if path == "c" and NATIVE is None:
        pytest.skip("C extension not built")
    with chain_path(path):
        assert token_ids(values, 2**31) is expected


@needs_extension
def test_token_ids_refuses_what_is_not_a_list() -> None:
    from registry.core.hashing import token_ids

    with chain_path("c"), pytest.raises(TypeError):
        token_ids((1, 2), 2**31)  # type: ignore[arg-type]
