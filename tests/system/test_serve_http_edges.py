"""``pcr serve`` at the edges of HTTP: every error in the one JSON shape
``{"error": KIND, "detail": ...}`` that never repeats the request, malformed HTTP
answered in JSON too, and deadlines that close a connection a slow client holds
(headers sent a byte at a time, a body that never completes) while others are served.

The deadlines are 1 s here; a test only requires the connection closed before 15 s, so
a busy machine cannot break it. Waits poll (a socket read with a timeout, or
``wait_until``), never sleep."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from pcr.bench.servers import RedisServer  # noqa: E402
from registry.core.keys import NamespaceKeys  # noqa: E402
from tests.support.serving import ServeProcess  # noqa: E402
from tests.system.test_serve import H, Served, fill  # noqa: E402

DEADLINE = 1.0
"""The header and body deadlines the tests' services run with (seconds)."""
CLOSED_BY = 15.0
"""A slow client's connection must be closed before this many seconds."""
MARKER = "ZqX-marker"
"""Put into requests; no error reply may repeat it."""


@pytest.fixture(scope="module")
def redis_for_edges() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"ed{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def edge(redis_for_edges: RedisServer, prefix: str) -> Iterator[Served]:
    client = redis_for_edges.client()
    fill(client, prefix)
    client.close()
    served = Served(
        redis_for_edges.url,
        prefix,
        header_timeout=DEADLINE,
        body_timeout=DEADLINE,
        keep_alive_timeout=1,
    )
    yield served
    served.close()


def assert_one_shape(reply: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    body = reply.json()
    assert set(body) == {"error", "detail"}, body
    assert body["error"] == kind, body
    assert MARKER not in reply.text
    assert "Traceback" not in reply.text
    return dict(body)


JSON = {"content-type": "application/json"}
NESTED = b"[" * 1000 + b"]" * 1000
LONG_INTEGER = b'{"block_hashes": [' + b"7" * 5000 + b"]}"
NOT_UTF8 = b'{"namespaces": ["\xff\xfe"], "x": 1}'
UNKNOWN_FIELD = b'{"block_hashes": [1], "' + MARKER.encode() + b'": 1}'


def as_json(body: Any) -> dict[str, Any]:
    return {"json": body}


def as_bytes(content: bytes) -> dict[str, Any]:
    return {"content": content, "headers": JSON}


ERROR_CASES = [
    ("GET", f"/v1/{MARKER}", {}, 404, "not found"),
    ("DELETE", "/v1/score", {}, 405, "method not allowed"),
    ("PUT", "/health", {}, 405, "method not allowed"),
    ("POST", "/v1/score", as_bytes(NESTED), 422, None),
    ("POST", "/v1/score", as_bytes(LONG_INTEGER), 422, None),
    ("POST", "/v1/score", {"content": LONG_INTEGER}, 422, None),  # no content type
    ("POST", "/v1/score", as_bytes(NOT_UTF8), 422, None),
    ("POST", "/v1/score", as_bytes(UNKNOWN_FIELD), 422, None),
    ("POST", "/v1/score", as_bytes(f'{{"{MARKER}'.encode()), 422, None),
    ("POST", "/v1/score", as_json({"block_hashes": [1], "namespaces": [f"a {MARKER}"]}), 422, None),
    ("POST", "/v1/score", as_json({"block_hashes": [1], "load": {f"{MARKER} b": 1.0}}), 422, None),
    ("POST", "/v1/score", as_json({"block_hashes": [1], "load": {MARKER: "high"}}), 422, None),
    ("POST", "/v1/score", as_json({"block_hashes": [MARKER]}), 422, None),
    ("POST", "/v1/score", as_bytes(b" " * (33 << 20)), 413, "request too large"),
]


@pytest.mark.parametrize(
    ("method", "path", "request_options", "status", "kind"),
    ERROR_CASES,
    ids=[f"{c[3]}-{i}" for i, c in enumerate(ERROR_CASES)],
)
def test_every_error_is_one_json_shape_without_the_input(
    edge: Served,
    method: str,
    path: str,
    request_options: dict[str, Any],
    status: int,
    kind: str | None,
) -> None:
    reply = edge.http.request(method, path, **request_options)
    body = assert_one_shape(reply, status, kind or "invalid request")
    if status == 405:
        assert reply.headers["allow"]  # the methods the endpoint takes
    if status == 422:
        assert isinstance(body["detail"], list)
        assert all(set(item) <= {"loc", "msg", "type"} for item in body["detail"])


def test_unparseable_bodies_name_the_reason(edge: Served) -> None:
    """Bodies json.loads cannot read get 422 like any other broken body (FastAPI's bare
    ``400 {"detail": "There was an error parsing the body"}`` before), with the reason."""
    cases = {
        b"[" * 1000 + b"]" * 1000: "the body nests too deeply",
        b'{"block_hashes": [' + b"7" * 5000 + b"]}": "an integer in the body has too many digits",
        b'{"salt": "\xff"}': "the body is not UTF-8",
        b'{"block_hashes": [NaN]}': "the body is not JSON",
        b'{"load": {"a": Infinity}}': "the body is not JSON",
    }
    for content, why in cases.items():
        reply = edge.http.post("/v1/score", content=content, headers=JSON)
        body = assert_one_shape(reply, 422, "invalid request")
        assert body["detail"] == [{"loc": ["body"], "msg": why, "type": "json_invalid"}]


def test_registry_faults_and_service_faults_are_500_json(
    edge: Served, redis_for_edges: RedisServer, prefix: str
) -> None:
    client = redis_for_edges.client()
    meta = NamespaceKeys("node-c", prefix).meta
    saved = client.dump(meta)
    try:
        client.delete(meta)
        client.set(meta, MARKER)  # another type where node-c's meta belongs
        request = {"block_hashes": H, "namespaces": ["node-c"]}
        body = assert_one_shape(edge.score(request), 500, "registry fault")
        assert "WRONGTYPE" in body["detail"] or "type" in body["detail"]
    finally:
        client.delete(meta)
        if saved is not None:
            client.restore(meta, 0, saved)
        client.close()
    assert edge.score({"block_hashes": H}).status_code == 200
    router = edge.app.state.registry.router

    async def broken(*_args: Any) -> Any:
        raise RuntimeError(MARKER)

    try:
        router.decide = broken  # a fault of the service itself
        body = assert_one_shape(edge.score({"block_hashes": H}), 500, "internal error")
        assert body["detail"] == "RuntimeError"
    finally:
        del router.decide


def test_redis_down_is_503_json(own_server: RedisServer) -> None:
    prefix = f"dn{uuid.uuid4().hex[:8]}"
    served = Served(own_server.url, prefix)
    try:
        own_server.kill()
        body = assert_one_shape(
            served.score({"block_hashes": H, "namespaces": [MARKER]}), 503, "unavailable"
        )
        assert "Redis unavailable" in body["detail"]
        assert_one_shape(served.http.get("/health"), 503, "unhealthy")
        assert_one_shape(served.http.get("/v1/nodes"), 503, "unavailable")
    finally:
        served.close()


# -- protocol errors and slow clients: answered by pcr serve's HTTP protocol ------------


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=CLOSED_BY)


def read_until_closed(sock: socket.socket, started: float) -> bytes:
    """Everything the server sends until it closes the connection; fails when that has
    not happened ``CLOSED_BY`` seconds after ``started``."""
    received = b""
    while True:
        left = started + CLOSED_BY - time.monotonic()
        assert left > 0, f"the connection was still open after {CLOSED_BY} s: {received!r}"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue  # the assertion above fails next
        except ConnectionResetError:
            return received  # closed too (what was not read yet may be lost)
        if not chunk:
            return received
        received += chunk


def json_answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json", raw
    assert headers["connection"] == "close", raw
    return int(lines[0].split()[1]), json.loads(body)


def answers_others(served: Served) -> bool:
    return bool(httpx.get(f"{served.base}/live", timeout=CLOSED_BY).status_code == 200)


def test_malformed_http_is_400_json(edge: Served) -> None:
    with connect(edge.port) as sock:
        sock.sendall(f"NOT HTTP {MARKER}\r\n\r\n".encode())
        status, body = json_answer(read_until_closed(sock, time.monotonic()))
    assert (status, body["error"]) == (400, "bad request")
    assert MARKER not in json.dumps(body)


def test_headers_over_the_limit_are_431_json(edge: Served) -> None:
    with connect(edge.port) as sock:
        sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10))
        status, body = json_answer(read_until_closed(sock, time.monotonic()))
    assert (status, body["error"]) == (431, "request headers too large")


def test_many_complete_headers_over_the_limit_are_431_json(edge: Served) -> None:
    """A head of 400 complete headers (24 KiB) and its end in one send: counted as the
    parser reads each header, so refused before any endpoint runs."""
    headers = b"".join(b"X-H%03d: %s\r\n" % (i, b"v" * 50) for i in range(400))
    with connect(edge.port) as sock:
        sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        status, body = json_answer(read_until_closed(sock, time.monotonic()))
    assert (status, body["error"]) == (431, "request headers too large")


def test_a_head_under_the_limit_with_a_large_body_in_one_send_is_served(edge: Served) -> None:
    """12 KiB of headers and a 1 MiB body in one send: only the head counts."""
    headers = b"".join(b"X-H%03d: %s\r\n" % (i, b"v" * 50) for i in range(200))
    body = json.dumps({"block_hashes": [1], "pad": "p" * (1 << 20)}).encode()
    request = (
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        + body
    )
    with connect(edge.port) as sock:
        sock.sendall(request)
        received = read_until_closed(sock, time.monotonic())
    assert not received.startswith(b"HTTP/1.1 431"), received[:200]
    assert received.startswith(b"HTTP/1.1 422 "), received[:200]  # the unknown field "pad"


def test_pipelined_requests_are_answered_in_order(edge: Served) -> None:
    """Three requests in one send: three answers, in order, then keep-alive ends it."""
    score = json.dumps({"block_hashes": [1]}).encode()
    request = (
        b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(score)
        + score
        + b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    started = time.monotonic()
    with connect(edge.port) as sock:
        sock.sendall(request)
        received = read_until_closed(sock, started)
    statuses = [int(part[:3]) for part in received.split(b"HTTP/1.1 ")[1:] if part[:3].isdigit()]
    assert statuses == [200, 200, 404], received[:600]


def test_a_service_fault_keeps_the_connection(edge: Served) -> None:
    """A fault of the service itself (its router raises) is answered 500 and the
    connection goes on: the requests pipelined behind it on the same connection are
    answered too (a closed connection would leave a keep-alive client's next request
    unanswered)."""
    router = edge.app.state.registry.router

    async def broken(*_args: Any) -> Any:
        raise RuntimeError(MARKER)

    score = json.dumps({"block_hashes": [1]}).encode()
    request = (
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(score)
        + score
        + b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    router.decide = broken
    try:
        started = time.monotonic()
        with connect(edge.port) as sock:
            sock.sendall(request)
            received = read_until_closed(sock, started)
    finally:
        del router.decide
    statuses = [int(part[:3]) for part in received.split(b"HTTP/1.1 ")[1:] if part[:3].isdigit()]
    assert statuses == [500, 200, 404], received[:600]
    assert MARKER.encode() not in received
    assert b"Traceback" not in received


def test_headers_sent_a_byte_at_a_time_are_cut_off(edge: Served) -> None:
    """Slowloris: each byte restarts uvicorn's keep-alive timer, never the header
    deadline; meanwhile the service answers other clients."""
    request = b"GET /live HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"s" * 10_000
    started = time.monotonic()
    with connect(edge.port) as sock:
        received = b""
        for i, byte in enumerate(request):
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed by the server while we were still sending
                break
            if i == 5:
                assert answers_others(edge)
            sock.settimeout(0.05)  # the pace of the drip, and a look for the answer
            try:
                received = sock.recv(65536)
            except TimeoutError:
                assert time.monotonic() - started < CLOSED_BY, "still open"
                continue
            break
        received += read_until_closed(sock, started)
    assert time.monotonic() - started < CLOSED_BY
    status, body = json_answer(received)
    assert (status, body["error"]) == (408, "request timeout")
    assert answers_others(edge)


def test_a_body_that_never_completes_is_cut_off(edge: Served) -> None:
    started = time.monotonic()
    with connect(edge.port) as sock:
        sock.sendall(
            b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"block_hashes": [1, 2'
        )
        assert answers_others(edge)
        status, body = json_answer(read_until_closed(sock, started))
    assert (status, body["error"]) == (408, "request timeout")
    assert "body" in body["detail"]


def test_a_body_the_endpoint_never_reads_still_has_a_deadline(edge: Served) -> None:
    """GET /health answers at once; the body it did not read must still arrive in time."""
    started = time.monotonic()
    with connect(edge.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        received = read_until_closed(sock, started)
    assert received.startswith(b"HTTP/1.1 200 ")


def test_idle_connections_are_closed(edge: Served) -> None:
    started = time.monotonic()
    with connect(edge.port) as sock:  # opened, and nothing sent
        assert read_until_closed(sock, started) == b""
    started = time.monotonic()
    with connect(edge.port) as sock:  # a request, then a next one that never completes
        sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\nGET /live HTTP/1.1\r\nHo")
        received = read_until_closed(sock, started)
    first, _, rest = received.partition(b"HTTP/1.1 408 ")
    assert first.startswith(b"HTTP/1.1 200 "), received
    assert rest, received
    started = time.monotonic()
    with connect(edge.port) as sock:  # a request answered, then silence: keep-alive ends it
        sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
        received = read_until_closed(sock, started)
    assert received.startswith(b"HTTP/1.1 200 "), received
    assert b"408" not in received


def test_the_pcr_serve_command_has_the_deadlines(redis_for_edges: RedisServer) -> None:
    served = ServeProcess(
        "--redis-url", redis_for_edges.url, "--header-timeout", "1", "--body-timeout", "1",
        "--max-connections", "4", "--pool-timeout", "2",
    ).start()  # fmt: skip
    port = served.port
    try:
        started = time.monotonic()
        with connect(port) as sock:
            sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n")
            status, body = json_answer(read_until_closed(sock, started))
        assert (status, body["error"]) == (408, "request timeout")
        with connect(port) as sock:
            sock.sendall(b"BAD\r\n\r\n")
            assert json_answer(read_until_closed(sock, time.monotonic()))[0] == 400
    finally:
        code = served.stop()
    assert code == 0, served.err
    assert "Traceback" not in served.err
