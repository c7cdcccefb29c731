"""The connection layer of both services, ``pcr serve`` and ``pcr gateway``, as real
processes: a client whose event loop stalls keeps its kept-alive connections, a request
on a connection the server closed for idleness is retried by the client, and a head over
the limit is refused with 431 and no traceback in the service's output.

The stall is the scenario itself (the client's event loop blocked, as a busy client's
is), never a wait for the service: every assertion holds however slow the machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
aiohttp = pytest.importorskip("aiohttp")

from pcr.bench.servers import RedisServer  # noqa: E402
from pcr.web.server import KEEP_ALIVE_TIMEOUT  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.fake_engine import FakeEngine  # noqa: E402
from tests.support.serving import ServeProcess  # noqa: E402
from tests.support.tiny_tokenizer import build_tokenizer, words  # noqa: E402

CONCURRENT = 32
STALL = 7.0
"""Seconds the client's event loop is blocked: past uvicorn's 5 s keep-alive default."""
SHORT = 1
"""The keep-alive timeout of the service the retry test configures (seconds)."""
SERVICES = ["serve", "gateway"]


@pytest.fixture(scope="module")
def redis_for_connections() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeEngine]:
    made = FakeEngine("a").start()
    try:
        yield made
    finally:
        made.stop()


def service(redis: RedisServer, engine: FakeEngine, command: str, *options: str) -> ServeProcess:
    """``pcr serve`` or ``pcr gateway`` (routing to ``engine``) with ``options``."""
    args = ["--redis-url", redis.url, "--key-prefix", f"cn{uuid.uuid4().hex[:8]}", *options]
    if command == "gateway":
        args += ["--backend", f"a={engine.url}", "--no-announced"]
    return ServeProcess(*args, command=command)


def stopped_cleanly(served: ServeProcess) -> None:
    """Stop ``served``: exit 0 and no traceback, no fatal transport error in its output."""
    code = served.stop()
    assert code == 0, served.err
    assert "Traceback" not in served.err, served.err
    assert "Fatal error" not in served.err, served.err


def request_of(command: str) -> tuple[str, dict[str, Any]]:
    """A POST (which no client retries by itself) each service answers 200."""
    if command == "gateway":
        return "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 1}
    return "/v1/score", {"block_hashes": [1, 2, 3]}


class Client:
    """An aiohttp session with its default connector, counting the connections it opens."""

    def __init__(self) -> None:
        self.opened = 0
        self.failures: list[str] = []

    def trace(self) -> Any:
        config = aiohttp.TraceConfig()

        async def opened(*_args: Any) -> None:
            self.opened += 1

        config.on_connection_create_end.append(opened)
        return config

    async def batch(self, session: Any, method: str, url: str, body: Any) -> int:
        """``CONCURRENT`` requests at once; how many were answered 200."""

        async def one() -> bool:
            try:
                async with session.request(method, url, json=body) as reply:
                    await reply.read()
                    return bool(reply.status == 200)
            except aiohttp.ClientError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                return False

        return sum(await asyncio.gather(*(one() for _ in range(CONCURRENT))))


def stalled_client(base: str, method: str, path: str, body: Any, stall: float) -> dict[str, Any]:
    """``CONCURRENT`` requests, the event loop blocked ``stall`` seconds, ``CONCURRENT``
    more: what each batch got and how many connections each opened."""
    client = Client()

    async def run() -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, trace_configs=[client.trace()]) as s:
            first = await client.batch(s, method, base + path, body)
            opened_first = client.opened
            time.sleep(stall)  # the client stalls: its loop sees nothing meanwhile
            second = await client.batch(s, method, base + path, body)
        return {
            "first": first,
            "second": second,
            "opened_first": opened_first,
            "opened_second": client.opened - opened_first,
            "failures": client.failures,
        }

    return asyncio.run(run())


@pytest.mark.parametrize("command", SERVICES)
def test_a_client_stalled_past_5_s_keeps_its_connections(
    redis_for_connections: RedisServer, engine: FakeEngine, command: str
) -> None:
    """The issue's case with the defaults: 32 POSTs, the client's loop blocked 7 s, 32
    more. With uvicorn's 5 s default the server closed the pooled connections while the
    client could not see it, and the second batch failed on them (``ClientOSError``);
    the default now outlives the clients' pools, so they are still open."""
    assert STALL < KEEP_ALIVE_TIMEOUT
    served = service(redis_for_connections, engine, command).start()
    try:
        path, body = request_of(command)
        result = stalled_client(served.base, "POST", path, body, STALL)
    finally:
        stopped_cleanly(served)
    assert result["failures"] == [], result
    assert (result["first"], result["second"]) == (CONCURRENT, CONCURRENT), result
    assert result["opened_first"] >= 1, result
    assert result["opened_second"] == 0, result  # the same connections, still open


@pytest.mark.parametrize("command", SERVICES)
def test_a_connection_closed_for_idleness_is_retried_by_the_client(
    redis_for_connections: RedisServer, engine: FakeEngine, command: str
) -> None:
    """With ``--keep-alive-timeout 1`` and the client stalled past it, the server closes
    the idle connections while the client cannot see it; the client's next GETs go out on
    them and must end in a way it retries on a new connection (aiohttp retries idempotent
    requests on a reused connection that fails), never an error it reports."""
    served = service(
        redis_for_connections, engine, command, "--keep-alive-timeout", str(SHORT)
    ).start()
    try:
        result = stalled_client(served.base, "GET", "/live", None, SHORT + 2.0)
    finally:
        stopped_cleanly(served)
    assert result["failures"] == [], result
    assert (result["first"], result["second"]) == (CONCURRENT, CONCURRENT), result
    assert result["opened_second"] >= 1, result  # the idle ones were closed: new ones


# -- a head over the limit ---------------------------------------------------------------


def read_all(port: int, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes (a reset ends it too)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        with contextlib.suppress(OSError):  # closed while we still sent: answer waiting
            sock.sendall(request)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk


ONE_LONG_HEADER = b"GET /live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10)
MANY_HEADERS = (
    b"GET /live HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%03d: %s\r\n" % (i, b"v" * 50) for i in range(400))
    + b"\r\n"
)


@pytest.mark.parametrize("command", SERVICES)
def test_a_head_over_16_kib_is_431_without_a_traceback(
    redis_for_connections: RedisServer, engine: FakeEngine, command: str
) -> None:
    """A head over the limit, as one line that never ends and as many complete headers:
    431 in the service's JSON shape, the connection closed, nothing but that on stderr
    (the half-close after the answer was tried twice and raised, before)."""
    served = service(redis_for_connections, engine, command).start()
    try:
        for request in (ONE_LONG_HEADER, MANY_HEADERS, ONE_LONG_HEADER):
            raw = read_all(served.port, request)
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431 "), raw[:300]
            assert b"connection: close" in head.lower(), raw[:300]
            error = json.loads(body)["error"]
            assert error == "request headers too large" or error["code"] == 431, body
        with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
            sock.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # still serving
    finally:
        stopped_cleanly(served)


# -- start-up ----------------------------------------------------------------------------


def test_a_service_that_cannot_start_fails_the_wait_at_once_with_its_error() -> None:
    """The wait ends with the process (no poll until a deadline), showing its stderr."""
    with pytest.raises(AssertionError, match="pcr gateway: error: argument --redis-url"):
        ServeProcess("--redis-url", "http://x", command="gateway").start()


def test_the_gateway_tokenizes_without_torch(tmp_path: Path) -> None:
    """``pcr gateway`` keeps torch out of its process (transformers imports it otherwise,
    most of the start) and still tokenizes as the tokenizer does with torch about."""
    pytest.importorskip("transformers")
    from pcr.gateway.tokens import PromptTokenizer

    build_tokenizer(tmp_path)
    chat = {"messages": [{"role": "user", "content": words([7, 8, 9])}]}
    script = (
        "import json, sys\n"
        "from pcr.cli.gateway import without_torch\n"
        "without_torch()\n"
        "from pcr.gateway.tokens import PromptTokenizer\n"
        f"tokenizer = PromptTokenizer({str(tmp_path)!r})\n"
        f"ids = [tokenizer.completion({words([5, 6])!r}), tokenizer.chat({chat!r})]\n"
        "print(json.dumps({'ids': ids, 'torch': sys.modules.get('torch') is not None}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # nor transformers' advice that torch is missing
    result = json.loads(done.stdout)
    tokenizer = PromptTokenizer(tmp_path)
    assert result == {
        "ids": [tokenizer.completion(words([5, 6])), tokenizer.chat(chat)],
        "torch": False,
    }
