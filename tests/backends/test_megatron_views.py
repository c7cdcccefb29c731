"""Megatron-Core reads the registry's two dicts directly. These tests re-create, in our
own words, what its KV block allocator and engine do with them, on every backend."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from registry import RegistryBase, block_hashes
from tests.support.backends import Backend

TOKENS = list(range(3000, 3160))  # 10 blocks of 16 tokens
H = block_hashes(TOKENS, 16)


class Allocator:
    """A KV block allocator as Megatron-Core's uses the registry: it resolves each new
    block's parent through ``kv_hash_to_block_id.get(parent_hash, -1)``, registers the
    chain, and releases least recently used blocks with ``evict_kv``."""

    def __init__(self, registry: RegistryBase, capacity: int) -> None:
        self.registry = registry
        self.free = list(range(capacity - 1, -1, -1))
        self.parent_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()

    def register(self, hashes: list[int]) -> list[int]:
        cached = self.registry.kv_hash_to_block_id
        blocks = []
        for i, h in enumerate(hashes):
            block = cached.get(h, -1)
            if block == -1:
                if not self.free:
                    self.release(1)
                block = self.free.pop()
                parent = cached.get(hashes[i - 1], -1) if i else -1
                self.parent_of[block] = parent
                self.registry.register_kv([block], [h])
            self.lru[block] = None
            self.lru.move_to_end(block)
            blocks.append(block)
        return blocks

    def release(self, count: int) -> None:
        victims = list(self.lru)[:count]
        view = self.registry.kv_hash_to_block_id
        hashes = [h for h, b in view.items() if b in victims]
        assert self.registry.evict_kv(hashes) == set(hashes)
        for block in victims:
            del self.lru[block]
            self.free.append(block)


def test_the_views_read_like_dicts(backend: Backend) -> None:
    reg = backend.registry()
    assert reg.kv_hash_to_block_id == {}
    assert reg.mamba_hash_to_block_id == {}
    reg.register_kv([1, 3], [111, 333])
    reg.register_mamba([3], [333])
    kv, mamba = reg.kv_hash_to_block_id, reg.mamba_hash_to_block_id
    assert kv == {111: 1, 333: 3}
    assert mamba == {333: 3}
    assert kv != {111: 1}
    assert (kv[111], kv.get(222, -1), kv.get(333)) == (1, -1, 3)
    assert 111 in kv
    assert 222 not in kv
    assert (len(kv), len(mamba)) == (2, 1)
    assert sorted(kv) == [111, 333]
    assert sorted(kv.keys()) == [111, 333]
    assert sorted(kv.values()) == [1, 3]
    assert sorted(kv.items()) == [(111, 1), (333, 3)]
    assert dict(mamba) == {333: 3}
    with pytest.raises(KeyError):
        kv[222]
    for odd in ("111", 111.0, True, None, -1, 0, 2**63):
        assert odd not in kv
        assert kv.get(odd, "absent") == "absent"
    reg.evict_kv([111])  # live: the same view object sees the change
    assert kv == {333: 3}
    assert mamba == {333: 3}


def test_writing_through_a_view_is_refused_and_names_the_method(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_kv([1], [111])
    kv, mamba = reg.kv_hash_to_block_id, reg.mamba_hash_to_block_id
    attempts = [
        lambda: kv.__setitem__(5, 5),
        lambda: kv.__delitem__(111),
        lambda: kv.pop(111),
        lambda: kv.update({5: 5}),
        lambda: kv.clear(),
        lambda: kv.setdefault(5, 5),
        lambda: kv.popitem(),
    ]
    for attempt in attempts:
        with pytest.raises(TypeError, match="register_kv / evict_kv"):
            attempt()
    with pytest.raises(TypeError, match="register_mamba / evict_mamba"):
        mamba[7] = 7  # type: ignore[index]
    assert kv == {111: 1}


def test_chained_registration_lru_release_and_reset(backend: Backend) -> None:
    reg = backend.registry()
    allocator = Allocator(reg, capacity=12)
    first = allocator.register(H[:6])
    assert reg.kv_hash_to_block_id == dict(zip(H[:6], first, strict=True))
    assert [allocator.parent_of[b] for b in first] == [-1, *first[:-1]]
    assert allocator.register(H[:6]) == first  # all cached: nothing new
    reg.register_mamba([first[5]], [H[5]])
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    allocator.register(H[6:10] + [2**62 + i for i in range(4)])  # 8 new: 2 released
    assert len(reg.kv_hash_to_block_id) == 12
    assert H[0] not in reg.kv_hash_to_block_id  # the least recently used went first
    allocator.release(4)  # reaches the block with Mamba state: the cascade fires
    assert fired == [[first[5]]]
    assert reg.mamba_hash_to_block_id == {}
    reg.reset()
    assert reg.kv_hash_to_block_id == {}
    reg.register_mamba([4], [H[4]])
    reg.clear_kv()
    assert reg.kv_hash_to_block_id == {}
    assert reg.mamba_hash_to_block_id == {H[4]: 4}  # clear_kv keeps Mamba entries
