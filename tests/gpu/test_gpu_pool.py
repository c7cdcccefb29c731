"""MambaSlotPool: bit-exact store/restore, LRU eviction through the registry, and
freeing only the exact, current (block_id, hash) of a slot."""

from __future__ import annotations

import pytest
import torch

from gpu import MambaSlotPool
from registry import EvictionNotice, LocalPrefixCacheRegistry, PrefixCacheRegistry
from tests.support.backends import Backend, registry_state
from tests.support.gpu import make_pool, out_buffers, states

A, B, C, D, E = 1111, 2222, 3333, 4444, 5555


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_restore_round_trip_is_bit_exact(backend: Backend, dtype: torch.dtype) -> None:
    reg = backend.registry()
    pool = make_pool(reg, dtype=dtype)
    conv, ssm = states(3, dtype=dtype)
    slots = pool.store([7, 8, 9], [A, B, C], conv, ssm)
    assert len(set(slots)) == 3
    assert registry_state(reg)[1] == {A: 7, B: 8, C: 9}
    conv_out, ssm_out = out_buffers(dtype)
    for i, block_id in enumerate([7, 8, 9]):
        assert pool.restore(block_id, conv_out, ssm_out)
        assert torch.equal(conv_out, conv[:, i])
        assert torch.equal(ssm_out, ssm[:, i])
    assert not pool.restore(10, conv_out, ssm_out)  # no slot: the engine zeroes
    assert not pool.restore(7, conv_out, ssm_out, expected_hash=B)
    counts = pool.counts()
    assert (counts.in_use, counts.free, counts.stored, counts.restored) == (3, 5, 3, 3)


def test_lru_eviction_goes_through_the_registry(backend: Backend) -> None:
    reg = backend.registry()
    seen: list[EvictionNotice] = []
    reg.add_eviction_hook(seen.append)
    freed: list[list[tuple[int, int]]] = []
    pool = make_pool(reg, slots=4, on_free=freed.append)
    for i, (block_id, h) in enumerate([(0, A), (1, B), (2, C), (3, D)]):
        pool.store([block_id], [h], *states(1, seed=i))
    conv_out, ssm_out = out_buffers()
    assert pool.restore(0, conv_out, ssm_out)  # block 0 is now the most recently used
    conv, ssm = states(1, seed=99)
    pool.store([4], [E], conv, ssm)
    # Block 1 was the least recently used: evicted in the registry, notice, slot freed.
    assert [(n.kind, n.pairs) for n in seen] == [("evict", ((1, B),))]  # numbers vary
    assert freed == [[(1, B)]]
    assert registry_state(reg)[1] == {A: 0, C: 2, D: 3, E: 4}
    assert pool.pairs() == {(0, A), (2, C), (3, D), (4, E)}
    assert pool.restore(4, conv_out, ssm_out)
    assert torch.equal(conv_out, conv[:, 0])
    counts = pool.counts()
    assert (counts.in_use, counts.evicted, counts.freed) == (4, 1, 1)
    # Two more blocks evict the next two least recently used, 2 and 3, in one call.
    pool.store([5, 6], [B, 9999], *states(2, seed=5))
    assert [(n.kind, n.pairs) for n in seen[1:]] == [("evict", ((2, C), (3, D)))]
    assert seen[0].seq < seen[1].seq
    assert pool.pairs() == {(0, A), (4, E), (5, B), (6, 9999)}


def test_restoring_a_block_id_with_a_new_hash_evicts_the_old_entry(backend: Backend) -> None:
    reg = backend.registry()
    pool = make_pool(reg)
    first = pool.store([5], [A], *states(1, seed=1))
    second = pool.store([5], [B], *states(1, seed=2))
    assert first == second  # the block keeps its slot
    assert registry_state(reg)[1] == {B: 5}
    assert pool.pairs() == {(5, B)}
    assert pool.counts().in_use == 1


def test_free_needs_the_exact_pair_and_is_idempotent(backend: Backend) -> None:
    reg = backend.registry()
    pool = make_pool(reg)
    pool.store([5, 6], [A, B], *states(2))
    assert pool.free([(5, B), (6, A), (7, A)]) == 0
    assert pool.free([(5, A)]) == 1
    assert pool.free([(5, A)]) == 0
    assert pool.pairs() == {(6, B)}


def test_late_notice_never_frees_a_newer_state(backend: Backend) -> None:
    """Block ids are reused: a notice about an older registration frees nothing."""
    reg = backend.registry()
    pool = make_pool(reg)
    other = LocalPrefixCacheRegistry()  # stand-in source of notices for the local backend
    if isinstance(reg, PrefixCacheRegistry):
        other = backend.registry(reg.namespace)  # another process's registry object
    pool.store([5], [A], *states(1))
    notices: list[EvictionNotice] = []
    other.add_eviction_hook(notices.append)
    if isinstance(reg, PrefixCacheRegistry):
        assert other.evict_mamba([A]) == {A}  # the pool's hook did not see this
        (old_notice,) = notices
    else:
        old_notice = EvictionNotice(reg.notice_sequence() + 1, "evict", ((5, A),))
        reg.mamba.pop(A)  # type: ignore[attr-defined]
        reg.notice_seq += 1  # type: ignore[attr-defined]
    pool.store([5], [A], *states(1, seed=3))  # the same pair stored again: stamp >= notice
    assert pool.apply_notice(old_notice) == 0
    assert pool.holds(5, A)
    pool.store([5], [B], *states(1, seed=4))  # the block id reused for another hash
    assert pool.apply_notice(old_notice) == 0
    assert pool.holds(5, B)
    assert registry_state(reg)[1] == {B: 5}


def test_notice_about_an_in_flight_store_waits_for_its_stamp() -> None:
    reg = LocalPrefixCacheRegistry()
    pool = make_pool(reg)
    original = reg.register_mamba_stamped

    def register_then_lose_it(block_ids: list[int], hashes: list[int]) -> int:
        stamp = original(block_ids, hashes)
        # Another process evicts it before this store learns its stamp.
        reg.mamba.pop(A)
        reg.notice_seq += 1
        assert pool.apply_notice(EvictionNotice(reg.notice_seq, "evict", ((5, A),))) == 0
        return stamp

    reg.register_mamba_stamped = register_then_lose_it  # type: ignore[method-assign]
    pool.store([5], [A], *states(1))
    assert not pool.holds(5, A)  # the held notice was applied once the stamp was known
    assert pool.counts().in_use == 0


def test_reconcile_frees_exactly_the_pairs_gone_from_the_registry(backend: Backend) -> None:
    reg = backend.registry()
    pool = make_pool(reg)
    pool.store([1, 2, 3, 4], [A, B, C, D], *states(4))
    if isinstance(reg, PrefixCacheRegistry):
        behind_its_back = backend.registry(reg.namespace)
        behind_its_back.evict_mamba([B])
        behind_its_back.register_mamba([9], [C])  # C now names another block
    else:
        del reg.mamba[B]  # type: ignore[attr-defined]
        reg.mamba[C] = 9  # type: ignore[attr-defined]
    assert sorted(pool.reconcile()) == [(2, B), (3, C)]
    assert pool.pairs() == {(1, A), (4, D)}
    assert pool.reconcile() == []
    assert pool.counts().reconciled == 2


def test_clear_frees_what_was_registered_before_it(backend: Backend) -> None:
    reg = backend.registry()
    pool = make_pool(reg)
    pool.store([1, 2], [A, B], *states(2))
    reg.clear_mamba()  # the pool's hook gets the clear notice
    assert pool.counts().in_use == 0
    pool.store([3], [C], *states(1))
    reg.register_kv([4], [D])
    reg.reset()
    assert pool.counts().in_use == 0
    assert registry_state(reg) == ({}, {})


def test_kv_eviction_cascade_frees_slots(backend: Backend) -> None:
    reg = backend.registry()
    pool = make_pool(reg)
    reg.register_kv([1, 2, 3], [A, B, C])
    pool.store([1, 3], [A, C], *states(2))
    assert reg.evict_kv([B, C]) == {B, C}
    assert pool.pairs() == {(1, A)}


@pytest.mark.parametrize(
    ("block_ids", "hashes", "n", "error"),
    [
        ([1, 2], [A], 2, ValueError),
        ([1, 1], [A, B], 2, ValueError),
        ([1], [0], 1, ValueError),
        ([-1], [A], 1, ValueError),
        ([1.0], [A], 1, TypeError),
        ([1], [A], 2, ValueError),  # states for 2 blocks, 1 block id
        ([], [], 0, ValueError),
    ],
)
def test_bad_store_takes_nothing(
    block_ids: list[int], hashes: list[int], n: int, error: type[Exception]
) -> None:
    reg = LocalPrefixCacheRegistry()
    pool = make_pool(reg)
    with pytest.raises(error):
        pool.store(block_ids, hashes, *states(n))
    assert pool.counts().in_use == 0
    assert reg.mamba == {}


def test_failed_registration_returns_the_slots() -> None:
    reg = LocalPrefixCacheRegistry()
    pool = make_pool(reg)

    def unavailable(block_ids: list[int], hashes: list[int]) -> int:
        raise ConnectionError("redis is down")

    reg.register_mamba_stamped = unavailable  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        pool.store([1, 2], [A, B], *states(2))
    assert pool.counts().in_use == 0
    assert pool.slot_of(1) is None


def test_bad_pool_arguments() -> None:
    reg = LocalPrefixCacheRegistry()
    with pytest.raises(ValueError, match="num_slots"):
        MambaSlotPool(reg, 0, 1, (1,), (1,))
    with pytest.raises(TypeError, match="num_layers"):
        MambaSlotPool(reg, 1, 1.5, (1,), (1,))  # type: ignore[arg-type]


@pytest.mark.cuda
def test_store_restore_free_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import time

    reg = LocalPrefixCacheRegistry()
    pool = make_pool(reg, slots=1024, device="cuda", dtype=torch.bfloat16)
    conv, ssm = states(512, dtype=torch.bfloat16, device="cuda")
    ids = list(range(512))
    hashes = [10_000 + i for i in ids]
    torch.cuda.synchronize()
    start = time.perf_counter()
    pool.store(ids, hashes, conv, ssm)
    torch.cuda.synchronize()
    stored = time.perf_counter() - start
    conv_out, ssm_out = out_buffers(torch.bfloat16, "cuda")
    for i in (0, 255, 511):
        assert pool.restore(i, conv_out, ssm_out)
        assert torch.equal(conv_out, conv[:, i])
        assert torch.equal(ssm_out, ssm[:, i])
    start = time.perf_counter()
    assert len(reg.evict_mamba(hashes[:256])) == 256  # frees through the hook, host-side only
    freed = time.perf_counter() - start
    assert pool.counts().in_use == 256
    print(f"\ncuda: store 512 blocks {stored * 1e3:.2f} ms, evict+free 256 {freed * 1e3:.2f} ms")


def device_checks(device: str, elsewhere: str) -> None:
    """A pool on ``device`` refuses tensors on ``elsewhere`` before changing anything (also
    when the refused store would replace a block), restores bit for bit onto its own
    device, casts only when asked, and stays exact under threads there."""
    reg = LocalPrefixCacheRegistry()
    pool = make_pool(reg, slots=4, device=device, dtype=torch.bfloat16)
    cuda = device == "cuda"
    expected = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(device)
    assert pool.device == pool.conv_states.device == expected
    conv, ssm = states(2, dtype=torch.bfloat16, device=device)
    pool.store([0, 1], [A, B], conv, ssm)
    before = (pool.counts(), pool.pairs(), dict(reg.mamba), reg.notice_seq)
    there = states(2, dtype=torch.bfloat16, device=elsewhere)
    with pytest.raises(ValueError, match=f"conv is on {elsewhere}"):
        pool.store([2, 3], [C, D], *there)
    with pytest.raises(ValueError, match=f"ssm is on {elsewhere}"):
        pool.store([0, 1], [C, D], conv, there[1])  # would replace blocks 0 and 1
    assert (pool.counts(), pool.pairs(), dict(reg.mamba), reg.notice_seq) == before
    foreign_out = out_buffers(torch.bfloat16, elsewhere)
    with pytest.raises(ValueError, match=f"conv_out is on {elsewhere}"):
        pool.restore(0, *foreign_out)
    conv_out, ssm_out = out_buffers(torch.bfloat16, device)
    conv_out.fill_(7)
    with pytest.raises(ValueError, match=f"ssm_out is on {elsewhere}"):
        pool.restore(0, conv_out, foreign_out[1])
    assert bool((conv_out == 7).all())
    for i in (0, 1):
        assert pool.restore(i, conv_out, ssm_out)
        assert torch.equal(conv_out, conv[:, i])
        assert torch.equal(ssm_out, ssm[:, i])
    wide_conv, wide_ssm = out_buffers(torch.float32, device)
    with pytest.raises(TypeError, match=r"conv_out has dtype torch\.float32"):
        pool.restore(0, wide_conv, wide_ssm)
    assert pool.restore(0, wide_conv, wide_ssm, cast=True)
    assert torch.equal(wide_conv, conv[:, 0].float())
    pool.close()
    threaded_stores(device)


def threaded_stores(device: str) -> None:
    """Four threads store one block at a time into 8 slots on ``device``: never
    exhausted, each eviction counted once, every slot holding its own block's state."""
    import threading

    import fakeredis

    reg = PrefixCacheRegistry(fakeredis.FakeRedis(), "device-threads")  # thread-safe, unlike local
    pool = make_pool(reg, slots=8, device=device)
    failures: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(25):
                block = worker * 100 + i
                conv = torch.full((3, 1, 4, 2), float(block), device=device)
                ssm = torch.full((3, 1, 2, 3, 4), float(block), device=device)
                pool.store([block], [10_000 + block], conv, ssm)
        except BaseException as exc:
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    try:
        for thread in workers:
            thread.start()
    finally:
        for thread in workers:
            if thread.ident is not None:
                thread.join(60)
    assert not any(t.is_alive() for t in workers)
    assert failures == []
    counts = pool.counts()
    assert (counts.stored, counts.in_use, counts.evicted, counts.freed) == (100, 8, 92, 92)
    conv_out, ssm_out = out_buffers(torch.float32, device)
    for block, h in pool.pairs():
        assert pool.restore(block, conv_out, ssm_out, expected_hash=h)
        assert bool((conv_out == block).all())
        assert bool((ssm_out == block).all())
    assert pool.pairs() == {(b, h) for h, b in registry_state(reg)[1].items()}
    pool.close()
    reg.client.close()


def test_device_checks_on_cpu() -> None:
    device_checks("cpu", "meta")


@pytest.mark.cuda
def test_device_checks_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device_checks("cuda", "cpu")


def test_a_registration_whose_reply_was_lost_is_withdrawn_at_reconcile(backend: Backend) -> None:
    from registry import RegistryUnavailable

    reg = backend.registry()
    pool = make_pool(reg)
    original = reg.register_mamba_stamped

    def lands_then_times_out(block_ids: list[int], hashes: list[int]) -> int:
        original(block_ids, hashes)
        raise RegistryUnavailable("reply lost")

    reg.register_mamba_stamped = lands_then_times_out  # type: ignore[method-assign]
    with pytest.raises(RegistryUnavailable):
        pool.store([1, 2], [A, B], *states(2))
    reg.register_mamba_stamped = original  # type: ignore[method-assign]
    assert pool.counts().in_use == 0  # the slots went back
    assert registry_state(reg)[1] == {A: 1, B: 2}  # but the entries landed
    pool.store([3], [C], *states(1))
    pool.reconcile()
    assert registry_state(reg)[1] == {C: 3}  # withdrawn: no entry names state nobody holds
