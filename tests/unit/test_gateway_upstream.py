"""The gateway's client to the engines (``pcr.gateway.upstream``) against raw asyncio
servers that misbehave on purpose: replies whole and chunked, kept-alive connections
reused, closed by the engine while idle, quiet past the read timeout, garbage, a reset in
the middle of a body, a client that reads a stream slower than it comes, a request
cancelled mid-reply."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from pcr.gateway.upstream import JOIN_BODY, STREAM_HIGH, Upstream, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b": ")
            headers[name.lower()] = value
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers, body


class Engine:
    """A raw HTTP server on a free port; counts its connections, keeps what it got."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _client(**kw: float) -> Upstream:
    options = {"connect_timeout": 2.0, "read_timeout": 30.0, "keep_alive": 4.0, **kw}
    return Upstream(**options)


def _fixed(body: bytes, *, close: bool = False, requests: list | None = None) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await _read_request(reader)
            if requests is not None:
                requests.append(request)
            extra = b"connection: close\r\n" if close else b""
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-engine: a\r\n"
                + extra
                + b"content-length: %d\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
            if close:
                return

    return handler


LOOPS = ["asyncio"]
try:
    import uvloop

    LOOPS.append("uvloop")  # the gateway's loop
except ImportError:  # pragma: no cover - uvloop is in the gateway extra
    uvloop = None


@pytest.fixture(params=LOOPS, autouse=True)
def loop_kind(request: pytest.FixtureRequest) -> str:
    global LOOP
    LOOP = request.param
    return LOOP


LOOP = "asyncio"


def run(coro: Awaitable[None]) -> None:
    if LOOP == "uvloop":
        uvloop.run(asyncio.wait_for(coro, 30))
    else:
        asyncio.run(asyncio.wait_for(coro, 30))


def test_a_whole_reply_and_its_connection_kept_for_the_next() -> None:
    requests: list = []

    async def main() -> None:
        async with Engine(_fixed(b'{"ok":1}', requests=requests)) as engine:
            client = _client()
            for i in range(5):
                reply = await client.request(
                    engine.url, b"POST", b"/v1/completions?x=1", b'{"n":%d}' % i,
                    [(b"content-type", b"application/json"), (b"x-key", b"v")],
                )  # fmt: skip
                assert reply.status == 200
                assert reply.header(b"x-engine") == b"a"
                assert (b"content-type", b"application/json") in reply.headers
                assert await reply.read() == b'{"ok":1}'
                reply.release()
            assert engine.connections == 1  # kept alive: one connection for all five
            await client.close()
        line, headers, body = requests[-1]
        assert line == b"POST /v1/completions?x=1 HTTP/1.1"
        assert headers[b"host"] == engine.url.removeprefix("http://").encode()
        assert headers[b"x-key"] == b"v"
        assert body == b'{"n":4}'

    run(main())


def test_an_engine_behind_a_path_gets_it_before_the_target() -> None:
    requests: list = []

    async def main() -> None:
        async with Engine(_fixed(b"{}", requests=requests)) as engine:
            client = _client()
            reply = await client.request(engine.url + "/engine/", b"POST", b"/v1/x", b"", [])
            await reply.read()
            reply.release()
            await client.close()
        assert requests[0][0] == b"POST /engine/v1/x HTTP/1.1"

    run(main())


def test_connection_close_is_not_pooled() -> None:
    async def main() -> None:
        async with Engine(_fixed(b"{}", close=True)) as engine:
            client = _client()
            for _ in range(3):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                assert await reply.read() == b"{}"
                reply.release()
            assert engine.connections == 3
            await client.close()

    run(main())


def test_a_chunked_stream_comes_chunk_by_chunk_and_keeps_its_connection() -> None:
    go = asyncio.Event

    async def main() -> None:
        step = go()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for i in range(3):
                    event = b"data: %d\n\n" % i
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await step.wait()  # the client has seen this one before the next
                    step.clear()
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        async with Engine(handler) as engine:
            client = _client()
            for _ in range(2):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                assert reply.header(b"content-type") == b"text/event-stream"
                got = []
                async for chunk in reply.chunks():
                    got.append(chunk)
                    step.set()
                assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
                reply.release()
            assert engine.connections == 1
            await client.close()

    run(main())


def test_an_idle_connection_the_engine_closed_is_replaced_once() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            # no connection: close said, but the engine drops it once idle

        async with Engine(handler) as engine:
            client = _client()
            for _ in range(3):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                assert await reply.read() == b"ok"
                reply.release()
                await asyncio.sleep(0.05)  # the close arrives (or not yet: retried)
            assert engine.connections == 3
            await client.close()

    run(main())


def test_a_connection_idle_past_keep_alive_is_not_used() -> None:
    async def main() -> None:
        async with Engine(_fixed(b"{}")) as engine:
            client = _client(keep_alive=0.0)
            for _ in range(3):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                await reply.read()
                reply.release()
            assert engine.connections == 3
            await client.close()

    run(main())


def test_a_body_without_a_length_ends_when_the_engine_closes() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil ")
            await writer.drain()
            writer.write(b"the end")

        async with Engine(handler) as engine:
            client = _client()
            reply = await client.request(engine.url, b"POST", b"/", b"", [])
            assert await reply.read() == b"until the end"
            reply.release()
            assert all(not o.idle for o in client.origins.values())  # not kept: closed

    run(main())


def test_a_100_continue_is_skipped_for_the_reply_after_it() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
                writer.write(b"HTTP/1.1 201 Created\r\nx-a: b\r\ncontent-length: 2\r\n\r\nok")

        async with Engine(handler) as engine:
            client = _client()
            for _ in range(2):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                assert reply.status == 201
                assert reply.headers == [(b"x-a", b"b"), (b"content-length", b"2")]
                assert await reply.read() == b"ok"
                reply.release()
            assert engine.connections == 1

    run(main())


def test_refused_is_connect() -> None:
    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        client = _client()
        with pytest.raises(UpstreamError) as error:
            await client.request(f"http://127.0.0.1:{port}", b"POST", b"/", b"", [])
        assert error.value.kind == "connect"

    run(main())


def test_a_quiet_engine_is_a_timeout_and_its_connection_closed() -> None:
    async def main() -> None:
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            await reader.read()  # nothing sent; returns when the client closes
            closed.set()

        async with Engine(handler) as engine:
            client = _client(read_timeout=0.2)
            with pytest.raises(UpstreamError) as error:
                await client.request(engine.url, b"POST", b"/", b"", [])
            assert error.value.kind == "timeout"
            await asyncio.wait_for(closed.wait(), 10)

    run(main())


def test_a_body_quiet_past_the_timeout_fails_as_timeout() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            await writer.drain()
            await reader.read()

        async with Engine(handler) as engine:
            client = _client(read_timeout=0.2)
            reply = await client.request(engine.url, b"POST", b"/", b"", [])
            with pytest.raises(UpstreamError) as error:
                await reply.read()
            assert error.value.kind == "timeout"
            reply.close()

    run(main())


def test_a_kept_connection_keeps_one_deadline_timer_and_it_still_fires() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(3):
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
            await _read_request(reader)  # the fourth: never answered
            await reader.read()

        async with Engine(handler) as engine:
            client = _client(read_timeout=0.3)
            timers = set()
            for _ in range(3):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                timers.add(id(reply._conn.timer))
                await reply.read()
                reply.release()
            assert len(timers) == 1  # no timer made per request on a kept connection
            with pytest.raises(UpstreamError) as error:
                await client.request(engine.url, b"POST", b"/", b"", [])
            assert error.value.kind == "timeout"
            assert engine.connections == 1

    run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b"this is not HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",  # then closed: cut short
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"",  # closed at once, a fresh connection
    ],
)
def test_garbage_or_a_cut_is_protocol(answer: bytes) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(answer)
            await writer.drain()

        async def whole(client: Upstream, url: str) -> bytes:
            reply = await client.request(url, b"POST", b"/", b"", [])
            return await reply.read()

        async with Engine(handler) as engine:
            client = _client()
            with pytest.raises(UpstreamError) as error:
                await whole(client, engine.url)
            assert error.value.kind == "protocol"
            assert all(not o.idle for o in client.origins.values())

    run(main())


def test_a_head_that_never_ends_fails_as_protocol() -> None:
    written = [0]

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\n")
            for n in range(100_000):  # headers, and more headers: 11 MB
                writer.write(b"x-%d: %s\r\n" % (n, b"v" * 100))
                await writer.drain()
                written[0] += 1

        async with Engine(handler) as engine:
            client = _client()
            with pytest.raises(UpstreamError) as error:
                await client.request(engine.url, b"POST", b"/", b"", [])
            assert error.value.kind == "protocol"
            await asyncio.sleep(0.2)
        assert written[0] < 50_000  # the client hung up long before the engine was done

    run(main())


def test_a_slow_reader_stops_reading_the_engine_and_gets_every_byte() -> None:
    total = 8 * STREAM_HIGH

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
            for _ in range(total // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()

        async with Engine(handler) as engine:
            client = _client()
            reply = await client.request(engine.url, b"POST", b"/", b"", [])
            conn = reply._conn
            got = 0
            paused = False
            async for chunk in reply.chunks():
                got += len(chunk)
                await asyncio.sleep(0.02)  # slower than the engine writes
                paused = paused or conn.paused
                assert conn.buffered <= STREAM_HIGH + 65536 * 4
            assert got == total
            assert paused
            reply.release()
            await client.close()

    run(main())


def test_a_large_whole_reply_is_read_to_its_end() -> None:
    total = 8 * STREAM_HIGH

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
                for _ in range(total // 65536):
                    writer.write(b"y" * 65536)
                    await writer.drain()

        async with Engine(handler) as engine:
            client = _client(read_timeout=5.0)
            for _ in range(2):
                reply = await client.request(engine.url, b"POST", b"/", b"", [])
                await asyncio.sleep(0.2)  # the whole reply arrives before it is read
                assert await reply.read() == b"y" * total
                reply.release()
            assert engine.connections == 1

    run(main())


def test_a_cancelled_request_closes_its_connection() -> None:
    async def main() -> None:
        closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            await reader.read()  # the engine sees the client leave
            closed.set()

        async with Engine(handler) as engine:
            client = _client()
            task = asyncio.ensure_future(client.request(engine.url, b"POST", b"/", b"", []))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(closed.wait(), 10)
            assert all(not o.idle for o in client.origins.values())

    run(main())


def test_a_closed_client_refuses() -> None:
    async def main() -> None:
        client = _client()
        await client.close()
        with pytest.raises(UpstreamError):
            await client.request("http://127.0.0.1:1", b"POST", b"/", b"", [])

    run(main())


def test_not_an_http_url_fails_as_connect() -> None:
    async def main() -> None:
        for url in ("ftp://x", "http://", "no url"):
            with pytest.raises(UpstreamError) as error:
                await _client().request(url, b"POST", b"/", b"", [])
            assert error.value.kind == "connect"

    run(main())


def test_a_large_body_arrives_whole_beside_a_small_one() -> None:
    requests: list = []

    async def main() -> None:
        async with Engine(_fixed(b"{}", requests=requests)) as engine:
            client = _client()
            for size in (10, JOIN_BODY + 1, 3 * 1024 * 1024):
                body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
                reply = await client.request(engine.url, b"POST", b"/", body, [])
                await reply.read()
                reply.release()
                assert requests[-1][2] == body
            assert engine.connections == 1

    run(main())


def test_send_writes_on_a_pooled_connection_before_the_reply_is_awaited() -> None:
    """``send`` then ``reply``: on a kept connection the engine has the request while the
    caller is still busy (nothing awaited yet); on none, it goes when the reply is
    awaited; either way the same reply, on one connection."""
    requests: list = []

    async def main() -> None:
        async with Engine(_fixed(b'{"ok":1}', requests=requests)) as engine:
            client = _client()
            first = client.send(engine.url, b"POST", b"/a", b"1", [])
            await asyncio.sleep(0.05)
            assert requests == []  # no connection yet: nothing sent before the reply
            reply = await first.reply()
            assert await reply.read() == b'{"ok":1}'
            reply.release()
            second = client.send(engine.url, b"POST", b"/b", b"2", [])
            for _ in range(600):  # the engine reads it with the reply not awaited
                if len(requests) == 2:
                    break
                await asyncio.sleep(0.05)
            assert [r[0] for r in requests] == [b"POST /a HTTP/1.1", b"POST /b HTTP/1.1"]
            reply = await second.reply()
            assert reply.status == 200
            assert await reply.read() == b'{"ok":1}'
            reply.release()
            assert engine.connections == 1
            await client.close()

    run(main())


def test_an_abandoned_send_drops_its_connection_and_the_next_one_is_fresh() -> None:
    requests: list = []

    async def main() -> None:
        async with Engine(_fixed(b"{}", requests=requests)) as engine:
            client = _client()
            reply = await client.request(engine.url, b"POST", b"/", b"", [])
            await reply.read()
            reply.release()
            exchange = client.send(engine.url, b"POST", b"/dropped", b"", [])
            exchange.abandon()  # the caller failed before awaiting it
            exchange.abandon()  # twice: nothing more
            reply = await client.request(engine.url, b"POST", b"/", b"", [])
            assert await reply.read() == b"{}"
            reply.release()
            assert engine.connections == 2  # the abandoned one was not pooled again
            await client.close()

    run(main())


def test_send_never_raises_and_its_reply_does() -> None:
    async def main() -> None:
        client = _client()
        bad = client.send("not a url", b"POST", b"/", b"", [])
        with pytest.raises(UpstreamError) as failed:
            await bad.reply()
        assert failed.value.kind == "connect"
        await client.close()
        closed = client.send("http://127.0.0.1:1", b"POST", b"/", b"", [])
        with pytest.raises(UpstreamError) as failed:
            await closed.reply()
        assert failed.value.kind == "connect"

    run(main())
