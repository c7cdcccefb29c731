"""``pcr serve`` and ``pcr gateway`` in front of users (issue 42): HTTPS with certificates
the tests make (``tests/support/certificates.py``), client certificates, ``https://``
engines (mutual TLS too), CORS only for the origins given, non-JSON completion bodies
refused, one ``Date`` and no ``Server`` header on replies, and a client that leaves
counted as ``client_closed``. The services run as real processes; the engines are
``FakeEngine``s. Waits poll a condition, never sleep."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from pcr.cli.main import main  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.certificates import (  # noqa: E402
    ClientCert,
    TlsFiles,
    make_client_cert,
    make_tls_files,
)
from tests.support.fake_engine import FakeEngine  # noqa: E402
from tests.support.servers import HOST, RedisServer  # noqa: E402
from tests.support.serving import ServeProcess, metric  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

ORIGIN = "https://app.example.com"
FOREIGN = "https://evil.example.net"
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, ClientCert]:
    files = make_tls_files(tmp_path_factory.mktemp("service-tls"))
    return files, make_client_cert(files)


class HttpsProcess(ServeProcess):
    """A service started with TLS options: its readiness line says https://."""

    @property
    def base(self) -> str:
        return f"https://{HOST}:{self.port}"


def tls_client(files: TlsFiles, client: ClientCert | None = None) -> Any:
    """An httpx client that trusts the test CA (and presents ``client`` when given)."""
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return httpx.Client(verify=context, timeout=30)


def gateway_args(redis_server: RedisServer, *engines: FakeEngine) -> list[str]:
    args = ["--redis-url", redis_server.url, "--key-prefix", f"st{uuid.uuid4().hex[:8]}"]
    args += ["--no-announced", "--block-size", "4"]
    for engine in engines:
        args += ["--backend", f"{engine.name}={engine.url}"]
    return args


def tls_args(files: TlsFiles) -> list[str]:
    return ["--ssl-certfile", str(files.server_cert), "--ssl-keyfile", str(files.server_key)]


def one_date_no_server(reply: Any) -> None:
    """One ``Date`` header line (not the engine's merged with the gateway's), no ``Server``."""
    assert len(reply.headers.get_list("date")) == 1, reply.headers
    assert "server" not in reply.headers, reply.headers


# -- HTTPS on both services ----------------------------------------------------------------


def test_serve_over_https_requires_a_client_certificate(
    redis_server: RedisServer, certs: tuple[TlsFiles, ClientCert]
) -> None:
    """``pcr serve`` with ``--ssl-ca-certs`` (client certificates required by default):
    it says https:// when ready; a client with a certificate of the CA is answered, one
    without fails the handshake, as do a client that does not trust the server's CA and
    plain HTTP. Its CORS answers the given origin's preflight on ``/v1/score``."""
    files, client = certs
    args = ["--redis-url", redis_server.url, *tls_args(files)]
    args += ["--ssl-ca-certs", str(files.ca_cert), "--allowed-origins", ORIGIN]
    proc = HttpsProcess(*args, path=None).start()
    try:
        with tls_client(files, client) as http:
            live = http.get(f"{proc.base}/live")
            assert live.status_code == 200
            assert "server" not in live.headers
            preflight = http.options(
                f"{proc.base}/v1/score",
                headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == ORIGIN
        with tls_client(files) as anonymous, pytest.raises(httpx.TransportError):
            anonymous.get(f"{proc.base}/live")  # the handshake (or its first read) fails
        with httpx.Client(timeout=30) as untrusting, pytest.raises(httpx.ConnectError):
            untrusting.get(f"{proc.base}/live")  # certificate verify failed
        with httpx.Client(timeout=30) as plain, pytest.raises(httpx.TransportError):
            plain.get(f"http://{HOST}:{proc.port}/live")
        assert "pcr serve: scoring on https://" in "".join(proc._lines["out"])
    finally:
        assert proc.stop() == 0, proc.err


def test_gateway_over_https_to_an_engine_asking_for_a_client_certificate(
    redis_server: RedisServer, certs: tuple[TlsFiles, ClientCert]
) -> None:
    """The gateway serves HTTPS and reaches an ``https://`` engine that requires a client
    certificate (mutual TLS): with ``--backend-ca-certs`` and ``--backend-certfile`` /
    ``--backend-keyfile``, completions (whole and streamed), ``/v1/models`` and the
    engine's ``/metrics`` pass; replies carry one ``Date`` and no ``Server`` header."""
    files, client = certs
    engine = FakeEngine(
        "tls-a",
        certfile=str(files.server_cert),
        keyfile=str(files.server_key),
        client_ca=str(files.ca_cert),
    ).start()
    proc: ServeProcess | None = None
    try:
        args = gateway_args(redis_server, engine) + tls_args(files)
        args += ["--backend-ca-certs", str(files.ca_cert)]
        args += ["--backend-certfile", str(client.cert), "--backend-keyfile", str(client.key)]
        proc = HttpsProcess(*args, path=None, command="gateway").start()
        with tls_client(files) as http:
            reply = http.post(f"{proc.base}/v1/completions", json=BODY)
            assert reply.status_code == 200, reply.text
            assert reply.json()["by"] == "tls-a"
            one_date_no_server(reply)
            streamed = http.post(f"{proc.base}/v1/completions", json={**BODY, "stream": True})
            assert streamed.status_code == 200
            assert streamed.text.endswith("data: [DONE]\n\n")
            one_date_no_server(streamed)
            models = http.get(f"{proc.base}/v1/models")
            assert models.status_code == 200
            assert models.json()["data"][0]["id"] == "tiny"
            one_date_no_server(models)

            def engine_up() -> bool:
                text = http.get(f"{proc.base}/metrics").text
                return 'pcr_gateway_backend_up{backend="tls-a"} 1.0' in text

            wait_until(engine_up, 30, "the gateway to scrape the https engine")
        assert len(engine.received) == 2
    finally:
        if proc is not None:
            assert proc.stop() == 0, proc.err
        engine.stop()


def test_gateway_without_the_engines_ca_does_not_send_to_it(
    redis_server: RedisServer, certs: tuple[TlsFiles, ClientCert]
) -> None:
    """An ``https://`` engine whose certificate the gateway cannot verify (no
    ``--backend-ca-certs``: the system's CAs) gets nothing: 502 in the OpenAI shape. And
    without ``--allowed-origins`` the gateway answers no CORS at all."""
    files, _client = certs
    engine = FakeEngine(
        "tls-b", certfile=str(files.server_cert), keyfile=str(files.server_key)
    ).start()
    proc = ServeProcess(*gateway_args(redis_server, engine), path=None, command="gateway")
    try:
        proc.start()
        reply = httpx.post(f"{proc.base}/v1/completions", json=BODY, timeout=30)
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"]["code"] == 502
        assert engine.received == []
        errors = metric(proc.base, "pcr_gateway_errors_total", backend="tls-b", kind="connect")
        assert errors >= 1
        preflight = httpx.options(
            f"{proc.base}/v1/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
            timeout=30,
        )
        assert preflight.status_code == 405
        assert "access-control-allow-origin" not in preflight.headers
    finally:
        if proc.process is not None:
            assert proc.stop() == 0, proc.err
        engine.stop()


# -- bad TLS files: one line, before binding ----------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["missing-cert", "key-without-cert", "not-pem", "wrong-key", "reqs-without-ca", "bad-ca"],
)
def test_bad_tls_settings_are_one_line_usage_errors(
    case: str,
    certs: tuple[TlsFiles, ClientCert],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files, client = certs
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cert, key = str(files.server_cert), str(files.server_key)
    options = {
        "missing-cert": ["--ssl-certfile", str(tmp_path / "absent.crt"), "--ssl-keyfile", key],
        "key-without-cert": ["--ssl-keyfile", key],
        "not-pem": ["--ssl-certfile", str(garbage), "--ssl-keyfile", key],
        "wrong-key": ["--ssl-certfile", cert, "--ssl-keyfile", str(client.key)],
        "reqs-without-ca": ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs",
                            "required"],
        "bad-ca": ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(garbage)],
    }[case]  # fmt: skip
    with socket.create_server((HOST, 0)) as taken:  # binding first would say so instead
        port = str(taken.getsockname()[1])
        code = main(["serve", "--redis-url", "redis://127.0.0.1:1/0", "--port", port, *options])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""  # nothing announced
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "argument --ssl-" in lines[0], err


def test_bad_backend_ca_and_origin_are_one_line_usage_errors(tmp_path: Path) -> None:
    """``pcr gateway`` checks its ``--backend-*`` files and each ``--allowed-origins``
    before it starts (a process: the gateway keeps torch out of the one it runs in)."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    base = [sys.executable, "-m", "pcr", "gateway", "--redis-url", "redis://127.0.0.1:1/0"]
    for extra, says in (
        (["--backend-ca-certs", str(garbage)], "argument --backend-ca-certs:"),
        (["--allowed-origins", "https://app.example.com/path"], "argument --allowed-origins:"),
    ):
        result = subprocess.run(
            [*base, *extra], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
        )
        assert result.returncode == 2, result
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert says in lines[0], result.stderr


# -- CORS, JSON bodies, headers and client disconnects on a plain gateway -------------------


@pytest.fixture(scope="module")
def plain(redis_server: RedisServer) -> Iterator[tuple[ServeProcess, FakeEngine]]:
    """A gateway allowing ``ORIGIN``, in front of one plain-HTTP engine."""
    engine = FakeEngine("plain-a").start()
    args = [*gateway_args(redis_server, engine), "--allowed-origins", ORIGIN]
    proc = ServeProcess(*args, path="/health", command="gateway")
    try:
        proc.start()
        yield proc, engine
    finally:
        engine.release.set()
        engine.chunk_gate = None
        if proc.process is not None:
            proc.stop()
        engine.stop()


def preflight(base: str, origin: str, path: str = "/v1/completions") -> Any:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
    }
    return httpx.options(base + path, headers=headers, timeout=30)


def test_cors_answers_the_allowed_origin_alone(plain: tuple[ServeProcess, FakeEngine]) -> None:
    """Preflights of the proxied route and of a FastAPI route: the allowed origin gets
    ``Access-Control-Allow-Origin``, a foreign one a 400 in the OpenAI shape without it;
    the proxied POST itself carries the header for the allowed origin only."""
    proc, engine = plain
    for path in ("/v1/completions", "/v1/score"):
        allowed = preflight(proc.base, ORIGIN, path)
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "x-stainless-lang" in allowed.headers["access-control-allow-headers"].lower()
        refused = preflight(proc.base, FOREIGN, path)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == 400
        assert "origin" in refused.json()["error"]["message"]
        assert "access-control-allow-origin" not in refused.headers
    sent = len(engine.received)
    ours = httpx.post(f"{proc.base}/v1/completions", json=BODY, headers={"Origin": ORIGIN})
    assert ours.status_code == 200
    assert ours.headers["access-control-allow-origin"] == ORIGIN
    theirs = httpx.post(f"{proc.base}/v1/completions", json=BODY, headers={"Origin": FOREIGN})
    assert "access-control-allow-origin" not in theirs.headers
    assert len(engine.received) == sent + 2
    models = httpx.get(f"{proc.base}/v1/models", headers={"Origin": ORIGIN}, timeout=30)
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_completions_refuse_bodies_that_are_not_json(
    plain: tuple[ServeProcess, FakeEngine],
) -> None:
    """A ``text/plain`` POST (what a foreign page may send without a preflight), a form
    and a body without ``Content-Type`` get 415 in the OpenAI shape on both completion
    endpoints, and the engine is sent nothing; ``application/json; charset=utf-8`` passes."""
    proc, engine = plain
    data = json.dumps(BODY).encode()
    sent = len(engine.received)
    for path in ("/v1/completions", "/v1/chat/completions"):
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Origin": FOREIGN} | ({"Content-Type": kind} if kind else {})
            reply = httpx.post(proc.base + path, content=data, headers=headers, timeout=30)
            assert reply.status_code == 415, (path, kind, reply.text)
            error = reply.json()["error"]
            assert error["code"] == 415
            assert error["type"] == "invalid_request_error"
    assert len(engine.received) == sent
    charset = {"Content-Type": "application/json; charset=utf-8"}
    reply = httpx.post(f"{proc.base}/v1/completions", content=data, headers=charset, timeout=30)
    assert reply.status_code == 200, reply.text
    assert len(engine.received) == sent + 1


def test_replies_have_one_date_and_no_server_header(
    plain: tuple[ServeProcess, FakeEngine],
) -> None:
    """The engine (uvicorn) sends its own ``Date`` and ``Server: uvicorn``: the client
    sees the gateway's one ``Date`` and no ``Server``, whole, streamed and on
    ``/v1/models``; the gateway's own routes send no ``Server`` either."""
    proc, _engine = plain
    whole = httpx.post(f"{proc.base}/v1/completions", json=BODY, timeout=30)
    streamed = httpx.post(f"{proc.base}/v1/completions", json={**BODY, "stream": True})
    models = httpx.get(f"{proc.base}/v1/models", timeout=30)
    health = httpx.get(f"{proc.base}/health", timeout=30)
    for reply in (whole, streamed, models, health):
        assert reply.status_code == 200, reply.text
        one_date_no_server(reply)


def leave_while_held(proc: ServeProcess, engine: FakeEngine, body: dict[str, Any]) -> None:
    """Send ``body`` on a raw socket and close it once the engine holds the request."""
    before = len(engine.received)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((HOST, proc.port), timeout=30) as sock:
        sock.sendall(head + data)
        wait_until(lambda: len(engine.received) > before, 30, "the engine to get the request")


def test_a_client_that_leaves_is_counted_client_closed(
    plain: tuple[ServeProcess, FakeEngine],
) -> None:
    """A client that leaves while the engine holds its whole reply, and one that leaves a
    stream after its first chunk, count ``result="client_closed"``, not ``error``."""
    proc, engine = plain
    name = "pcr_gateway_requests_total"

    def counts() -> tuple[float, float]:
        return (
            metric(proc.base, name, backend=engine.name, result="client_closed"),
            metric(proc.base, name, backend=engine.name, result="error"),
        )

    closed, errors = counts()
    engine.release.clear()
    try:
        leave_while_held(proc, engine, BODY)
        wait_until(lambda: counts()[0] == closed + 1, 30, "a client_closed request")
    finally:
        engine.release.set()
    cancelled = engine.cancelled
    engine.chunk_gate = threading.Semaphore(1)
    try:
        body = {**BODY, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{proc.base}/v1/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            next(reply.iter_raw())  # the first chunk, then the client goes
        wait_until(lambda: engine.cancelled > cancelled, 30, "the engine to see the stream go")
        wait_until(lambda: counts()[0] == closed + 2, 30, "a second client_closed request")
    finally:
        engine.chunk_gate = None
    assert counts()[1] == errors
