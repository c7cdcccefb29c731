"""Bad input to the slot pool and the listener changes nothing, and a store that fails
part way leaves the pool and Redis consistent.

Every refused call is checked against a snapshot taken before it: the pool's counts,
block-to-slot map, LRU order and state tensors (bit for bit), and a ``DUMP`` of every
key of the namespace. The pool is full, so a store that got past a check would evict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gpu import EvictionListener, MambaSlotPool
from registry import EvictionNotice, PrefixCacheRegistry, RegistryUnavailable
from sim.config import FleetConfig, FleetConfigError, check_fleet_config
from sim.workload import WorkloadConfig
from tests.support.backends import (
    REDIS_BACKEND_PARAMS,
    Backend,
    dump_keys,
    make_backend,
    registry_state,
)
from tests.support.gpu import CONV_SHAPE, LAYERS, SSM_SHAPE, make_pool, out_buffers, states

SLOTS = 4
HASHES = [1001, 1002, 1003, 1004]  # of blocks 0..3, filling the pool
BIG = 2**63


@pytest.fixture(params=REDIS_BACKEND_PARAMS[:2])
def redis_kind(request: pytest.FixtureRequest) -> Iterator[Backend]:
    made = make_backend(request.param, request)
    yield made
    made.close()


@pytest.fixture
def full(redis_kind: Backend) -> Iterator[tuple[PrefixCacheRegistry, MambaSlotPool]]:
    """A registry and a full 4-slot pool (blocks 0..3); block 0 was restored since, so
    block 1 is the least recently used."""
    reg = redis_kind.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    pool = make_pool(reg, slots=SLOTS)
    for block in range(SLOTS):
        pool.store([block], [HASHES[block]], *states(1, seed=block))
    assert pool.restore(0, *out_buffers())
    yield reg, pool
    pool.close()


def snapshot(reg: PrefixCacheRegistry, pool: MambaSlotPool) -> dict[str, Any]:
    """Everything a refused call must leave as it was (the LRU order is internal)."""
    return {
        "counts": pool.counts(),
        "pairs": pool.pairs(),
        "slots": {block: pool.slot_of(block) for block in range(SLOTS)},
        "lru": list(pool._table.lru),
        "conv": pool.conv_states.numpy().tobytes(),
        "ssm": pool.ssm_states.numpy().tobytes(),
        "redis": dump_keys(reg),
    }


def conv_of(n: int, **options: Any) -> torch.Tensor:
    return torch.zeros((LAYERS, n, *CONV_SHAPE), **options)


def ssm_of(n: int, **options: Any) -> torch.Tensor:
    return torch.zeros((LAYERS, n, *SSM_SHAPE), **options)


Call = Callable[[MambaSlotPool], object]


def case(call: Call, error: type[Exception], match: str, name: str) -> Any:
    return pytest.param(call, error, match, id=name)


STORE_CASES = [
    case(
        lambda p: p.store([10, BIG], [2001, 2002], *states(2)),
        ValueError,
        r"block_ids\[1\] = 9223372036854775808 is outside",
        "block id above 2^63-1",
    ),
    case(
        lambda p: p.store([-1], [2001], *states(1)),
        ValueError,
        r"block_ids\[0\] = -1",
        "negative block id",
    ),
    case(
        lambda p: p.store([10, True], [2001, 2002], *states(2)),
        TypeError,
        r"block_ids\[1\] is a bool",
        "bool block id",
    ),
    case(
        lambda p: p.store([10.0], [2001], *states(1)),
        TypeError,
        r"block_ids\[0\] is float",
        "float block id",
    ),
    case(
        lambda p: p.store([np.float64(3)], [2001], *states(1)),
        TypeError,
        r"block_ids\[0\]",
        "numpy float block id",
    ),
    case(
        lambda p: p.store(["10"], [2001], *states(1)),
        TypeError,
        r"block_ids\[0\] is str",
        "str block id",
    ),
    case(
        lambda p: p.store([None], [2001], *states(1)),
        TypeError,
        r"block_ids\[0\] is NoneType",
        "None block id",
    ),
    case(
        lambda p: p.store(10, [2001], *states(1)),
        TypeError,
        "block_ids must be a list",
        "block_ids not a list",
    ),
    case(
        lambda p: p.store("10", [2001], *states(1)),
        TypeError,
        "block_ids must be a list",
        "block_ids a string",
    ),
    case(
        lambda p: p.store([10], [0], *states(1)),
        ValueError,
        r"hashes\[0\] = 0 is outside \[1, 2\^63-1\]",
        "hash 0",
    ),
    case(lambda p: p.store([10], [-1], *states(1)), ValueError, r"hashes\[0\] = -1", "hash -1"),
    case(
        lambda p: p.store([10, 11], [2001, BIG], *states(2)),
        ValueError,
        r"hashes\[1\] = 9223372036854775808",
        "hash above 2^63-1",
    ),
    case(
        lambda p: p.store([10], [True], *states(1)),
        TypeError,
        r"hashes\[0\] is a bool",
        "bool hash",
    ),
    case(
        lambda p: p.store([10], [2001.0], *states(1)),
        TypeError,
        r"hashes\[0\] is float",
        "float hash",
    ),
    case(
        lambda p: p.store([10, 11, 10], [2001, 2002, 2003], *states(3)),
        ValueError,
        r"block_ids\[2\] = 10 repeats block_ids\[0\]",
        "repeated block id",
    ),
    case(
        lambda p: p.store([10, 11], [2001, 2001], *states(2)),
        ValueError,
        r"hashes\[1\] = 2001 repeats hashes\[0\]",
        "repeated hash",
    ),
    case(
        lambda p: p.store([10, 11], [2001], *states(2)),
        ValueError,
        r"differ in length \(2 != 1\)",
        "lengths differ",
    ),
    case(
        lambda p: p.store([], [], *states(0)), ValueError, "store takes 1 to 4 blocks", "no blocks"
    ),
    case(
        lambda p: p.store(list(range(10, 15)), list(range(2001, 2006)), *states(5)),
        ValueError,
        "store takes 1 to 4 blocks",
        "more blocks than slots",
    ),
    case(
        lambda p: p.store([10], [2001], *states(2)),
        ValueError,
        r"conv has shape \(3, 2, 4, 2\), expected \(3, 1, 4, 2\)",
        "states for 2 blocks",
    ),
    case(
        lambda p: p.store([10, 11], [2001, 2002], conv_of(1), ssm_of(2)),
        ValueError,
        "conv has shape",
        "broadcastable conv",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1), ssm_of(1)[0]),
        ValueError,
        "ssm has shape",
        "ssm missing a dimension",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1, dtype=torch.float64), ssm_of(1)),
        TypeError,
        r"conv has dtype torch.float64, the pool torch.float32",
        "float64 conv",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1), ssm_of(1, dtype=torch.bfloat16)),
        TypeError,
        "ssm has dtype torch.bfloat16",
        "bfloat16 ssm",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1, dtype=torch.int64), ssm_of(1), cast=True),
        TypeError,
        "cast=True converts floating dtypes",
        "cast of an int tensor",
    ),
    case(
        lambda p: p.store([10], [2001], *states(1), cast="yes"),
        TypeError,
        "cast must be a bool",
        "cast a string",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1, device="meta"), ssm_of(1)),
        ValueError,
        "conv is on meta, the pool on cpu",
        "conv on another device",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1).numpy(), ssm_of(1)),
        TypeError,
        "conv must be a torch.Tensor, not ndarray",
        "numpy conv",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1), ssm_of(1).tolist()),
        TypeError,
        "ssm must be a torch.Tensor, not list",
        "list ssm",
    ),
    case(
        lambda p: p.store([10], [2001], conv_of(1).to_sparse(), ssm_of(1)),
        TypeError,
        "conv has layout torch.sparse_coo",
        "sparse conv",
    ),
    # Blocks already stored, with a new hash: the old entries must stay on refusal.
    case(
        lambda p: p.store([0, 1], [2001, 2002], conv_of(2), ssm_of(2, device="meta")),
        ValueError,
        "ssm is on meta",
        "re-store with ssm on another device",
    ),
    case(
        lambda p: p.store([0, 1], [2001, BIG], *states(2)),
        ValueError,
        r"hashes\[1\]",
        "re-store with a hash too big",
    ),
]

RESTORE_CASES = [
    case(
        lambda p: p.restore(True, *out_buffers()), TypeError, "block_id is a bool", "bool block id"
    ),
    case(
        lambda p: p.restore(1.0, *out_buffers()), TypeError, "block_id is float", "float block id"
    ),
    case(
        lambda p: p.restore(np.float64(1), *out_buffers()),
        TypeError,
        "block_id is float64",
        "numpy float block id",
    ),
    case(lambda p: p.restore("1", *out_buffers()), TypeError, "block_id is str", "str block id"),
    case(
        lambda p: p.restore(-1, *out_buffers()),
        ValueError,
        "block_id = -1 is outside",
        "negative block id",
    ),
    case(lambda p: p.restore(BIG, *out_buffers()), ValueError, "block_id = 92", "huge block id"),
    case(
        lambda p: p.restore(1, *out_buffers(), expected_hash=0),
        ValueError,
        r"expected_hash = 0 is outside \[1, 2\^63-1\]",
        "expected hash 0",
    ),
    case(
        lambda p: p.restore(1, *out_buffers(), expected_hash=1002.0),
        TypeError,
        "expected_hash is float",
        "float expected hash",
    ),
    case(
        lambda p: p.restore(1, *out_buffers(), cast=1),
        TypeError,
        "cast must be a bool",
        "cast an int",
    ),
    case(
        lambda p: p.restore(1, torch.empty(LAYERS, 4, 3), out_buffers()[1]),
        ValueError,
        r"conv_out has shape \(3, 4, 3\), expected \(3, 4, 2\)",
        "wrong conv_out shape",
    ),
    case(
        lambda p: p.restore(1, torch.empty(1, *CONV_SHAPE), out_buffers()[1]),
        ValueError,
        "conv_out has shape",
        "broadcastable conv_out",
    ),
    case(
        lambda p: p.restore(1, [0.0], out_buffers()[1]),
        TypeError,
        "conv_out must be a torch.Tensor, not list",
        "list conv_out",
    ),
    case(
        lambda p: p.restore(1, None, out_buffers()[1]),
        TypeError,
        "conv_out must be a torch.Tensor, not NoneType",
        "None conv_out",
    ),
    case(
        lambda p: p.restore(1, out_buffers()[0], out_buffers()[1].numpy()),
        TypeError,
        "ssm_out must be a torch.Tensor, not ndarray",
        "numpy ssm_out",
    ),
    case(
        lambda p: p.restore(1, *out_buffers(torch.float64)),
        TypeError,
        "conv_out has dtype torch.float64",
        "float64 outputs",
    ),
    case(
        lambda p: p.restore(1, *out_buffers(torch.int32), cast=True),
        TypeError,
        "conv_out has dtype torch.int32; cast=True converts floating dtypes",
        "int outputs",
    ),
    case(
        lambda p: p.restore(1, out_buffers()[0], torch.empty(SSM_SHAPE).expand(LAYERS, -1, -1, -1)),
        ValueError,
        "ssm_out is an expanded view",
        "expanded ssm_out",
    ),
    case(
        lambda p: p.restore(1, p.conv_states[:, 3], out_buffers()[1]),
        ValueError,
        "conv_out shares memory with the pool's states",
        "conv_out inside the pool",
    ),
    case(
        lambda p: p.restore(1, *overlapping_outputs()),
        ValueError,
        "conv_out and ssm_out share memory",
        "overlapping outputs",
    ),
]

OTHER_CASES = [
    case(
        lambda p: p.free([(0, 1001), (1, "1002")]),
        TypeError,
        r"pairs\[1\]\[1\] is str",
        "free with a str hash after a good pair",
    ),
    case(
        lambda p: p.free([(0, 1001), (1,)]),
        ValueError,
        r"pairs\[1\] has 1 items",
        "free with a short pair",
    ),
    case(lambda p: p.free([(0, 1001), 1]), TypeError, r"pairs\[1\] is int", "free with an int"),
    case(
        lambda p: p.free([(0, 1001), (-1, 1002)]),
        ValueError,
        r"pairs\[1\]\[0\] = -1",
        "free with a negative block id",
    ),
    case(
        lambda p: p.free([(0, 1001), (1, 0)]),
        ValueError,
        r"pairs\[1\]\[1\] = 0",
        "free with hash 0",
    ),
    case(
        lambda p: p.free([(0, 1001), (True, 1002)]),
        TypeError,
        r"pairs\[1\]\[0\] is a bool",
        "free with a bool block id",
    ),
    case(lambda p: p.free("01"), TypeError, "pairs must be an iterable", "free a string"),
    case(lambda p: p.free(None), TypeError, "pairs must be an iterable", "free None"),
    case(
        lambda p: p.apply_notice("9 evict 0:1001"),
        TypeError,  # type: ignore[arg-type]
        "notice must be an EvictionNotice, not str",
        "notice text",
    ),
    case(
        lambda p: p.apply_notice(EvictionNotice("9", "evict", ((0, 1001),))),  # type: ignore[arg-type]
        TypeError,
        "notice.seq is str",
        "notice with a str number",
    ),
    case(
        lambda p: p.apply_notice(EvictionNotice(99, "bogus", ((0, 1001),))),
        ValueError,
        "notice.kind 'bogus'",
        "notice of an unknown kind",
    ),
    case(
        lambda p: p.apply_notice(EvictionNotice(99, "evict", ((0, 1001), (1, "x")))),  # type: ignore[arg-type]
        TypeError,
        r"notice.pairs\[1\]\[1\] is str",
        "notice with a bad second pair",
    ),
    case(
        lambda p: p.reconcile("x"),
        TypeError,  # type: ignore[arg-type]
        "registry must be a registry or None, not str",
        "reconcile a string",
    ),
    case(lambda p: p.holds(True, 1001), TypeError, "block_id is a bool", "holds a bool"),
    case(lambda p: p.holds(0, 0), ValueError, r"h = 0 is outside", "holds hash 0"),
    case(lambda p: p.slot_of(0.0), TypeError, "block_id is float", "slot_of a float"),
]


def overlapping_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    """conv_out and ssm_out as two views of one buffer that share elements."""
    conv_n, ssm_n = LAYERS * math.prod(CONV_SHAPE), LAYERS * math.prod(SSM_SHAPE)
    buffer = torch.zeros(conv_n + ssm_n - 8)
    return buffer[:conv_n].view(LAYERS, *CONV_SHAPE), buffer[conv_n - 8 :].view(LAYERS, *SSM_SHAPE)


def named(kind: str, cases: list[Any]) -> list[Any]:
    return [pytest.param(*c.values, id=f"{kind}: {c.id}") for c in cases]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    named("store", STORE_CASES) + named("restore", RESTORE_CASES) + named("other", OTHER_CASES),
)
def test_refused_call_changes_nothing(
    full: tuple[PrefixCacheRegistry, MambaSlotPool],
    call: Call,
    error: type[Exception],
    match: str,
) -> None:
    reg, pool = full
    before = snapshot(reg, pool)
    with pytest.raises(error, match=match):
        call(pool)
    assert snapshot(reg, pool) == before


def test_restore_writes_neither_output_when_one_is_wrong(
    full: tuple[PrefixCacheRegistry, MambaSlotPool],
) -> None:
    """Both outputs are checked before either is written."""
    _, pool = full
    conv_out = torch.full((LAYERS, *CONV_SHAPE), 7.0)
    for ssm_out in (
        torch.full((LAYERS, 1, 3, 4), 7.0),
        torch.full((LAYERS, *SSM_SHAPE), 7.0).permute(3, 2, 1, 0),
    ):
        with pytest.raises(ValueError, match="ssm_out has shape"):
            pool.restore(1, conv_out, ssm_out)
        assert bool((conv_out == 7).all())
        assert bool((ssm_out == 7).all())


def test_cast_is_an_explicit_opt_in(full: tuple[PrefixCacheRegistry, MambaSlotPool]) -> None:
    """Exact dtypes round-trip bit for bit; another dtype needs cast=True (and is lossy)."""
    _, pool = full
    conv, ssm = states(1, seed=5, dtype=torch.float64)
    pool.store([20], [3001], conv, ssm, cast=True)
    conv_out, ssm_out = out_buffers(torch.bfloat16)
    assert pool.restore(20, conv_out, ssm_out, cast=True)
    assert torch.equal(conv_out, conv[:, 0].float().bfloat16())
    assert torch.equal(ssm_out, ssm[:, 0].float().bfloat16())


def test_store_reading_a_view_of_the_pool_copies_it_first(
    full: tuple[PrefixCacheRegistry, MambaSlotPool],
) -> None:
    """States taken straight from the pool's tensors (a slot this store may overwrite as
    its LRU victim) are copied before the slots are written."""
    _, pool = full
    victim = pool.slot_of(1)  # the least recently used: this store takes its slot
    assert victim is not None
    expected_conv = pool.conv_states[:, victim : victim + 1].clone()
    expected_ssm = pool.ssm_states[:, victim : victim + 1].clone()
    conv_view = pool.conv_states[:, victim : victim + 1]
    ssm_view = pool.ssm_states[:, victim : victim + 1]
    assert pool.store([30], [4001], conv_view, ssm_view) == [victim]
    conv_out, ssm_out = out_buffers()
    assert pool.restore(30, conv_out, ssm_out)
    assert torch.equal(conv_out, expected_conv[:, 0])
    assert torch.equal(ssm_out, expected_ssm[:, 0])


def test_numpy_integers_are_accepted(full: tuple[PrefixCacheRegistry, MambaSlotPool]) -> None:
    reg, pool = full
    pool.store(np.array([40, 41]), [np.int64(5001), np.uint32(5002)], *states(2))
    assert pool.holds(np.int32(40), np.int64(5001))
    assert pool.restore(np.int64(41), *out_buffers(), expected_hash=np.int16(5002))
    assert pool.free(np.array([[40, 5001]]).tolist()) == 1
    assert registry_state(reg)[1][5002] == 41


# -- the constructor ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "options", "error", "match"),
    [
        pytest.param(
            (None, 4, 1, (1,), (1,)), {}, TypeError, "registry must be a registry", id="no registry"
        ),
        pytest.param(("reg", 0, 1, (1,), (1,)), {}, ValueError, "num_slots = 0", id="0 slots"),
        pytest.param(
            ("reg", -3, 1, (1,), (1,)), {}, ValueError, "num_slots = -3", id="negative slots"
        ),
        pytest.param(
            ("reg", True, 1, (1,), (1,)), {}, TypeError, "num_slots is a bool", id="bool slots"
        ),
        pytest.param(
            ("reg", "4", 1, (1,), (1,)), {}, TypeError, "num_slots is str", id="str slots"
        ),
        pytest.param(
            ("reg", 4, 2.0, (1,), (1,)), {}, TypeError, "num_layers is float", id="float layers"
        ),
        pytest.param(
            ("reg", 4, 1, (4, -2), (1,)),
            {},
            ValueError,
            r"conv_shape\[1\] = -2",
            id="negative conv dimension",
        ),
        pytest.param(
            ("reg", 4, 1, (4,), (0, 3)),
            {},
            ValueError,
            r"ssm_shape\[0\] = 0",
            id="zero ssm dimension",
        ),
        pytest.param(
            ("reg", 4, 1, 4, (1,)),
            {},
            TypeError,
            "conv_shape must be a sequence",
            id="int conv shape",
        ),
        pytest.param(
            ("reg", 4, 1, "42", (1,)),
            {},
            TypeError,
            "conv_shape must be a sequence",
            id="str conv shape",
        ),
        pytest.param(
            ("reg", 4, 1, (4, 2.5), (1,)),
            {},
            TypeError,
            r"conv_shape\[1\] is float",
            id="float conv dimension",
        ),
        pytest.param(
            ("reg", 2**40, 2**20, (2**10,), (1,)),
            {},
            ValueError,
            "the pool would take",
            id="more bytes than torch can index",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"dtype": torch.int32},
            ValueError,
            "dtype = torch.int32 is not a floating-point dtype",
            id="int dtype",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"dtype": "float32"},
            TypeError,
            "dtype must be a torch.dtype",
            id="str dtype",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"device": "bogus"},
            ValueError,
            "device 'bogus' is not a torch device",
            id="bogus device",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"device": "meta"},
            ValueError,
            "the pool lives on one of cpu, cuda",
            id="meta device",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"device": 0},
            TypeError,
            "device must be a str or torch.device",
            id="int device",
        ),
        pytest.param(
            ("reg", 4, 1, (1,), (1,)),
            {"on_free": 5},
            TypeError,
            "on_free must be callable",
            id="on_free not callable",
        ),
    ],
)
def test_bad_constructor_arguments(
    redis_kind: Backend,
    args: tuple[Any, ...],
    options: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    reg = redis_kind.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    before = dump_keys(reg)
    arguments = tuple(reg if a == "reg" else a for a in args)
    with pytest.raises(error, match=match):
        MambaSlotPool(*arguments, **options)
    assert dump_keys(reg) == before
    assert reg.evict_mamba([1]) == set()  # no half-built pool is hooked to the registry


def test_a_cuda_device_needs_cuda(redis_kind: Backend) -> None:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"there are only {count} CUDA devices"):
            make_pool(redis_kind.registry(), device=f"cuda:{count}")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_pool(redis_kind.registry(), device="cuda")


# -- the listener's constructor ----------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        pytest.param(
            {"client_or_url": None}, TypeError, "client_or_url must be a Redis URL", id="no client"
        ),
        pytest.param(
            {"namespace": ""}, ValueError, "namespace must not be empty", id="empty namespace"
        ),
        pytest.param({"namespace": 5}, TypeError, "namespace must be a str", id="int namespace"),
        pytest.param(
            {"namespace": "elsewhere"},
            ValueError,
            "pool belongs to namespace",
            id="another namespace than the pool's",
        ),
        pytest.param(
            {"key_prefix": "other"},
            ValueError,
            "pool belongs to namespace",
            id="another key prefix than the pool's",
        ),
        pytest.param({"pool": "pool"}, TypeError, "pool must be a MambaSlotPool", id="no pool"),
        pytest.param(
            {"poll_interval": 0},
            ValueError,
            "poll_interval = 0 must be a positive number",
            id="zero poll interval",
        ),
        pytest.param(
            {"poll_interval": float("nan")},
            ValueError,
            "poll_interval = nan",
            id="nan poll interval",
        ),
        pytest.param(
            {"poll_interval": True},
            TypeError,
            "poll_interval must be a number",
            id="bool poll interval",
        ),
        pytest.param(
            {"poll_interval": "0.1"},
            TypeError,
            "poll_interval must be a number",
            id="str poll interval",
        ),
        pytest.param(
            {"resync_interval": -1.0},
            ValueError,
            "resync_interval = -1.0",
            id="negative resync interval",
        ),
        pytest.param(
            {"max_backoff": float("inf")},
            ValueError,
            "max_backoff = inf is longer than the longest wait",
            id="infinite backoff",
        ),
        pytest.param({"max_backoff": 10**400}, ValueError, "max_backoff = ", id="huge backoff"),
    ],
)
def test_bad_listener_arguments(
    full: tuple[PrefixCacheRegistry, MambaSlotPool],
    options: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    reg, pool = full
    arguments: dict[str, Any] = {
        "client_or_url": reg.client,
        "namespace": reg.namespace,
        "pool": pool,
        **options,
    }
    before = snapshot(reg, pool)
    with pytest.raises(error, match=match):
        EvictionListener(**arguments)
    assert snapshot(reg, pool) == before


def test_listener_accepts_an_endless_resync_interval(
    full: tuple[PrefixCacheRegistry, MambaSlotPool],
) -> None:
    reg, pool = full
    listener = EvictionListener(reg.client, reg.namespace, pool, resync_interval=math.inf)
    with listener:
        assert listener.alive
    assert not listener.alive


# -- all or nothing ----------------------------------------------------------------------


def agrees(reg: PrefixCacheRegistry, pool: MambaSlotPool) -> bool:
    """The pool holds exactly the pairs the registry has, no store being in flight."""
    counts = pool.counts()
    registered = {(b, h) for h, b in registry_state(reg)[1].items()}
    return pool.pairs() == registered and counts.stored == counts.in_use + counts.freed


def test_a_failed_eviction_gives_every_claimed_slot_back(
    full: tuple[PrefixCacheRegistry, MambaSlotPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis away at the store's eviction: the LRU victims and the block stored again
    keep their slots, states and LRU places; nothing reached Redis."""
    reg, pool = full

    def away(hashes: Any) -> set[int]:
        raise RegistryUnavailable("redis is away")

    before = snapshot(reg, pool)
    monkeypatch.setattr(reg, "evict_mamba", away)
    with pytest.raises(RegistryUnavailable):
        pool.store([2, 50, 51], [6002, 6050, 6051], *states(3))  # block 2 again + 2 victims
    assert snapshot(reg, pool) == before
    monkeypatch.undo()
    pool.store([2, 50, 51], [6002, 6050, 6051], *states(3))
    assert pool.pairs() == {(0, 1001), (2, 6002), (50, 6050), (51, 6051)}
    assert agrees(reg, pool)
    assert pool.counts().evicted == 2  # blocks 1 and 3; block 2's old entry is not an eviction


def test_an_eviction_whose_reply_was_lost_frees_what_it_removed(
    full: tuple[PrefixCacheRegistry, MambaSlotPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eviction landed (its notice reached the pool's hook) but the call failed:
    the removed entries are freed, not given back; pool and Redis agree at once."""
    reg, pool = full
    original = reg.evict_mamba

    def lands_then_fails(hashes: Any) -> set[int]:
        original(hashes)
        raise RegistryUnavailable("reply lost")

    monkeypatch.setattr(reg, "evict_mamba", lands_then_fails)
    with pytest.raises(RegistryUnavailable):
        pool.store([50], [6050], *states(1))
    assert pool.pairs() == {(0, 1001), (2, 1003), (3, 1004)}  # block 1 was the LRU victim
    assert agrees(reg, pool)


def test_a_failed_copy_leaves_the_evicted_entries_gone_on_both_sides(
    full: tuple[PrefixCacheRegistry, MambaSlotPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    reg, pool = full
    original = reg.evict_mamba
    real_states = pool.ssm_states

    class DeviceLost:
        def __setitem__(self, index: object, value: object) -> None:
            raise RuntimeError("device lost")

    def evict_then_break_the_device(hashes: Any) -> set[int]:
        removed = original(hashes)
        pool.ssm_states = DeviceLost()  # type: ignore[assignment]
        return removed

    monkeypatch.setattr(reg, "evict_mamba", evict_then_break_the_device)
    with pytest.raises(RuntimeError, match="device lost"):
        pool.store([2, 50], [6002, 6050], *states(2))
    pool.ssm_states = real_states
    assert pool.pairs() == {(0, 1001), (3, 1004)}  # block 1 evicted, block 2's old entry too
    assert agrees(reg, pool)
    assert pool.counts().in_use == 2


def test_a_refused_registration_returns_the_slots(
    full: tuple[PrefixCacheRegistry, MambaSlotPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    reg, pool = full

    def refused(block_ids: Any, hashes: Any) -> int:
        raise RegistryUnavailable("redis is away")

    monkeypatch.setattr(reg, "register_mamba_stamped", refused)
    with pytest.raises(RegistryUnavailable):
        pool.store([50], [6050], *states(1))
    monkeypatch.undo()
    assert agrees(reg, pool)  # the victim is gone on both sides, the new block on both
    assert pool.counts().in_use == SLOTS - 1
    assert pool.reconcile() == []  # nothing for the reconcile to repair
    assert agrees(reg, pool)


# -- pcr simulate's sizes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field", "match"),
    [
        ({"mamba_slots": 10**20}, "mamba_slots", "mamba_slots = 100000000000000000000 is too"),
        ({"kv_blocks": 10**20}, "kv_blocks", "kv_blocks = 100000000000000000000 is too large"),
        ({"nodes": 10**20}, "nodes", "nodes = 100000000000000000000 is too large"),
        ({"mamba_slots": 2**24}, "mamba_slots", r"= 32 GiB .* over the 4 GiB"),
        ({"mamba_slots": 10**400}, "mamba_slots", r"= about 10\^403 bytes"),
        ({"kv_blocks": 0}, "kv_blocks", "kv_blocks = 0 must be at least 1"),
        ({"layers": -1}, "layers", "layers = -1 must be at least 1"),
        ({"conv_shape": (4, 0)}, "conv_shape[1]", r"conv_shape\[1\] = 0"),
        ({"block_size": 2**40}, "block_size", "block_size = 1099511627776 is too large"),
        ({"key_prefix": "a b"}, "key_prefix", "must not contain whitespace"),
        ({"workload": WorkloadConfig(requests=0)}, "requests", "requests = 0"),
    ],
)
def test_fleet_sizes_are_checked_before_allocating(
    options: dict[str, Any], field: str, match: str
) -> None:
    with pytest.raises(FleetConfigError, match=match) as caught:
        check_fleet_config(FleetConfig(**options))
    assert caught.value.field == field
    assert "\n" not in str(caught.value)


def test_fleet_defaults_and_wrong_kinds() -> None:
    check_fleet_config(FleetConfig())
    check_fleet_config(FleetConfig(kv_blocks=100_000, mamba_slots=10_000))
    with pytest.raises(TypeError, match="mamba_slots must be an int"):
        check_fleet_config(FleetConfig(mamba_slots=1e20))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a FleetConfig"):
        check_fleet_config({"nodes": 4})  # type: ignore[arg-type]
