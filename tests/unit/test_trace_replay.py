"""The trace replay in simulated time (``sim.trace_replay``)."""

from __future__ import annotations

import math

import pytest

from sim.trace import PromptMaker, TraceRequest, arrivals, ideal
from sim.trace_gen import TraceShape, generate
from sim.trace_replay import POLICIES, ReplayConfig, replay


def request(line: int, ids: tuple[int, ...], output: int = 4) -> TraceRequest:
    return TraceRequest(line, 0, (len(ids) - 1) * 512 + 100, output, ids)


def by_policy(result: dict[str, object]) -> dict[str, dict[str, object]]:
    runs = result["runs"]
    assert isinstance(runs, list)
    return {run["policy"]: run for run in runs}


def test_a_burst_sharing_a_prefix_hits_only_when_requests_in_flight_count() -> None:
    """Four requests sharing 40 blocks arrive together: the registry hears of the first
    one's blocks only when its prefill ends, so ``prefix`` spreads the burst over the
    idle engines (no hit); counting the blocks sent there as cached keeps the rest where
    the first went, and they hit the 40 blocks once its prefill is done."""
    shared = tuple(range(40))
    burst = [request(n + 1, (*shared, 100 + n)) for n in range(4)]
    config = ReplayConfig(engines=4, kv_blocks=400, max_running=4)
    runs = by_policy(replay(burst, [0.0, 0.001, 0.002, 0.003], config))
    assert runs["prefix"]["hit_rate"] == 0
    assert runs["prefix"]["requests_per_engine"] == [1, 1, 1, 1]
    assert sorted(runs["prefix+pending"]["requests_per_engine"]) == [0, 0, 0, 4]
    # Three of four prompts hit their 40 shared blocks (16 tokens each).
    prompt = 40 * 16 + 4  # 100/512 of the last block: 4 tokens
    assert runs["prefix+pending"]["hit_rate"] == round(3 * 40 * 16 / (4 * prompt), 4)
    assert runs["prefix+pending"]["ideal_fraction"] == 1.0


def test_spaced_requests_hit_the_cache_they_were_sent_to() -> None:
    """One request at a time, each after the last one's prefill: ``prefix`` reaches the
    infinite cache's hit rate while the caches hold everything; round-robin does not."""
    talk: list[TraceRequest] = []
    ids: tuple[int, ...] = ()
    for turn in range(12):
        ids = (*ids[:-1], 1000 + 3 * turn, 1001 + 3 * turn, 1002 + 3 * turn)
        talk.append(request(turn + 1, ids))
    config = ReplayConfig(engines=3, kv_blocks=200)
    runs = by_policy(replay(talk, [float(n) for n in range(len(talk))], config))
    best = ideal(talk, 16).hit_rate
    assert runs["prefix"]["hit_rate"] == runs["prefix+pending"]["hit_rate"] == round(best, 4)
    # Round-robin: each turn hits only the turn three before it (engines 0, 1, 2).
    rr_hits = sum(2 * turn - 4 for turn in range(3, 12))
    assert runs["round-robin"]["hit_rate"] == round(rr_hits * 16 / 2544, 4)
    assert best == 132 * 16 / 2544
    assert runs["round-robin"]["requests_per_engine"] == [4, 4, 4]


def test_a_replay_is_deterministic_and_no_policy_beats_the_ideal() -> None:
    requests = list(generate(TraceShape(requests=400, seed=2)))
    times = arrivals(requests, 0.1)
    first = replay(requests, times, ReplayConfig(engines=4))
    assert first == replay(requests, times, ReplayConfig(engines=4))
    assert [run["policy"] for run in first["runs"]] == list(POLICIES)
    for run in first["runs"]:
        assert 0 < run["hit_rate"] <= first["ideal_hit_rate"]
        assert sum(run["requests_per_engine"]) == 400
    assert first["kv_blocks_per_engine"] == -(-first["distinct_blocks"] // 16)  # a quarter / 4
    # A window too small for its largest request gets room for it.
    few = replay(requests[:3], times[:3], ReplayConfig(engines=8))
    maker = PromptMaker(16)
    sizes = [maker.prompt_length(r) + max(1, min(r.output_length, 16)) for r in requests[:3]]
    assert few["kv_blocks_per_engine"] == max(math.ceil(size / 16) for size in sizes)
    assert few["kv_blocks_per_engine"] > math.ceil(few["distinct_blocks"] / 32)


def test_bad_configurations_and_requests_too_big_are_refused() -> None:
    requests = [request(1, tuple(range(30)))]
    with pytest.raises(ValueError, match="request 1 needs more than the 10 blocks"):
        replay(requests, [0.0], ReplayConfig(kv_blocks=10))
    with pytest.raises(ValueError, match="engines must be an integer >= 1"):
        replay(requests, [0.0], ReplayConfig(engines=0))
    with pytest.raises(ValueError, match="prefill_ms must be a number >= 0"):
        replay(requests, [0.0], ReplayConfig(prefill_ms=-1))
    with pytest.raises(ValueError, match="unknown policies"):
        replay(requests, [0.0], ReplayConfig(), ["greedy"])
    with pytest.raises(ValueError, match="2 arrivals for 1 requests"):
        replay(requests, [0.0, 1.0], ReplayConfig())


def test_the_gateway_policy_is_the_gateways_own_rule() -> None:
    """``pcr gateway`` and the replay's ``gateway`` policy rank with one function, so a
    rule tried in the simulation is the rule the gateway runs."""
    from pcr.gateway import balance as gateway_balance
    from registry.routing import balance as shared

    assert gateway_balance.ranked is shared.ranked
    assert gateway_balance.BalanceRule is shared.BalanceRule
    assert gateway_balance.Kin is shared.Kin


def test_the_gateway_keeps_turns_and_bursts_where_their_prefix_is() -> None:
    """The gateway's rule on the replay: a conversation's turns, one at a time, stay
    where its prefix is cached (the ideal's hit rate); a burst sharing 40 blocks stays
    where the first was sent (its blocks count as arriving there), and no decision goes
    away from the engine listing the longest prefix."""
    talk: list[TraceRequest] = []
    ids: tuple[int, ...] = ()
    for turn in range(12):
        ids = (*ids[:-1], 1000 + 3 * turn, 1001 + 3 * turn, 1002 + 3 * turn)
        talk.append(request(turn + 1, ids))
    config = ReplayConfig(engines=3, kv_blocks=200)
    spaced = by_policy(replay(talk, [float(n) for n in range(len(talk))], config, ["gateway"]))
    assert spaced["gateway"]["hit_rate"] == round(ideal(talk, 16).hit_rate, 4)
    assert spaced["gateway"]["lost"]["away"] == 0
    assert spaced["gateway"]["lost"]["evicted"] == 0

    shared = tuple(range(40))
    burst = [request(n + 1, (*shared, 100 + n)) for n in range(4)]
    config = ReplayConfig(engines=4, kv_blocks=400, max_running=4)
    runs = by_policy(replay(burst, [0.0, 0.001, 0.002, 0.003], config, ["gateway"]))
    assert sorted(runs["gateway"]["requests_per_engine"]) == [0, 0, 0, 4]
    assert runs["gateway"]["ideal_fraction"] == 1.0


def test_lost_hits_are_counted_by_where_they_went() -> None:
    """Against one infinite cache: round-robin sends each turn away from the engine that
    lists its conversation (``away``); one engine too small for the conversation loses
    its older blocks (``evicted``: held by no engine)."""
    talk: list[TraceRequest] = []
    ids: tuple[int, ...] = ()
    for turn in range(6):
        ids = (*ids[:-1], 1000 + 3 * turn, 1001 + 3 * turn, 1002 + 3 * turn)
        talk.append(request(turn + 1, ids))
    times = [float(n) for n in range(len(talk))]
    rr = replay(talk, times, ReplayConfig(engines=2, kv_blocks=200), ["round-robin"])
    lost = rr["runs"][0]["lost"]
    assert lost["ideal"] == sum(2 * turn for turn in range(1, 6)) * 16
    # Turn n (from 0) lists 2n blocks on the other engine, 2n - 2 on its own.
    assert lost["away"] == 2 * 16 * 5
    assert lost["requests_away"] == 5
    assert lost["evicted"] == 0
    first, flood = request(1, tuple(range(11))), request(2, tuple(range(100, 120)))
    again = request(3, (*range(10), 50, 51))
    small = replay([first, flood, again], [0.0, 1.0, 2.0], ReplayConfig(engines=1, kv_blocks=20))
    for run in small["runs"]:  # the flood took every block the first prompt cached
        assert run["lost"]["ideal"] == run["lost"]["evicted"] == 10 * 16
        assert run["lost"]["away"] == 0
        assert run["hit_rate"] == 0


def test_cache_aware_follows_its_tree_over_the_threshold_else_the_smallest_tree() -> None:
    """vllm-router ``cache_aware`` as replayed: a prompt matching over 30% of a tree goes
    there; one matching less goes to the engine with the smallest tree of sent text."""
    long = request(1, tuple(range(20)))
    other = request(2, (500, 501, 502))
    sibling = request(3, (*range(10), 900, 901))  # 10 of 11 full blocks: that tree
    stranger = request(4, (0, 700, 701, 702, 703, 704, 705))  # 1 of 6: the smaller tree
    config = ReplayConfig(engines=2, kv_blocks=200)
    run = replay([long, other, sibling, stranger], [0.0, 1.0, 2.0, 3.0], config, ["cache-aware"])
    assert run["runs"][0]["requests_per_engine"] == [2, 2]
    hits = run["runs"][0]["hit_rate"]
    maker = PromptMaker(16)
    prompts = sum(maker.prompt_length(r) for r in (long, other, sibling, stranger))
    assert hits == round(10 * 16 / prompts, 4)  # the sibling's 10 blocks, nothing else
