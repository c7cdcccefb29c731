"""Megatron-Core's registry behaviours, run on every backend: in-memory, fakeredis,
Redis, Cluster."""

from __future__ import annotations

from registry import PrefixCacheRegistry
from tests.support.backends import Backend, registry_state

H = [1111, 2222, 3333, 4444, 5555]
BIG = 2**63 - 1  # the largest hash: must survive Lua untouched (doubles hold 2^53)


def test_kv_lifecycle(backend: Backend) -> None:
    reg = backend.registry()
    assert reg.match_kv_prefix(H) == ([], 0)
    reg.register_kv([10, 11, 12], H[:3])
    assert reg.match_kv_prefix(H) == ([10, 11, 12], H[2])
    assert reg.match_kv_prefix(H[:2]) == ([10, 11], H[1])
    assert reg.evict_kv([H[2], H[4]]) == {H[2]}
    assert reg.match_kv_prefix(H) == ([10, 11], H[1])
    assert reg.evict_kv(H) == {H[0], H[1]}
    assert reg.match_kv_prefix(H) == ([], 0)
    assert registry_state(reg) == ({}, {})


def test_large_hashes_round_trip_exactly(backend: Backend) -> None:
    reg = backend.registry()
    hashes = [BIG, BIG - 1, 2**53 + 1, 2**53, 1]
    reg.register_kv([7, 8, 9, 10, 11], hashes)
    reg.register_mamba([7, 9], [BIG, 2**53 + 1])
    assert reg.match_kv_prefix(hashes) == ([7, 8, 9, 10, 11], 1)
    assert reg.match_kv_prefix([BIG, 2**53 - 1]) == ([7], BIG)  # 2^53-1 was never stored
    assert reg.match_mamba_farthest(hashes) == 3
    assert reg.match_mamba_farthest([2**53]) == 0  # 2^53 has KV only, no Mamba state
    assert reg.evict_kv([2**53 + 1, BIG]) == {2**53 + 1, BIG}
    assert registry_state(reg) == ({BIG - 1: 8, 2**53: 10, 1: 11}, {})


def test_hole_in_the_middle_stops_the_prefix(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_kv([1, 2, 3, 4], H[:4])
    reg.evict_kv([H[1]])
    # Megatron-Core's backward scan raises KeyError here; the prefix ends at the hole.
    assert reg.match_kv_prefix(H) == ([1], H[0])
    reg.evict_kv([H[0]])
    assert reg.match_kv_prefix(H) == ([], 0)


def test_sentinels_never_match(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_kv([1, 2], H[:2])
    assert reg.match_kv_prefix([H[0], -1, H[1]]) == ([1], H[0])
    assert reg.match_kv_prefix([0, H[0]]) == ([], 0)
    assert reg.evict_kv([-1]) == set()
    assert reg.evict_kv([-1, H[0], -1]) == {H[0]}


def test_reregistration_last_writer_wins(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_kv([1, 2], H[:2])
    reg.register_kv([5], H[:1])
    assert reg.match_kv_prefix(H[:2]) == ([5, 2], H[1])
    reg.register_kv([6, 7], [H[2], H[2]])  # repeated hash in one call: last one wins
    assert registry_state(reg)[0] == {H[0]: 5, H[1]: 2, H[2]: 7}


def test_duplicates_in_evict_and_match(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_kv([1, 2], H[:2])
    reg.register_mamba([1], H[:1])
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    assert reg.match_kv_prefix([H[0], H[0], H[1]]) == ([1, 1, 2], H[1])
    assert reg.evict_kv([H[0], H[0], H[0]]) == {H[0]}
    assert fired == [[1]]


def test_empty_input(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    assert reg.match_kv_prefix([]) == ([], 0)
    reg.register_kv([], [])
    assert reg.evict_kv([]) == set()
    assert reg.match_mamba_farthest([]) == 0
    assert reg.find_mamba_backoff([], 3) == 0
    reg.register_mamba([], [])
    assert reg.evict_mamba([]) == set()
    assert fired == []
    assert registry_state(reg) == ({}, {})


def test_mamba_lifecycle_with_callback(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_kv([1, 2, 3, 4, 5], H)
    reg.register_mamba([2, 4, 9, 9], [H[1], H[3], -1, 0])  # -1 and 0 are skipped
    assert registry_state(reg)[1] == {H[1]: 2, H[3]: 4}
    assert reg.match_mamba_farthest(H) == 4
    assert reg.match_mamba_farthest(H[:3]) == 2
    assert reg.match_mamba_farthest([H[0], H[2], H[4]]) == 0
    assert reg.evict_mamba([H[3], H[0], -1]) == {H[3]}
    assert fired == [[4]]
    assert reg.evict_mamba([H[3]]) == set()
    assert fired == [[4]]  # nothing removed: no callback
    assert reg.match_mamba_farthest(H) == 2
    assert reg.match_kv_prefix(H) == ([1, 2, 3, 4, 5], H[4])  # KV untouched


def test_find_mamba_backoff(backend: Backend) -> None:
    reg = backend.registry()
    reg.register_mamba([1, 3], [H[0], H[2]])
    assert reg.find_mamba_backoff(H, 5) == 3
    assert reg.find_mamba_backoff(H, 3) == 3
    assert reg.find_mamba_backoff(H, 2) == 1
    assert reg.find_mamba_backoff(H, 1) == 1
    assert reg.find_mamba_backoff(H, 0) == 0
    assert reg.find_mamba_backoff(H, -4) == 0
    assert reg.find_mamba_backoff(H, 99) == 3  # past the end: clamped (Megatron-Core raises)
    assert reg.find_mamba_backoff(H[1:2], 1) == 0


def test_kv_eviction_cascades_to_mamba(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_kv([1, 2, 3], H[:3])
    reg.register_mamba([1, 2, 3], H[:3])
    assert reg.evict_kv([H[1], H[2], H[4]]) == {H[1], H[2]}
    assert fired == [[2, 3]]
    assert registry_state(reg) == ({H[0]: 1}, {H[0]: 1})
    # KV evicted, no Mamba entry left for it: no callback.
    reg.register_kv([4], H[3:4])
    assert reg.evict_kv([H[3]]) == {H[3]}
    assert fired == [[2, 3]]


def test_cascade_only_for_hashes_present_in_kv(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_mamba([8], [H[0]])  # Mamba entry with no KV entry
    assert reg.evict_kv([H[0]]) == set()
    assert fired == []
    assert registry_state(reg) == ({}, {H[0]: 8})


def test_mamba_replacement_counts_as_removal(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_mamba([5], [H[0]])
    reg.register_mamba([5], [H[0]])  # same block id again: nothing replaced
    assert fired == []
    reg.register_mamba([6, 7], [H[0], H[1]])
    assert fired == [[5]]
    assert registry_state(reg)[1] == {H[0]: 6, H[1]: 7}


def test_clear_and_reset(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_kv([1, 2], H[:2])
    reg.register_mamba([1], H[:1])
    reg.clear_kv()
    assert registry_state(reg) == ({}, {H[0]: 1})
    reg.clear_mamba()
    assert registry_state(reg) == ({}, {})
    reg.register_kv([1, 2], H[:2])
    reg.register_mamba([2], H[1:2])
    reg.reset()
    assert registry_state(reg) == ({}, {})
    assert fired == []  # clears fire no callback, as in Megatron-Core
    reg.clear_kv()  # clearing empty maps is harmless
    reg.reset()


def test_reset_keeps_the_callback_wired(backend: Backend) -> None:
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    reg.register_mamba([1], H[:1])
    reg.reset()
    reg.register_kv([3], H[:1])
    reg.register_mamba([3], H[:1])
    reg.evict_kv(H[:1])
    assert fired == [[3]]
    reg.set_mamba_evict_callback(None)
    reg.register_mamba([4], H[:1])
    reg.evict_mamba(H[:1])
    assert fired == [[3]]


def test_twenty_thousand_hashes(backend: Backend) -> None:
    """Lists far past Lua's unpack limit (the scripts chunk by 4,000): 20,000 hashes on a
    real server (fakeredis runs Lua in Python: 8,400 there, still three chunks)."""
    size = 8_400 if backend.name == "fakeredis" else 20_000
    hole, search = size * 7 // 20, size * 12_345 // 20_000  # 7,000 and 12,345 of 20,000
    reg = backend.registry()
    fired: list[list[int]] = []
    reg.set_mamba_evict_callback(fired.append)
    hashes = [2**62 + i for i in range(size)]
    ids = list(range(size))
    reg.register_kv(ids, hashes)
    reg.register_mamba(ids[::2], hashes[::2])
    assert reg.match_kv_prefix(hashes) == (ids, hashes[-1])
    assert reg.match_mamba_farthest(hashes) == size - 1
    assert reg.find_mamba_backoff(hashes, search) == search - (search + 1) % 2
    reg.register_mamba(ids[::2], hashes[::2])  # same ids: no replacement
    # Evict the second half (with its Mamba entries) plus a middle hole.
    removed = reg.evict_kv([*hashes[size // 2 :], hashes[hole]])
    assert removed == {*hashes[size // 2 :], hashes[hole]}
    assert sorted(fired[0]) == sorted({*ids[size // 2 :: 2], hole})
    assert reg.match_kv_prefix(hashes) == (ids[:hole], hashes[hole - 1])
    assert reg.evict_mamba(hashes) == set(hashes[: size // 2 : 2]) - {hashes[hole]}
    assert reg.match_mamba_farthest(hashes) == 0


def test_two_objects_on_one_namespace_share_state(redis_backend: Backend) -> None:
    backend = redis_backend
    first = backend.registry()
    assert isinstance(first, PrefixCacheRegistry)
    second = backend.registry(first.namespace, decode_responses=True)
    first.register_kv([1, 2], H[:2])
    assert second.match_kv_prefix(H) == ([1, 2], H[1])
    second.register_mamba([2], H[1:2])
    assert first.match_mamba_farthest(H) == 2
    fired: list[list[int]] = []
    first.set_mamba_evict_callback(fired.append)
    second.evict_kv([H[1]])
    assert fired == []  # the callback is local to the process/object that evicts
    assert first.match_kv_prefix(H) == ([1], H[0])


def test_namespaces_are_isolated(redis_backend: Backend) -> None:
    backend = redis_backend
    a, b = backend.registry(), backend.registry()
    a.register_kv([1, 2], H[:2])
    a.register_mamba([1], H[:1])
    assert b.match_kv_prefix(H) == ([], 0)
    assert b.match_mamba_farthest(H) == 0
    assert b.evict_kv(H) == set()
    b.reset()
    assert registry_state(a) == ({H[0]: 1, H[1]: 2}, {H[0]: 1})


def test_arguments_are_never_modified(backend: Backend) -> None:
    reg = backend.registry()
    hashes, ids = [H[0], -1, H[1], 0], [1, 2, 3, 4]
    reg.register_kv([1, 2], [H[0], H[1]])
    reg.match_kv_prefix(hashes)
    reg.match_mamba_farthest(hashes)
    reg.find_mamba_backoff(hashes, 3)
    reg.register_mamba(ids, hashes)
    reg.evict_mamba(hashes)
    reg.evict_kv(hashes)
    assert hashes == [H[0], -1, H[1], 0]
    assert ids == [1, 2, 3, 4]
