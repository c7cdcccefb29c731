"""The fleet view's records and scoring without a server (``FleetView.detached``):
random records over many namespaces (slots past 64 bits, hashes held by one namespace
and by many, Mamba entries, clears and claims) against a plain model of each namespace's
two sets, scored the way the routers' direct computation scores them. Every test runs on
the native maps and walk (``registry/fleet/_holders.c``, where built) and on the pure
Python ones."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from registry.fleet import holders
from registry.fleet.view import FleetView


@pytest.fixture(autouse=True, params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test on the native maps and walk, and on the pure-Python ones."""
    if request.param == "python":
        monkeypatch.setattr(holders, "NATIVE", None)
    elif holders.NATIVE is None:
        pytest.skip("C extension not built")
    return str(request.param)


class Model:
    """What each namespace holds, as two sets, and whether it is a hybrid model's node."""

    def __init__(self, names: Sequence[str]) -> None:
        self.kv: dict[str, set[int]] = {n: set() for n in names}
        self.mamba: dict[str, set[int]] = {n: set() for n in names}
        self.hybrid: dict[str, bool] = dict.fromkeys(names, False)

    def scores(self, prompt: Sequence[int]) -> dict[str, tuple[int, int, int]]:
        out = {}
        for name, kv in self.kv.items():
            end = 0
            while end < len(prompt) and prompt[end] in kv:
                end += 1
            if not end:
                continue
            farthest = max((i + 1 for i in range(end) if prompt[i] in self.mamba[name]), default=0)
            out[name] = (end, farthest, farthest if self.hybrid[name] else end)
        return out


def test_random_records_score_as_the_model() -> None:
    rng = random.Random(5)
    names = [f"ns-{i:03d}" for i in range(90)]
    view = FleetView.detached(names)
    model = Model(names)
    seq = dict.fromkeys(names, 0)
    chains = [[rng.randrange(1, 2**63) for _ in range(30)] for _ in range(4)]

    def send(name: str, parts: str) -> None:
        seq[name] += 1
        view.apply(f"{name} 0 {seq[name]} {parts}".encode())

    for step in range(3000):
        name = rng.choice(names[:12] if rng.random() < 0.5 else names)
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.4:
            part = chain[: rng.randrange(1, 31)]
            send(name, "k+ " + " ".join(map(str, part)))
            model.kv[name].update(part)
        elif roll < 0.55:
            part = rng.sample(chain, 3)
            send(name, "m+ " + " ".join(map(str, part)))
            model.mamba[name].update(part)
            model.hybrid[name] = True
        elif roll < 0.75:
            part = rng.sample(chain, 4)
            gone = model.kv[name] & set(part)
            cascade = model.mamba[name] & gone
            text = "k- " + " ".join(map(str, part))
            if cascade:
                text += " m- " + " ".join(map(str, cascade))
            send(name, text)
            model.kv[name] -= gone
            model.mamba[name] -= cascade
        elif roll < 0.85:
            part = rng.sample(chain, 5)
            send(name, "m- " + " ".join(map(str, part)))
            model.mamba[name] -= set(part)
        elif roll < 0.9:
            send(name, "K")
            model.kv[name] = set()
        elif roll < 0.94:
            send(name, "M")
            model.mamba[name] = set()
        else:
            send(name, "C")
            model.kv[name], model.mamba[name] = set(), set()
            model.hybrid[name] = False
        if step % 50 == 49:
            for prompt in [*chains, chains[1][:10] + chains[2][10:]]:
                want = model.scores(prompt)
                got = {
                    n: (s.kv_prefix, s.mamba_prefix, s.usable)
                    for n, s in view.score(prompt).items()
                }
                assert got == want, step
                assert view.match(prompt) == {n: s[2] for n, s in want.items()}
                assert view.match(prompt, hybrid=False) == {n: s[0] for n, s in want.items()}
                assert view.match(prompt, hybrid=True) == {n: s[1] for n, s in want.items()}
                for hybrid, at in ((None, 2), (False, 0), (True, 1)):
                    found = view.match(prompt, hybrid=hybrid)
                    top, tied = found.top()
                    best = max((s[at] for s in want.values()), default=0)
                    assert top == best, (step, hybrid)
                    assert sorted(tied) == sorted(
                        n for n, s in want.items() if best and s[at] == best
                    )
                    assert bool(found) == bool(want)
                some = names[::7]
                assert view.match(prompt, some) == {n: s[2] for n, s in want.items() if n in some}
                every = view.score(prompt, everyone=True)
                assert set(every) == set(names)
            for n in names:  # the counts, as the registry's own
                assert view.entries(n) == (len(model.kv[n]), len(model.mamba[n])), step
    # Every hash held by no one is gone from the view; each value has the bits of
    # exactly its holders.
    table = view._table
    for blocks, held_by in ((view.blocks, model.kv), (view.mamba_blocks, model.mamba)):
        assert set(blocks) == set().union(*held_by.values())
        for h, value in blocks.items():
            bits = 0
            for n in names:
                if h in held_by[n]:
                    bits |= table.slot_bit(n) or 0
            assert value == bits, h


def test_a_hash_one_namespace_holds_points_at_its_shared_bit() -> None:
    names = [f"ns-{i:03d}" for i in range(300)]  # slots past 64 bits
    view = FleetView.detached(names)
    big = view._table.slot_bit("ns-299")
    assert big is not None
    assert big == 1 << 299
    view.apply(b"ns-299 0 1 k+ 1 2 3")
    view.apply(b"ns-007 0 1 k+ 1")
    assert view.blocks[2] is big  # one int, not one per block
    assert view.blocks[3] is big
    assert view.blocks[1] == big | (1 << 7)
    view.apply(b"ns-007 0 2 k- 1")
    assert view.blocks[1] is big  # back to the shared int once one holder is left
    view.apply(b"ns-299 0 2 m+ 2")
    assert view.mamba_blocks == {2: big}
    view.apply(b"ns-299 0 3 K")
    assert view.blocks == {}
    assert view.mamba_blocks == {2: big}


def test_namespaces_asked_for_and_a_collected_namespace() -> None:
    view = FleetView.detached(["a", "b", "c"])
    chain = [11, 12, 13, 14]
    view.apply(b"a 0 1 k+ 11 12 13")
    view.apply(b"b 0 1 k+ 11 12")
    assert view.match(chain) == {"a": 3, "b": 2}
    assert view.match(chain, ["b", "c", "unknown"]) == {"b": 2}
    view.apply(b"a 0 2 G")
    assert view.match(chain) == {"b": 2}
    assert view.held("a") is None
    assert view.entries("a") is None
    assert view.age() == 0.0  # a detached view follows nothing: always fresh
    assert view.live_nodes() == ["b", "c"]


@pytest.mark.parametrize(
    "prompt", [[1, 2.0], [1, True], ["1"], [1, -5, 2**63], "11", 7, [[1]], [None]]
)
def test_a_bad_prompt_is_refused_as_the_routers_refuse_it(prompt: object) -> None:
    view = FleetView.detached(["a"])
    view.apply(b"a 0 1 k+ 1 2")
    if prompt == [1, -5, 2**63]:  # -5 and 2^63 are outside [-1, 2^63-1]
        with pytest.raises(ValueError, match="2\\^63-1"):
            view.match(prompt)  # type: ignore[arg-type]
        return
    with pytest.raises((TypeError, ValueError)):
        view.match(prompt)  # type: ignore[arg-type]


def test_an_answer_reads_like_a_dict_and_names_the_holders_of_its_moment() -> None:
    view = FleetView.detached(["a", "b", "c"])
    view.apply(b"a 0 1 k+ 11 12 13")
    view.apply(b"b 0 1 k+ 11 12")
    found = view.match([11, 12, 13, 14])
    assert found.top() == (3, ["a"])
    view.apply(b"a 0 2 G")  # collected; its slot goes to the next namespace held
    view._table.add_empty("d")
    view.apply(b"d 0 1 k+ 11 12 13 14")
    assert found == {"a": 3, "b": 2}  # resolved now, named as when it was found
    assert "a" in found
    assert "d" not in found
    assert found["b"] == 2
    assert found.get("c") is None
    assert len(found) == 2
    assert dict(found) == found.usable == {"a": 3, "b": 2}
    assert sorted(found.items()) == [("a", 3), ("b", 2)]
    later = view.match([11, 12, 13, 14])
    assert later == {"b": 2}  # d is not live yet
    view._table.set_live(["b", "d"])
    assert view.match([11, 12, 13, 14]) == {"b": 2, "d": 4}
    nothing = view.match([99])
    assert not nothing
    assert nothing.top() == (0, [])
    assert nothing == {}
