"""Requests the server takes straight from its protocol (``pcr.web.server.Direct``: the
gateway's proxied routes): a ``POST`` to one of the paths as sent reaches the direct app
with no layer of uvicorn's between, everything else the whole app; the response head is
written by the short way (``_DirectCycle``) and a whole response (``WHOLE``) in one
write, with the same HTTP as uvicorn's own: content-length, chunked streams, keep-alive,
HTTP/1.0, pipelining, the deadlines and uvicorn's header checks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

uvicorn = pytest.importorskip("uvicorn")

from pcr.web import server as web  # noqa: E402
from tests.support.asgi import lifespan  # noqa: E402

PATH = b"/v1/completions"


async def _read(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


LEFT: list[bool] = []
"""What each ``?leave`` request's cycle said when its task was cancelled."""


async def _main(scope: Any, receive: Any, send: Any) -> None:
    """The whole app: says it was the one, with the client it saw."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    assert web.leaving(receive) is None  # not a Direct request: no cycle of that kind
    assert web.ARRIVED not in scope  # nor its head's time
    await _read(receive)
    body = json.dumps({"app": "main", "path": scope["path"], "client": scope["client"][0]})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body.encode()})


async def _direct(scope: Any, receive: Any, send: Any) -> None:
    """The direct app: the query string says how to answer."""
    began = time.perf_counter()
    body = await _read(receive)
    seen = {
        "arrived": scope.get(web.ARRIVED),
        "began": began,
        "app": "direct",
        "path": scope["path"],
        "query": scope["query_string"].decode(),
        "client": scope["client"][0],
        "whole": web.WHOLE in scope.get("extensions", {}),
        "body": body.decode(),
    }
    content = json.dumps(seen).encode()
    how = scope["query_string"]
    if how == b"raise":  # a bug of the app's, before its response
        raise LookupError("not for the client's eyes")
    if how == b"raise-late":  # after its response began
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise LookupError("mid-stream")
    if how == b"leave":  # waits on something else; the client's leaving cancels it
        cycle = web.leaving(receive)
        assert cycle is not None
        assert cycle.watch_leave()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            LEFT.append(cycle.left)
            raise
        return
    if how == b"slow":  # past the keep-alive deadline of ``idle_port``
        await asyncio.sleep(2 * KEEP_ALIVE_S)
    if how == b"stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif how == b"bad-header":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-bad", b"a\r\nset-cookie: x")], "body": b"{}"})  # fmt: skip
    elif how == b"lists":
        await send({"type": "http.response.start", "status": 200, "body": b"{}",
                    "headers": [[b"content-type", b"application/json"],
                                [b"x-pair", b"list"]]})  # fmt: skip
    elif how == b"no-content":
        await send({"type": "http.response.start", "status": 204, "headers": [], "body": b""})
    elif how == b"two":  # the usual two messages, with a content-length
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(content)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})
    else:  # one message: the whole response
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json")],
                    "body": content})  # fmt: skip


KEEP_ALIVE_S = 1


@pytest.fixture
def port() -> Iterator[int]:
    """A server of ``_main`` with ``_direct`` for ``PATH``, its body deadline 1 s."""
    yield from _serve()


@pytest.fixture
def idle_port() -> Iterator[int]:
    """As ``port``, idle connections closed after ``KEEP_ALIVE_S``."""
    yield from _serve(keep_alive_timeout=KEEP_ALIVE_S)


def _serve(**options: Any) -> Iterator[int]:
    direct = web.Direct(frozenset({PATH}), _direct)
    config = web.uvicorn_config(
        _main,
        host="127.0.0.1",
        port=0,
        log_level="critical",
        direct=direct,
        body_timeout=1.0,
        **options,
    )
    server = web.server_class()(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and server.servers):
        assert thread.is_alive(), "the server stopped as it started"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    server.handle_exit(0, None)
    thread.join(60)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def _request(target: bytes, body: bytes = b"{}", *, method: bytes = b"POST",
             version: bytes = b"1.1", extra: bytes = b"") -> bytes:  # fmt: skip
    return (
        method + b" " + target + b" HTTP/" + version + b"\r\nhost: x\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n"
        % len(body)
        + extra
        + b"\r\n"
        + body
    )


class _Reader:
    """Reads HTTP/1.1 responses off a socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._more(), "the connection closed before a response"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"{name} twice"
            headers[name.lower()] = value.strip()
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buffer) < size:
                assert self._more()
            body, self.buffer = self.buffer[:size], self.buffer[size:]
            return status, headers, body
        assert headers.get("transfer-encoding") == "chunked" or status == 204, headers
        body = b""
        while status != 204:
            while b"\r\n" not in self.buffer:
                assert self._more()
            size_line, rest = self.buffer.split(b"\r\n", 1)
            size = int(size_line, 16)
            while len(rest) < size + 2:
                assert self._more()
                rest = self.buffer.split(b"\r\n", 1)[1]
            body += rest[:size]
            self.buffer = rest[size + 2 :]
            if size == 0:
                break
        return status, headers, body

    def closed(self) -> bool:
        return not self._more() and not self.buffer


def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with _connect(port) as sock:
        sock.sendall(raw)
        return _Reader(sock).response()


def test_a_post_to_a_direct_path_reaches_the_direct_app_with_no_proxy_headers_layer(
    port: int,
) -> None:
    forwarded = b"x-forwarded-for: 203.0.113.9\r\n"
    status, headers, body = _exchange(port, _request(PATH + b"?a=1", b'{"x":1}', extra=forwarded))
    seen = json.loads(body)
    assert status == 201
    assert seen["app"] == "direct"
    assert seen["whole"] is True
    assert seen["path"] == "/v1/completions"
    assert seen["query"] == "a=1"
    assert seen["body"] == '{"x":1}'
    assert seen["client"] == "127.0.0.1"  # uvicorn's proxy-headers layer skipped
    assert headers["content-length"] == str(len(body))
    assert "date" in headers
    assert headers["content-type"] == "application/json"
    # the same request to another path goes through the whole app and its layers
    status, _, body = _exchange(port, _request(b"/v1/other", extra=forwarded))
    assert status == 200
    assert json.loads(body) == {"app": "main", "path": "/v1/other", "client": "203.0.113.9"}


def test_a_direct_request_carries_when_its_head_arrived_before_the_server_parsed_it(
    port: int,
) -> None:
    """``ARRIVED``: a reading of the same clock taken as the head came off the
    connection, after the client sent it and before the app began; a body sent later
    does not move it; pipelined requests read in one piece share their reading."""
    with _connect(port) as sock:
        reader = _Reader(sock)
        before = time.perf_counter()
        sock.sendall(_request(PATH, b"1"))
        seen = json.loads(reader.response()[2])
        assert before <= seen["arrived"] <= seen["began"]
        # the head now, the body once the app has begun: the head's time is kept
        head, _, body = _request(PATH, b'{"late":1}').partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        time.sleep(0.2)
        body_sent = time.perf_counter()
        sock.sendall(body)
        late = json.loads(reader.response()[2])
        assert late["body"] == '{"late":1}'
        assert seen["began"] < late["arrived"] < body_sent
        sock.sendall(_request(PATH + b"?one", b"1") + _request(PATH + b"?two", b"2"))
        first, second = json.loads(reader.response()[2]), json.loads(reader.response()[2])
        assert body_sent < first["arrived"] <= first["began"]
        assert second["arrived"] >= first["arrived"]
    # the whole app's requests (uvicorn's way) carry none (``_main`` asserts it)
    status, _, body = _exchange(port, _request(b"/v1/other"))
    assert status == 200
    assert json.loads(body)["app"] == "main"


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"GET", PATH), (b"PUT", PATH), (b"POST", b"/v1/%63ompletions"), (b"POST", PATH + b"/")],
)
def test_anything_else_goes_to_the_whole_app(port: int, method: bytes, target: bytes) -> None:
    status, _, body = _exchange(port, _request(target, method=method))
    assert status == 200
    assert json.loads(body)["app"] == "main"
    if b"%" in target:  # an escaped spelling of the path: the app sees it unescaped
        assert json.loads(body)["path"] == "/v1/completions"


def test_keep_alive_pipelining_and_both_kinds_of_head_on_one_connection(port: int) -> None:
    with _connect(port) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(PATH + b"?one", b"1") + _request(PATH + b"?two", b"2"))
        first, second = reader.response(), reader.response()  # pipelined: in order
        assert (first[0], json.loads(first[2])["body"]) == (201, "1")
        assert (second[0], json.loads(second[2])["body"]) == (200, "2")
        assert second[1]["content-length"] == str(len(second[2]))
        sock.sendall(_request(PATH + b"?stream"))
        status, headers, body = reader.response()
        assert status == 200
        assert headers["transfer-encoding"] == "chunked"
        assert "content-length" not in headers
        assert body == b"data: 1\n\ndata: 2\n\n"
        sock.sendall(_request(PATH + b"?no-content"))  # 204: uvicorn's own send
        status, headers, body = reader.response()
        assert status == 204
        assert body == b""
        assert "content-length" not in headers
        sock.sendall(_request(PATH, b"last"))  # the connection is still good
        assert json.loads(reader.response()[2])["body"] == "last"


@pytest.mark.parametrize("how", [b"", b"?stream"])
def test_http_1_0_and_connection_close_end_the_connection(port: int, how: bytes) -> None:
    for raw in (
        _request(PATH + how, version=b"1.0"),
        _request(PATH + how, extra=b"connection: close\r\n"),
    ):
        with _connect(port) as sock:
            sock.sendall(raw)
            reader = _Reader(sock)
            if how:  # HTTP/1.0 has no chunks: uvicorn's way, the body to the close
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                assert b"data: 1" in data
                assert b"connection: close" in data.lower()
                continue
            status, headers, _ = reader.response()
            assert status == 201
            assert headers["connection"] == "close"
            assert reader.closed()


def test_a_header_that_could_split_the_response_is_refused(port: int) -> None:
    for _ in range(2):  # each time: a header found bad is never taken as checked
        status, headers, _ = _exchange(port, _request(PATH + b"?bad-header"))
        assert status == 500
        assert "set-cookie" not in headers


def test_headers_sent_as_lists_are_checked_and_written_each_time(port: int) -> None:
    """ASGI allows a header as any pair, a list included (not kept among the headers
    found valid, which are tuples): written the same on every reply."""
    with _connect(port) as sock:
        reader = _Reader(sock)
        for _ in range(2):
            sock.sendall(_request(PATH + b"?lists"))
            status, headers, body = reader.response()
            assert (status, headers["x-pair"], body) == (200, "list", b"{}")


def test_a_direct_requests_body_still_has_its_deadline(port: int) -> None:
    with _connect(port) as sock:
        sock.sendall(_request(PATH, b'{"x": 1}')[:-3])  # the body's last bytes never come
        status, headers, body = _Reader(sock).response()
    assert status == 408
    assert headers["connection"] == "close"
    assert "did not arrive" in json.loads(body)["detail"]


def test_the_keep_alive_deadline_counts_from_the_last_response_not_the_first(
    idle_port: int,
) -> None:
    """One timer per connection: armed by the first response, it fires while the second
    request is still running (twice the deadline), which must not close the connection;
    the next response arms it again, and the silence after it does close it."""
    with _connect(idle_port) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(PATH, b"first"))
        assert json.loads(reader.response()[2])["body"] == "first"
        sock.sendall(_request(PATH + b"?slow", b"slow"))
        assert json.loads(reader.response()[2])["body"] == "slow"
        sock.sendall(_request(PATH, b"after"))  # at once: the connection is still open
        assert json.loads(reader.response()[2])["body"] == "after"
        sock.settimeout(60)
        assert reader.closed()  # then silence: closed by the deadline (well within 60 s)


def test_a_fault_of_the_direct_app_is_answered_500_in_the_json_shape_and_keeps_the_connection(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """As ``pcr.serve.errors.Faults`` answers it: the exception's type named, nothing of
    its text, logged with its traceback; the connection goes on. Once the response has
    begun there is nothing to answer: the connection is closed."""
    with caplog.at_level("ERROR", logger="pcr.serve.errors"), _connect(port) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(PATH + b"?raise"))
        status, headers, body = reader.response()
        assert status == 500
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == {"error": "internal error", "detail": "LookupError"}
        assert b"eyes" not in body
        assert "internal error on POST /v1/completions" in caplog.text
        sock.sendall(_request(PATH, b"after"))  # the same connection
        assert json.loads(reader.response()[2])["body"] == "after"
        sock.sendall(_request(PATH + b"?raise-late"))
        with pytest.raises(AssertionError):
            reader.response()  # a chunk, then the connection closed mid-body
        assert reader.closed()


def test_a_body_that_comes_in_parts_and_an_expected_continue_reach_the_direct_app(
    port: int,
) -> None:
    """The app waits for what has not come yet (the cycle's ``_Signal``), and a client
    that asks to be told to go on is told ``100 Continue`` when the app reads."""
    body = b'{"part": "' + b"x" * 3000 + b'"}'
    with _connect(port) as sock:
        reader = _Reader(sock)
        raw = _request(PATH, body)
        head_end = raw.index(b"\r\n\r\n") + 4
        sock.sendall(raw[: head_end + 100])
        time.sleep(0.2)  # the app is waiting by now (not needed for the test to hold)
        sock.sendall(raw[head_end + 100 :])
        assert json.loads(reader.response()[2])["body"] == body.decode()
        expecting = _request(PATH, b"goes", extra=b"expect: 100-continue\r\n")
        sock.sendall(expecting[: expecting.index(b"\r\n\r\n") + 4])
        while b"\r\n\r\n" not in reader.buffer:
            assert reader._more()
        assert reader.buffer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        reader.buffer = reader.buffer[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
        sock.sendall(b"goes")
        assert json.loads(reader.response()[2])["body"] == "goes"


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "pipelined"])
def test_a_direct_request_watching_for_its_client_is_cancelled_when_the_client_leaves(
    port: int, pipelined: bool
) -> None:
    """``leaving(receive).watch_leave()``: the request's task is cancelled when its
    connection is lost, with nothing of the app's own reading for it, and ``left`` says
    why (also where the client sent another request behind it, still queued); the
    server goes on serving."""
    LEFT.clear()
    with _connect(port) as sock:
        sock.sendall(_request(PATH + b"?leave") + (_request(PATH) if pipelined else b""))
        time.sleep(0.2)  # the request is waiting (the test holds without it)
    deadline = time.monotonic() + 30
    while not LEFT:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.01)
    assert LEFT == [True]
    status, _, body = _exchange(port, _request(PATH, b"next"))
    assert (status, json.loads(body)["body"]) == (201, "next")


@pytest.mark.parametrize("target", [b"/v1/other", PATH], ids=["whole-app", "direct"])
def test_a_bodys_tail_read_with_the_next_head_is_not_taken_for_a_head_too_large(
    port: int, target: bytes
) -> None:
    """A large body whose last 40 KB arrive in one read with the start of the next
    request's head: only the head's own bytes count against ``HEAD_LIMIT`` (a busy
    server reads in bigger pieces, and took such a tail for a head of 40 KB: 431)."""
    body = b'{"pad": "' + b"x" * 100_000 + b'"}'
    first = _request(target, body)
    second = _request(target, b"second")
    with _connect(port) as sock:
        reader = _Reader(sock)
        tail = 40_000
        sock.sendall(first[:-tail])
        time.sleep(0.3)  # that much read before the rest (the test holds without it)
        sock.sendall(first[-tail:] + second[:20])  # the tail and a head just begun
        status, _, reply = reader.response()
        assert status in (200, 201)
        assert json.loads(reply)["body"] == body.decode() if target == PATH else True
        time.sleep(0.3)
        sock.sendall(second[20:])
        status, _, reply = reader.response()
        assert status in (200, 201), reply
