"""The routers' last step, without a server: the least-loaded of the namespaces holding
the longest prefix (``least_loaded``), against the rule it implements, written out."""

from __future__ import annotations

import random

from registry.routing.plan import least_loaded


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
