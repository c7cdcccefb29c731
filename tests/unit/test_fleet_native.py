"""The fleet view's C extension (``registry/fleet/_holders.c``) against the pure-Python
maps and walk it replaces: random records over many namespaces (slots past 64 bits,
hashes held by one and by many, removals leaving one holder, clears, claims, collected
namespaces) applied to a view on each path; after every batch each native index equals
its dict, and every prompt (chains, their mixes, sentinels inside, hashes no one holds)
walks to the same change points, checkpoints and refusals. The index's own table is
churned past its growth and its removed entries. test_fleet_view_records.py runs whole
on each path too."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from registry.fleet import holders, matches
from registry.fleet.view import FleetView

NATIVE = holders.NATIVE
needs_extension = pytest.mark.skipif(NATIVE is None, reason="C extension not built")


def pure_view(names: list[str], monkeypatch: pytest.MonkeyPatch) -> FleetView:
    """A detached view on the pure-Python maps and walk."""
    with monkeypatch.context() as patch:
        patch.setattr(holders, "NATIVE", None)
        view = FleetView.detached(names)
    assert view._table._indexes is None
    return view


def indexes_equal(view: FleetView) -> None:
    table = view._table
    assert table._indexes is not None
    kv, mamba = table._indexes
    assert kv.as_dict() == table.kv
    assert mamba.as_dict() == table.mamba
    assert len(kv) == len(table.kv)
    assert len(mamba) == len(table.mamba)
    for value in table.kv.values():  # a lone holder's entries share its slot's int
        if not value & (value - 1):
            assert value is table._bits[value.bit_length() - 1]


def walks(view: FleetView, prompt: list[int], checkpoints: bool) -> Any:
    table = view._table
    mask = table._live.mask
    try:
        return matches.walk(table.kv, table.mamba, prompt, mask, checkpoints, table._indexes)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def prompts(rng: random.Random, chains: list[list[int]]) -> Iterator[list[Any]]:
    yield from chains
    yield chains[0][:9] + chains[1][9:]
    yield [*chains[2][:5], -1, *chains[2][6:]]  # a sentinel ends it
    yield [0, *chains[3]]
    yield [*chains[1][:12], rng.randrange(1, 2**63), *chains[1][13:]]
    yield []
    yield [*chains[0][:4], 2**63, *chains[0][4:]]  # refused where read
    yield [*chains[0][:3], 7.0]
    yield [rng.randrange(1, 2**63), True]  # never read: no one holds the first


@needs_extension
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_records_walk_alike_on_both_paths(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    names = [f"ns-{i:03d}" for i in range(100)]
    native = FleetView.detached(names)
    pure = pure_view(names, monkeypatch)
    seq = dict.fromkeys(names, 0)
    chains = [[rng.randrange(1, 2**63) for _ in range(40)] for _ in range(4)]
    chains.append(list(range(1, 41)))  # small hashes: neighbours in the native table

    def send(name: str, parts: str) -> None:
        seq[name] += 1
        record = f"{name} 0 {seq[name]} {parts}".encode()
        native.apply(record)
        pure.apply(record)

    for step in range(2500):
        name = rng.choice(names[:8] if rng.random() < 0.6 else names)
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.45:
            start = rng.randrange(0, 3)
            send(name, "k+ " + " ".join(map(str, chain[start : rng.randrange(start + 1, 41)])))
        elif roll < 0.55:
            send(name, "m+ " + " ".join(map(str, rng.sample(chain, 4))))
        elif roll < 0.8:
            send(name, "k- " + " ".join(map(str, rng.sample(chain, 6))))
        elif roll < 0.88:
            send(name, "m- " + " ".join(map(str, rng.sample(chain, 3))))
        elif roll < 0.92:
            send(name, rng.choice(["K", "M", "C"]))
        elif roll < 0.95:
            send(name, "G")  # collected: its slot goes to the next namespace held
            native._table.add_empty(name)
            pure._table.add_empty(name)
            seq[name] = 0
            for view in (native, pure):
                view._table.set_live(names)
        if step % 100 == 99:
            indexes_equal(native)
            assert native.blocks == pure.blocks
            assert native.mamba_blocks == pure.mamba_blocks
            for prompt in prompts(rng, chains):
                for checkpoints in (False, True):
                    assert walks(native, prompt, checkpoints) == walks(pure, prompt, checkpoints)
                if all(type(h) is int and -1 <= h < 2**63 for h in prompt):
                    assert native.match(prompt) == pure.match(prompt)
                    assert native.match(prompt).top() == pure.match(prompt).top()
    indexes_equal(native)


@needs_extension
def test_the_index_grows_and_reuses_removed_entries() -> None:
    assert NATIVE is not None
    rng = random.Random(9)
    index = NATIVE.Index()
    blocks: dict[int, int] = {}
    shared = [1 << s for s in range(70)]
    live: set[int] = set()
    for round_ in range(40):
        added = {rng.randrange(1, 2**63) for _ in range(rng.randrange(0, 3000))}
        removed = set(rng.sample(sorted(live), min(len(live), rng.randrange(0, 3000))))
        bit = shared[round_ % 70]
        NATIVE.change(blocks, index, added, (), bit, shared)
        NATIVE.change(blocks, index, (), removed, bit, shared)
        live = set(blocks)
        assert index.as_dict() == blocks
        assert len(index) == len(blocks)
    for h in list(blocks):
        NATIVE.change(blocks, index, (), [h], blocks[h], shared)
    assert blocks == {}
    assert len(index) == 0
    assert index.as_dict() == {}


@needs_extension
def test_change_refuses_what_is_not_a_hash_before_changing_it() -> None:
    assert NATIVE is not None
    index = NATIVE.Index()
    blocks: dict[int, int] = {}
    for bad in (0, -1, 2**63, "5", 5.0, True):
        with pytest.raises(ValueError, match=r"\[1, 2\^63-1\]"):
            NATIVE.change(blocks, index, [bad], (), 1, [1])
    assert blocks == {}
    assert len(index) == 0
    with pytest.raises(TypeError):
        NATIVE.Index(1)
    with pytest.raises(TypeError):
        NATIVE.walk(index, (1, 2), 1, None)  # a list only


@needs_extension
def test_decisions_while_records_arrive_from_another_thread() -> None:
    """The follower changes the maps while routers walk them: no decision fails or
    names a namespace outside the view, and once the writer stops both paths agree."""
    rng = random.Random(4)
    names = [f"ns-{i:02d}" for i in range(70)]
    view = FleetView.detached(names)
    chain = [rng.randrange(1, 2**63) for _ in range(300)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        seq = dict.fromkeys(names, 0)
        try:
            while not stop.is_set():
                name = rng.choice(names)
                seq[name] += 1
                cut = rng.randrange(1, 300)
                op = "k+" if rng.random() < 0.6 else "k-"
                view.apply(f"{name} 0 {seq[name]} {op} {' '.join(map(str, chain[:cut]))}".encode())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(3000):
            found = view.match(chain)
            assert set(found) <= set(names)
            assert all(0 < n <= 300 for n in found.values())
    finally:
        stop.set()
        writer.join()
    assert not errors
    indexes_equal(view)
    table = view._table
    pure = matches.walk_python(table.kv, table.mamba, chain, table._live.mask, False)
    assert (
        matches.walk(table.kv, table.mamba, chain, table._live.mask, False, table._indexes) == pure
    )
