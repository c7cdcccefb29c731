"""``pcr gateway`` as a process in front of fake engines (``tests/support/fake_engine.py``)
and a real redis-server: it sends each request where the registry says its prefix is
cached, tokenizes text and chat prompts as the engine will, passes streamed chunks through
one at a time, shares its load with other replicas through Redis, and finds engines
announced in Redis. Faults (refusals, retries, Redis away, bad input) are in
``test_gateway_faults.py``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.support.fake_engine import (
    FakeEngine,
    engine_pair,
    gateway_args,
    tagged_names,
    wait_in_flight,
)
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric
from tests.support.tiny_tokenizer import words
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

BLOCK = 4


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    with engine_pair() as made:
        yield made


@pytest.fixture
def names() -> list[str]:
    return tagged_names("gw")


def gateway(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], *extra: str
) -> ServeProcess:
    args = gateway_args(redis_server.url, engines, names, BLOCK)
    return ServeProcess(*args, *extra, path="/health", command="gateway")


def cache(client: redis.Redis, namespace: str, *prompts: list[int]) -> None:
    """Say in the registry that ``namespace``'s engine holds the prompts' blocks."""
    registry = PrefixCacheRegistry(client, namespace)
    registry.claim(120)
    for tokens in prompts:
        hashes = block_hashes(tokens, BLOCK)
        registry.register_kv(list(range(len(hashes))), hashes)


def complete(base: str, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    reply = httpx.post(base + path, json={"model": "tiny", **body}, timeout=30)
    assert reply.status_code == 200, reply.text
    out: dict[str, Any] = reply.json()
    return out


def test_a_prompt_goes_to_the_engine_that_caches_its_prefix(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    client = redis_server.client()
    prompt = list(range(10, 43))  # 33 tokens: 8 whole blocks
    cache(client, names[1], prompt)
    proc = gateway(redis_server, engines, names).start()
    try:
        served = [complete(proc.base, {"prompt": prompt})["by"] for _ in range(6)]
        assert served == ["b"] * 6
        assert metric(proc.base, "pcr_gateway_routing_decisions_total", outcome="prefix") == 6
        predicted = metric(proc.base, "pcr_gateway_predicted_cached_tokens_total", backend=names[1])
        assert predicted == 6 * 32
    finally:
        proc.stop()
        client.close()


def test_chat_and_text_prompts_are_tokenized_as_the_engine_does(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], tokenizer_dir: Path
) -> None:
    """The chat template writes its own BOS and the text prompt gets one from the
    tokenizer: the hashes of exactly those tokens are cached on engine b, so only a gateway
    that tokenizes as the engine does sends both there."""
    client = redis_server.client()
    message = words(list(range(20, 52)))
    chat_ids = [1, 0, *range(20, 52), 0, 0]  # <s> user ... assistant (roles are <unk>)
    text_ids = [1, *range(60, 92)]
    cache(client, names[1], chat_ids, text_ids)
    proc = gateway(redis_server, engines, names, "--tokenizer", str(tokenizer_dir)).start()
    try:
        chat = {"messages": [{"role": "user", "content": message}]}
        assert complete(proc.base, chat, "/v1/chat/completions")["by"] == "b"
        parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": message}]}]}
        assert complete(proc.base, parts, "/v1/chat/completions")["by"] == "b"
        assert complete(proc.base, {"prompt": words(list(range(60, 92)))})["by"] == "b"
        assert metric(proc.base, "pcr_gateway_routing_decisions_total", outcome="prefix") == 3
        # the engine got the request as it was sent, not the gateway's tokens
        assert engines[1].received[0]["messages"][0]["content"] == message
    finally:
        proc.stop()
        client.close()


def test_requests_one_at_a_time_are_spread_over_idle_engines(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Distinct prompts, nothing cached, one at a time: nothing is ever in flight, and
    still both engines get about half (the rule weighs each engine's recent work)."""
    proc = gateway(redis_server, engines, names).start()
    try:
        for i in range(20):
            complete(proc.base, {"prompt": list(range(100 + i * 40, 140 + i * 40))})
        counts = sorted(len(e.received) for e in engines)
        assert counts[0] >= 8, counts
    finally:
        proc.stop()


def test_streamed_chunks_are_passed_through_one_at_a_time(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """The engine sends its second chunk only after the client has read the first
    through the gateway: a gateway that buffered the stream would never deliver it."""
    for engine in engines:
        engine.chunk_gate = threading.Semaphore(0)
    proc = gateway(redis_server, engines, names).start()
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "stream": True}
        with httpx.stream("POST", f"{proc.base}/v1/completions", json=body, timeout=30) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = reply.iter_lines()
            seen = []
            for _ in range(3):
                for engine in engines:
                    assert engine.chunk_gate is not None
                    engine.chunk_gate.release()
                line = next(line for line in lines if line)
                seen.append(line)
            rest = [line for line in lines if line]
        assert [s.startswith("data: {") for s in seen] == [True, True, True]
        assert rest == ["data: [DONE]"]
    finally:
        proc.stop()


def test_two_replicas_see_each_others_requests_in_flight(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Requests held in flight at engine a through replica 1 are counted by replica 2,
    which then sends a new request to engine b."""
    first = gateway(redis_server, engines[:1], names[:1], "--replica-id", "one").start()
    both = gateway(redis_server, engines, names, "--replica-id", "two").start()
    engines[0].release.clear()
    threads = [
        threading.Thread(
            target=httpx.post,
            args=(f"{first.base}/v1/completions",),
            kwargs={"json": {"model": "tiny", "prompt": [7] * 40}, "timeout": 60},
        )
        for _ in range(3)
    ]
    try:
        for thread in threads:
            thread.start()
        wait_in_flight(engines[0], 3)

        def seen_by_two() -> bool:
            health = httpx.get(f"{both.base}/health", timeout=10).json()
            return bool(health["in_flight"][names[0]]["other_replicas"] == 3)

        wait_until(seen_by_two, 30, "replica two counting replica one's requests")
        assert complete(both.base, {"prompt": [9] * 40})["by"] == "b"
    finally:
        engines[0].release.set()
        for thread in threads:
            thread.join(60)
        first.stop()
        both.stop()


def test_a_replica_sees_another_replicas_request_as_it_starts_and_ends(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Two replicas in-process whose periodic exchange is a minute apart: a request held
    in flight through replica one is counted by replica two, and its end too, before any
    periodic exchange could say so: each start and end is pushed on the load channel."""
    from pcr.gateway.config import GatewayConfig
    from tests.system.test_serve import Served

    prefix = f"gr{uuid.uuid4().hex[:6]}"
    backends = dict(zip(names, (e.url for e in engines), strict=True))
    replicas = [
        Served(
            redis_server.url,
            prefix,
            gateway=GatewayConfig(
                backends=backends, block_size=BLOCK, replica_id=rid, share_interval=60
            ),
        )
        for rid in ("one", "two")
    ]
    one, two = replicas
    engines[0].release.clear()
    engines[1].release.clear()
    thread = threading.Thread(
        target=one.http.post,
        args=("/v1/completions",),
        kwargs={"json": {"model": "tiny", "prompt": [7] * 40}, "timeout": 60},
    )
    try:
        thread.start()
        held = engines[0] if wait_in_flight_any(engines) is engines[0] else engines[1]
        other_replicas = lambda: {  # noqa: E731
            ns: v["other_replicas"] for ns, v in two.http.get("/health").json()["in_flight"].items()
        }
        held_name = names[engines.index(held)]
        wait_until(lambda: other_replicas()[held_name] == 1, 30, "replica two seeing it")
        engines[0].release.set()
        engines[1].release.set()
        thread.join(60)
        wait_until(lambda: other_replicas()[held_name] == 0, 30, "replica two seeing it end")
    finally:
        engines[0].release.set()
        engines[1].release.set()
        thread.join(60)
        for served in replicas:
            served.close()


def test_a_lone_replica_exchanges_nothing_per_request_and_replicas_exchange_in_batches(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """A replica that knows no other sends nothing to Redis per request (its periodic
    exchange is a minute apart here: no load message while it serves five requests); once
    a second replica is known, the starts and ends of many requests are told in batches
    (``share_batch`` apart, 2 s here): far fewer exchanges than requests, counted by the
    server (``INFO commandstats`` after ``CONFIG RESETSTAT``: each exchange publishes
    once), and the other replica still hears the last end."""
    from pcr.gateway.config import GatewayConfig
    from registry.core.keys import gateway_load_channel
    from tests.system.test_serve import Served

    prefix = f"gt{uuid.uuid4().hex[:6]}"
    backends = dict(zip(names, (e.url for e in engines), strict=True))
    client = redis.Redis.from_url(redis_server.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(gateway_load_channel(prefix))

    def replica(rid: str) -> Served:
        config = GatewayConfig(
            backends=backends, block_size=BLOCK, replica_id=rid, share_interval=60,
            share_batch=2.0, registry_timeout=30,
        )  # fmt: skip
        return Served(redis_server.url, prefix, gateway=config)

    def heard_until(rid: str) -> list[str]:
        """The ids of the load messages up to and including ``rid``'s first."""
        ids: list[str] = []
        deadline = time.monotonic() + 30
        while rid not in ids:
            assert time.monotonic() < deadline, ids
            message = pubsub.get_message(timeout=1)  # None: a confirmation, or nothing yet
            if message is not None:
                ids.append(message["data"].decode().split(" ", 1)[0])
        return ids

    def publishes() -> int:
        stats = client.info("commandstats").get("cmdstat_publish", {})
        return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0

    made: list[Served] = []
    try:
        made.append(replica("one"))
        assert heard_until("one") == ["one"]  # its announcement at start
        for n in range(5):
            reply = made[0].http.post("/v1/completions", json={"model": "tiny", "prompt": [n] * 9})
            assert reply.status_code == 200
        made.append(replica("two"))
        assert heard_until("two") == ["two"]  # nothing from one meanwhile
        one = made[0].app.state.gateway
        two = made[1].app.state.gateway
        wait_until(lambda: one.exchange.peers, 30, "replica one hearing of two")
        wait_until(lambda: one.exchange._flush is None, 30, "replica one's first batch told")
        client.config_resetstat()
        began = time.monotonic()
        requests = 30
        for n in range(requests):
            reply = made[0].http.post("/v1/completions", json={"model": "tiny", "prompt": [n] * 9})
            assert reply.status_code == 200
        took = time.monotonic() - began
        told = publishes()  # per request the old exchange made two: start and end
        assert told <= took / 2.0 + 2, (told, took)
        assert told < requests, told
        in_flight = lambda: {  # noqa: E731
            ns: v["other_replicas"]
            for ns, v in made[1].http.get("/health").json()["in_flight"].items()
        }
        wait_until(lambda: not any(in_flight().values()), 30, "replica two hearing the last end")
        assert two.exchange.peers["one"].seq > 0
    finally:
        for served in made:
            served.close()
        pubsub.close()
        client.close()


def wait_in_flight_any(engines: list[FakeEngine]) -> FakeEngine:
    found: list[FakeEngine] = []

    def any_in_flight() -> bool:
        found[:] = [e for e in engines if e.in_flight]
        return bool(found)

    wait_until(any_in_flight, 30, "a request in flight at an engine")
    return found[0]


def test_the_load_exchange_returns_the_others_and_pushes_each_entry(
    redis_server: RedisServer,
) -> None:
    """``lua/gateway_load.lua`` through ``AsyncPrefixRouter.exchange_load``: each call
    returns the other live replicas' entries by id, publishes its own on the channel, and
    an entry past its TTL is gone."""
    import asyncio

    from registry.core.keys import gateway_load_channel
    from registry.routing.aio_routing import AsyncPrefixRouter
    from registry.transport.client import async_client_from_url

    prefix = f"gl{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        client = async_client_from_url(redis_server.url)
        router = AsyncPrefixRouter(client, prefix)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(gateway_load_channel(prefix))
        try:
            assert await router.exchange_load("a", 60_000, '{"seq":1}') == {}
            assert await router.exchange_load("b", 1, '{"seq":7}') == {"a": '{"seq":1}'}
            heard = []
            deadline = asyncio.get_running_loop().time() + 30
            while len(heard) < 2:  # None: the subscription's own confirmation, or nothing yet
                assert asyncio.get_running_loop().time() < deadline, heard
                message = await pubsub.get_message(timeout=1)
                if message is not None:
                    heard.append(message["data"])
            assert heard == [b'a {"seq":1}', b'b {"seq":7}']
            while await router.exchange_load("a", 60_000, '{"seq":2}'):
                await asyncio.sleep(0.01)  # until b's 1 ms entry has expired
            assert await client.hkeys(f"{prefix}:gateway:load") == [b"a"]
        finally:
            await pubsub.aclose()
            await client.aclose()

    asyncio.run(scenario())


def test_engines_announced_in_redis_become_backends(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    client = redis_server.client()
    index = NodeIndex(client)
    proc = ServeProcess(
        "--redis-url", redis_server.url, "--block-size", str(BLOCK), path="/live",
        command="gateway",
    ).start()  # fmt: skip
    try:
        reply = httpx.post(f"{proc.base}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == 503
        index.announce_engine(names[0], engines[0].url)

        def served() -> bool:
            return httpx.get(f"{proc.base}/health", timeout=10).json()["backends"] == {
                names[0]: "up"
            }

        wait_until(served, 30, "the announced engine listed")
        assert complete(proc.base, {"prompt": [1, 2, 3]})["by"] == "a"
    finally:
        index.forget_engine(names[0])
        proc.stop()
        client.close()


def test_no_announced_routes_only_to_the_backends_given(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """``--no-announced``: an engine announced in Redis before the gateway starts (a
    gateway reads the table before it serves) is not a backend; every request goes to
    the one given."""
    client = redis_server.client()
    index = NodeIndex(client)
    index.announce_engine(names[1], engines[1].url)
    proc = ServeProcess(
        "--redis-url", redis_server.url, "--block-size", str(BLOCK), "--no-announced",
        "--backend", f"{names[0]}={engines[0].url}", "--policy", "round-robin",
        path="/live", command="gateway",
    ).start()  # fmt: skip
    try:
        assert httpx.get(f"{proc.base}/health", timeout=10).json()["backends"] == {names[0]: "up"}
        assert [complete(proc.base, {"prompt": [1, 2, 3]})["by"] for _ in range(4)] == ["a"] * 4
    finally:
        index.forget_engine(names[1])
        proc.stop()
        client.close()


def test_models_and_round_robin(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    proc = gateway(redis_server, engines, names, "--policy", "round-robin").start()
    try:
        models = httpx.get(f"{proc.base}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny"
        served = [complete(proc.base, {"prompt": [3, 4, 5]})["by"] for _ in range(6)]
        assert sorted(served) == ["a"] * 3 + ["b"] * 3
        assert served[0] != served[1]
    finally:
        proc.stop()
