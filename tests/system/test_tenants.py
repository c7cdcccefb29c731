"""API keys, tenants and rate limits on ``pcr serve`` and ``pcr gateway`` (issue 42), as
processes on a real redis-server, the gateway in front of fake engines.

The probe: tenant-a's engine caches a prompt; tenant-b, holding a key of its own, guesses
that prompt (right, and wrong by its last token) and compares what it can read: the
answers of ``/v1/score`` (all namespaces, tenant-a's named, a namespace that does not
exist), ``/v1/nodes``, ``/metrics``, and through the gateway the reply, its headers and
the engine it reached. Without keys (today's default) the guesses answer differently; with
keys they must answer alike. An operator key still sees everything. Missing and wrong
keys get 401, a key past its burst 429 with ``Retry-After``, the proxied routes included.
A bad key file is a one-line usage error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from registry import PrefixCacheRegistry, block_hashes
from tests.support import REPO_ROOT
from tests.support.fake_engine import FakeEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

BLOCK = 16
SECRET = [7000 + i for i in range(4 * BLOCK)]  # tenant-a's prompt: 4 blocks
WRONG = [*SECRET[:-1], 1]  # the same but its last token: 3 blocks in common
OPERATOR = "op-" + "0" * 29
KEY_A = "ka-" + "1" * 29
KEY_B = "kb-" + "2" * 29
KEY_HASHED = "kh-" + "3" * 29  # given in the file by its digest only


TIMEOUT = 120.0
"""Seconds a request may take: a service on a busy machine (CI beside two CPU burners)
answers its first requests slowly; nothing here measures time."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def tenants() -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {"a": f"tenant-a-{tag}", "b": f"tenant-b-{tag}"}


def key_file(tmp_path: Path, tenants: dict[str, str], **b_extra: Any) -> Path:
    path = tmp_path / "keys.json"
    keys = {
        KEY_A: {"tenant": "tenant-a", "namespaces": [tenants["a"]]},
        KEY_B: {"tenant": "tenant-b", "namespaces": [tenants["b"]], **b_extra},
        "sha256:" + hashlib.sha256(KEY_HASHED.encode()).hexdigest(): {"operator": True},
    }
    path.write_text(json.dumps({"keys": keys}))
    path.chmod(0o600)
    return path


def cache(client: redis.Redis, namespace: str, tokens: list[int]) -> None:
    """Say in the registry that ``namespace``'s engine holds ``tokens``' blocks."""
    registry = PrefixCacheRegistry(client, namespace)
    registry.claim(300)
    if tokens:
        hashes = block_hashes(tokens, BLOCK)
        registry.register_kv(list(range(len(hashes))), hashes)


@pytest.fixture
def fleet(redis_server: RedisServer, tenants: dict[str, str]) -> Iterator[redis.Redis]:
    """tenant-a's engine holds ``SECRET``; tenant-b's holds nothing (both live)."""
    client = redis_server.client()
    cache(client, tenants["a"], SECRET)
    cache(client, tenants["b"], [])
    try:
        yield client
    finally:
        client.close()


def score(base: str, key: str | None, tokens: list[int], **extra: Any) -> httpx.Response:
    body = {"token_ids": tokens, "block_size": BLOCK, **extra}
    return httpx.post(
        f"{base}/v1/score", json=body, headers=bearer(key) if key else {}, timeout=TIMEOUT
    )


def metrics_text(base: str, key: str) -> str:
    reply = httpx.get(f"{base}/metrics", headers=bearer(key), timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.text


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.split("{")[0].split(" ")[0] == name and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_without_keys_the_probe_works_which_is_why_keys_exist(
    redis_server: RedisServer, fleet: redis.Redis, tenants: dict[str, str]
) -> None:
    """Today's default (no keys): anyone's guess is graded by block, so the probes below
    would tell tenant-b what tenant-a caches; this is what keys must prevent."""
    proc = ServeProcess("--redis-url", redis_server.url).start()
    try:
        right = score(proc.base, None, SECRET, namespaces=[tenants["a"]]).json()
        wrong = score(proc.base, None, WRONG, namespaces=[tenants["a"]]).json()
        assert right["nodes"][tenants["a"]]["kv_prefix"] == 4
        assert wrong["nodes"][tenants["a"]]["kv_prefix"] == 3
        assert (
            httpx.get(f"{proc.base}/openapi.json", timeout=TIMEOUT).status_code == 200
        )  # docs as today
    finally:
        proc.stop()


def test_a_tenant_cannot_learn_what_another_tenant_caches_through_serve(
    redis_server: RedisServer, fleet: redis.Redis, tenants: dict[str, str], tmp_path: Path
) -> None:
    keys = key_file(tmp_path, tenants)
    proc = ServeProcess(
        "--redis-url", redis_server.url, "--api-keys", str(keys), "--api-key", OPERATOR
    ).start()
    try:
        base = proc.base
        ghost = f"ghost-{uuid.uuid4().hex[:8]}"  # no such namespace
        for asked in (None, [tenants["a"]], [tenants["a"], tenants["b"]], [ghost]):
            extra = {} if asked is None else {"namespaces": asked}
            replies = [score(base, KEY_B, tokens, **extra) for tokens in (SECRET, WRONG)]
            assert [r.status_code for r in replies] == [200, 200]
            right, wrong = (r.json() for r in replies)
            assert right == wrong, asked  # no difference to read
            assert tenants["a"] not in right["nodes"]
            if asked is None or tenants["b"] in asked:
                assert set(right["nodes"]) == {tenants["b"]}
            else:  # tenant-a's namespace answers exactly as one that does not exist
                ghostly = score(base, KEY_B, SECRET, namespaces=[ghost]).json()
                assert right == ghostly == {"blocks": 4, "best": None, "nodes": {}}

        nodes = httpx.get(f"{base}/v1/nodes", headers=bearer(KEY_B), timeout=TIMEOUT).json()[
            "nodes"
        ]
        assert [n["namespace"] for n in nodes] == [tenants["b"]]

        refused = httpx.get(f"{base}/metrics", headers=bearer(KEY_B), timeout=TIMEOUT)
        assert refused.status_code == 403
        assert refused.json()["error"] == "forbidden"

        # tenant-a sees its own; the operators (command line, file digest) see all
        own = score(base, KEY_A, WRONG).json()
        assert set(own["nodes"]) == {tenants["a"]}
        assert own["nodes"][tenants["a"]]["kv_prefix"] == 3
        for operator in (OPERATOR, KEY_HASHED):
            seen = score(base, operator, SECRET, namespaces=[tenants["a"], tenants["b"]]).json()
            assert seen["nodes"][tenants["a"]]["kv_prefix"] == 4
            assert seen["best"] == tenants["a"]
            listed = httpx.get(
                f"{base}/v1/nodes", headers=bearer(operator), timeout=TIMEOUT
            ).json()["nodes"]
            assert {tenants["a"], tenants["b"]} <= {n["namespace"] for n in listed}
            text = metrics_text(base, operator)
            assert sample(text, "pcr_http_rejected_total", reason="forbidden") == 1
    finally:
        proc.stop()


def test_missing_and_wrong_keys_get_401_and_health_stays_open(
    redis_server: RedisServer, tmp_path: Path, tenants: dict[str, str]
) -> None:
    keys = key_file(tmp_path, tenants)
    keys.chmod(0o644)  # readable by others: a warning, not a refusal
    proc = ServeProcess("--redis-url", redis_server.url, "--api-keys", str(keys)).start()
    try:
        base = proc.base
        for headers in (
            {},
            bearer("not-a-key"),
            bearer(KEY_B + "x"),
            {"Authorization": KEY_B},  # no scheme
            {"Authorization": f"Basic {KEY_B}"},
        ):
            for method, path in (("POST", "/v1/score"), ("GET", "/v1/nodes"), ("GET", "/metrics")):
                reply = httpx.request(method, base + path, headers=headers, json={})
                assert reply.status_code == 401, (headers, path)
                assert reply.headers["www-authenticate"] == "Bearer"
                assert reply.json()["error"] == "unauthorized"
        for path in ("/docs", "/redoc", "/openapi.json"):  # off with keys unless --docs
            assert (
                httpx.get(base + path, headers=bearer(KEY_HASHED), timeout=TIMEOUT).status_code
                == 404
            )
        assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{base}/live", timeout=TIMEOUT).status_code == 200
        lower = {"authorization": f"bearer {KEY_B}"}  # the scheme is case-insensitive
        assert httpx.get(f"{base}/v1/nodes", headers=lower, timeout=TIMEOUT).status_code == 200
        text = metrics_text(base, KEY_HASHED)
        assert sample(text, "pcr_http_rejected_total", reason="unauthorized") == 15
    finally:
        proc.stop()
    assert "readable by other users" in proc.err


def test_a_key_past_its_burst_gets_429_with_retry_after(
    redis_server: RedisServer, tmp_path: Path, tenants: dict[str, str]
) -> None:
    """Rates low enough that no token comes back during the test: no timing margin."""
    keys = key_file(tmp_path, tenants, rate=0.001, burst=2)
    args = ["--redis-url", redis_server.url, "--api-keys", str(keys), "--api-key", OPERATOR]
    proc = ServeProcess(*args, "--rate-limit", "0.001", "--rate-burst", "3", "--docs").start()
    try:
        base = proc.base
        got = [
            httpx.get(f"{base}/v1/nodes", headers=bearer(KEY_B), timeout=TIMEOUT) for _ in range(3)
        ]
        assert [r.status_code for r in got] == [200, 200, 429]
        assert got[2].json()["error"] == "too many requests"
        assert int(got[2].headers["retry-after"]) >= 1
        # the default applies to keys without a rate of their own, each key its own bucket
        got = [
            httpx.get(f"{base}/v1/nodes", headers=bearer(KEY_A), timeout=TIMEOUT) for _ in range(4)
        ]
        assert [r.status_code for r in got] == [200, 200, 200, 429]
        assert httpx.get(f"{base}/openapi.json", timeout=TIMEOUT).status_code == 200  # --docs: open
        text = metrics_text(base, OPERATOR)
        assert sample(text, "pcr_http_rejected_total", reason="rate_limited") == 2
        assert sample(text, "pcr_http_rejected_total", reason="rate_limited", tenant="tenant-b")
    finally:
        proc.stop()


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    made = [FakeEngine("a").start(), FakeEngine("b").start()]
    try:
        yield made
    finally:
        for engine in made:
            engine.stop()


def complete(base: str, key: str | None, tokens: list[int], model: str = "tiny") -> httpx.Response:
    body = {"model": model, "prompt": tokens, "max_tokens": 1}
    return httpx.post(
        f"{base}/v1/completions", json=body, headers=bearer(key) if key else {}, timeout=30
    )


def test_through_the_gateway_a_tenant_routes_among_its_own_backends_only(
    redis_server: RedisServer,
    fleet: redis.Redis,
    tenants: dict[str, str],
    engines: list[FakeEngine],
    tmp_path: Path,
) -> None:
    keys = key_file(tmp_path, tenants, models=["tiny"], rate=0.001, burst=6)
    args = ["--redis-url", redis_server.url, "--block-size", str(BLOCK), "--no-announced"]
    args += ["--backend", f"{tenants['a']}={engines[0].url}"]
    args += ["--backend", f"{tenants['b']}={engines[1].url}"]
    args += ["--pending-grace", "600"]  # these engines publish no events: nothing confirms
    proc = ServeProcess(
        *args, "--api-keys", str(keys), "--api-key", OPERATOR, path="/live", command="gateway"
    ).start()
    try:
        base = proc.base
        for key in (None, "not-a-key"):  # the proxied routes are keyed too
            reply = complete(base, key, SECRET)
            assert reply.status_code == 401
            assert reply.headers["www-authenticate"] == "Bearer"
            assert reply.json()["error"]["code"] == 401  # the OpenAI shape
        assert engines[0].received == engines[1].received == []

        right, wrong = complete(base, KEY_B, SECRET), complete(base, KEY_B, WRONG)
        assert right.status_code == wrong.status_code == 200
        assert right.json() == wrong.json()  # both answered by tenant-b's own engine
        assert right.json()["by"] == "b"
        shown = [{k: v for k, v in r.headers.items() if k != "date"} for r in (right, wrong)]
        assert shown[0] == shown[1]
        assert engines[0].received == []

        other_model = complete(base, KEY_B, SECRET, model="not-yours")
        assert other_model.status_code == 404
        assert len(engines[1].received) == 2

        refused = httpx.get(f"{base}/metrics", headers=bearer(KEY_B), timeout=TIMEOUT)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == 403
        text = metrics_text(base, OPERATOR)
        name = "pcr_gateway_predicted_cached_tokens_total"
        assert sample(text, name, backend=tenants["a"]) == 0
        # tenant-b's own first request (its salt's chain), pending at its engine, drew the
        # second's 3 shared blocks; tenant-a's cached SECRET never counted for it
        assert sample(text, name, backend=tenants["b"]) == 3 * BLOCK

        # the operator routes over every backend: the secret goes where it is cached
        assert complete(base, OPERATOR, SECRET).json()["by"] == "a"

        # past the burst (6: two completions, a 404, a 403, and two more), 429 on the proxy
        assert complete(base, KEY_B, WRONG).status_code == 200
        listed = httpx.get(f"{base}/v1/models", headers=bearer(KEY_B), timeout=TIMEOUT).json()[
            "data"
        ]
        assert [m["id"] for m in listed] == ["tiny"]  # its backends', its models alone
        limited = complete(base, KEY_B, WRONG)
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["code"] == 429
        assert len(engines[1].received) == 3
        text = metrics_text(base, OPERATOR)
        assert sample(text, "pcr_http_rejected_total", reason="unauthorized") == 2
        assert sample(text, "pcr_http_rejected_total", reason="rate_limited") == 1
    finally:
        proc.stop()


def run_pcr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pcr", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


BAD_FILES = [
    ("{not json", "is not JSON"),
    ('{"keys": []}', '{"keys": {"KEY": {"tenant": NAME'),
    ('{"keys": {"k-123456": {"tenant": "t", "colour": "red"}}}', "unknown field 'colour'"),
    ('{"keys": {"k-123456": {}}}', "needs a tenant"),
    ('{"keys": {"k-123456": {"tenant": "t", "namespaces": ["a b"]}}}', "namespace"),
    ('{"keys": {"k-123456": {"tenant": "t", "rate": -1}}}', "rate"),
    ('{"keys": {"k-123456": {"tenant": "t", "burst": 0}}}', "burst"),
    ('{"keys": {"k-123456": {"operator": true, "namespaces": ["a"]}}}', "operator"),
    ('{"keys": {"sha256:12": {"tenant": "t"}}}', "sha256:"),
    ('{"keys": {"k 1": {"tenant": "t"}}}', "key"),
]


@pytest.mark.parametrize(
    ("command", "content", "says"),
    [
        *(("serve", *case) for case in BAD_FILES),
        ("gateway", *BAD_FILES[0]),
        ("gateway", *BAD_FILES[2]),
    ],
)
def test_a_bad_key_file_is_a_one_line_usage_error(
    tmp_path: Path, command: str, content: str, says: str
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    path.chmod(0o600)
    done = run_pcr(command, "--redis-url", "redis://127.0.0.1:1", "--api-keys", str(path))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--api-keys" in lines[0]
    assert says in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--api-keys", "/nonexistent/keys.json"], "cannot read"),
        (["--rate-limit", "5"], "--rate-limit needs"),
        (["--api-key", ""], "--api-key"),
        (["--api-key", "a\tb"], "--api-key"),
        (["--api-key", "k", "--rate-limit", "0"], "--rate-limit"),
    ],
)
def test_bad_access_options_are_one_line_usage_errors(args: list[str], says: str) -> None:
    done = run_pcr("serve", "--redis-url", "redis://127.0.0.1:1", *args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert says in done.stderr


KEY_C = "kc-" + "4" * 29  # a tenant whose key maps no namespace: routed over every backend
ENGINE_KEY = "engine-key-" + "5" * 21


@pytest.mark.parametrize("salts", [True, False], ids=["tenant-salts", "no-tenant-salts"])
def test_each_tenant_reaches_the_engines_with_a_salt_of_its_own(
    redis_server: RedisServer, tmp_path: Path, salts: bool
) -> None:
    """Engines started with ``--api-key`` behind a keyed gateway (``--backend-api-key-file``):
    a tenant's request reaches them with ``cache_salt`` set to ``tenant_salt`` of its
    tenant and whatever salt it sent (so two tenants sending one prompt never share, or
    time, a cache), hashed and routed under that salt; an operator's request goes as
    sent. With ``--no-tenant-salts`` every request goes as sent."""
    from pcr.gateway.tokens import tenant_salt

    tag = uuid.uuid4().hex[:8]
    plain, salted = f"plain-{tag}", f"salted-{tag}"
    client = redis_server.client()
    made = [FakeEngine("plain", api_key=ENGINE_KEY), FakeEngine("salted", api_key=ENGINE_KEY)]
    for engine in made:
        engine.start()
    try:
        cache(client, plain, SECRET)  # the prompt unsalted on one engine
        registry = PrefixCacheRegistry(client, salted)  # tenant-c's salt on the other
        registry.claim(300)
        hashes = block_hashes(SECRET, BLOCK, salt=tenant_salt("tenant-c", None))
        registry.register_kv(list(range(len(hashes))), hashes)
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"keys": {KEY_C: {"tenant": "tenant-c"}}}))
        keys.chmod(0o600)
        engine_key = tmp_path / "engine.key"
        engine_key.write_text(ENGINE_KEY + "\n")
        args = ["--redis-url", redis_server.url, "--block-size", str(BLOCK), "--no-announced"]
        args += ["--backend", f"{plain}={made[0].url}", "--backend", f"{salted}={made[1].url}"]
        args += ["--api-keys", str(keys), "--api-key", OPERATOR]
        args += ["--backend-api-key-file", str(engine_key)]
        proc = ServeProcess(
            *args, *([] if salts else ["--no-tenant-salts"]), path="/live", command="gateway"
        ).start()
        try:
            as_tenant = complete(proc.base, KEY_C, SECRET)
            assert as_tenant.status_code == 200, as_tenant.text  # the engine's key was sent
            own = httpx.post(
                f"{proc.base}/v1/completions",
                json={"model": "tiny", "prompt": SECRET, "max_tokens": 1, "cache_salt": "mine"},
                headers=bearer(KEY_C),
                timeout=TIMEOUT,
            )
            assert own.status_code == 200, own.text
            as_operator = complete(proc.base, OPERATOR, SECRET)
            assert as_operator.json()["by"] == "plain"
            bodies = made[0].received + made[1].received
            assert len(bodies) == 3
            if salts:
                assert as_tenant.json()["by"] == "salted"  # its salt's blocks drew it
                assert made[1].received[0]["cache_salt"] == tenant_salt("tenant-c", None)
                sent_own = [b for b in bodies if "cache_salt" in b]
                assert {b["cache_salt"] for b in sent_own} == {
                    tenant_salt("tenant-c", None),
                    tenant_salt("tenant-c", "mine"),
                }
                assert made[0].received[-1] == {"model": "tiny", "prompt": SECRET, "max_tokens": 1}
            else:
                assert as_tenant.json()["by"] == "plain"  # unsalted: where the prompt is
                assert [b.get("cache_salt") for b in bodies].count("mine") == 1
                assert [b.get("cache_salt") for b in bodies].count(None) == 2
        finally:
            proc.stop()
    finally:
        for engine in made:
            engine.stop()
        client.close()


def test_without_the_engines_key_a_keyed_engine_refuses_the_gateway(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The control for the test above: the client's own key is the gateway's, never
    passed on, so an engine with ``--api-key`` answers 401 unless the gateway has its key."""
    engine = FakeEngine("keyed", api_key=ENGINE_KEY).start()
    try:
        args = ["--redis-url", redis_server.url, "--no-announced", "--api-key", OPERATOR]
        proc = ServeProcess(
            *args, "--backend", f"keyed-{uuid.uuid4().hex[:6]}={engine.url}", command="gateway"
        ).start()
        try:
            assert complete(proc.base, OPERATOR, SECRET).status_code == 401
        finally:
            proc.stop()
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("content", "says"),
    [("", "printable ASCII"), ("two words", "printable ASCII"), (None, "cannot read")],
)
def test_a_bad_backend_key_file_is_a_one_line_usage_error(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "engine.key"
    if content is not None:
        path.write_text(content)
    done = run_pcr(
        "gateway", "--redis-url", "redis://127.0.0.1:1", "--backend-api-key-file", str(path)
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--backend-api-key-file" in done.stderr
    assert says in done.stderr
