"""``pcr gateway`` routes salted and LoRA requests as the engine hashes them (issue 42),
as a process in front of fake engines (``tests/support/fake_engine.py``) and a real
redis-server: a request's ``cache_salt`` and its adapter (a ``model`` some backend lists
with a ``parent`` in its ``/v1/models``) start its hash chain where the bridge lists
such blocks (``registry.block_hashes(..., salt=, lora=)``), so a salted request is drawn
only by its own tenant's blocks and never counts predicted hits on an engine holding the
unsalted prompt; a request goes only to backends that serve its model (404 in the OpenAI
shape when none does; a backend whose models are not known is never left out), and
``GET /v1/models`` lists every backend's models once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from registry import PrefixCacheRegistry, block_hashes
from tests.support.fake_engine import (
    FakeEngine,
    engine_pair,
    gateway_args,
    model_list,
    tagged_names,
)
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess, metric
from tests.support.tiny_tokenizer import words
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

BLOCK = 4
PROMPT = list(range(10, 43))  # 33 tokens: 8 whole blocks
PREDICTED = "pcr_gateway_predicted_cached_tokens_total"
DECISIONS = "pcr_gateway_routing_decisions_total"


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    with engine_pair(started=False) as made:  # each test sets their models first
        yield made


@pytest.fixture
def names() -> list[str]:
    return tagged_names("salt")


def gateway(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], *extra: str
) -> ServeProcess:
    """The gateway in front of ``engines`` (started here, with the models the test set)."""
    for engine in engines:
        engine.start()
    args = gateway_args(redis_server.url, engines, names, BLOCK)
    return ServeProcess(*args, *extra, path="/health", command="gateway").start()


def cache(
    client: redis.Redis,
    namespace: str,
    tokens: list[int],
    salt: str | None = None,
    lora: str | None = None,
) -> None:
    """Say in the registry that ``namespace``'s engine holds the prompt's blocks, keyed
    by ``salt`` and ``lora`` as the bridge lists an engine's keyed blocks."""
    registry = PrefixCacheRegistry(client, namespace)
    registry.claim(120)
    hashes = block_hashes(tokens, BLOCK, salt=salt, lora=lora)
    registry.register_kv(list(range(len(hashes))), hashes)


def post(base: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(base + path, json={"model": "tiny", **body}, timeout=30)


def served_by(base: str, body: dict[str, Any], path: str = "/v1/completions") -> str:
    reply = post(base, body, path)
    assert reply.status_code == 200, reply.text
    by: str = reply.json()["by"]
    return by


def test_a_salted_request_goes_where_its_salted_blocks_are(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Engine a holds the prompt unsalted, engine b holds it under tenant-1's salt: the
    salted request goes to b with b's prefix predicted, the unsalted one to a; a
    request salted for another tenant matches neither and predicts nothing anywhere,
    and the next ones of that tenant only its own blocks, sent with the first (pending
    where it went: ``pcr.gateway.pending``; a grace of 10 minutes, as these engines
    publish no events)."""
    client = redis_server.client()
    cache(client, names[0], PROMPT)
    cache(client, names[1], PROMPT, salt="tenant-1")
    proc = gateway(redis_server, engines, names, "--pending-grace", "600")
    try:
        assert [served_by(proc.base, {"prompt": PROMPT, "cache_salt": "tenant-1"})
                for _ in range(4)] == ["b"] * 4  # fmt: skip
        assert metric(proc.base, PREDICTED, backend=names[1]) == 4 * 32
        assert metric(proc.base, PREDICTED, backend=names[0]) == 0
        assert [served_by(proc.base, {"prompt": PROMPT}) for _ in range(4)] == ["a"] * 4
        assert metric(proc.base, PREDICTED, backend=names[0]) == 4 * 32
        assert metric(proc.base, DECISIONS, outcome="prefix") == 8
        # another tenant: the same tokens, a chain no engine holds
        first = served_by(proc.base, {"prompt": PROMPT, "cache_salt": "tenant-2"})
        assert metric(proc.base, PREDICTED, backend=names[0]) == 4 * 32
        assert metric(proc.base, PREDICTED, backend=names[1]) == 4 * 32
        assert metric(proc.base, DECISIONS, outcome="load") == 1
        for _ in range(3):  # drawn by the first one's own blocks alone
            assert served_by(proc.base, {"prompt": PROMPT, "cache_salt": "tenant-2"}) == first
        where = names[["a", "b"].index(first)]
        assert metric(proc.base, PREDICTED, backend=where) == 4 * 32 + 3 * 32
        # the engines got the salt as it was sent
        assert [r.get("cache_salt") for r in engines[1].received[:4]] == ["tenant-1"] * 4
    finally:
        proc.stop()
        client.close()


def test_salted_chat_is_hashed_from_its_rendered_tokens(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str], tokenizer_dir: Path
) -> None:
    """The tokenized path (a chat rendered by the template) keys its hashes by the salt
    too: the unsalted chat's blocks on a do not draw the salted chat, b's salted do (36
    tokens: 8 blocks usable, the engine computes the last token)."""
    client = redis_server.client()
    message = words(list(range(20, 52)))
    chat_ids = [1, 0, *range(20, 52), 0, 0]  # <s> user ... assistant (roles are <unk>)
    cache(client, names[0], chat_ids)
    cache(client, names[1], chat_ids, salt="t1")
    proc = gateway(redis_server, engines, names, "--tokenizer", str(tokenizer_dir))
    try:
        chat = {"messages": [{"role": "user", "content": message}]}
        path = "/v1/chat/completions"
        assert served_by(proc.base, {**chat, "cache_salt": "t1"}, path) == "b"
        assert served_by(proc.base, chat, path) == "a"
        assert metric(proc.base, PREDICTED, backend=names[0]) == 32
        assert metric(proc.base, PREDICTED, backend=names[1]) == 32
    finally:
        proc.stop()
        client.close()


BAD_SALTS = ["", "a/b", "x@y", "back\\slash", "nul\0", "s" * 129, 5, ["t"], {"t": 1}]
"""Salts vLLM refuses: empty, with ``/``, ``@``, ``\\`` or NUL, over 128 characters,
not a string."""


def test_a_salt_the_engine_would_refuse_is_answered_400_before_routing(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    proc = gateway(redis_server, engines, names)
    try:
        for salt in BAD_SALTS:
            for path, body in (
                ("/v1/completions", {"prompt": PROMPT}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                reply = post(proc.base, {**body, "cache_salt": salt}, path)
                assert reply.status_code == 400, (salt, reply.text)
                error = reply.json()["error"]
                assert "cache_salt" in error["message"]
                assert error["type"] == "invalid_request_error"
                assert error["code"] == 400
        assert engines[0].received == engines[1].received == []
        assert metric(proc.base, DECISIONS) == 0
        assert served_by(proc.base, {"prompt": PROMPT, "cache_salt": "s" * 128}) in "ab"
    finally:
        proc.stop()


def test_an_adapter_request_goes_where_the_adapter_blocks_are(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Both serve the adapter; a holds the prompt under the adapter's chain, b under the
    base model's: the adapter's request goes to a, the base model's to b."""
    for engine in engines:
        engine.models = model_list("tiny", "sql-lora")
    client = redis_server.client()
    cache(client, names[0], PROMPT, lora="sql-lora")
    cache(client, names[1], PROMPT)
    proc = gateway(redis_server, engines, names)
    try:
        assert [served_by(proc.base, {"prompt": PROMPT, "model": "sql-lora"})
                for _ in range(3)] == ["a"] * 3  # fmt: skip
        assert [served_by(proc.base, {"prompt": PROMPT}) for _ in range(3)] == ["b"] * 3
        assert metric(proc.base, PREDICTED, backend=names[0]) == 3 * 32
        assert metric(proc.base, PREDICTED, backend=names[1]) == 3 * 32
        # salted and adapter at once: b's base blocks and a's unsalted adapter blocks
        # are both another chain
        served_by(proc.base, {"prompt": PROMPT, "model": "sql-lora", "cache_salt": "t9"})
        assert metric(proc.base, DECISIONS, outcome="load") == 1
    finally:
        proc.stop()
        client.close()


def test_a_request_goes_only_to_backends_serving_its_model(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """Only a serves the adapter, and b holds the prompt's base-model blocks: every
    adapter request goes to a, and b is never predicted a hit it cannot serve; a model
    nobody serves is 404 in the OpenAI shape and reaches no engine."""
    engines[0].models = model_list("tiny", "only-a")
    client = redis_server.client()
    cache(client, names[1], PROMPT)
    # the registry's prefixes alone: a's own requests in flight count nowhere
    proc = gateway(redis_server, engines, names, "--pending-ttl", "0")
    try:
        assert [served_by(proc.base, {"prompt": PROMPT, "model": "only-a"})
                for _ in range(6)] == ["a"] * 6  # fmt: skip
        assert metric(proc.base, PREDICTED, backend=names[1]) == 0
        assert metric(proc.base, PREDICTED, backend=names[0]) == 0
        sent = len(engines[0].received) + len(engines[1].received)
        for path, body in (
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            reply = post(proc.base, {**body, "model": "no-such-model"}, path)
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
            assert error["type"] == "not_found_error"
            assert error["code"] == 404
            assert "no-such-model" in error["message"]
        assert len(engines[0].received) + len(engines[1].received) == sent
    finally:
        proc.stop()
        client.close()


def test_a_backend_whose_models_are_unknown_is_not_left_out(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """b has no ``/v1/models`` (404): any model may go there, while a takes only what
    it lists; ``GET /v1/models`` lists what is known."""
    engines[1].models = None
    proc = gateway(redis_server, engines, names)
    try:
        assert [served_by(proc.base, {"prompt": PROMPT, "model": "elsewhere"})
                for _ in range(4)] == ["b"] * 4  # fmt: skip
        served = {served_by(proc.base, {"prompt": list(range(100 + 40 * i, 140 + 40 * i))})
                  for i in range(12)}  # fmt: skip
        assert served == {"a", "b"}
        listed = httpx.get(f"{proc.base}/v1/models", timeout=10).json()
        assert [m["id"] for m in listed["data"]] == ["tiny"]
    finally:
        proc.stop()


def test_models_lists_the_union_and_learns_new_adapters(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> None:
    """``GET /v1/models`` lists each model once, adapters with their parent; an adapter
    an engine loads later is listed, and routed to, once the gateway has read it."""
    engines[0].models = model_list("tiny", "sql-lora")
    engines[1].models = model_list("tiny", "chat-lora")
    proc = gateway(redis_server, engines, names)
    try:
        listed = httpx.get(f"{proc.base}/v1/models", timeout=10).json()
        assert listed["object"] == "list"
        by_id = {m["id"]: m for m in listed["data"]}
        assert sorted(by_id) == ["chat-lora", "sql-lora", "tiny"]
        assert len(listed["data"]) == 3
        assert by_id["sql-lora"]["parent"] == "tiny"
        assert post(proc.base, {"prompt": PROMPT, "model": "late-lora"}).status_code == 404
        engines[1].models = model_list("tiny", "chat-lora", "late-lora")
        wait_until(
            lambda: (
                "late-lora"
                in [m["id"] for m in httpx.get(f"{proc.base}/v1/models", timeout=10).json()["data"]]
            ),
            30,
            "the new adapter listed",
        )
        assert served_by(proc.base, {"prompt": PROMPT, "model": "late-lora"}) == "b"
    finally:
        proc.stop()
