"""``pcr gateway`` as a real process, in front of fake engines (``FakeEngine``) and a real
redis-server, used the way a hostile client and an operator would: backends that refuse
connections, drop them before a byte, die mid-stream or answer 500; clients that give up;
Redis killed or frozen mid-run; bodies, paths, methods and HTTP that are wrong; and
command lines that are wrong.

What is asserted, each case in its test's docstring: no request fails for what the
gateway can route around (a refused backend, one that fails before its first byte, Redis
away or stalled); what it cannot route around is said in the OpenAI error shape, never a
traceback, never the request's own data; nothing is retried once a byte went to the
client, and a backend's own answer is passed through as it is. Waits poll a condition
(``wait_until``, a socket read with a deadline), never sleep; the only timing bound is
the one a test is about (a stalled Redis must not slow a request past 1.5 s).

Four of them found gateway bugs, fixed since: a client leaving before a non-streamed
reply starts went unnoticed; a stream its backend broke counted as two errors; SIGTERM
often left the gateway hung in its shutdown (a cancellation lost inside redis-py); a body
that stopped short logged a traceback."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from pcr.bench.servers import RedisServer  # noqa: E402
from registry import PrefixCacheRegistry  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.fake_engine import FakeEngine  # noqa: E402
from tests.support.servers import HOST, refused_port  # noqa: E402
from tests.support.serving import ServeProcess  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from tests.system.test_serve_http_edges import json_answer, read_until_closed  # noqa: E402

MARKER = "QvW-gateway-marker"
"""Put into every bad request; no reply may repeat it."""
CLOSED_BY = 15.0
"""A connection the gateway must close is closed before this many seconds."""
GRACE = 5.0
"""Seconds a gateway stopped at the end of a test has to end before it is killed (its
own shutdown takes well under one; ``test_sigterm_ends_the_gateway`` checks it)."""
STALL_BOUND = 1.5
"""With Redis frozen, each request must be answered within this many seconds (the
gateway waits ``--registry-timeout`` 0.25 s for Redis, Redis' own read timeout is 2 s)."""

# -- helpers ------------------------------------------------------------------------------


def tokens(n: int, length: int = 48) -> list[int]:
    """A prompt of token ids of its own (``n`` distinct: distinct prompts)."""
    return [100_000 + n * 1_000 + i for i in range(length)]


def completion(n: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": tokens(n), "max_tokens": 4}


def chat(n: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"question {n}"}]}


def key_prefix() -> str:
    """A key prefix of the test's own: the replicas' load table in Redis is per prefix."""
    return f"gf{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def running(
    redis_url: str,
    engines: Sequence[FakeEngine] = (),
    *options: str,
    others: Mapping[str, str] | None = None,
    prefix: str | None = None,
) -> Iterator[ServeProcess]:
    """``pcr gateway`` with ``engines`` (started here) and ``others`` (namespace -> URL)
    as its backends, on ``prefix`` (default: a key prefix of its own). Whatever happens,
    the engines are let go (a held reply would hold the gateway's shutdown), the gateway
    is stopped and then the engines; when the test passed, the gateway must also have
    exited 0 (or hung in its shutdown: ``stop``) and printed no traceback."""
    started: list[FakeEngine] = []
    served: ServeProcess | None = None
    code: int | None = 0
    try:
        for engine in engines:
            started.append(engine.start())
        backends = [f"{e.name}={e.url}" for e in engines]
        backends += [f"{name}={url}" for name, url in (others or {}).items()]
        args = ["--redis-url", redis_url, "--key-prefix", prefix or key_prefix(), *options]
        for backend in backends:
            args += ["--backend", backend]
        served = ServeProcess(*args, path="/health", command="gateway").start()
        yield served
    finally:
        for engine in started:
            engine.chunk_gate = None
            engine.release.set()
        if served is not None and served.process is not None:
            code = stop(served)
        for engine in started:
            engine.stop()
    assert served is not None
    assert code in (0, None), served.err  # None: hung in its shutdown (a known bug), killed
    assert "Traceback" not in served.err, served.err


def stop(served: ServeProcess) -> int | None:
    """SIGTERM, then the exit status; None when the gateway had not ended ``GRACE``
    seconds later (it is killed then: ``test_sigterm_ends_the_gateway`` is about that)."""
    assert served.process is not None
    served.process.terminate()
    try:
        served.process.wait(GRACE)
    except subprocess.TimeoutExpired:
        served.process.kill()
        served.stop()
        return None
    return served.stop()


def post(served: ServeProcess, path: str, body: Any, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{served.base}{path}", json=body, timeout=timeout)


def health(served: ServeProcess) -> dict[str, Any]:
    reply = httpx.get(f"{served.base}/health", timeout=30)
    assert reply.status_code in (200, 503), reply.text
    body: dict[str, Any] = reply.json()
    return body


def metric(served: ServeProcess, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on the gateway's ``/metrics`` whose labels include
    ``labels`` (0 when there are none)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.base}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def in_flight(served: ServeProcess) -> float:
    return metric(served, "pcr_gateway_in_flight")


def assert_openai_error(reply: httpx.Response, status: int) -> dict[str, Any]:
    """``reply`` is the gateway's own error: ``status``, JSON in the OpenAI shape, neither a
    traceback nor the request's marker in it."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    assert MARKER not in reply.text
    assert "Traceback" not in reply.text
    return openai_shape(reply.json(), status)


def openai_shape(body: Any, status: int) -> dict[str, Any]:
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str), body
    assert error["message"], body
    assert isinstance(error["type"], str), body
    assert error["param"] is None, body
    assert error["code"] == status, body
    assert type(error["code"]) is int, body
    return dict(error)


class ClosingServer:
    """A TCP server that accepts each connection and closes it at once, before a byte:
    a backend that fails before its first byte. ``accepted`` counts the connections."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)  # the accept loop's look at ``_stop``
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            connection.close()

    def __enter__(self) -> ClosingServer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sock.close()


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, as they come."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


# -- 1. a backend that refuses connections ----------------------------------------------


def test_a_refusing_backend_is_passed_over_and_comes_back(redis_server: RedisServer) -> None:
    """Engine ``a`` stopped (its port refuses): 20 requests all get 200 from ``b``, each
    once; the refusals are counted (``kind="connect"`` errors, retries) and ``/health``
    says ``a`` is ``refusing``. Started again on the same port, ``a`` gets requests again
    (the gateway passes a refused backend over for 2 s, then tries it). Scraping is off,
    so only requests find the refusal out."""
    a, b = FakeEngine("a"), FakeEngine("b")
    with running(redis_server.url, [a, b], "--scrape-interval", "0") as served:
        a.stop()
        for n in range(20):
            reply = post(served, "/v1/completions", completion(n))
            assert reply.status_code == 200, reply.text
            assert reply.json()["by"] == "b"
        assert len(b.received) == 20  # each request once: a refused one is not sent twice
        assert metric(served, "pcr_gateway_errors_total", backend="a", kind="connect") >= 1
        assert metric(served, "pcr_gateway_retries_total", backend="a") >= 1
        assert metric(served, "pcr_gateway_errors_total", backend="b") == 0

        def refused_and_said() -> bool:  # a request finds the refusal, /health says it
            assert post(served, "/v1/completions", completion(100)).status_code == 200
            return bool(health(served)["backends"] == {"a": "refusing", "b": "up"})

        wait_until(refused_and_said, 60, "/health to say a is refusing")
        assert health(served)["status"] == "ok"

        a.start()  # the same port
        serial = itertools.count(200)

        def a_serves() -> bool:
            reply = post(served, "/v1/completions", completion(next(serial)))
            assert reply.status_code == 200, reply.text
            return reply.json()["by"] == "a"

        wait_until(a_serves, 60, "a to get requests again")
        assert a.received
        wait_until(lambda: health(served)["backends"]["a"] == "up", 60, "a to be up")


# -- 2. a failure before the first byte ---------------------------------------------------


def test_a_failure_before_the_first_byte_is_retried_on_the_next_backend(
    redis_server: RedisServer,
) -> None:
    """Backend ``a`` accepts each connection and closes it before a byte: every request
    still gets 200 from ``b``, which receives each exactly once; the failures are counted
    (``kind="protocol"``) and so are the retries. Scraping is off: every choice of ``a``
    is found out by a request."""
    b = FakeEngine("b")
    with (
        ClosingServer() as closing,
        running(
            redis_server.url, [b], "--scrape-interval", "0", others={"a": closing.url}
        ) as served,
    ):
        count = 20
        for n in range(count):
            body = completion(n) if n % 2 else chat(n)
            path = "/v1/completions" if n % 2 else "/v1/chat/completions"
            reply = post(served, path, body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["by"] == "b"
        assert len(b.received) == count
        assert closing.accepted >= 1
        failed = metric(served, "pcr_gateway_errors_total", backend="a")
        retried = metric(served, "pcr_gateway_retries_total", backend="a")
        assert failed >= 1
        assert retried == failed  # each failure of a was retried, once
        assert metric(served, "pcr_gateway_errors_total", backend="b") == 0
        assert in_flight(served) == 0


def test_both_backends_failing_before_a_byte_is_502(redis_server: RedisServer) -> None:
    """Both backends close each connection before a byte: the client gets 502 in the
    OpenAI shape after one try on each, without the request's data; so do two backends
    that refuse connections (both passed over, so both tried), never a hang."""
    with (
        ClosingServer() as first,
        ClosingServer() as second,
        running(
            redis_server.url, [], "--scrape-interval", "0",
            others={"a": first.url, "b": second.url},
        ) as served,
    ):  # fmt: skip
        body = {"model": "tiny", "prompt": f"say {MARKER}", "max_tokens": 1}
        error = assert_openai_error(post(served, "/v1/completions", body), 502)
        assert error["type"] == "server_error"
        assert first.accepted >= 1
        assert second.accepted >= 1  # the retry went to the other one
        assert in_flight(served) == 0
    with (
        refused_port() as one,
        refused_port() as two,
        running(
            redis_server.url, [], "--scrape-interval", "0",
            others={"a": f"http://{HOST}:{one}", "b": f"http://{HOST}:{two}"},
        ) as served,
    ):  # fmt: skip
        for _ in range(3):  # the first finds both refusing; then both are passed over
            body = {"model": "tiny", "messages": [{"role": "user", "content": MARKER}]}
            assert_openai_error(post(served, "/v1/chat/completions", body), 502)
        assert metric(served, "pcr_gateway_errors_total", kind="connect") >= 2


# -- 3. never retried once bytes went out -------------------------------------------------


def stream_then_kill(served: ServeProcess, a: FakeEngine, b: FakeEngine) -> FakeEngine:
    """A streamed completion whose engine is killed once the client has its first chunk;
    the chunks the client got are checked (that one only), and the killed engine
    returned, once the gateway has nothing in flight."""
    for engine in (a, b):
        engine.chunk_gate = threading.Semaphore(1)  # the first chunk, then hold
    body = {**completion(1), "stream": True}
    got: list[str] = []
    with httpx.stream("POST", f"{served.base}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        events = sse_events(reply.iter_lines())
        got.append(next(events))
        serving = a if a.received else b
        assert len(serving.received) == 1
        serving.kill()
        with contextlib.suppress(httpx.RemoteProtocolError):  # a connection cut: an end too
            got.extend(events)
    events_got = [json.loads(e) for e in got]
    assert events_got[0] == {"by": serving.name, "i": 0}, got
    # then the break said in the stream (OpenAI's error shape), never a clean [DONE]
    assert len(events_got) == 2, got
    assert events_got[1]["error"]["code"] == 502, got
    wait_until(lambda: in_flight(served) == 0, 30, "the gateway's in-flight gauge at 0")
    return serving


def test_a_stream_whose_backend_dies_is_not_retried(redis_server: RedisServer) -> None:
    """A streamed completion whose engine dies after its first chunk: the client has the
    first chunk, then an error event and the end (no ``[DONE]``); the other engine
    received nothing:
    a request is never sent twice once a byte went to the client. The gateway counts the
    break as a ``protocol`` error and its in-flight gauge returns to 0."""
    a, b = FakeEngine("a", chunks=5), FakeEngine("b", chunks=5)
    with running(redis_server.url, [a, b]) as served:
        serving = stream_then_kill(served, a, b)
        other = b if serving is a else a
        assert other.received == []
        assert metric(served, "pcr_gateway_retries_total") == 0
        errors = "pcr_gateway_errors_total"
        assert metric(served, errors, backend=serving.name, kind="protocol") == 1


def test_a_stream_whose_backend_dies_is_one_error(redis_server: RedisServer) -> None:
    """The engine broke the stream, the client stayed: one error, ``protocol``, and no
    ``cancelled`` (which says the client went away first)."""
    a, b = FakeEngine("a", chunks=5), FakeEngine("b", chunks=5)
    with running(redis_server.url, [a, b]) as served:
        serving = stream_then_kill(served, a, b)
        assert metric(served, "pcr_gateway_errors_total", backend=serving.name) == 1


# -- 4. a client that leaves cancels the upstream request ---------------------------------


def send_and_leave(
    served: ServeProcess, body: dict[str, Any], engines: tuple[FakeEngine, ...]
) -> None:
    """A whole request on a raw socket, the socket closed once an engine has it: a client
    that gave up while the engine works. (A client that leaves before that is not sent
    on at all.)"""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((HOST, served.port), timeout=CLOSED_BY) as sock:
        sock.sendall(head + data)
        wait_until(lambda: sum(len(e.received) for e in engines) == 1, 30, "the request sent")


def test_a_client_that_leaves_cancels_a_whole_reply(redis_server: RedisServer) -> None:
    """A non-streamed completion held by the engine (it sends nothing, headers included,
    until it has the whole reply, as vLLM does); the client sends it and closes its
    socket: the engine sees its request cancelled and the gateway's in-flight gauge
    returns to 0, while the engine still holds its replies."""
    a, b = FakeEngine("a"), FakeEngine("b")
    with running(redis_server.url, [a, b]) as served:
        a.release.clear()
        b.release.clear()
        send_and_leave(served, completion(1), (a, b))
        wait_until(lambda: a.cancelled + b.cancelled == 1, 10, "the engine to see it cancelled")
        wait_until(lambda: in_flight(served) == 0, 10, "the in-flight gauge at 0")


def test_a_client_that_leaves_a_stream_cancels_it(redis_server: RedisServer) -> None:
    """A streamed completion; the client reads its first chunk and closes: the engine
    sees the request cancelled (while it holds the next chunk), the gateway's in-flight
    gauge returns to 0, and nothing was sent to the other engine."""
    a, b = FakeEngine("a", chunks=5), FakeEngine("b", chunks=5)
    with running(redis_server.url, [a, b]) as served:
        for engine in (a, b):
            engine.chunk_gate = threading.Semaphore(1)
        body = {**completion(1), "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{served.base}/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            first = next(sse_events(reply.iter_lines()))
            assert json.loads(first)["i"] == 0
        # the response and the client are closed: the connection is gone
        serving, other = (a, b) if a.received else (b, a)
        wait_until(lambda: serving.cancelled == 1, 30, "the engine to see the stream cancelled")
        assert serving.completed == 0
        assert other.received == []
        wait_until(lambda: in_flight(served) == 0, 30, "the in-flight gauge at 0")
        assert metric(served, "pcr_gateway_errors_total", backend=serving.name, kind="cancelled")


# -- 5 and 6. Redis killed, Redis frozen ---------------------------------------------------


@pytest.mark.parametrize("mode", [[], ["--no-view"]], ids=["view", "no-view"])
def test_redis_killed_mid_run_fails_no_request(own_server: RedisServer, mode: list[str]) -> None:
    """60 requests (token-id completions and chat completions in turn), Redis killed
    after 20: none fails. ``/health`` (still 200) says the registry is away, the gauge
    ``pcr_gateway_registry_up`` is 0 and the decisions made without it are counted
    ``registry_away``. Redis back on the same port: the registry is ``reachable`` again."""
    a, b = FakeEngine("a"), FakeEngine("b")
    with running(own_server.url, [a, b], *mode) as served:
        failed = []
        for n in range(60):
            if n == 20:
                own_server.kill()
            path, body = (
                ("/v1/completions", completion(n)) if n % 2 else ("/v1/chat/completions", chat(n))
            )
            reply = post(served, path, body)
            if reply.status_code != 200:
                failed.append((n, reply.status_code, reply.text))
        assert failed == []
        assert len(a.received) + len(b.received) == 60
        reply = httpx.get(f"{served.base}/health", timeout=30)
        assert reply.status_code == 200
        assert reply.json()["registry"] == "away"
        assert reply.json()["routing"] == "load"
        assert metric(served, "pcr_gateway_registry_up") == 0
        away = metric(served, "pcr_gateway_routing_decisions_total", outcome="registry_away")
        assert away > 0

        own_server.restart()  # the same port, an empty Redis
        serial = itertools.count(1000)

        def reachable() -> bool:  # requests with token ids try Redis again
            assert post(served, "/v1/completions", completion(next(serial))).status_code == 200
            return bool(health(served)["registry"] == "reachable")

        wait_until(reachable, 60, "the registry to be reachable again")
        assert metric(served, "pcr_gateway_registry_up") == 1
        assert health(served)["routing"] == "prefix"


@pytest.mark.parametrize("mode", [[], ["--no-view"]], ids=["view", "no-view"])
def test_redis_frozen_does_not_slow_requests_past_the_registry_timeout(
    own_server: RedisServer, mode: list[str]
) -> None:
    """Redis frozen (SIGSTOP, so connections open and nothing answers): each request is
    still answered 200 within 1.5 s, though Redis' own read timeout is 2 s (the gateway
    scores from its fleet view, which needs no Redis per request, and routes by load once
    the view has not heard from Redis for a few seconds). Thawed, the registry is
    reachable again."""
    assert own_server.process is not None
    pid = own_server.process.pid
    a, b = FakeEngine("a"), FakeEngine("b")
    with running(own_server.url, [a, b], "--registry-timeout", "0.25", *mode) as served:
        assert post(served, "/v1/completions", completion(0)).status_code == 200
        assert health(served)["registry"] == "reachable"
        os.kill(pid, signal.SIGSTOP)
        try:
            took = []
            for n in range(1, 16):
                path, body = (
                    ("/v1/completions", completion(n))
                    if n % 3
                    else ("/v1/chat/completions", chat(n))
                )
                started = time.monotonic()
                reply = post(served, path, body)
                took.append(time.monotonic() - started)
                assert reply.status_code == 200, reply.text
            assert max(took) < STALL_BOUND, took

            def away() -> bool:  # the fleet view stops hearing from Redis: it says so
                started = time.monotonic()
                assert post(served, "/v1/completions", completion(99)).status_code == 200
                assert time.monotonic() - started < STALL_BOUND
                return bool(health(served)["registry"] == "away")

            wait_until(away, 60, "the registry to be away")
            assert post(served, "/v1/completions", completion(98)).status_code == 200
            assert metric(served, "pcr_gateway_routing_decisions_total", outcome="registry_away")
        finally:
            os.kill(pid, signal.SIGCONT)
        serial = itertools.count(1000)

        def reachable() -> bool:
            assert post(served, "/v1/completions", completion(next(serial))).status_code == 200
            return bool(health(served)["registry"] == "reachable")

        wait_until(reachable, 60, "the registry to be reachable again")


# -- stopping ------------------------------------------------------------------------------
# (Not the file's last test: the module fixtures' teardown runs in the last test's, and a
# strict xfail there would take their failures for its own.)


@pytest.mark.timeout(300)  # 10 gateways started and stopped, on a busy machine
def test_sigterm_ends_the_gateway(redis_server: RedisServer) -> None:
    """An operator's SIGTERM ends ``pcr gateway`` with exit 0, every time: 10 gateways in
    turn, each idle in front of an engine and Redis, each ended within 15 s. (The hang
    is a race: about every other stop hangs here, so 10 clean stops in a row do not
    happen by chance.)"""
    engine = FakeEngine("a").start()
    try:
        for _ in range(10):
            served = ServeProcess(
                "--redis-url", redis_server.url, "--key-prefix", key_prefix(),
                "--backend", f"a={engine.url}", path="/health", command="gateway",
            ).start()  # fmt: skip
            assert served.process is not None
            served.process.terminate()
            try:
                code = served.process.wait(CLOSED_BY)
            finally:
                if served.process.poll() is None:
                    served.process.kill()
                served.stop()
            assert code == 0, served.err
            assert "Traceback" not in served.err
    finally:
        engine.stop()


# -- 7. bad input -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def edge_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def edge(edge_redis: RedisServer) -> Iterator[ServeProcess]:
    """One gateway for the bad-input cases, with 1 s header and body deadlines."""
    engine = FakeEngine("a")
    with running(
        edge_redis.url, [engine], "--header-timeout", "1", "--body-timeout", "1"
    ) as served:
        yield served
    assert engine.received == []  # no bad request reached the engine


JSON = {"content-type": "application/json"}

BAD_BODIES = [
    ("/v1/completions", f'{{"prompt": "{MARKER}'.encode()),  # cut short
    ("/v1/completions", f"prompt={MARKER}".encode()),  # a form, not JSON
    ("/v1/chat/completions", f'["{MARKER}"]'.encode()),  # an array
    ("/v1/chat/completions", b"42"),  # a number
    ("/v1/completions", f'"{MARKER}"'.encode()),  # a string
    ("/v1/completions", b"null"),
    ("/v1/completions", f'{{"prompt": "\xff{MARKER}"}}'.encode("latin-1")),  # not UTF-8
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000),  # nested past the parser
    ("/v1/completions", b""),  # no body at all
]


@pytest.mark.parametrize(("path", "content"), BAD_BODIES, ids=[str(i) for i in range(9)])
def test_a_body_that_is_not_a_json_object_is_400(
    edge: ServeProcess, path: str, content: bytes
) -> None:
    """Not JSON, or JSON but not an object: 400 in the OpenAI shape, without the body."""
    reply = httpx.post(f"{edge.base}{path}", content=content, headers=JSON, timeout=30)
    error = assert_openai_error(reply, 400)
    assert error["type"] == "invalid_request_error"


BIG = b'{"prompt": "' + MARKER.encode() * ((33 << 20) // len(MARKER)) + b'"}'
"""A body over the 32 MiB limit."""


def test_a_body_over_32_mib_is_413(edge: ServeProcess) -> None:
    """Over the 32 MiB limit by its Content-Length: 413, before it is read."""
    reply = httpx.post(f"{edge.base}/v1/completions", content=BIG, headers=JSON, timeout=60)
    assert_openai_error(reply, 413)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", f"/v1/{MARKER}", 404),
        ("POST", f"/{MARKER}/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("PUT", "/health", 405),
        ("POST", "/v1/models", 405),
    ],
)
def test_unknown_paths_and_wrong_methods(
    edge: ServeProcess, method: str, path: str, status: int
) -> None:
    """An unknown path is 404 (``not_found_error``), a wrong method 405 with ``Allow``."""
    reply = httpx.request(method, f"{edge.base}{path}", json={"x": MARKER}, timeout=30)
    error = assert_openai_error(reply, status)
    if status == 404:
        assert error["type"] == "not_found_error"
    else:
        assert reply.headers["allow"]


def test_malformed_http_is_400_in_the_openai_shape(edge: ServeProcess) -> None:
    with socket.create_connection((HOST, edge.port), timeout=CLOSED_BY) as sock:
        sock.sendall(f"NOT HTTP {MARKER}\r\n\r\n".encode())
        raw = read_until_closed(sock, time.monotonic())
    status, body = json_answer(raw)
    assert status == 400
    openai_shape(body, 400)
    assert MARKER.encode() not in raw


def answer_408(port: int, request: bytes) -> None:
    """``request`` sent and never finished is answered 408 in the OpenAI shape, the
    connection closed before 15 s, without the request's marker."""
    started = time.monotonic()
    with socket.create_connection((HOST, port), timeout=CLOSED_BY) as sock:
        sock.sendall(request)
        raw = read_until_closed(sock, started)
    status, body = json_answer(raw)
    assert status == 408, raw
    openai_shape(body, 408)
    assert MARKER.encode() not in raw


def test_headers_that_never_finish_are_408(edge: ServeProcess) -> None:
    """Headers begun and never finished: 408 after the 1 s header deadline."""
    answer_408(edge.port, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-{MARKER}: 1\r\n".encode())


UNFINISHED_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n" + f'{{"prompt": "{MARKER}'.encode()
)


def test_a_body_cut_short_logs_no_traceback(redis_server: RedisServer) -> None:
    """Bodies that stop short: a client that leaves mid-body, a body that never finishes
    (408 after the 1 s body deadline), one over 32 MiB without a Content-Length (413 once
    the count passes the limit). Each is answered in the OpenAI shape, and the gateway
    logs no traceback for any (``running`` reads its stderr once it stopped)."""
    engine = FakeEngine("a")
    with running(redis_server.url, [engine], "--body-timeout", "1") as served:
        with socket.create_connection((HOST, served.port), timeout=CLOSED_BY) as sock:
            sock.sendall(UNFINISHED_BODY)  # and gone
        answer_408(served.port, UNFINISHED_BODY)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(BIG), 1 << 20):
            yield BIG[start : start + (1 << 20)]

    # The default body deadline (20 s): 32 MiB must not race a 1 s deadline on a busy machine.
    with running(redis_server.url, [engine]) as served:
        url = f"{served.base}/v1/completions"
        assert_openai_error(httpx.post(url, content=chunks(), headers=JSON, timeout=60), 413)
    assert engine.received == []


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"block_hashes": [MARKER]}).encode(),
        json.dumps({"block_hashes": [1], MARKER: 1}).encode(),
        json.dumps({"block_hashes": [1], "namespaces": [f"a {MARKER}"]}).encode(),
        f'{{"block_hashes": [{MARKER}'.encode(),
        f'["{MARKER}"]'.encode(),
    ],
    ids=["hash", "field", "namespace", "not-json", "array"],
)
def test_a_bad_score_is_422_in_the_openai_shape(edge: ServeProcess, content: bytes) -> None:
    reply = httpx.post(f"{edge.base}/v1/score", content=content, headers=JSON, timeout=30)
    assert assert_openai_error(reply, 422)["type"] == "invalid_request_error"


# -- 8. command-line mistakes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on: a usage error must be found before the
    gateway binds its port, and one missed ends in "cannot listen" (exit 1), not a hang."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen(1)
        yield int(taken.getsockname()[1])


def pcr_gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pcr", "gateway", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess[str], code: int) -> None:
    assert done.returncode == code, done.stderr
    assert done.stderr.startswith("pcr gateway: error: "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


FILES = {
    "not-json": f"{{backends: {MARKER}",
    "a-list": '["http://127.0.0.1:1"]',
    "no-table": '{"engines": {"a": "http://127.0.0.1:1"}}',
    "table-a-list": '{"backends": ["http://127.0.0.1:1"]}',
    "url-a-number": '{"backends": {"a": 8000}}',
    "bad-url": '{"backends": {"a": "ftp://127.0.0.1:1"}}',
    "bad-namespace": '{"backends": {"a b": "http://127.0.0.1:1"}}',
    "not-utf8": b'{"backends": {"\xff": "http://127.0.0.1:1"}}'.decode("latin-1"),
}


@pytest.mark.parametrize(
    "args",
    [
        ["--backend", "nonsense"],
        ["--backend", "ns=ftp://x"],
        ["--backend", "a{b}=http://x:1"],
        ["--backend", "=http://x:1"],
        ["--backend", "a=http://x:1", "--backend", "a=http://y:1"],
        ["--backends", "/nonexistent.json"],
        ["--tokenizer", "/nonexistent"],
        ["--queue-weight", "-1"],
        ["--spread-weight", "nan"],
        ["--half-life", "0"],
        ["--registry-timeout", "0"],
        ["--upstream-timeout", "inf"],
        ["--scrape-interval", "-1"],
        ["--policy", "random"],
        ["--block-size", "0"],
        ["--redis-url", "http://127.0.0.1:1"],
    ],
    ids=lambda args: " ".join(args),
)
def test_usage_errors_are_one_line_exit_2(taken_port: int, args: list[str]) -> None:
    assert_one_line(pcr_gateway(*args, "--port", str(taken_port)), 2)


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_bad_backends_file_is_one_line_exit_2(taken_port: int, tmp_path: Path, name: str) -> None:
    path = tmp_path / "backends.json"
    path.write_bytes(FILES[name].encode("latin-1"))
    done = pcr_gateway("--backends", str(path), "--port", str(taken_port))
    assert_one_line(done, 2)
    assert MARKER not in done.stderr


def test_a_tokenizer_directory_without_a_tokenizer_is_one_line_exit_2(
    taken_port: int, tmp_path: Path
) -> None:
    assert_one_line(pcr_gateway("--tokenizer", str(tmp_path), "--port", str(taken_port)), 2)


def test_a_port_in_use_is_one_line_exit_1(taken_port: int) -> None:
    done = pcr_gateway("--backend", "a=http://127.0.0.1:1", "--port", str(taken_port))
    assert_one_line(done, 1)
    assert done.stderr.startswith(f"pcr gateway: error: cannot listen on 127.0.0.1:{taken_port}")


# -- 9. namespaces without a lease ----------------------------------------------------------


def test_backends_without_a_lease_are_routed_by_load(redis_server: RedisServer) -> None:
    """Namespace ``a`` holds a lease and nothing cached, ``b`` was never claimed: 20
    distinct prompts one after another go to both (neither gets none), all 200, Redis
    reachable throughout (no decision counted ``registry_away``)."""
    a, b = FakeEngine("a"), FakeEngine("b")
    prefix = key_prefix()
    client = redis_server.client()
    try:
        PrefixCacheRegistry(client, "a", key_prefix=prefix).claim(lease_ttl=300)
        with running(redis_server.url, [a, b], prefix=prefix) as served:
            for n in range(20):
                assert post(served, "/v1/completions", completion(n)).status_code == 200
            assert len(a.received) + len(b.received) == 20
            assert a.received
            assert b.received
            assert health(served)["registry"] == "reachable"
            decisions = "pcr_gateway_routing_decisions_total"
            assert metric(served, decisions, outcome="registry_away") == 0
            assert metric(served, decisions, outcome="load") == 20
    finally:
        client.close()


# -- 10. a backend's own error ------------------------------------------------------------


def test_a_backend_answering_500_is_passed_through_not_retried(
    redis_server: RedisServer,
) -> None:
    """Engine ``a`` answers every request 500: a request the gateway sends there gets that
    500 and ``a``'s own body, streamed or not, and is not sent to ``b`` too: each of the
    20 requests reached exactly one engine, and the 500s are as many as ``a`` received."""
    a, b = FakeEngine("a", status=500), FakeEngine("b")
    with running(redis_server.url, [a, b]) as served:
        statuses = []
        for n in range(20):
            body = {**completion(n), "stream": n % 2 == 1}
            reply = post(served, "/v1/completions", body)
            statuses.append(reply.status_code)
            if reply.status_code == 500:
                assert reply.json() == {"error": {"message": "engine says no"}}
            else:
                assert reply.status_code == 200, reply.text
        assert a.received
        assert len(a.received) + len(b.received) == 20
        assert statuses.count(500) == len(a.received)
        assert metric(served, "pcr_gateway_retries_total") == 0
        assert metric(served, "pcr_gateway_errors_total", backend="a", kind="status") == len(
            a.received
        )
        assert in_flight(served) == 0


def test_a_fault_inside_the_gateway_is_500_in_the_openai_shape(redis_server: RedisServer) -> None:
    """A bug in the gateway's own code (here: its choice raises, with the request's
    marker in the message) while proxying, in-process: 500 in the OpenAI shape naming
    only the exception's type, no traceback, no marker; the next request is served."""
    from pcr.gateway.config import GatewayConfig
    from tests.system.test_serve import Served

    engine = FakeEngine("e0").start()
    served = Served(
        redis_server.url,
        f"gw{uuid.uuid4().hex[:8]}",
        gateway=GatewayConfig(backends={"e0": engine.url}, block_size=16),
    )
    try:
        state = served.app.state.gateway
        choose = state.choose

        async def broken(tokens: Any, root: Any = None) -> Any:
            raise RuntimeError(MARKER)

        state.choose = broken
        reply = served.http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 40})
        body = assert_openai_error(reply, 500)
        assert "RuntimeError" in body["message"], body
        assert not engine.received
        state.choose = choose
        reply = served.http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 40})
        assert reply.status_code == 200, reply.text
        assert len(engine.received) == 1
    finally:
        served.close()
        engine.stop()
