"""The gateway's balance rule (``pcr.gateway.balance``), without I/O: what it weighs and
what it must never do (pile every request onto one engine while another idles)."""

from __future__ import annotations

import math
import random

import pytest

from pcr.gateway.balance import (
    BackendLoad,
    BalanceRule,
    Decayed,
    Kin,
    Weighed,
    cached_tokens,
    leader,
    prompt_root,
    ranked,
)

RULE = BalanceRule()


def best(
    prompt: int,
    cached: dict[str, int],
    loads: dict[str, BackendLoad],
    rule: BalanceRule = RULE,
    now: float = 0.0,
) -> str:
    return ranked(["a", "b"], prompt, cached, loads, rule, now)[0].namespace


def test_cached_tokens_are_whole_blocks_and_never_the_last_token() -> None:
    assert cached_tokens(3, 32, 200) == 96
    assert cached_tokens(4, 32, 128) == 96  # a fully cached prompt recomputes one block
    assert cached_tokens(10, 32, 100) == 96
    assert cached_tokens(0, 32, 100) == 0
    assert cached_tokens(5, 32, 0) == 0


def test_with_no_load_the_longest_cached_prefix_wins() -> None:
    assert best(300, {"a": 64, "b": 256}, {}) == "b"
    assert best(300, {"a": 256, "b": 64}, {}) == "a"


def test_work_queued_ahead_outweighs_a_small_cached_prefix() -> None:
    loads = {"a": BackendLoad(in_flight=3, pending=900.0)}
    assert best(300, {"a": 64}, loads) == "b"


def test_a_long_cached_prefix_outweighs_a_short_queue() -> None:
    loads = {"a": BackendLoad(in_flight=1, pending=20.0)}
    assert best(1000, {"a": 960}, loads) == "a"


def test_other_replicas_requests_count_like_this_ones() -> None:
    mine = {"a": BackendLoad(in_flight=3, pending=900.0)}
    theirs = {"a": BackendLoad(remote_in_flight=3, remote_pending=900.0)}
    assert best(300, {"a": 64}, mine) == best(300, {"a": 64}, theirs) == "b"


def test_the_engines_own_queue_counts_when_it_is_longer() -> None:
    loads = {"a": BackendLoad(engine_requests=40.0)}
    assert best(300, {"a": 64}, loads) == "b"


def test_a_full_kv_cache_costs_a_prompt() -> None:
    loads = {"a": BackendLoad(kv_usage=0.99)}
    assert best(300, {"a": 128}, loads) == "b"
    assert best(300, {"a": 128}, {"a": BackendLoad(kv_usage=0.5)}) == "a"


def test_requests_one_at_a_time_do_not_pile_onto_the_first_engine() -> None:
    """Sequential requests (nothing ever in flight) of 16 conversations sharing one system
    prompt: the engine that cached the system prompt first is not given everything; the
    two engines share the conversations, and each conversation's later turns stay on the
    engine that holds its earlier ones."""
    rng = random.Random(1)
    size, system = 32, 96
    loads = {"a": BackendLoad(), "b": BackendLoad()}
    holds: dict[str, set[int]] = {"a": set(), "b": set()}  # conversations cached
    home: dict[int, str] = {}
    moved = 0
    now = 0.0
    turns = [c for c in range(16) for _ in range(5)]
    rng.shuffle(turns)
    length = dict.fromkeys(range(16), system)
    for conversation in turns:
        length[conversation] += 64
        prompt = length[conversation]
        cached = {}
        for name in ("a", "b"):
            held = system if holds[name] else 0
            if conversation in holds[name]:
                held = prompt - 64
            cached[name] = cached_tokens(held // size, size, prompt)
        choice = ranked(["a", "b"], prompt, cached, loads, RULE, now)[0]
        loads[choice.namespace].recent.add(prompt - choice.cached, now, RULE.half_life)
        holds[choice.namespace].add(conversation)
        if conversation in home and home[conversation] != choice.namespace:
            moved += 1
        home.setdefault(conversation, choice.namespace)
        now += 0.5
    sent = {name: sum(1 for h in home.values() if h == name) for name in ("a", "b")}
    assert min(sent.values()) >= 5, sent  # both engines hold conversations
    assert moved <= 8, moved  # later turns mostly stay home


def test_after_an_outage_cached_turns_stay_and_only_new_work_moves() -> None:
    """Engine b was away: a did all the recent work and holds every conversation (b came
    back empty). A turn cached on a stays there, however lopsided the recent work (the
    spread weighs only the tokens no engine caches); a prompt that only a's shared system
    prompt helps goes to the idle b."""
    loads = {"a": BackendLoad(recent=Decayed(50_000.0, 0.0))}
    assert best(600, {"a": 560, "b": 0}, loads) == "a"
    assert best(600, {"a": 96, "b": 0}, loads) == "b"


def test_new_work_goes_to_the_engine_that_serves_its_kin() -> None:
    """Two engines equally loaded and both caching the system prompt: a new conversation
    goes where the requests that share its first block have gone lately (the engines
    specialize by system prompt), and without kin the rule is as before."""
    kin = ({"a": 0.0, "b": 12.0}, {"a": 12.0, "b": 12.0})  # b serves this kin, a others
    loads = {n: BackendLoad(recent=Decayed(5_000.0, 0.0)) for n in ("a", "b")}
    assert ranked(["a", "b"], 300, {"a": 96, "b": 96}, loads, RULE, 0.0, kin)[0].namespace == "b"
    assert ranked(["a", "b"], 300, {"a": 96, "b": 96}, loads, RULE, 0.0)[0].namespace == "a"
    cached = {"a": 256, "b": 96}  # a turn cached on a stays there whatever its kin says
    assert ranked(["a", "b"], 300, cached, loads, RULE, 0.0, kin)[0].namespace == "a"


def test_one_prefix_shared_by_everything_still_spreads_the_work() -> None:
    """Every prompt starts with the same system prompt (one root for all): requests one
    at a time, new conversations and later turns; kin pulls towards the engine that
    served the root most only beyond its share of all requests, which is none here, so
    both engines get conversations."""
    rng = random.Random(5)
    size = 16
    system = 64
    loads = {"a": BackendLoad(), "b": BackendLoad()}
    kin = Kin()
    holds: dict[str, set[int]] = {"a": set(), "b": set()}
    home: dict[int, str] = {}
    length: dict[int, int] = {}
    now = 0.0
    for _ in range(120):
        conversation = rng.randrange(24)
        length[conversation] = length.get(conversation, system) + 64
        prompt = length[conversation]
        tokens = [7] * prompt  # the same first block for every prompt
        root = prompt_root(tokens, size)
        cached = {}
        for name in ("a", "b"):
            held = prompt - 64 if conversation in holds[name] else system if holds[name] else 0
            cached[name] = cached_tokens(held // size, size, prompt)
        counts = kin.counts(root, now, RULE.half_life)
        choice = ranked(["a", "b"], prompt, cached, loads, RULE, now, counts)[0]
        loads[choice.namespace].recent.add(prompt - choice.cached, now, RULE.half_life)
        kin.record(root, choice.namespace, now, RULE.half_life)
        holds[choice.namespace].add(conversation)
        home.setdefault(conversation, choice.namespace)
        now += 0.5
    sent = {name: sum(1 for h in home.values() if h == name) for name in ("a", "b")}
    assert min(sent.values()) >= 6, sent


def test_kin_remembers_the_roots_used_last_and_a_prompt_root_is_its_first_block() -> None:
    kin = Kin(limit=3)
    for root in range(5):
        kin.record(root, "a", 0.0, 30.0)
    kin.record(2, "b", 1.0, 30.0)
    kin.record(5, "a", 1.0, 30.0)
    assert len(kin) == 3
    assert kin.counts(0, 1.0, 30.0) is None
    kinned, sent = kin.counts(2, 1.0, 30.0) or ({}, {})
    assert set(kinned) == {"a", "b"}
    assert sent["a"] == pytest.approx(6.0, rel=0.1)  # every request, of any root
    assert kin.counts(None, 1.0, 30.0) is None
    assert prompt_root([1, 2, 3, 4, 5], 4) == (1, 2, 3, 4)
    assert prompt_root([1, 2, 3, 4], 4) is None  # not more than one block
    assert prompt_root(None, 4) is None


def test_with_both_weights_zero_the_rule_is_greedy() -> None:
    greedy = BalanceRule(queue_weight=0, spread_weight=0)
    loads = {"a": BackendLoad(in_flight=50, pending=1e6)}
    assert best(300, {"a": 64}, loads, greedy) == "a"


def test_ties_go_to_fewer_requests_in_flight_then_the_name() -> None:
    order = ranked(["b", "a"], 100, {}, {}, BalanceRule(spread_weight=0), 0.0)
    assert [c.namespace for c in order] == ["a", "b"]


def test_recent_work_decays_by_its_half_life() -> None:
    recent = Decayed()
    recent.add(100.0, 0.0, 10.0)
    assert recent.now(10.0, 10.0) == pytest.approx(50.0)
    assert recent.now(20.0, 10.0) == pytest.approx(25.0)
    recent.add(100.0, 20.0, 10.0)
    assert recent.now(20.0, 10.0) == pytest.approx(125.0)


@pytest.mark.parametrize(
    "changes",
    [
        {"queue_weight": -1.0},
        {"affinity_weight": float("nan")},
        {"spread_weight": float("inf")},
        {"half_life": 0.0},
        {"kv_usage_limit": 1.5},
        {"request_tokens": True},
        {"checkpoint_weight": -0.5},
    ],
)
def test_bad_weights_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises((TypeError, ValueError)):
        BalanceRule(**changes)


def test_a_hybrid_nodes_kv_without_a_state_draws_the_request_that_leaves_one() -> None:
    """On a hybrid model's node, KV blocks with no Mamba state at their end serve no hit
    now, but the request sent there leaves a state where its prompt leaves the cached
    prefix (vLLM's shared-prefix checkpoint), so its siblings hit there later: with the
    default weight that node wins a tie on the usable prefix; with weight 0 it does not."""
    loads = {"a": BackendLoad(), "b": BackendLoad()}
    kv = {"b": 64}
    assert ranked(["a", "b"], 100, {}, loads, RULE, 0.0, None, kv)[0].namespace == "b"
    assert ranked(["a", "b"], 100, {}, loads, RULE, 0.0)[0].namespace == "a"
    flat = BalanceRule(checkpoint_weight=0.0)
    assert ranked(["a", "b"], 100, {}, loads, flat, 0.0, None, kv)[0].namespace == "a"
    choice = ranked(["a", "b"], 100, {}, loads, RULE, 0.0, None, kv)[0]
    assert choice.cached == 0  # what the engine serves now is still 0


def test_a_hit_now_beats_a_checkpoint_up_to_twice_its_length() -> None:
    loads = {"a": BackendLoad(), "b": BackendLoad()}
    cached = {"a": 96, "b": 0}
    assert ranked(["a", "b"], 300, cached, loads, RULE, 0.0, None, {"b": 160})[0].namespace == "a"
    assert ranked(["a", "b"], 300, cached, loads, RULE, 0.0, None, {"b": 224})[0].namespace == "b"
    # a KV prefix no longer than the usable one adds nothing, however long the prompt
    assert ranked(["a", "b"], 300, cached, loads, RULE, 0.0, None, {"a": 96})[0].cost == (
        ranked(["a", "b"], 300, cached, loads, RULE, 0.0)[0].cost
    )


def test_the_affinity_pulls_no_further_than_its_bound() -> None:
    """Bounded loads: kin pulls new work towards b only while b serves at most
    ``affinity_bound`` times the mean share of the recent requests; past it b's cost is
    what it would be without the term."""
    kin = ({"a": 0.0, "b": 10.0}, {"a": 10.0, "b": 20.0})  # b: 21/32 of the requests, 1.31x
    loads = {"a": BackendLoad(), "b": BackendLoad()}
    cached = {"a": 0, "b": 0}

    def cost_of_b(rule: BalanceRule) -> float:
        order = ranked(["a", "b"], 300, cached, loads, rule, 0.0, kin)
        return next(c.cost for c in order if c.namespace == "b")

    unpulled = cost_of_b(BalanceRule(affinity_weight=0))
    assert cost_of_b(BalanceRule(affinity_bound=1.5)) < unpulled
    assert cost_of_b(BalanceRule(affinity_bound=math.inf)) < unpulled
    assert cost_of_b(BalanceRule()) == unpulled  # the default 1.3
    assert (
        ranked(["a", "b"], 300, cached, loads, BalanceRule(affinity_bound=1.5), 0.0, kin)[
            0
        ].namespace
        == "b"
    )
    with pytest.raises(ValueError, match="affinity_bound"):
        BalanceRule(affinity_bound=0.5)


def test_leader_is_the_first_of_ranked_ties_and_all() -> None:
    """``leader`` (the pending-changed metric's second look) answers what ``ranked``
    puts first, on random fleets with equal costs on purpose (the tie breaker)."""
    rng = random.Random(7)
    names = ["a", "b", "c", "d", "e"]
    assert leader([], 100, {}, {}, RULE, 0.0) is None
    for _ in range(2_000):
        loads = {}
        for n in names:
            load = BackendLoad(in_flight=rng.choice([0, 0, 1, 3]), pending=rng.choice([0.0, 64.0]))
            load.engine_requests = rng.choice([0.0, 2.0])
            loads[n] = load
        prompt = rng.choice([0, 16, 400])
        cached = {n: rng.choice([0, 0, 16, 64, 400]) for n in names}
        kv = {n: rng.choice([0, 128]) for n in names} if rng.random() < 0.3 else None
        kin = ({"a": 2.0, "c": 1.0}, {"a": 3.0, "b": 1.0}) if rng.random() < 0.3 else None
        now = rng.random()
        pick = rng.sample(names, rng.randint(1, 5))
        first = ranked(pick, prompt, cached, loads, RULE, now, kin, kv)[0].namespace
        assert leader(pick, prompt, cached, loads, RULE, now, kin, kv) == first


def test_one_weighing_ranks_any_prefixes_as_a_fresh_one() -> None:
    """The gateway weighs a decision's loads once (``Weighed``) and ranks the prompt
    twice, with and without the blocks in flight: each ranking (every cost and part,
    and the leader) equals one made from scratch, in either order, whatever the other
    ranking's prefixes were."""
    rng = random.Random(11)
    names = ["a", "b", "c", "d"]
    for _ in range(500):
        loads = {
            n: BackendLoad(
                in_flight=rng.choice([0, 2]),
                pending=rng.choice([0.0, 80.0]),
                recent=Decayed(rng.choice([0.0, 500.0]), 0.0),
                remote_recent=rng.choice([0.0, 40.0]),
                kv_usage=rng.choice([0.0, 0.99]),
            )
            for n in names
            if rng.random() < 0.9
        }
        prompt = rng.choice([0, 48, 400])
        kin = ({"a": 3.0, "d": 1.0}, {"a": 4.0, "b": 2.0, "d": 1.0}) if rng.random() < 0.5 else None
        now = rng.uniform(0.0, 60.0)
        weighed = Weighed(names, prompt, loads, RULE, now, kin)
        asked = []
        for _turn in range(3):
            cached = {n: rng.choice([0, 16, 48, 384]) for n in names}
            kv = {n: rng.choice([0, 400]) for n in names} if rng.random() < 0.3 else None
            asked.append((cached, kv))
        for cached, kv in asked + asked[::-1]:
            fresh = ranked(names, prompt, cached, loads, RULE, now, kin, kv)
            assert weighed.ranked(cached, kv) == fresh
            assert weighed.leader(cached, kv) == fresh[0].namespace
