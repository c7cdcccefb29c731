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
