"""Redis SIGKILLed and started again, empty, on the same port, under load: a real
redis-server, two engines (fake HTTP engines, each with a KV-event publisher that
stores the blocks of every prompt it was sent, as an engine does), one ``Bridge``
following both with their URLs (``--engine-url``), and a ``pcr gateway`` process that
knows its backends only from those announcements. No request may fail, and routing by
prefix must come back: the bridge writes what each engine holds again and announces it
again; the gateway keeps the backends it was routing to meanwhile.

Also: a gateway keeps a backend whose announcement vanished while Redis holds no lease
for it, says so in ``/health``, and drops it once its lease has run out."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, block_hashes
from tests.support.fake_engine import FakeEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")
zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from registry.bridge.bridge import Bridge, EngineSource  # noqa: E402  (the bridge extra)
from sim.engine_events import EnginePublisher, engine_chain, stored  # noqa: E402

BS = 4
SYSTEM_BLOCKS = 4
STREAMS = 4
WAIT = 60.0  # generous: a loaded machine may be slow, never wrong
PREFIX_TARGET = 10.0  # the target: prefix decisions again within 10 s


class Engine:
    """One engine: a fake HTTP engine and its KV-event publisher. ``served`` stores a
    prompt's blocks the engine does not hold yet, continuing from those it holds (its
    system prompt is stored once, and never again while it stays cached)."""

    def __init__(self, name: str) -> None:
        self.http = FakeEngine(name).start()
        self.events = EnginePublisher()
        self.events.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.held: set[int] = set()
        self.lock = threading.Lock()

    def served(self, tokens: list[int]) -> None:
        hashes = engine_chain(tokens, BS)
        with self.lock:
            first = 0
            while first < len(hashes) and hashes[first] in self.held:
                first += 1
            if first == len(hashes):
                return
            parent = hashes[first - 1] if first else None
            event = stored(hashes[first:], parent, tokens[first * BS :], BS)
            self.events.publish([event])
            self.held.update(hashes[first:])

    def close(self) -> None:
        self.http.stop()
        self.events.close()


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def two_engines() -> Iterator[list[Engine]]:
    made = [Engine("a"), Engine("b")]
    try:
        yield made
    finally:
        for engine in made:
            engine.close()


def prefix_decisions(base: str) -> float:
    return metric(base, "pcr_gateway_routing_decisions_total", outcome="prefix")


def system_prompt(seed: int) -> list[int]:
    return [1000 * seed + i for i in range(SYSTEM_BLOCKS * BS)]


class Load:
    """``STREAMS`` client threads sending prompts (one of two system prompts, then two
    blocks of their own) through the gateway; each engine that answers stores the
    prompt's blocks. Every failure (a status other than 200, an error) is kept."""

    def __init__(self, base: str, engines: dict[str, Engine], systems: list[list[int]]) -> None:
        self.base = base
        self.engines = engines
        self.systems = systems
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.failures: list[str] = []
        self.threads = [
            threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(STREAMS)
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(WAIT)

    def _stream(self, stream: int) -> None:
        n = 0
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                n += 1
                system = self.systems[n % len(self.systems)]
                own = [(stream * 7919 + n * 31 + i) % 50_000 + 100_000 for i in range(2 * BS)]
                tokens = system + own
                try:
                    reply = client.post(
                        f"{self.base}/v1/completions", json={"model": "tiny", "prompt": tokens}
                    )
                except httpx.HTTPError as exc:
                    self._failed(f"{type(exc).__name__}: {exc}")
                    continue
                if reply.status_code != 200:
                    self._failed(f"{reply.status_code}: {reply.text[:200]}")
                    continue
                self.engines[reply.json()["by"]].served(tokens)
                with self.lock:
                    self.sent += 1

    def _failed(self, what: str) -> None:
        with self.lock:
            self.sent += 1
            self.failures.append(what)


def test_redis_restarted_empty_under_load_fails_no_request_and_prefix_routing_returns(
    own_server: RedisServer, two_engines: list[Engine], tag: str
) -> None:
    names = [f"rr-a-{tag}", f"rr-b-{tag}"]
    client = redis.Redis(
        host=own_server.host, port=own_server.port, socket_timeout=1, socket_connect_timeout=1
    )
    sources = [
        EngineSource(
            name, e.events.endpoint, e.events.replay_endpoint, block_size=BS, engine_url=e.http.url
        )
        for name, e in zip(names, two_engines, strict=True)
    ]
    bridge = Bridge(client, sources, lease_ttl=3.0)
    bridge.start()
    proc = None
    try:
        assert bridge.wait_ready(WAIT), bridge.error
        for engine in two_engines:
            engine.events.wait_subscribed(WAIT)
        # Each engine holds one system prompt, stored before the restart only.
        systems = [system_prompt(1), system_prompt(2)]
        for engine, system in zip(two_engines, systems, strict=True):
            engine.served(system)
        wanted = {n: block_hashes(s, BS)[-1] for n, s in zip(names, systems, strict=True)}

        def listed() -> bool:
            return all(h in PrefixCacheRegistry(client, n).entries()[0] for n, h in wanted.items())

        wait_until(listed, WAIT, "both system prompts in the registry")
        proc = ServeProcess(
            "--redis-url", own_server.url, "--block-size", str(BS),
            path="/health", command="gateway",
        ).start()  # fmt: skip
        base = proc.base
        wait_until(
            lambda: len(httpx.get(f"{base}/health", timeout=10).json()["backends"]) == 2,
            WAIT,
            "both announced engines as backends",
        )
        by_name = {"a": two_engines[0], "b": two_engines[1]}
        with Load(base, by_name, systems) as load:
            wait_until(lambda: prefix_decisions(base) >= 20, WAIT, "prefix decisions")
            sent_before = load.sent
            own_server.kill()  # SIGKILL: no save (the server has no persistence anyway)
            time.sleep(0.5)  # requests go on while Redis is away (routed by load)
            own_server.restart()
            restarted = time.monotonic()
            decisions = prefix_decisions(base)

            def routing_by_prefix() -> bool:
                return prefix_decisions(base) > decisions

            wait_until(routing_by_prefix, WAIT, "prefix decisions after the restart")
            to_prefix = time.monotonic() - restarted
            wait_until(listed, WAIT, "the system prompts in the registry again")
            to_registry = time.monotonic() - restarted
            # Routing by prefix stays: later requests too.
            decisions = prefix_decisions(base)
            wait_until(lambda: prefix_decisions(base) >= decisions + 20, WAIT, "more decisions")
            sent_after = load.sent - sent_before
        health = httpx.get(f"{base}/health", timeout=10).json()
        print(
            f"redis restart: first prefix decision after {to_prefix:.2f} s, "
            f"registry holding both system prompts after {to_registry:.2f} s; "
            f"{sent_after} requests after the kill"
        )
        assert load.failures == [], load.failures[:5]
        assert sent_after > 0
        assert sorted(health["backends"]) == sorted(names)
        assert health["registry"] == "reachable"
        assert to_prefix < PREFIX_TARGET * 3, to_prefix  # the target is 10 s; see the report
        counts = bridge.counts()
        for name in names:
            assert counts[name]["rewrites"] >= 1, counts[name]
            assert counts[name]["orphans"] == 0, counts[name]
        assert NodeIndex(client).engines() == {
            n: e.http.url for n, e in zip(names, two_engines, strict=True)
        }
    finally:
        if proc is not None:
            proc.stop()
        bridge.stop()
        client.close()


def test_a_backend_whose_announcement_vanished_is_kept_until_its_lease_runs_out(
    redis_server: RedisServer, tag: str
) -> None:
    engine = FakeEngine("a").start()
    name = f"rk-{tag}"
    client = redis_server.client()
    index = NodeIndex(client)
    index.announce_engine(name, engine.url)
    proc = ServeProcess(
        "--redis-url", redis_server.url, "--block-size", str(BS),
        path="/health", command="gateway",
    ).start()  # fmt: skip
    try:

        def health() -> dict[str, Any]:
            body: dict[str, Any] = httpx.get(f"{proc.base}/health", timeout=10).json()
            return body

        wait_until(lambda: health()["backends"] == {name: "up"}, WAIT, "the announced engine")
        index.forget_engine(name)  # Redis holds nothing of it now: it stays
        wait_until(lambda: name in health()["kept"], WAIT, "the backend kept")
        body = health()
        assert body["backends"] == {name: "up"}
        assert body["status"] == "ok"
        assert "announcement gone since" in body["kept"][name]
        reply = httpx.post(f"{proc.base}/v1/completions", json={"prompt": [1, 2]}, timeout=30)
        assert reply.status_code == 200
        assert reply.json()["by"] == "a"
        index.announce_engine(name, engine.url)  # announced again: no longer "kept"
        wait_until(lambda: health()["kept"] == {}, WAIT, "announced again")
        index.forget_engine(name)
        wait_until(lambda: name in health()["kept"], WAIT, "kept again")
        registry = PrefixCacheRegistry(client, name)
        registry.claim(lease_ttl=0.05)  # a lease, which then runs out
        wait_until(lambda: name in index.dead(), WAIT, "the lease to run out")
        wait_until(lambda: health()["backends"] == {}, WAIT, "the backend dropped")
        assert health()["kept"] == {}
    finally:
        index.forget_engine(name)
        client.delete(index.key)
        proc.stop()
        engine.stop()
        client.close()
