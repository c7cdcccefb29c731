"""The digests the C extension remembers (``registry.core.hashing.remember_digests``):
a block hashed before after the same parent gives the digest SHA-256 gives, whatever
else was remembered: prompts sharing prefixes, blocks that differ in one token and
land in one slot, the all-zero block after the zero parent, block sizes changing,
sizes too large to remember, threads hashing at once while it is switched and
cleared."""

from __future__ import annotations

import hashlib
import random
import struct
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.core.hashing import ZERO_PARENT, block_hashes, chain_digests, remember_digests
from tests.support.chains import NATIVE, specification

pytestmark = pytest.mark.skipif(NATIVE is None, reason="C extension not built")


@pytest.fixture(autouse=True)
def remembering() -> Iterator[None]:
    """Each test starts with nothing remembered and leaves the default (on)."""
    remember_digests(None)
    remember_digests(True)
    yield
    remember_digests(True)


def test_it_says_whether_it_remembers() -> None:
    assert remember_digests(False) is True
    assert remember_digests(True) is False
    assert remember_digests(None) is True  # forgetting leaves it on


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64, 65, 200])
def test_prompts_sharing_a_prefix_get_the_chain_again_and_again(block_size: int) -> None:
    rng = random.Random(block_size)
    system = [rng.randrange(50_000) for _ in range(12 * block_size)]
    prompts = [
        system + [rng.randrange(50_000) for _ in range(k * block_size + 3)] for k in range(6)
    ]
    prompts += [system[: 5 * block_size]]  # a prefix of the others
    for _ in range(3):  # cold, then remembered
        for prompt in prompts:
            assert block_hashes(prompt, block_size) == specification(prompt, block_size)


def test_blocks_differing_in_one_token_after_one_parent_each_get_their_own() -> None:
    """Same parent, same first token: one slot; the bytes compared tell them apart."""
    head = [7] * 16
    first = head + list(range(1, 17))
    second = head + list(range(1, 16)) + [99]
    for prompt in (first, second, first, second, first):
        assert block_hashes(prompt, 16) == specification(prompt, 16)
    assert block_hashes(first, 16)[1] != block_hashes(second, 16)[1]


def test_the_zero_block_after_the_zero_parent_is_not_taken_for_an_empty_slot() -> None:
    for prompt in ([0] * 64, [0] * 63 + [1], [0] * 64):
        assert block_hashes(prompt, 16) == specification(prompt, 16)
        assert (
            chain_digests(ZERO_PARENT, prompt, 16)[-1]
            == hashlib.sha256(
                chain_digests(ZERO_PARENT, prompt, 16)[-2] + struct.pack("<16q", *prompt[48:])
            ).digest()
        )


def test_block_sizes_taking_turns_and_salts_each_get_their_chain() -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(640)]
    for _ in range(2):
        for size in (16, 32, 16, 8, 32):
            assert block_hashes(prompt, size) == specification(prompt, size)
            salted = block_hashes(prompt, size, salt="tenant")
            assert salted != block_hashes(prompt, size)
            assert salted == block_hashes(prompt, size, salt="tenant")


def test_off_and_forgotten_give_the_same_hashes() -> None:
    prompt = list(range(4096))
    on = block_hashes(prompt, 16)
    remember_digests(False)
    off = block_hashes(prompt, 16)
    remember_digests(None)
    remember_digests(True)
    assert on == off == block_hashes(prompt, 16) == specification(prompt, 16)


def test_threads_hashing_while_it_is_switched_and_cleared_get_the_chain() -> None:
    """Long prompts (hashed without the GIL, the table then free to one thread) and
    short ones (with it) sharing prefixes, from four threads, while a fifth switches
    the table off, on and clears it."""
    rng = random.Random(9)
    system = [rng.randrange(50_000) for _ in range(2048 * 2)]
    prompts = [system + [rng.randrange(50_000) for _ in range(64 * k)] for k in range(1, 5)]
    prompts += [system[:400] + [k] * 40 for k in range(4)]
    expected = [specification(p, 16) for p in prompts]
    wrong: list[int] = []
    stop = threading.Event()

    def work(k: int) -> None:
        for n in range(30):
            at = (k + n) % len(prompts)
            if block_hashes(prompts[at], 16) != expected[at]:
                wrong.append(at)

    def switch() -> None:
        turn = 0
        while not stop.is_set():
            remember_digests((None, False, True)[turn % 3])
            turn += 1

    switcher = threading.Thread(target=switch)
    switcher.start()
    workers = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=120)
    stop.set()
    switcher.join(timeout=30)
    assert wrong == []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
    st.sampled_from([1, 2, 4, 16]),
)
def test_families_of_prompts_from_few_tokens_get_the_chain(
    shared: list[int], tails: list[list[int]], block_size: int
) -> None:
    """Few distinct tokens: blocks that repeat, collide in slots and share parents."""
    for tail in tails * 2:
        prompt = shared + tail
        assert block_hashes(prompt, block_size) == specification(prompt, block_size)


FORKS = """
import os, signal, sys, threading
from registry.core.hashing import block_hashes, remember_digests
prompt = list(range(8192))  # hashed without the GIL: the table's lock held meanwhile
want = block_hashes(prompt, 16)
stop = False
def hash_on():
    while not stop:
        block_hashes(prompt, 16)
threading.Thread(target=hash_on, daemon=True).start()
hung = 0
for _ in range(40):
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child stuck on its parent's lock is killed, not waited on
        remember_digests(True)  # takes the lock: blocks for ever on one held at the fork
        os._exit(0 if block_hashes(prompt, 16) == want else 3)
    _, status = os.waitpid(pid, 0)
    hung += status != 0
stop = True
print(hung)
"""


def test_a_child_forked_while_a_thread_hashes_has_its_own_lock() -> None:
    """A thread of the parent holds the table's lock while it hashes a long prompt
    without the GIL; a child forked then would wait on it for ever without its own."""
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    ran = subprocess.run(
        [sys.executable, "-c", FORKS], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "0"
