"""``pcr.web.auth`` without a server: the token bucket on a clock the test moves, and the
layer's effect on what the app behind it sees (the key taken out of the headers, the
grant in the scope, a tenant's namespaces). The services' behaviour over HTTP is in
``tests/system/test_tenants.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pcr.web.auth import (
    PRINCIPAL,
    Access,
    AccessPolicy,
    Bucket,
    Grant,
    digest,
    key_file_grants,
    model_allowed,
    routable,
    visible,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_burst_then_one_request_per_refill() -> None:
    clock = Clock()
    bucket = Bucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)  # a refused request takes nothing
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 60  # refills up to the burst, no further
    assert [bucket.take() for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.5)]


def call(layer: Access, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """One request through ``layer``: its status, headers and body, and the scope the
    app behind it saw (None when it saw none)."""
    seen: dict[str, Any] = {"scope": None}
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["scope"] = dict(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    layer.app = app
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    asyncio.run(layer(scope, receive, send))
    return {
        "status": sent[0]["status"],
        "headers": dict(sent[0]["headers"]),
        "body": json.loads(sent[1]["body"]),
        "scope": seen["scope"],
    }


GRANTS = key_file_grants(
    {
        "keys": {
            "tenant-key": {"tenant": "b", "namespaces": ["ns-b", "ns-b2"], "models": ["m"]},
            "bare-key": {"tenant": "c"},
        }
    }
)


def test_the_app_sees_the_grant_and_never_the_key() -> None:
    policy = AccessPolicy.build(["op-key"], GRANTS)
    layer = Access(lambda *a: None, policy)  # type: ignore[arg-type,return-value]
    header = (b"authorization", b"Bearer tenant-key")
    done = call(layer, "/v1/completions", [(b"x-other", b"1"), header])
    assert done["status"] == 200
    scope = done["scope"]
    assert scope["headers"] == [(b"x-other", b"1")]  # the gateway forwards no key
    assert scope[PRINCIPAL].tenant == "b"
    assert visible(scope, None) == ["ns-b", "ns-b2"]
    assert visible(scope, ["ns-a", "ns-b2", "ghost"]) == ["ns-b2"]
    assert routable(scope) == frozenset({"ns-b", "ns-b2"})
    assert model_allowed(scope, "m")
    assert not model_allowed(scope, "other")

    bare = call(layer, "/v1/score", [(b"authorization", b"Bearer bare-key")])["scope"]
    assert visible(bare, None) == []  # no namespaces mapped: scores none
    assert routable(bare) is None  # and is routed over every backend
    assert model_allowed(bare, "anything")

    operator = call(layer, "/metrics", [(b"authorization", b"Bearer op-key")])["scope"]
    assert visible(operator, ["ns-a"]) == ["ns-a"]
    assert visible(operator, None) is None


def test_refusals_come_in_the_chosen_shape_before_the_app() -> None:
    policy = AccessPolicy.build([], GRANTS, rate=0.001, burst=1)
    layer = Access(lambda *a: None, policy, openai=True)  # type: ignore[arg-type,return-value]
    refused = call(layer, "/v1/completions", [(b"authorization", b"Bearer op-key")])
    assert refused["status"] == 401
    assert refused["scope"] is None
    assert refused["headers"][b"www-authenticate"] == b"Bearer"
    assert refused["body"]["error"]["code"] == 401
    assert call(layer, "/health", [])["status"] == 200  # open, no token taken
    key = [(b"authorization", b"Bearer tenant-key")]
    assert call(layer, "/metrics", key)["status"] == 403  # takes the only token
    limited = call(layer, "/v1/completions", key)
    assert limited["status"] == 429
    assert limited["scope"] is None
    assert int(limited["headers"][b"retry-after"]) >= 1


def test_a_policy_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(ValueError, match="twice"):
        AccessPolicy.build(["same-key"], [(digest("same-key"), Grant("t"))])
    with pytest.raises(ValueError, match="needs keys"):
        AccessPolicy.build([], [], rate=1.0)
    assert AccessPolicy.build(["k"]).docs is False
    assert AccessPolicy.build(["k"], docs=True).docs is True
    assert AccessPolicy.build(docs=False).keys == ()
