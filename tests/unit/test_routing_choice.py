"""The routers' last step, without a server: the least-loaded of the namespaces holding
the longest prefix (``least_loaded``), against the rule it implements, written out."""

from __future__ import annotations

import random

import pytest

from registry.core.scores import NodeScore
from registry.routing.plan import best_of, least_loaded


def test_least_loaded_is_the_lowest_load_then_the_first_name() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        names = rng.sample([f"node-{i:03d}" for i in range(60)], rng.randrange(0, 40))
        kind = rng.randrange(3)
        load: dict[str, float] = {}
        for name in names + [f"gone-{i}" for i in range(3)]:  # loads of others too
            if rng.random() < 0.8:  # the rest are missing: load 0
                load[name] = (
                    rng.randrange(-1, 3) if kind == 0 else rng.random() if kind == 1 else 1.5
                )
        want = min(names, key=lambda n: (load.get(n, 0), n), default=None)
        assert least_loaded(names, load) == want
        assert least_loaded(iter(names), load) == want  # any iterable, read once
        assert least_loaded(names, None) == min(names, default=None)
        assert least_loaded(names, {}) == min(names, default=None)


def test_a_load_that_is_no_number_or_nan_is_refused_naming_its_namespace() -> None:
    names = [f"node-{i:03d}" for i in range(50)]
    for bad, error, said in (
        (float("nan"), ValueError, "not NaN"),
        ("3", TypeError, "not str"),
        (None, TypeError, "not NoneType"),
        ([1], TypeError, "not list"),
    ):
        for where in (0, 17, 49):
            load: dict[str, object] = {n: float(i) for i, n in enumerate(names)}
            load[names[where]] = bad
            with pytest.raises(error, match=f"load of '{names[where]}' must be a number, {said}"):
                least_loaded(names, load)  # type: ignore[arg-type]
            scores = {n: NodeScore(n, 4, 0, 4) for n in names}
            with pytest.raises(error, match=f"load of '{names[where]}'"):
                best_of(scores, load)  # type: ignore[arg-type]
            # a namespace not weighed is not read
            assert least_loaded(names[:where] + names[where + 1 :], load) == (  # type: ignore[arg-type]
                "node-000" if where else "node-001"
            )


def test_infinite_loads_are_numbers() -> None:
    load = {"a": float("inf"), "b": float("-inf"), "c": 0.0}
    assert least_loaded(["a", "b", "c"], load) == "b"
    assert least_loaded(["a", "c"], load) == "c"
    assert best_of({n: NodeScore(n, 2, 0, 2) for n in "abc"}, load) == "b"


def test_best_of_is_the_longest_prefix_then_the_lowest_load_then_the_first_name() -> None:
    rng = random.Random(12)
    for _ in range(2000):
        names = rng.sample([f"node-{i:03d}" for i in range(40)], rng.randrange(0, 25))
        scores = {n: NodeScore(n, u, 0, u) for n in names for u in [rng.randrange(0, 4)]}
        load = {n: rng.randrange(0, 3) for n in names if rng.random() < 0.7}
        want = min(names, key=lambda n: (-scores[n].usable, load.get(n, 0), n), default=None)
        assert best_of(scores, load) == want
        assert best_of(scores, None) == min(
            names, key=lambda n: (-scores[n].usable, n), default=None
        )
