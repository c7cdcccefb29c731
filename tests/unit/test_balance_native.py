"""The balance rule's C arithmetic (``registry/routing/_weigh.c``) against the Python it
replaces (``Weighed`` with ``NATIVE`` None): random fleets of 1 to 40 candidates (loads
missing, zero, decayed locally and remotely, ints where floats are usual, queues the
engine reports longer, caches past the KV limit; kin with and without a pull and past
its bound; prefixes negative, past the prompt, on hybrid nodes; prompts empty and
negative) give the same rows and kin terms, and every ranking the same costs to the
bit, the same parts, the same order and the same leader. Inputs the C does not read
(another Mapping, a subclass of the load, a float prefix, a NaN cost) fall back to the
Python, with its answers."""

from __future__ import annotations

import math
import random
from collections import UserDict
from typing import Any

import pytest

from registry.routing import balance
from registry.routing.balance import BackendLoad, BalanceRule, Choice, Decayed, Kin, Weighed

NATIVE = balance.NATIVE
needs_extension = pytest.mark.skipif(NATIVE is None, reason="C extension not built")


def _bits(value: Any) -> Any:
    """A number as its exact bits (a float's hex tells 0.0 from -0.0 and every ulp)."""
    return float(value).hex() if isinstance(value, float) else value


def _choices(order: list[Choice]) -> list[tuple[Any, ...]]:
    return [
        (c.namespace, _bits(c.cost), c.cached, _bits(c.queued), _bits(c.share), c.reach)
        for c in order
    ]


def _rows(weighed: Weighed) -> list[tuple[Any, ...]]:
    return [tuple(_bits(part) for part in row) for row in weighed.rows]


@pytest.fixture
def pure() -> Any:
    """A callable making a ``Weighed`` on the pure-Python path."""

    def make(*args: Any) -> Weighed:
        saved, balance.NATIVE = balance.NATIVE, None
        try:
            return Weighed(*args)
        finally:
            balance.NATIVE = saved

    return make


def _ranked(weighed: Weighed, cached: Any, kv: Any, native: bool) -> tuple[Any, Any]:
    saved = balance.NATIVE
    if not native:
        balance.NATIVE = None
    try:
        return _choices(weighed.ranked(cached, kv)), weighed.leader(cached, kv)
    finally:
        balance.NATIVE = saved


def _fleet(rng: random.Random) -> tuple[list[str], dict[str, BackendLoad], float]:
    names = [f"engine-{rng.randrange(60)}" for _ in range(rng.randint(1, 40))]
    now = rng.choice([0.0, 5.0, rng.uniform(0.0, 600.0)])
    loads: dict[str, BackendLoad] = {}
    for name in names:
        if rng.random() < 0.1:
            continue  # a candidate this replica never sent to
        loads[name] = BackendLoad(
            in_flight=rng.choice([0, 1, 3, rng.randrange(200)]),
            pending=rng.choice([0.0, 0, 96.0, rng.uniform(0.0, 50_000.0)]),
            recent=Decayed(
                rng.choice([0.0, 0, 700, rng.uniform(0.0, 90_000.0)]),
                rng.choice([now, now + 1.0, rng.uniform(0.0, now + 1.0)]),
            ),
            remote_in_flight=rng.choice([0, rng.randrange(50)]),
            remote_pending=rng.choice([0.0, rng.uniform(0.0, 9_000.0)]),
            remote_recent=rng.choice([0.0, rng.uniform(0.0, 9_000.0)]),
            remote_at=rng.choice([0.0, now, rng.uniform(0.0, now + 1.0)]),
            engine_requests=rng.choice([0.0, 2, rng.uniform(0.0, 300.0)]),
            kv_usage=rng.choice([0.0, 0.5, 0.95, 0.99, 1.0]),
        )
    return names, loads, now


def _kin(rng: random.Random, names: list[str]) -> Any:
    shape = rng.random()
    if shape < 0.3:
        return None
    if shape < 0.4:
        return ({}, {})
    kinned = {
        n: rng.choice([0.0, 1.0, rng.uniform(0.0, 40.0)]) for n in names if rng.random() < 0.5
    }
    sent = {n: rng.choice([0.0, 1.0, rng.uniform(0.0, 400.0)]) for n in names if rng.random() < 0.8}
    if shape < 0.5:
        kinned = {n: 0.0 for n in kinned}  # no pull: every kin share 0
    elif shape < 0.75:  # ``Kin.sums``: the sums themselves, decayed as they are read
        kinned = {n: _sum(rng, v) for n, v in kinned.items()}
        sent = {n: _sum(rng, v) for n, v in sent.items()}
    return kinned, sent


def _sum(rng: random.Random, value: float) -> Any:
    """``value`` as a ``Decayed`` sum last added to at some time (past, now or later),
    or left a number (a mix of both is read alike)."""
    if rng.random() < 0.2:
        return value
    return Decayed(value, rng.choice([0.0, 5.0, rng.uniform(0.0, 600.0)]))


def _prefixes(rng: random.Random, names: list[str], prompt: int) -> tuple[Any, Any]:
    cached = {
        n: rng.choice([0, 16, prompt, prompt + 16, -16, rng.randrange(max(1, prompt + 1))])
        for n in names
        if rng.random() < 0.7
    }
    kv = None
    if rng.random() < 0.3:
        kv = {n: rng.choice([0, prompt, prompt * 2, rng.randrange(max(1, prompt + 1))])
              for n in names if rng.random() < 0.5}  # fmt: skip
    elif rng.random() < 0.1:
        kv = {}
    return cached, kv


@needs_extension
def test_native_weighing_is_the_python_one_to_the_bit(pure: Any) -> None:
    rng = random.Random(45)
    rules = [
        BalanceRule(),
        BalanceRule(queue_weight=0, spread_weight=0.25, affinity_weight=3, affinity_bound=1.0),
        BalanceRule(half_life=0.5, request_tokens=0, kv_usage_limit=0.5, checkpoint_weight=1),
    ]
    compared = 0
    for _ in range(3_000):
        names, loads, now = _fleet(rng)
        prompt = rng.choice([0, 1, -5, 17, 408, 8_192, rng.randrange(20_000)])
        rule = rng.choice(rules)
        kin = _kin(rng, names)
        native = Weighed(names, prompt, loads, rule, now, kin)
        python = pure(names, prompt, loads, rule, now, kin)
        assert _rows(native) == _rows(python)
        assert native.count == python.count
        if python.kin_terms is None:
            assert native.kin_terms is None
        else:
            assert native.kin_terms is not None
            assert [_bits(t) for t in native.kin_terms] == [_bits(t) for t in python.kin_terms]
        for _turn in range(3):  # one weighing ranked for several prefixes
            cached, kv = _prefixes(rng, names, prompt)
            assert _ranked(native, cached, kv, True) == _ranked(python, cached, kv, False)
            compared += 1
    assert compared == 9_000


@needs_extension
def test_what_the_c_does_not_read_is_weighed_in_python(pure: Any) -> None:
    """Another Mapping of loads, a subclass of the load, a float prefix, a non-str name
    and a NaN cost: the Python's answers, not an error."""

    class Load(BackendLoad):
        pass

    now = 10.0
    plain = {"a": BackendLoad(in_flight=2, recent=Decayed(300.0, 1.0)), "b": BackendLoad()}
    rule = BalanceRule()
    for loads in (UserDict(plain), {"a": Load(in_flight=2), "b": BackendLoad()}):
        native = Weighed(["a", "b"], 64, loads, rule, now)
        python = pure(["a", "b"], 64, loads, rule, now)
        assert _rows(native) == _rows(python)
        assert _ranked(native, {"a": 16}, None, True) == _ranked(python, {"a": 16}, None, False)
    weighed = Weighed(["a", "b"], 64, plain, rule, now)
    for cached in ({"a": 16.0}, UserDict({"a": 16}), {"a": True}):
        assert _ranked(weighed, cached, None, True) == _ranked(weighed, cached, None, False)
    numbered = Weighed([1, 2], 64, {}, rule, now)  # type: ignore[list-item]
    assert _ranked(numbered, {1: 16}, None, True) == _ranked(numbered, {1: 16}, None, False)
    broken = {"a": BackendLoad(pending=math.nan), "b": BackendLoad()}
    native = Weighed(["a", "b"], 64, broken, rule, now)
    python = pure(["a", "b"], 64, broken, rule, now)
    assert _ranked(native, {}, None, True) == _ranked(python, {}, None, False)
    assert native.leader({}, None) == python.leader({}, None)


def test_no_candidates_rank_as_none(pure: Any) -> None:
    for make in (Weighed, pure):
        weighed = make([], 64, {}, BalanceRule(), 1.0)
        assert weighed.ranked({}) == []
        assert weighed.leader({}) is None


def test_kin_sums_weigh_as_its_counts_to_the_bit(pure: Any) -> None:
    """The gateway hands the weighing ``Kin.sums`` (no dict per decision): the same rows,
    kin terms and order as ``Kin.counts``, in C and in Python; ``record`` adds to the
    sums as ``Decayed.add`` does."""
    rng = random.Random(7)
    kin = Kin()
    shadow: dict[Any, dict[str, Decayed]] = {}
    every: dict[str, Decayed] = {}
    rule = BalanceRule(half_life=2.0)
    now = 0.0
    names = [f"engine-{n}" for n in range(6)]
    loads = {n: BackendLoad(in_flight=rng.randrange(4)) for n in names}
    for _ in range(400):
        now += rng.choice([0.0, 0.01, 0.3, 5.0])
        root = rng.randrange(5)
        counts, sums = kin.counts(root, now, rule.half_life), kin.sums(root)
        assert (counts is None) == (sums is None)
        for make in (Weighed, pure):
            by_counts = make(names, 64, loads, rule, now, counts)
            by_sums = make(names, 64, loads, rule, now, sums)
            assert _rows(by_counts) == _rows(by_sums)
            terms = [_bits(t) for t in by_counts.kin_terms or []]
            assert terms == [_bits(t) for t in by_sums.kin_terms or []]
            assert _choices(by_counts.ranked({})) == _choices(by_sums.ranked({}))
        backend = rng.choice(names)
        kin.record(root, backend, now, rule.half_life)
        every.setdefault(backend, Decayed()).add(1.0, now, rule.half_life)
        shadow.setdefault(root, {}).setdefault(backend, Decayed()).add(1.0, now, rule.half_life)
        sums = kin.sums(root)
        assert sums is not None
        assert {n: (_bits(d.value), d.at) for n, d in sums[0].items()} == {
            n: (_bits(d.value), d.at) for n, d in shadow[root].items()
        }
        assert {n: (_bits(d.value), d.at) for n, d in sums[1].items()} == {
            n: (_bits(d.value), d.at) for n, d in every.items()
        }
