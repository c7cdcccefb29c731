"""Simulated vLLM engines, ``pcr bridge`` and ``pcr gateway`` end to end (issue 44): two
engines of ``pcr.bench.sim_engines`` publish vLLM's KV events, the bridge follows them
into Redis, and the gateway routes a trace's conversations by what the engines hold.

Requests go one at a time, each once the bridge lists the previous one's blocks, so the
outcome depends on no timing: every later turn of a conversation must hit the whole of
its previous turn's complete blocks (the gateway sends it to the engine that caches
them), the engines' own counters must equal the infinite-cache ideal (nothing is evicted,
conversations share nothing), and the bridge must list exactly what each engine caches.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("aiohttp")

from pcr.bench.sim_engines import EngineAddress, EngineOptions
from registry import PrefixCacheRegistry
from registry.core.hashing import block_hashes
from sim.trace import PromptMaker, TraceRequest, full_blocks, ideal
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess
from tests.support.sim_fleet import BridgeProcess, FleetProcess, engine_counters
from tests.support.waiting import wait_until

BS = 16
MODEL = "sim-engine"
CONVERSATIONS = 3
TURNS = 10
FIRST_BLOCKS = 24
"""A long first prompt: a turn cached on one engine costs ~23 blocks more on the other,
far more than any balance term can weigh against a turn's two new blocks."""


def conversations() -> list[TraceRequest]:
    """Three conversations, interleaved turn by turn (round-robin over two engines would
    move each from one engine to the other at every turn), each turn the previous
    prompt's complete blocks and two more (the last one partial), then four one-off
    prompts."""
    requests: list[TraceRequest] = []
    talks = [[c * 1000 + k for k in range(FIRST_BLOCKS)] for c in range(CONVERSATIONS)]
    next_id = 100_000
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            if turn:
                talks[c] = [*talks[c][:-1], next_id, next_id + 1, next_id + 2]
                next_id += 3
            ids = tuple(talks[c])
            requests.append(TraceRequest(len(requests) + 1, 0, (len(ids) - 1) * 512 + 300, 2, ids))
    for n in range(4):
        ids = (200_000 + 10 * n, 200_001 + 10 * n)
        requests.append(TraceRequest(len(requests) + 1, 0, 700, 2, ids))
    return requests


def send(gateway: str, tokens: list[int]) -> dict[str, Any]:
    """One streamed completion through the gateway; the engine's usage chunk."""
    body = {
        "model": MODEL,
        "prompt": tokens,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] | None = None
    done = False
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
            elif json.loads(data).get("usage"):
                usage = json.loads(data)["usage"]
    assert done
    assert usage is not None
    return usage


def listed(client: redis.Redis, namespace: str) -> dict[int, int]:
    return PrefixCacheRegistry(client, namespace).entries()[0]


def engine_cache(engine: EngineAddress) -> dict[int, int]:
    blocks = httpx.get(f"{engine.url}/sim/cache", timeout=30).json()["blocks"]
    return {int(h): position for h, position in blocks.items()}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[EngineAddress]]:
    options = EngineOptions(kv_blocks=512, block_size=BS, prefill_ms=1, decode_ms=1)
    process = FleetProcess(2, options, tmp_path)
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.mark.timeout(600)
def test_conversations_follow_their_cache_through_bridge_and_gateway(
    redis_server: RedisServer, fleet: list[EngineAddress], tmp_path: Path
) -> None:
    client = redis_server.client()
    tag = uuid.uuid4().hex[:8]
    namespaces = [f"trace-e2e-{tag}-{n}" for n in range(len(fleet))]
    bridge = BridgeProcess(redis_server.url, tmp_path / "bridge.log").start(fleet, namespaces, BS)
    backends = [f"--backend={ns}={e.url}" for ns, e in zip(namespaces, fleet, strict=True)]
    gateway = ServeProcess(
        "--redis-url", redis_server.url, *backends, "--block-size", str(BS),
        "--policy", "prefix", "--replica-id", f"e2e-{tag}",
        command="gateway", path="/health",
    )  # fmt: skip
    requests = conversations()
    maker = PromptMaker(BS)
    try:
        gateway.start()
        cached: list[int] = []
        for request in requests:
            prompt = maker.prompt(request)
            cached.append(send(gateway.base, prompt)["prompt_tokens_details"]["cached_tokens"])
            done = set(block_hashes(prompt, BS)[: full_blocks(request, maker)])
            wait_until(
                lambda done=done: any(done <= set(listed(client, ns)) for ns in namespaces),
                timeout=120,
                what=f"the bridge to list request {request.line}'s blocks",
            )
        for n, request in enumerate(requests[CONVERSATIONS : CONVERSATIONS * TURNS]):
            previous = requests[n]  # the same conversation's previous turn
            assert previous.hash_ids[:-1] == request.hash_ids[: len(previous.hash_ids) - 1]
            assert cached[CONVERSATIONS + n] == full_blocks(previous, maker) * BS, request.line
        counters = [engine_counters(e.url) for e in fleet]
        hits = sum(c["hits"] for c in counters)
        assert hits == sum(cached) == ideal(requests, BS).hit_tokens
        assert sum(c["requests"] for c in counters) == len(requests)
        for engine, namespace in zip(fleet, namespaces, strict=True):
            wait_until(
                lambda e=engine, ns=namespace: engine_cache(e) == listed(client, ns),
                timeout=120,
                what=f"{namespace} to list exactly {engine.name}'s cache",
            )
        assert all(engine_cache(e) for e in fleet), "both engines served conversations"
    finally:
        if gateway.process is not None:
            gateway.stop()
        bridge.stop()
        client.close()
