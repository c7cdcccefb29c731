"""The gateway's usual decision in one C call (``GatewayState._decided``, ``decide`` in
``registry/routing/_weigh.c``) against its general path (``DECIDE`` None: the fleet
view's match, the pending blocks' extension, ``Weighed``): random fleets of 1 to 8
backends (some not in the view, some not live), random prefixes registered, requests
started and ended (successes in their grace, failures), time passing (pending blocks
expiring), engine queues and full caches, kin, block sizes 1 to 16 and empty prompts
give the same outcome, the same choices to the bit (costs, hits, queues, shares), the
same ``reach`` on the two best and the same ``pending_changed`` count, decision after
decision, with and without other replicas' chains told; and the C path is what ran.
Where the usual case does not hold (a hybrid model's node, ``hybrid=True``, the view not
following Redis, an input of another type) the general path answers, as before; slots
past 64 bits are read right."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

import pcr.gateway.state as gateway_state
from pcr.gateway.balance import BackendLoad, Choice
from pcr.gateway.config import GatewayConfig
from pcr.gateway.outcomes import Ending, started
from pcr.gateway.pending import _ladder
from pcr.gateway.state import GatewayState
from pcr.gateway.tokens import PromptIds, _parse_apart
from registry.fleet.view import FleetView

needs_extension = pytest.mark.skipif(gateway_state.DECIDE is None, reason="C extension not built")


class _Registry:
    hybrid: bool | None = None
    key_prefix = "pcr"


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _bits(value: Any) -> Any:
    return float(value).hex() if isinstance(value, float) else value


def _answer(made: tuple[list[Choice], str]) -> tuple[Any, ...]:
    order, outcome = made
    return outcome, [
        (c.namespace, _bits(c.cost), c.cached, _bits(c.queued), _bits(c.share), c.reach)
        for c in order
    ]


def _run(coroutine: Any) -> Any:
    """An ``async`` call that never waits (the fleet view answers in memory)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the decision waited")


class _Spy:
    """``DECIDE`` counting what it answered."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.made = self.declined = 0

    def __call__(self, *args: Any) -> Any:
        made = self.real(*args)
        if made is NotImplemented:
            self.declined += 1
        else:
            self.made += 1
        return made


def _gateway(rng: random.Random, names: list[str], in_view: list[str]) -> GatewayState:
    size = rng.choice([1, 4, 16])
    config = GatewayConfig(
        backends={n: f"http://127.0.0.1:{i + 1}" for i, n in enumerate(names)}, block_size=size
    )
    state = GatewayState(config, _Registry())
    view = FleetView.detached(in_view)
    view.observe(state.pending.heard)
    state.view = view
    return state


def _prompts(rng: random.Random, size: int) -> list[PromptIds]:
    """Prompts sharing a few system prompts (some shorter than a block, one empty)."""
    systems = [[rng.randrange(4, 60) for _ in range(rng.randint(0, 90))] for _ in range(3)]
    out = []
    for _ in range(10):
        tokens = rng.choice(systems) + [rng.randrange(4, 60) for _ in range(rng.randint(0, 20))]
        body = json.dumps({"model": "m", "prompt": tokens or [5]}).encode()
        _body, ids = _parse_apart(body, False, None, size, True)
        assert ids is not None
        assert ids.hashes is not None
        out.append(ids)
    return out


def _register(rng: random.Random, view: FleetView, prompts: list[PromptIds]) -> dict[str, int]:
    """Random prefixes of the prompts listed at the live namespaces; their records' last
    numbers."""
    seq = dict.fromkeys(view.live_nodes(), 0)
    for ids in prompts:
        for name in seq:
            if ids.hashes and rng.random() < 0.4:
                seq[name] += 1
                held = ids.hashes[: rng.randint(1, len(ids.hashes))]
                view.apply(f"{name} 0 {seq[name]} k+ {' '.join(map(str, held))}".encode())
    return seq


def _told(rng: random.Random, names: list[str], prompts: list[PromptIds]) -> dict[str, Any]:
    """Another replica's chains, as ``parse_wire`` gives them: per backend, prefixes of
    the prompts (held in part where they were sent), their hashes at the ladder's
    positions, and now and then a checkpoint."""
    told: dict[str, Any] = {}
    for name in names:
        chains = []
        for ids in rng.sample(prompts, rng.randint(0, 3)):
            if not ids.hashes:
                continue
            length = rng.randint(1, len(ids.hashes))
            values = [ids.hashes[p - 1] for p in _ladder(length)]
            marks = (
                [(p, ids.hashes[p - 1]) for p in {rng.randint(1, length)}]
                if rng.random() < 0.3
                else []
            )
            chains.append((rng.randint(0, length), length, values, marks))
        if chains:
            told[name] = chains
    return told


def _both(
    state: GatewayState, ids: PromptIds, spy: _Spy, monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple[Any, ...], tuple[Any, ...], list[Choice]]:
    """The general path's answer and count, then the C path's (same clock)."""
    changed = state.metrics.pending_changed
    monkeypatch.setattr(gateway_state, "DECIDE", None)
    before = changed.value
    general = _run(state.choose(ids))
    general_moved = changed.value - before
    monkeypatch.setattr(gateway_state, "DECIDE", spy)
    before = changed.value
    quick = _run(state.choose(ids))
    quick_moved = changed.value - before
    return (*_answer(general), general_moved), (*_answer(quick), quick_moved), quick[0]


@needs_extension
@pytest.mark.parametrize("seed", range(40))
def test_the_c_decision_is_the_general_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(rng.randint(1, 8))]
    in_view = [n for n in names if rng.random() < 0.8]
    state = _gateway(rng, names, in_view)
    assert state.view is not None
    assert state.metrics.on
    if in_view and rng.random() < 0.3:  # one held but not live
        state.view._table.set_live(in_view[1:])
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    prompts = _prompts(rng, state.config.block_size)
    _register(rng, state.view, prompts)
    spy = _Spy(gateway_state.DECIDE)
    live: list[tuple[Any, Any, int]] = []
    for _ in range(40):
        clock.now += rng.choice([0.0, 0.01, 0.3, 1.5, 3.0, 40.0])
        for backend in state.backends.values():
            backend.load.engine_requests = rng.choice([0, 0, 1, 4])
            backend.load.kv_usage = rng.choice([0.1, 0.1, 0.99])
        if rng.random() < 0.2:  # the other replicas tell their chains, or none
            told = _told(rng, names, prompts)
            state.pending.set_remote([told] if told and rng.random() < 0.7 else [])
        ids = rng.choice(prompts)
        general, quick, order = _both(state, ids, spy, monkeypatch)
        assert quick == general
        if rng.random() < 0.8:  # sent to the best: its blocks pending there
            choice = order[0]
            backend = state.backends[choice.namespace]
            prefill = max(0, ids.count - choice.cached)
            live.append((backend, started(state, backend, prefill, choice, ids), prefill))
        while live and rng.random() < 0.5:  # ended: a success (its grace) or not
            backend, sent, prefill = live.pop(rng.randrange(len(live)))
            ending = Ending(state, backend, prefill, sent)
            ending.told(ok=rng.random() < 0.7)
            ending()
    assert spy.made == 40
    assert spy.declined == 0


@needs_extension
def test_pending_blocks_change_the_leader_and_are_counted_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt registered nowhere, sent to ``a``: the next of its kind is ranked with
    its blocks pending at ``a`` (the count says the pending blocks changed the leader
    wherever load alone would pick another), by both paths alike; then the same with the
    prompt pending at another replica alone (its chain told)."""
    rng = random.Random(7)
    state = _gateway(rng, ["a", "b", "c"], ["a", "b", "c"])
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    ids = _prompts(rng, state.config.block_size)[0]
    spy = _Spy(gateway_state.DECIDE)
    moved = 0
    for _ in range(6):
        general, quick, order = _both(state, ids, spy, monkeypatch)
        assert quick == general
        moved += quick[-1]
        backend = state.backends[order[0].namespace]
        started(state, backend, 0, order[0], ids)
    assert spy.made == 6
    other = _gateway(rng, ["a", "b", "c"], ["a", "b", "c"])
    assert ids.hashes is not None
    length = len(ids.hashes)
    chain = (0, length, [ids.hashes[p - 1] for p in _ladder(length)], [])
    other.pending.set_remote([{"c": [chain]}])
    general, quick, told = _both(other, ids, spy, monkeypatch)
    assert quick == general
    assert told[0].namespace == "c"
    assert told[0].reach is not None
    assert told[0].reach.kv == length
    assert order[0].reach is not None
    assert order[0].reach.kv > order[0].reach.held
    assert moved >= 1


@needs_extension
def test_where_the_usual_case_does_not_hold_the_general_path_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(3)
    state = _gateway(rng, ["a", "b"], ["a", "b"])
    assert state.view is not None
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    prompts = _prompts(rng, state.config.block_size)
    seq = _register(rng, state.view, prompts)
    ids = next(p for p in prompts if p.hashes)
    spy = _Spy(gateway_state.DECIDE)
    monkeypatch.setattr(gateway_state, "DECIDE", spy)
    # hybrid=True: every node ranked by its Mamba checkpoints
    monkeypatch.setattr(_Registry, "hybrid", True)
    _run(state.choose(ids))
    monkeypatch.setattr(_Registry, "hybrid", None)
    # a hybrid model's node in the view
    assert ids.hashes is not None
    state.view.apply(f"b 0 {seq['b'] + 1} m+ {ids.hashes[0]}".encode())
    assert state.view.any_hybrid()
    _run(state.choose(ids))
    assert spy.made == spy.declined == 0
    # the view not following Redis: routed by load, as the general path says
    fresh = _gateway(rng, ["a", "b"], ["a", "b"])
    assert fresh.view is not None
    fresh.view._follower.live_read_at = fresh.view._follower.pinged_at = 0.0
    assert not fresh.view.fresh()
    _order, outcome = _run(fresh.choose(ids))
    assert outcome == "registry_away"
    assert spy.made == 0


@needs_extension
def test_hybrid_false_ranks_a_hybrid_node_by_its_kv_prefix_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--hybrid false`` (the registry's ``hybrid=False``): a node that held Mamba state
    is ranked by its KV prefix, by the C path as by the general one."""
    rng = random.Random(9)
    state = _gateway(rng, ["a", "b", "c"], ["a", "b", "c"])
    assert state.view is not None
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    monkeypatch.setattr(_Registry, "hybrid", False)
    prompts = _prompts(rng, state.config.block_size)
    seq = _register(rng, state.view, prompts)
    ids = next(p for p in prompts if p.hashes)
    assert ids.hashes is not None
    state.view.apply(f"b 0 {seq['b'] + 1} m+ {ids.hashes[0]}".encode())
    assert state.view.any_hybrid()
    spy = _Spy(gateway_state.DECIDE)
    for ids in prompts:
        general, quick, _order = _both(state, ids, spy, monkeypatch)
        assert quick == general
    assert spy.made == len(prompts)


@needs_extension
def test_an_input_the_c_does_not_read_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's load of another type: ``decide`` declines, the general path (and
    its Python weighing) answers."""

    class Load(BackendLoad):
        pass

    rng = random.Random(5)
    state = _gateway(rng, ["a", "b"], ["a", "b"])
    assert state.view is not None
    prompts = _prompts(rng, state.config.block_size)
    _register(rng, state.view, prompts)
    state.backends["b"].load = Load(in_flight=2)
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    spy = _Spy(gateway_state.DECIDE)
    general, quick, _order = _both(state, prompts[0], spy, monkeypatch)
    assert quick == general
    assert spy.declined == 1
    assert spy.made == 0


@needs_extension
def test_slots_past_64_bits_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet of 80 namespaces: the candidates' slots lie past one 64-bit word."""
    rng = random.Random(11)
    everyone = [f"n{i:02d}" for i in range(80)]
    state = _gateway(rng, everyone[70:], everyone)
    assert state.view is not None
    clock = _Clock()
    monkeypatch.setattr(gateway_state.time, "monotonic", clock)
    prompts = _prompts(rng, state.config.block_size)
    _register(rng, state.view, prompts)
    spy = _Spy(gateway_state.DECIDE)
    prefixed = 0
    for ids in prompts:
        general, quick, _order = _both(state, ids, spy, monkeypatch)
        assert quick == general
        prefixed += general[0] == "prefix"
    assert spy.made == len(prompts)
    assert prefixed
