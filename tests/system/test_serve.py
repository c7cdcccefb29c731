"""``pcr serve`` and ``AsyncPrefixRouter``: the HTTP scoring service on a real
redis-server, served by uvicorn in a thread on a free port and called with httpx.

Scores must equal ``PrefixRouter``'s for the same data (the two routers share their
rules); bad bodies are 422 JSON, never a traceback; a Redis outage is 503 until the
server is back, and only then: more requests at once than the service has connections
wait their turn. ``/metrics`` counts every score by outcome, and ``/openapi.json``
states what the server checks. Every wait polls a condition (``wait_until``), never a
fixed sleep. (Error shapes and slow clients: ``test_serve_http_edges.py``; the schema
fuzzed by Schemathesis: ``test_serve_schemathesis.py``.)"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

from pcr.bench.servers import RedisClusterServers, RedisServer  # noqa: E402
from pcr.serve.app import create_app  # noqa: E402
from pcr.serve.schema import MAX_HASHES, MAX_TOKENS  # noqa: E402
from pcr.web.server import uvicorn_config  # noqa: E402
from registry import PrefixCacheRegistry, PrefixRouter  # noqa: E402
from registry.core.hashing import block_hashes  # noqa: E402
from registry.core.keys import MAX_NAME_LENGTH, validate_namespace  # noqa: E402
from registry.routing.aio_routing import AsyncPrefixRouter  # noqa: E402
from registry.transport.client import async_client_from_url  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.servers import free_port  # noqa: E402
from tests.support.serving import ServeProcess  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

TOKENS = list(range(1000, 1000 + 16 * 12))
H = block_hashes(TOKENS, 16)  # 12 blocks


class Served:
    """The app of ``create_app`` on uvicorn in a thread, on a free loopback port, run as
    ``pcr serve`` runs it (``uvicorn_config``: its protocol deadlines). ``options`` are
    ``create_app``'s (``max_connections``, ``pool_timeout``, ``view``; with ``gateway``, a
    ``GatewayConfig``, ``create_gateway_app``'s) and ``uvicorn_config``'s
    (``header_timeout``, ``body_timeout``, ``keep_alive_timeout``)."""

    def __init__(
        self, url: str, key_prefix: str, *, hybrid: bool | None = None, **options: Any
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        app_options = {
            k: options.pop(k)
            for k in ("max_connections", "pool_timeout", "gateway", "view")
            if k in options
        }
        gateway = app_options.pop("gateway", None)
        if gateway is None:
            self.app = create_app(url, key_prefix=key_prefix, hybrid=hybrid, **app_options)
        else:
            from pcr.gateway.service import create_gateway_app

            self.app = create_gateway_app(
                gateway, url, key_prefix=key_prefix, hybrid=hybrid, **app_options
            )
        config = uvicorn_config(
            self.app, host="127.0.0.1", port=self.port, log_level="error", **options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn")
        assert self.server.started, "uvicorn did not start"
        self.http = httpx.Client(base_url=self.base, timeout=30)

    def score(self, body: dict[str, Any]) -> httpx.Response:
        return self.http.post("/v1/score", json=body)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)


def fill(client: Any, prefix: str) -> dict[str, PrefixCacheRegistry]:
    """Four live nodes holding different prefixes of ``H``, with Mamba checkpoints."""
    nodes = {}
    for name, kv, mamba in (
        ("node-a", 12, [3, 7, 11]),
        ("node-b", 9, [8]),
        ("node-c", 5, []),
        ("node-d", 0, []),
    ):
        reg = PrefixCacheRegistry(client, name, key_prefix=prefix)
        reg.claim(lease_ttl=300)
        if kv:
            reg.register_kv(range(kv), H[:kv])
        if mamba:
            reg.register_mamba(mamba, [H[i] for i in mamba])
        nodes[name] = reg
    return nodes


def as_dict(scores: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    return {n: (s.kv_prefix, s.mamba_prefix, s.usable) for n, s in scores.items()}


def from_reply(reply: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    return {n: (s["kv_prefix"], s["mamba_prefix"], s["usable"]) for n, s in reply["nodes"].items()}


@pytest.fixture
def prefix() -> str:
    return f"sv{uuid.uuid4().hex[:8]}"


@pytest.fixture
def service(redis_server: RedisServer, prefix: str) -> Iterator[Served]:
    served = Served(redis_server.url, prefix)
    yield served
    served.close()


def test_score_equals_the_sync_router(
    redis_server: RedisServer, service: Served, prefix: str
) -> None:
    client = redis_server.client()
    fill(client, prefix)
    router = PrefixRouter(client, prefix)
    whole = service.score({"block_hashes": H}).json()["nodes"]
    # Each ranked by what its engine reuses: node-c never held Mamba state (KV only).
    assert {n: s["usable"] for n, s in whole.items()} == {
        "node-a": 12, "node-b": 9, "node-c": 5, "node-d": 0
    }  # fmt: skip
    hybrid = Served(redis_server.url, prefix, hybrid=True)
    try:
        assert hybrid.score({"block_hashes": H}).json()["nodes"]["node-c"]["usable"] == 0
    finally:
        hybrid.close()
    for prompt in (H, H[:6], H[:1], [], [*H[:4], -1, *H[5:]]):
        reply = service.score({"block_hashes": prompt})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert from_reply(body) == as_dict(router.score(prompt))
        assert body["best"] == router.best(prompt)
    assert service.score({"block_hashes": H}).json()["blocks"] == 12
    # tokens hashed by the service, as block_hashes would
    by_tokens = service.score({"token_ids": TOKENS, "block_size": 16}).json()
    assert from_reply(by_tokens) == as_dict(router.score(H))
    big = [*TOKENS, *range(20_000)]  # hashed in a worker thread
    by_big = service.score({"token_ids": big, "block_size": 16}).json()
    assert by_big["blocks"] == len(big) // 16
    assert from_reply(by_big) == as_dict(router.score(block_hashes(big, 16)))
    salted = service.score({"token_ids": TOKENS, "block_size": 16, "salt": "s"}).json()
    assert {s["kv_prefix"] for s in salted["nodes"].values()} == {0}
    # a chosen set of namespaces, and load breaking ties
    some = service.score({"block_hashes": H[:5], "namespaces": ["node-b", "node-c"]}).json()
    assert set(some["nodes"]) == {"node-b", "node-c"}
    for load in ({"node-b": 2.0, "node-c": 1.0}, {"node-b": 0.5, "node-c": 1.0}):
        body = {"block_hashes": H[:5], "namespaces": ["node-b", "node-c"], "load": load}
        expected = router.best(H[:5], load=load, namespaces=["node-b", "node-c"])
        assert service.score(body).json()["best"] == expected
    client.close()


def test_a_service_with_a_fleet_view_scores_as_the_sync_router(
    own_server: RedisServer, prefix: str
) -> None:
    """``pcr serve --view``: once the view has applied the writes, every score equals
    the sync router's; a write after it reaches the scores; Redis killed: the view
    stops following and the scores are 503 as without it; Redis back: 200 again."""
    client = own_server.client()
    nodes = fill(client, prefix)
    router = PrefixRouter(client, prefix)
    served = Served(own_server.url, prefix, view=True)
    try:
        view = served.app.state.registry.view
        assert view is not None
        wait_until(view.ready.is_set, what="the view loaded")
        view.sync()
        for prompt in (H, H[:6], H[:1], [], [*H[:4], -1, *H[5:]]):
            body = served.score({"block_hashes": prompt}).json()
            assert from_reply(body) == as_dict(router.score(prompt))
            assert body["best"] == router.best(prompt)
        nodes["node-d"].register_kv(range(12), H)  # now level with node-a
        view.sync()
        body = served.score({"block_hashes": H, "load": {"node-a": 3}}).json()
        assert body["nodes"]["node-d"]["kv_prefix"] == 12
        assert body["best"] == "node-d"
        assert view.counts.records >= 1
        own_server.kill()
        wait_until(lambda: not view.fresh(), what="the view to stop following")
        reply = served.score({"block_hashes": H})
        assert reply.status_code == 503, reply.text
        own_server.restart()
        fill(client, prefix)
        wait_until(lambda: view.fresh(), what="the view to follow again")
        view.sync()
        assert from_reply(served.score({"block_hashes": H}).json()) == as_dict(router.score(H))
    finally:
        served.close()
        client.close()


def test_no_hybrid_service_ranks_by_kv(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    fill(client, prefix)
    served = Served(redis_server.url, prefix, hybrid=False)
    try:
        body = served.score({"block_hashes": H}).json()
        assert from_reply(body) == as_dict(PrefixRouter(client, prefix, hybrid=False).score(H))
        assert body["nodes"]["node-b"]["usable"] == 9
    finally:
        served.close()
        client.close()


def test_nodes_health_live_metrics_and_docs(
    redis_server: RedisServer, service: Served, prefix: str
) -> None:
    client = redis_server.client()
    fill(client, prefix)
    nodes = service.http.get("/v1/nodes").json()["nodes"]
    assert [n["namespace"] for n in nodes] == ["node-a", "node-b", "node-c", "node-d"]
    assert [(n["kv_entries"], n["mamba_entries"]) for n in nodes] == [
        (12, 3),
        (9, 1),
        (5, 0),
        (0, 0),
    ]
    assert all(0 < n["lease_left_s"] <= 300 for n in nodes)
    assert service.http.get("/live").json() == {"status": "alive"}
    health = service.http.get("/health")
    assert health.status_code == 200
    assert health.json()["scripts"] == "loaded"
    client.script_flush()  # scripts gone: /health loads them again
    assert service.http.get("/health").status_code == 200
    assert service.score({"block_hashes": H}).status_code == 200  # and calls reload them
    metrics = service.http.get("/metrics")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        assert metrics.status_code == 404
        assert metrics.json()["error"] == "not available"
    else:
        assert metrics.status_code == 200
        assert "# TYPE" in metrics.text
    spec = service.http.get("/openapi.json").json()
    assert {"/v1/score", "/v1/nodes", "/health", "/live", "/metrics"} <= set(spec["paths"])
    assert service.http.get("/docs").status_code == 200
    client.close()


BAD_BODIES = [
    {"block_hashes": "1,2"},  # wrong type
    {"block_hashes": [1, "2"]},  # a string hash
    {"block_hashes": [1, 2.5]},
    {"block_hashes": [True]},
    {"block_hashes": [1], "extra": 1},  # unknown field
    {},  # neither
    {"block_hashes": [1], "token_ids": [1], "block_size": 1},  # both
    {"token_ids": [1, 2]},  # no block size
    {"block_hashes": [1], "block_size": 16},
    {"token_ids": [1], "block_size": 0},
    {"block_hashes": [2**63]},  # out of range
    {"block_hashes": [-2]},
    {"token_ids": [2**63], "block_size": 1},
    {"block_hashes": [1], "namespaces": ["bad namespace"]},
    {"block_hashes": [1], "namespaces": "node-a"},
    {"block_hashes": [1], "load": {"node-a": "high"}},
    {"block_hashes": [1], "load": {"bad namespace": 1.0}},
    {"block_hashes": list(range(1, MAX_HASHES + 2))},  # over the limits
    {"token_ids": [0] * (MAX_TOKENS + 1), "block_size": 16},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_are_422_json(service: Served, body: dict[str, Any]) -> None:
    reply = service.score(body)
    assert reply.status_code == 422, reply.text
    error = reply.json()
    assert error["error"] == "invalid request"
    assert len(reply.content) < 4096  # the input is not echoed back
    assert "Traceback" not in reply.text


def test_malformed_json_and_huge_bodies(service: Served) -> None:
    bad = service.http.post(
        "/v1/score", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 422
    assert bad.json()["error"] == "invalid request"
    huge = service.http.post(
        "/v1/score", content=b" " * (33 << 20), headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413
    assert huge.json()["error"] == "request too large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * (1 << 20)

    chunked = service.http.post(
        "/v1/score", content=chunks(), headers={"content-type": "application/json"}
    )
    assert chunked.status_code == 413
    assert service.http.get("/v1/nope").status_code == 404


def test_redis_down_is_503_then_200_when_back(own_server: RedisServer, prefix: str) -> None:
    client = own_server.client()
    fill(client, prefix)
    served = Served(own_server.url, prefix)
    try:
        assert served.score({"block_hashes": H}).json()["best"] == "node-a"
        own_server.kill()
        for reply in (
            served.score({"block_hashes": H, "namespaces": ["node-a"]}),
            served.http.get("/v1/nodes"),
            served.http.get("/health"),
        ):
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"] in ("unavailable", "unhealthy")
            assert "Redis unavailable" in reply.json()["detail"]
        assert served.http.get("/live").status_code == 200
        own_server.restart()  # empty: scripts and nodes gone
        wait_until(lambda: served.http.get("/health").status_code == 200, what="healthy again")
        fill(client, prefix)
        body = served.score({"block_hashes": H, "namespaces": ["node-a"]}).json()
        assert body["nodes"]["node-a"]["kv_prefix"] == 12
    finally:
        served.close()
        client.close()


# -- many requests at once: the connection pool is bounded and waited for ----------------


async def _burst(base: str, count: int, body: dict[str, Any]) -> collections.Counter[Any]:
    """``count`` requests at once, each on its own connection (every tenth a ``/health``):
    the (path, status, error kind) of each reply, counted."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:

        async def one(i: int) -> tuple[str, int, str | None]:
            if i % 10 == 0:
                reply = await client.get("/health")
            else:
                reply = await client.post("/v1/score", json=body)
            kind = reply.json().get("error") if reply.status_code != 200 else None
            return reply.request.url.path, reply.status_code, kind

        return collections.Counter(await asyncio.gather(*(one(i) for i in range(count))))


def test_250_requests_at_once_get_no_503(redis_server: RedisServer, prefix: str) -> None:
    """More requests in flight than redis-py's default pool of 100 connections: each
    waits its turn for one of the service's connections, none is refused, and /health
    stays 200 among them."""
    client = redis_server.client()
    fill(client, prefix)
    # The default --max-connections (64); a turn's deadline past what a busy machine
    # (CI beside two CPU burners) can take to serve 250 requests: no timing margin.
    served = Served(redis_server.url, prefix, pool_timeout=120.0)
    try:
        counts = asyncio.run(_burst(served.base, 250, {"block_hashes": H}))
        assert counts == {("/health", 200, None): 25, ("/v1/score", 200, None): 225}, counts
    finally:
        served.close()
        client.close()


def test_the_pool_is_bounded_and_503_comes_only_while_redis_is_away(
    own_server: RedisServer, prefix: str
) -> None:
    client = own_server.client()
    fill(client, prefix)
    # 120 requests through 2 connections: a turn's deadline past what a busy machine can
    # take (the 503 past the deadline has its own test below); Redis away is 503 at once.
    served = Served(own_server.url, prefix, max_connections=2, pool_timeout=120.0)
    try:
        counts = asyncio.run(_burst(served.base, 120, {"block_hashes": H}))
        assert counts == {("/health", 200, None): 12, ("/v1/score", 200, None): 108}, counts
        # A pool keeps what it opened: the service never held more than its 2 connections.
        service_connections = len(client.client_list()) - 1  # this test's own connection
        assert 1 <= service_connections <= 2
        own_server.kill()
        down = asyncio.run(_burst(served.base, 60, {"block_hashes": H}))
        assert sum(down.values()) == 60
        assert {(path, status) for path, status, _kind in down} <= {
            ("/health", 503),
            ("/v1/score", 503),
        }, down
        assert {kind for _path, _status, kind in down} <= {"unavailable", "unhealthy"}
        own_server.restart()
        wait_until(lambda: served.http.get("/health").status_code == 200, what="healthy again")
        fill(client, prefix)
        again = asyncio.run(_burst(served.base, 60, {"block_hashes": H}))
        assert again == {("/health", 200, None): 6, ("/v1/score", 200, None): 54}, again
    finally:
        served.close()
        client.close()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"max_connections": 0}, ValueError),
        ({"max_connections": True}, TypeError),
        ({"max_connections": 2.0}, TypeError),
        ({"pool_timeout": 0}, ValueError),
        ({"pool_timeout": float("inf")}, ValueError),
    ],
)
def test_create_app_checks_its_limits(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match=r"max_connections|pool_timeout"):
        create_app("redis://127.0.0.1:1/0", **options)


def test_a_request_waits_its_turn_and_gets_503_only_past_the_deadline() -> None:
    from pcr.serve.state import Gate
    from registry.core.errors import RegistryUnavailable

    async def scenario(gate: Gate, release_while_waiting: bool) -> None:
        holding, release = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            async with gate.turn():
                holding.set()
                await release.wait()

        async def take() -> None:
            async with gate.turn():
                pass

        holder = asyncio.create_task(hold())
        await holding.wait()
        waiter = asyncio.create_task(take())
        if release_while_waiting:
            await asyncio.sleep(0)  # the waiter is queued for the one turn now
            release.set()
            await waiter  # its turn came: no error
        else:
            with pytest.raises(
                RegistryUnavailable, match=r"no free Redis connection within 0\.2 s"
            ):
                await waiter  # the turn never came within its deadline
            release.set()
        await holder

    asyncio.run(scenario(Gate(1, 60.0), release_while_waiting=True))
    asyncio.run(scenario(Gate(1, 0.2), release_while_waiting=False))


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_the_service_counts_every_score_by_outcome(own_server: RedisServer, prefix: str) -> None:
    """``/metrics`` of the service shows each score as ``pcr_operations_total`` with the
    sync router's labels: ``ok`` while Redis answers, ``unavailable`` while it is away."""
    pytest.importorskip("prometheus_client")
    from registry import metrics

    client = own_server.client()
    fill(client, prefix)
    served = Served(own_server.url, prefix)
    metrics.enable_metrics()  # on the default registry, the one /metrics serves
    try:
        good, failed = 7, 5
        for _ in range(good):
            assert served.score({"block_hashes": H}).status_code == 200
        own_server.kill()
        for _ in range(failed):
            assert served.score({"block_hashes": H}).status_code == 503
        scores = {
            dict(labels)["outcome"]: value
            for labels, value in _samples(
                served.http.get("/metrics").text, "pcr_operations_total"
            ).items()
            if dict(labels)["operation"] == "score"
        }
        assert scores == {"ok": good, "unavailable": failed}
        timed = _samples(served.http.get("/metrics").text, "pcr_operation_duration_seconds_count")
        assert timed[(("operation", "score"), ("outcome", "ok"))] == good
        assert timed[(("operation", "score"), ("outcome", "unavailable"))] == failed
    finally:
        metrics.disable_metrics()
        served.close()
        client.close()


def test_the_services_fleet_view_is_on_its_metrics(own_server: RedisServer, prefix: str) -> None:
    """``pcr serve --view`` with the metrics on reports its view (``pcr_view_*``: the
    records applied, the KV hashes held, its age) and stops when the app closes."""
    pytest.importorskip("prometheus_client")
    from registry import metrics

    client = own_server.client()
    nodes = fill(client, prefix)
    metrics.enable_metrics()  # before the app starts: its view is registered then
    served = Served(own_server.url, prefix, view=True)
    try:
        view = served.app.state.registry.view
        assert view is not None
        wait_until(view.ready.is_set, what="the view loaded")
        nodes["node-d"].register_kv(range(12), H)
        view.sync()
        text = served.http.get("/metrics").text
        assert _samples(text, "pcr_view_records_total")[()] == view.counts.records >= 1
        assert _samples(text, "pcr_view_hashes")[()] == len(view.blocks) == len(H)
        assert 0 <= _samples(text, "pcr_view_age_seconds")[()] < 3
        served.close()
        assert metrics.active is not None
        assert not any(f.name.startswith("pcr_view") for f in metrics.active.objects.collect())
    finally:
        served.close()
        metrics.disable_metrics()
        client.close()


# -- the OpenAPI schema states what the server checks -------------------------------------


def _schemas(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas(value)


GOOD_BODIES = [
    {"block_hashes": []},
    {"block_hashes": [1, -1, 0, 2**63 - 1]},
    {"token_ids": [], "block_size": 1},
    {"token_ids": [-(2**63), 2**63 - 1], "block_size": 2**20, "salt": ""},
    {"block_hashes": [1], "token_ids": None, "block_size": None, "salt": None},
    {"token_ids": [1], "block_size": 1, "block_hashes": None, "salt": None},
    {"block_hashes": [1], "namespaces": None, "load": None},
    {"block_hashes": [1], "namespaces": [], "load": {}},
    {"block_hashes": [1], "namespaces": ["\u00e9t\u00e9-\U0001f600", "x" * 200], "load": {"n": 1}},
    {"block_hashes": [1.0, 2e3, -1.0], "load": {"n": 2.0}},  # whole numbers are integers
    {"token_ids": [5.0], "block_size": 16.0},
]
MORE_BAD_BODIES = [
    {"block_hashes": None, "token_ids": None},
    {"token_ids": [1], "block_size": None},
    {"block_hashes": [1], "salt": ""},
    {"block_hashes": [1], "load": {"": 1.0}},
    {"block_hashes": [1], "load": {"a}b": 1.0}},
    {"block_hashes": [1], "namespaces": ["x" * 201]},
    {"block_hashes": [1], "namespaces": ["a{b"]},
    {"block_hashes": [1], "namespaces": ["ab\n"]},
    {"block_hashes": [1], "namespaces": ["\u00a0"]},
    {"block_size": 1},
    [],
    {"block_hashes": [1.5]},
    {"block_hashes": [2.0**63]},
    {"token_ids": [1], "block_size": 16.5},
]


def test_openapi_states_what_the_server_checks(service: Served) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    spec = service.http.get("/openapi.json").json()
    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
    integers = [s for s in _schemas(spec) if s.get("type") == "integer"]
    assert len(integers) >= 3
    for schema in integers:  # exact integers, never floats (2^63 - 1 is no double)
        for key in set(bounds) & set(schema):
            assert type(schema[key]) is int, (key, schema)
    request = spec["components"]["schemas"]["ScoreRequest"]
    hashes = request["properties"]["block_hashes"]["anyOf"][0]["items"]
    assert (hashes["minimum"], hashes["maximum"]) == (-1, 2**63 - 1)
    tokens = request["properties"]["token_ids"]["anyOf"][0]["items"]
    assert (tokens["minimum"], tokens["maximum"]) == (-(2**63), 2**63 - 1)
    namespace = request["properties"]["namespaces"]["anyOf"][0]["items"]
    assert request["properties"]["load"]["anyOf"][0]["propertyNames"] == namespace
    assert (namespace["minLength"], namespace["maxLength"]) == (1, MAX_NAME_LENGTH)
    # The schema and the server agree on every body: accepted by both, or by neither.
    validator = jsonschema_rs.validator_for(request)
    for body in [*GOOD_BODIES, *BAD_BODIES, *MORE_BAD_BODIES]:
        reply = service.score(body)  # type: ignore[arg-type]
        assert reply.status_code in (200, 422), reply.text
        assert validator.is_valid(body) == (reply.status_code == 200), (body, reply.text)


def _refused(text: str) -> bool:
    try:
        validate_namespace(text)
    except ValueError:
        return True
    return False


def _code_points() -> list[int]:
    """Every code point of the planes that hold characters (0-3, 14), every 61st of the
    planes that hold none (4-13) or only private use (15, 16); no surrogate (a JSON string
    cannot hold a lone one)."""
    return [
        c
        for c in range(sys.maxunicode + 1)
        if not 0xD800 <= c <= 0xDFFF and (c < 0x40000 or 0xE0000 <= c < 0xF0000 or c % 61 == 0)
    ]


def test_the_namespace_pattern_is_validate_namespace(service: Served) -> None:
    """Character by character, the published pattern, read by a JSON Schema validator,
    accepts exactly what the server's ``validate_namespace`` accepts."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    spec = service.http.get("/openapi.json").json()
    namespace = spec["components"]["schemas"]["ScoreRequest"]["properties"]["namespaces"]
    validator = jsonschema_rs.validator_for(namespace["anyOf"][0]["items"])
    code_points = _code_points()
    by_schema = {c for c in code_points if validator.is_valid(chr(c))}
    assert len(by_schema) > 100_000
    allowed = "".join(map(chr, sorted(by_schema)))
    for start in range(0, len(allowed), MAX_NAME_LENGTH):  # the server takes them all
        validate_namespace(allowed[start : start + MAX_NAME_LENGTH])
    refused_by_schema_only = [
        hex(c) for c in code_points if c not in by_schema and not _refused(chr(c))
    ]
    assert refused_by_schema_only == []
    for text, valid in (("", False), ("a" * 200, True), ("a" * 201, False), ("ab{", False)):
        assert validator.is_valid(text) == valid
        assert _refused(text) != valid


async def _both_scores(
    url: str, prefix: str, prompts: list[list[int]], *, exact: bool = False
) -> list[dict[str, tuple[int, int, int]]]:
    client = async_client_from_url(url)
    try:
        router = AsyncPrefixRouter(client, prefix, exact=exact)
        out = []
        for prompt in prompts:
            out.append(as_dict(await router.score(prompt)))
            out.append({"best": await router.best(prompt, load={"node-c": -1})})  # type: ignore[dict-item]
        return out
    finally:
        await client.aclose()


PROMPTS = [H, H[:8], H[:4], H[:1], []]


def test_async_router_equals_sync_router(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    fill(client, prefix)
    router = PrefixRouter(client, prefix)
    expected = []
    for prompt in PROMPTS:
        expected.append(as_dict(router.score(prompt)))
        expected.append({"best": router.best(prompt, load={"node-c": -1})})
    assert asyncio.run(_both_scores(redis_server.url, prefix, PROMPTS)) == expected
    # The fleet index and the exact per-namespace scripts agree, both ways.
    assert asyncio.run(_both_scores(redis_server.url, prefix, PROMPTS, exact=True)) == expected
    client.close()


def test_async_router_equals_sync_router_on_a_cluster(
    redis_cluster: RedisClusterServers, prefix: str
) -> None:
    client = redis_cluster.client()
    fill(client, prefix)
    router = PrefixRouter(client, prefix)
    expected = []
    for prompt in PROMPTS:
        expected.append(as_dict(router.score(prompt)))
        expected.append({"best": router.best(prompt, load={"node-c": -1})})
    url = redis_cluster.url.replace("redis://", "redis+cluster://")
    assert asyncio.run(_both_scores(url, prefix, PROMPTS)) == expected
    assert asyncio.run(_both_scores(url, prefix, PROMPTS, exact=True)) == expected
    client.script_flush()  # NOSCRIPT on every primary: the async router reloads
    assert asyncio.run(_both_scores(url, prefix, PROMPTS[:1])) == expected[:2]
    served = Served(url, prefix, max_connections=4)  # per node: redis-py refuses the 5th
    try:
        assert from_reply(served.score({"block_hashes": H}).json()) == as_dict(router.score(H))
        assert len(served.http.get("/v1/nodes").json()["nodes"]) == 4
        counts = asyncio.run(_burst(served.base, 100, {"block_hashes": H}))
        assert counts == {("/health", 200, None): 10, ("/v1/score", 200, None): 90}, counts
    finally:
        served.close()
        client.close()


def test_async_router_reports_to_the_metrics(redis_server: RedisServer, prefix: str) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from registry import metrics

    target = prometheus_client.CollectorRegistry()
    metrics.enable_metrics(target)
    try:
        client = redis_server.client()
        fill(client, prefix)
        asyncio.run(_both_scores(redis_server.url, prefix, [H]))  # one score, one best
        client.close()
        assert target.get_sample_value("pcr_router_score_duration_seconds_count") == 2
        assert target.get_sample_value("pcr_router_decisions_total", {"outcome": "hit"}) == 1
    finally:
        metrics.disable_metrics()


def test_async_router_translates_errors(prefix: str) -> None:
    from registry.core.errors import RegistryUnavailable
    from tests.support.servers import refused_port

    async def scored(port: int) -> None:
        client = async_client_from_url(f"redis://127.0.0.1:{port}/0")
        try:
            await AsyncPrefixRouter(client, prefix).score(H)
        finally:
            await client.aclose()

    with refused_port() as port, pytest.raises(RegistryUnavailable, match="Redis unavailable"):
        asyncio.run(scored(port))
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(AsyncPrefixRouter(None, prefix).score([2**63]))
    with pytest.raises(ValueError, match="unsupported Redis URL scheme"):
        async_client_from_url("redis+sentinel://127.0.0.1:1/mymaster")


def test_async_live_nodes_skip_what_is_not_a_namespace(
    redis_server: RedisServer, prefix: str
) -> None:
    client = redis_server.client()
    fill(client, prefix)
    client.zadd(f"{prefix}:nodes", {"not a namespace": 2**50, b"\xff": 2**50})

    async def listed() -> tuple[list[str], int]:
        aclient = async_client_from_url(redis_server.url)
        try:
            router = AsyncPrefixRouter(aclient, prefix)
            return await router.live_nodes(), router.skipped
        finally:
            await aclient.aclose()

    names, skipped = asyncio.run(listed())
    assert names == PrefixRouter(client, prefix).live_nodes()
    assert sorted(names) == ["node-a", "node-b", "node-c", "node-d"]
    assert skipped == 2
    client.close()


# -- the command --------------------------------------------------------------------


def pcr(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pcr", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "0"],
        ["--port", "70000"],
        ["--bogus"],
        ["--redis-url", "redis+sentinel://127.0.0.1:1/mymaster"],
        ["--redis-url", "http://x"],
        ["--key-prefix", "bad prefix"],
        ["--host", "no such host.invalid."],
        ["extra"],
        ["--max-connections", "0"],
        ["--max-connections", "many"],
        ["--pool-timeout", "0"],
        ["--header-timeout", "nan"],
        ["--body-timeout", "-1"],
        ["--keep-alive-timeout", "0"],
    ],
)
def test_serve_usage_errors_are_one_line_exit_2(args: list[str]) -> None:
    done = pcr("serve", *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("pcr serve: error: "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stdout == ""


def test_serve_command_serves_and_stops(redis_server: RedisServer, prefix: str) -> None:
    served = ServeProcess("--redis-url", redis_server.url, "--key-prefix", prefix).start()
    port = served.port
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.json() == {"status": "ok", "redis": "reachable", "scripts": "loaded"}
        base = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{base}/v1/score", json={"block_hashes": H}, timeout=30).json() == {
            "blocks": 12,
            "best": None,
            "nodes": {},
        }
        if importlib.util.find_spec("prometheus_client") is not None:  # the process's metrics
            assert (
                'pcr_router_decisions_total{outcome="none"} 1.0'
                in httpx.get(f"{base}/metrics", timeout=30).text
            )
        taken = pcr("serve", "--redis-url", redis_server.url, "--port", str(port))
        assert taken.returncode == 1
        assert taken.stderr.startswith(f"pcr serve: error: cannot listen on 127.0.0.1:{port}")
        assert taken.stderr.count("\n") == 1
    finally:
        code = served.stop()
    assert code == 0, served.err
    out, err = served.out, served.err
    assert out.startswith(f"pcr serve: scoring on http://127.0.0.1:{port}")
    assert "Traceback" not in err
    json.dumps(out)  # plain text


def test_serve_scores_from_a_fleet_view_unless_told_not_to() -> None:
    """``pcr serve`` follows a fleet view by default; ``--no-view`` asks Redis, exactly,
    on every request (``create_app(view=...)``)."""
    from pcr.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).view is True
    assert parser.parse_args(["serve", "--view"]).view is True
    assert parser.parse_args(["serve", "--no-view"]).view is False


def test_plain_pcr_never_imports_the_service_packages() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, pcr.cli.main; pcr.cli.main.build_parser(); "
         "print(sorted({'fastapi', 'uvicorn', 'starlette'} & set(sys.modules)))"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.stdout.strip() == "[]", done.stderr


def test_serve_without_fastapi_is_one_line_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pcr.cli.main import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    assert main(["serve", "--redis-url", "redis://127.0.0.1:9/0"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "pcr serve: error: pcr serve needs fastapi: pip install 'prefix-cache-registry[serve]'\n"
    )


def test_a_service_whose_port_was_taken_starts_again_on_another(redis_server: RedisServer) -> None:
    """The suite's own helper: a port another process took between ``free_port`` and
    the service's bind is retried on a fresh port, not reported as the service's
    failure (parallel workers pick ports at the same time)."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        proc = ServeProcess("--redis-url", redis_server.url)
        taken = holder.getsockname()[1]
        proc.port = taken
        proc.args = [*proc.args[:-2], "--port", str(taken)]
        proc.start()
        try:
            assert proc.port != taken
            assert httpx.get(f"{proc.base}/live", timeout=60).status_code == 200
        finally:
            proc.stop()
    finally:
        holder.close()
