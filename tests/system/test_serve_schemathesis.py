"""Schemathesis against a running ``pcr serve``: it reads the live ``/openapi.json`` and
sends what the schema allows (each must be accepted) and what it forbids (each must be
refused with 4xx), with every check on: no 5xx, every status, content type, header and
body as documented, 405 with ``Allow`` for other methods.

The service is the real command (uvicorn on a free port) on a real redis-server holding
two claimed namespaces; examples are bounded (``MAX_EXAMPLES`` per operation and mode,
derandomized), so the test stays well under a minute on two cores."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from pcr.bench.servers import RedisServer  # noqa: E402
from registry import PrefixCacheRegistry  # noqa: E402
from tests.support.serving import ServeProcess  # noqa: E402
from tests.system.test_serve import H  # noqa: E402

MAX_EXAMPLES = {"positive": 25, "negative": 8}
"""Examples per operation and mode: each negative case rebuilds the strategies of the
namespace pattern (a class of 144,000 characters), about a second apiece on a busy
machine. Runs of 300 positive and 60 negative cases, not derandomized, pass as well."""


@pytest.fixture(scope="module")
def service_url() -> Iterator[str]:
    """``pcr serve`` on a redis-server of its own with two claimed namespaces."""
    prefix = f"st{uuid.uuid4().hex[:8]}"
    with RedisServer() as redis_server:
        client = redis_server.client()
        for name, blocks in (("node-a", 12), ("node-b", 5)):
            owner = PrefixCacheRegistry(client, name, key_prefix=prefix)
            owner.claim(lease_ttl=600)
            owner.register_kv(range(blocks), H[:blocks])
        served = ServeProcess(
            "--redis-url", redis_server.url, "--key-prefix", prefix, path="/health"
        )
        try:
            served.start()
            yield served.base
        finally:
            served.stop()
            client.close()
        assert "Traceback" not in served.err, served.err


@pytest.fixture
def live_schema(service_url: str) -> Any:
    config = schemathesis.Config()
    project = config.projects.default
    project.update(base_url=service_url, request_timeout=30)
    project.checks.update(included_check_names=["all"])
    project.generation.update(modes=["positive", "negative"])
    project.phases.update(phases=["examples", "coverage", "fuzzing"])
    return schemathesis.openapi.from_url(f"{service_url}/openapi.json", config=config)


OPERATIONS = ["POST /v1/score", "GET /v1/nodes", "GET /health", "GET /live", "GET /metrics"]
RUNS = [
    ("POST /v1/score", "positive"),
    ("POST /v1/score", "negative"),  # the only operation with an input to get wrong
    *((label, "positive") for label in OPERATIONS[1:]),
]


def test_the_schema_lists_every_operation(live_schema: Any) -> None:
    listed = [result.ok().label for result in live_schema.get_all_operations()]
    assert sorted(listed) == sorted(OPERATIONS)


@pytest.mark.parametrize(("label", "mode"), RUNS, ids=[f"{label} {mode}" for label, mode in RUNS])
def test_the_live_schema_holds(live_schema: Any, label: str, mode: str) -> None:
    operation = live_schema.find_operation_by_label(label)
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def holds(case: Any) -> None:
        case.call_and_validate()

    holds()
