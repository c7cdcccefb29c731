"""Requests in flight counted as cached where they were sent (``pcr.gateway.pending``),
through ``pcr gateway`` in front of two fake engines that publish no events and a real
redis-server: a request held open at one engine draws the next request sharing its
prefix there (balanced apart with ``--pending-ttl 0``), a failure stops it counting at
once, the engine's blocks listed in the registry confirm it, and a second replica counts
the first one's request as its own."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from registry import PrefixCacheRegistry, block_hashes
from tests.support.fake_engine import FakeEngine, engine_pair, gateway_args, tagged_names
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")

BLOCK = 4
FIRST = list(range(10, 50))  # 40 tokens: 10 blocks
NEXT = [*FIRST, 7, 7, 7, 7, 7, 7, 7, 7]  # the next turn: FIRST and 8 tokens more


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    with engine_pair() as made:
        yield made


@pytest.fixture
def names() -> list[str]:
    return tagged_names("gp")


def gateway(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], *extra: str
) -> ServeProcess:
    args = [*gateway_args(redis_server.url, engines, names, BLOCK), "--no-announced"]
    return ServeProcess(*args, *extra, path="/health", command="gateway")


class Held:
    """Requests sent in threads while every engine holds its replies."""

    def __init__(self, engines: list[FakeEngine]) -> None:
        self.engines = engines
        self.threads: list[threading.Thread] = []
        self.replies: list[httpx.Response] = []
        for engine in engines:
            engine.release.clear()

    def send(self, base: str, prompt: list[int]) -> FakeEngine:
        """Send ``prompt`` and return the engine it arrived at (held there)."""
        before = [len(e.received) for e in self.engines]

        def post() -> None:
            body = {"model": "tiny", "prompt": prompt}
            self.replies.append(httpx.post(f"{base}/v1/completions", json=body, timeout=120))

        thread = threading.Thread(target=post)
        thread.start()
        self.threads.append(thread)
        arrived = lambda: [  # noqa: E731
            e for e, n in zip(self.engines, before, strict=True) if len(e.received) > n
        ]
        wait_until(lambda: bool(arrived()), 60, "the request at an engine")
        return arrived()[0]

    def release(self) -> None:
        for engine in self.engines:
            engine.release.set()
        for thread in self.threads:
            thread.join(120)


def health(base: str) -> dict[str, Any]:
    reply: dict[str, Any] = httpx.get(f"{base}/health", timeout=30).json()
    return reply


@pytest.mark.parametrize("pending", [True, False], ids=["pending", "pending-off"])
def test_a_request_in_flight_draws_the_next_sharing_its_prefix_to_its_engine(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], pending: bool
) -> None:
    """Nothing is cached anywhere; the first request is held open at its engine. The
    next turn of its conversation goes to the same engine only because the first one's
    blocks count as arriving there: with ``--pending-ttl 0`` the first one's load sends
    it to the idle engine."""
    extra = [] if pending else ["--pending-ttl", "0"]
    proc = gateway(redis_server, engines, names, *extra).start()
    held = Held(engines)
    try:
        first = held.send(proc.base, FIRST)
        where = names[engines.index(first)]
        if pending:
            assert health(proc.base)["pending"][where]["blocks"] == 10
        else:
            assert "pending" not in health(proc.base)
        second = held.send(proc.base, NEXT)
        assert (second is first) is pending
        changed = metric(proc.base, "pcr_gateway_pending_decisions_total")
        assert changed == (1 if pending else 0)
        if pending:
            blocks = metric(proc.base, "pcr_gateway_pending_blocks", backend=where)
            assert blocks == 12  # NEXT's two blocks more
    finally:
        held.release()
        proc.stop()
    assert [r.status_code for r in held.replies] == [200, 200]


def test_a_failed_request_stops_counting_at_once_a_success_after_the_grace(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """The engine answers 500: the request's blocks no longer count when its reply
    reaches the client. A success's still count (a grace of 10 minutes here: the engines
    publish no events, nothing confirms them)."""
    proc = gateway(redis_server, engines, names, "--pending-grace", "600").start()
    try:
        for engine in engines:
            engine.status = 500
        reply = httpx.post(
            f"{proc.base}/v1/completions", json={"model": "tiny", "prompt": FIRST}, timeout=60
        )
        assert reply.status_code == 500
        assert {v["blocks"] for v in health(proc.base)["pending"].values()} == {0}
        for engine in engines:
            engine.status = 200
        reply = httpx.post(
            f"{proc.base}/v1/completions", json={"model": "tiny", "prompt": FIRST}, timeout=60
        )
        assert reply.status_code == 200
        where = names[["a", "b"].index(reply.json()["by"])]
        assert health(proc.base)["pending"][where]["blocks"] == 10
    finally:
        proc.stop()


def test_blocks_the_registry_lists_where_they_were_sent_stop_counting(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """The request is held open at its engine; the engine's blocks then appear in its
    namespace (as ``pcr bridge`` writes them): the gateway's fleet view lists them and
    they no longer count as pending, while the next request still goes there (now by
    the registry's prefix)."""
    client = redis_server.client()
    owners = {name: PrefixCacheRegistry(client, name) for name in names}
    for registry in owners.values():
        registry.claim(120)
    proc = gateway(redis_server, engines, names).start()
    held = Held(engines)
    try:
        first = held.send(proc.base, FIRST)
        where = names[engines.index(first)]
        assert health(proc.base)["pending"][where]["blocks"] == 10
        hashes = block_hashes(FIRST, BLOCK)
        owners[where].register_kv(list(range(len(hashes))), hashes)
        confirmed: Callable[[], bool] = lambda: (  # noqa: E731
            health(proc.base)["pending"][where]["blocks"] == 0
        )
        wait_until(confirmed, 60, "the view confirming the pending blocks")
        assert held.send(proc.base, NEXT) is first
    finally:
        held.release()
        proc.stop()
        client.close()


def test_a_replica_counts_another_replicas_request_in_flight_as_cached_there(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """A request held open through replica one; replica two hears of it with the load
    (its chain of hashes), and sends the next turn to the same engine."""
    from pcr.gateway.config import GatewayConfig
    from tests.system.test_serve import Served

    prefix = f"gq{uuid.uuid4().hex[:6]}"
    backends = dict(zip(names, (e.url for e in engines), strict=True))
    replicas = [
        Served(
            redis_server.url,
            prefix,
            gateway=GatewayConfig(backends=backends, block_size=BLOCK, replica_id=rid),
        )
        for rid in ("one", "two")
    ]
    one, two = replicas
    held = Held(engines)
    threads: list[threading.Thread] = []
    try:
        sent = threading.Thread(
            target=one.http.post,
            args=("/v1/completions",),
            kwargs={"json": {"model": "tiny", "prompt": FIRST}, "timeout": 120},
        )
        sent.start()
        threads.append(sent)
        wait_until(lambda: any(e.in_flight for e in engines), 60, "the request at an engine")
        first = next(e for e in engines if e.in_flight)
        where = names[engines.index(first)]

        def heard() -> bool:
            state = two.http.get("/health").json()
            told = state["pending"][where]["other_replicas_chains"]
            return bool(told == 1 and state["in_flight"][where]["other_replicas"] == 1)

        wait_until(heard, 60, "replica two hearing of replica one's request")
        second = threading.Thread(
            target=two.http.post,
            args=("/v1/completions",),
            kwargs={"json": {"model": "tiny", "prompt": NEXT}, "timeout": 120},
        )
        second.start()
        threads.append(second)
        wait_until(lambda: sum(e.in_flight for e in engines) == 2, 60, "both requests held")
        assert first.in_flight == 2
    finally:
        held.release()
        for thread in threads:
            thread.join(120)
        for served in replicas:
            served.close()


def test_the_view_exports_what_it_holds_of_each_backend(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """``pcr_gateway_view_entries`` follows each backend's maps as they are written and
    evicted (what ``info()`` counts in Redis), ``pcr_gateway_view_events_total`` counts
    the records applied, and ``pcr_gateway_view_age_seconds`` stays under the staleness
    limit while Redis answers."""
    client = redis_server.client()
    owners = {name: PrefixCacheRegistry(client, name) for name in names}
    for registry in owners.values():
        registry.claim(120)
    first, second = names
    proc = gateway(redis_server, engines, names).start()
    try:
        entries = lambda name, kind: metric(  # noqa: E731
            proc.base, "pcr_gateway_view_entries", backend=name, map=kind
        )
        records = metric(proc.base, "pcr_gateway_view_events_total", event="records")
        hashes = block_hashes(FIRST, BLOCK)
        owners[first].register_kv(list(range(len(hashes))), hashes)
        owners[second].register_kv([0, 1], hashes[:2])
        owners[second].register_mamba([5], hashes[1:2])
        wanted = {(first, "kv"): 10, (first, "mamba"): 0, (second, "kv"): 2, (second, "mamba"): 1}
        counted = lambda: {key: entries(*key) for key in wanted}  # noqa: E731
        wait_until(lambda: counted() == wanted, 60, "the view's entries exported")
        owners[first].evict_kv(hashes[6:])
        wanted[first, "kv"] = 6
        wait_until(lambda: counted() == wanted, 60, "the eviction exported")
        for name, registry in owners.items():
            info = registry.info()
            assert (info.kv_entries, info.mamba_entries) == (
                wanted[name, "kv"],
                wanted[name, "mamba"],
            )
        assert metric(proc.base, "pcr_gateway_view_events_total", event="records") >= records + 4
        assert 0 <= metric(proc.base, "pcr_gateway_view_age_seconds") < 3
    finally:
        proc.stop()
        client.close()
