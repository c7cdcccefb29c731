"""The gateway's client to the engines for proxied requests: HTTP/1.1 on asyncio's
transports, parsed by httptools (the C parser the gateway's server already uses), with a
pool of kept-alive connections per engine.

Chosen by measurement (issue 45): per request it does a fraction of aiohttp's client work
(no request object, header multidict, tracing or per-read timeout context): the head is
one bytes join of the client's own header lines, the reply's headers stay raw bytes as
the gateway's server wants them, and one timer per request watches the read deadline.
aiohttp stays for the gateway's own small reads (``/v1/models``, ``/metrics``).

What it keeps of a careful client: connecting bounded by ``connect_timeout``, every wait
for the engine's bytes by ``read_timeout`` (a reply quiet for longer fails as
``timeout``); a connection goes back to the pool only after a whole reply the engine
let it keep, is dropped when older than ``keep_alive`` idle, and one the engine closed
while idle is tried again once, fresh, before anything of the reply arrived; a streamed
reply read slower than it comes stops reading the engine (backpressure); a request
cancelled (its client left) closes its connection, so the engine aborts it.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

HEAD_LIMIT = 64 * 1024
"""Bytes of a reply's headers taken from an engine (a broken one that never ends its head
fails as ``protocol`` instead of filling memory)."""
JOIN_BODY = 64 * 1024
"""Bodies up to this many bytes go out in one buffer with the head; larger ones after it."""
STREAM_HIGH = 256 * 1024
"""Bytes of a streamed reply held unread before the engine's socket is no longer read."""


class UpstreamError(Exception):
    """A request to an engine that failed: ``kind`` is ``connect`` (refused, unreachable,
    connecting timed out), ``timeout`` (the engine quiet over the read timeout) or
    ``protocol`` (reset, closed early, not HTTP)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _HeadTooLarge(Exception):
    pass


class _Origin:
    """One engine's address and its idle connections, the most recently used last."""

    __slots__ = ("host", "host_header", "idle", "port", "prefix", "server_hostname", "ssl")

    def __init__(self, base: str, context: ssl.SSLContext | None) -> None:
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        secure = parts.scheme == "https"
        self.ssl: ssl.SSLContext | bool | None = (
            (context or ssl.create_default_context()) if secure else None
        )
        self.server_hostname = self.host if secure else None
        self.prefix = parts.path.rstrip("/").encode()  # an engine behind a path
        netloc = parts.netloc.rsplit("@", 1)[-1]
        try:
            host = netloc.encode("ascii")
        except UnicodeEncodeError:
            host = netloc.encode("idna")
        self.host_header = b"host: " + host + b"\r\n"
        self.idle: collections.deque[_Connection] = collections.deque()


class _Connection(asyncio.Protocol):
    """One connection to an engine, and the reply being read on it."""

    def __init__(self, client: Upstream, origin: _Origin) -> None:
        self.origin = origin
        self.loop = client.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.active = False  # a reply is being awaited or read on it
        self.timer: asyncio.TimerHandle | None = None  # the read deadline's check
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep = False
        self.failed: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.received = False
        self.paused = False
        self.streaming = False  # read chunk by chunk: held bytes bounded (backpressure)
        self.last_read = 0.0
        self.read_timeout = 0.0
        self.head_size = 0
        self.informational = False  # a 1xx head is being read (skipped)
        self.until_eof = False  # a body with no length: it ends when the engine closes

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, _HeadTooLarge):
            self._fail("protocol")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.waiter is None and self in self.origin.idle:  # closed by the engine, idle
            self.origin.idle.remove(self)
            return
        if self.until_eof and exc is None and not self.complete and self.failed is None:
            self.complete = True  # the end of a body without a length
            self.keep = False
            self._wake()
            return
        self._fail("protocol")

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value)
        if self.head_size > HEAD_LIMIT:
            raise _HeadTooLarge  # out of feed_data as the parser's error: ``protocol``
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # "100 Continue" and the like: the reply comes after
            self.informational = True
            self.headers.clear()
            return
        delimited = any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers)
        self.until_eof = not delimited and status not in (204, 304)
        self.status = status
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if (
            self.streaming
            and self.buffered > STREAM_HIGH
            and not self.paused
            and self.transport is not None
        ):
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep = self.parser.should_keep_alive()
        self._wake()

    # -- waiting -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, kind: str) -> None:
        if self.failed is None and not self.complete:
            self.failed = UpstreamError(kind)
            self._wake()

    async def wait(self) -> None:
        """Until the parser has more to say (headers, body, end) or the reply failed."""
        if self.failed is not None:
            raise self.failed
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.failed is not None:
            raise self.failed

    def abort(self) -> None:
        self.closed = True
        self.active = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.abort()

    # -- the read deadline: one timer per connection, kept across its requests ------------

    def watch(self, read_timeout: float) -> None:
        """A reply awaited from now: it fails as ``timeout`` once the engine has sent
        nothing for ``read_timeout`` seconds (checked by a timer that outlives the
        request: the next one on this connection reuses it instead of making its own)."""
        self.active = True
        self.read_timeout = read_timeout
        self.last_read = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_later(read_timeout, self._check)

    def _check(self) -> None:
        self.timer = None
        if not self.active or self.closed:
            return
        quiet = self.loop.time() - self.last_read
        if quiet >= self.read_timeout and not self.paused:  # paused: the reader is slow
            self._fail("timeout")
            self.abort()
            return
        wait = self.read_timeout - quiet if quiet < self.read_timeout else self.read_timeout
        self.timer = self.loop.call_later(wait, self._check)


class Reply:
    """An engine's reply, its status and headers read; its body by ``read`` or
    ``chunks``; then ``release`` (the connection back to the pool, where the engine lets
    it be kept) or ``close`` (dropped)."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of the header ``name`` (lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        while not conn.complete:
            await conn.wait()
        body = conn.body
        conn.buffered = 0
        if len(body) == 1:
            return body.popleft()
        content = b"".join(body)
        body.clear()
        return content

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes: what has arrived by each turn, joined."""
        conn = self._conn
        conn.streaming = True
        body = conn.body
        while True:
            if body:
                chunk = body.popleft() if len(body) == 1 else b"".join(body)
                body.clear()
                conn.buffered = 0
                if conn.paused and conn.transport is not None and not conn.closed:
                    conn.paused = False
                    conn.transport.resume_reading()
                yield chunk
                continue
            if conn.complete:
                return
            await conn.wait()

    def release(self) -> None:
        """Done with a whole reply: its connection kept for the next request when the
        engine allows it, else closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.active = False
        if conn.complete and conn.keep and not conn.closed and not conn.paused:
            conn._reset()
            conn.idle_since = conn.loop.time()
            conn.origin.idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Done, whatever is left unread: the connection dropped (an engine aborts a
        request whose connection closes)."""
        if self._done:
            return
        self._done = True
        self._conn.abort()


class Exchange:
    """A request to an engine between its two halves (``Upstream.send``): written on
    ``conn`` already, or to be sent on a fresh connection; ``error``: what its reply
    raises."""

    __slots__ = ("client", "conn", "error", "message", "origin")

    def __init__(self, client: Upstream) -> None:
        self.client = client
        self.origin: _Origin | None = None
        self.message: tuple[bytes, ...] = ()
        self.conn: _Connection | None = None
        self.error: BaseException | None = None

    async def reply(self) -> Reply:
        """The reply once its headers are read; ``UpstreamError`` when that fails."""
        if self.error is not None:
            raise self.error
        client, conn = self.client, self.conn
        if conn is not None:
            self.conn = None
            try:
                return await client._replied(conn)
            except UpstreamError as error:
                # The engine closed the idle connection as it was taken: once more, fresh
                if conn.received or error.kind != "protocol":
                    raise
        assert self.origin is not None
        return await client._exchange(await client._connect(self.origin), self.message)

    def abandon(self) -> None:
        """Never to be awaited: a request already written is dropped with its connection
        (the engine aborts it)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()


class Upstream:
    """The pool of connections to the engines (one per engine, by base URL)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        keep_alive: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keep_alive = keep_alive
        self.ssl_context = ssl_context
        self.origins: dict[str, _Origin] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def origin(self, base: str) -> _Origin:
        found = self.origins.get(base)
        if found is None:
            found = self.origins[base] = _Origin(base, self.ssl_context)
        return found

    async def request(
        self,
        base: str,
        method: bytes,
        target: bytes,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> Reply:
        """Send ``method`` ``target`` (a path and query, under ``base``'s path), the
        ``Host``, ``headers`` (lower-case names, no hop-by-hop ones; the caller's to
        check, as a server's parser does), the body's length and ``body`` to the engine
        at ``base``; the reply once its headers are read. ``UpstreamError`` when that
        fails."""
        return await self.send(base, method, target, body, headers).reply()

    def send(
        self,
        base: str,
        method: bytes,
        target: bytes,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> Exchange:
        """``request`` in two halves: the message written now where an idle connection
        to ``base`` is pooled (the engine starts on it while the caller does its own
        bookkeeping), then the reply awaited (``Exchange.reply``: on a fresh connection
        where none was pooled, or where the engine had closed the one taken). Never
        raises: a failure is the reply's."""
        exchange = Exchange(self)
        if self._closed:
            exchange.error = UpstreamError("connect")
            return exchange
        try:
            origin = exchange.origin = self.origin(base)
        except ValueError:  # an announced engine's URL that is not one
            exchange.error = UpstreamError("connect")
            return exchange
        lines = [method, b" ", origin.prefix, target, b" HTTP/1.1\r\n", origin.host_header]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n")
        if len(body) <= JOIN_BODY:
            exchange.message = (b"".join([*lines, body]),)
        else:  # a large body is not copied into the head's buffer
            exchange.message = (b"".join(lines), body)
        conn = self._pooled(origin)
        if conn is not None:
            try:
                self._write(conn, exchange.message)
            except Exception as error:
                conn.abort()
                exchange.error = error
                return exchange
            exchange.conn = conn
        return exchange

    def _pooled(self, origin: _Origin) -> _Connection | None:
        idle = origin.idle
        oldest = self.loop.time() - self.keep_alive
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > oldest:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: _Origin) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _transport, conn = await self.loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.server_hostname,
                )
        except (OSError, TimeoutError, ssl.SSLError):
            raise UpstreamError("connect") from None
        return conn

    def _write(self, conn: _Connection, message: tuple[bytes, ...]) -> None:
        assert conn.transport is not None
        conn.watch(self.read_timeout)
        for part in message:
            conn.transport.write(part)

    async def _replied(self, conn: _Connection) -> Reply:
        """The reply on ``conn``, its request written, once its headers are read."""
        reply = Reply(conn)
        try:
            while not conn.status:
                await conn.wait()
        except BaseException:
            reply.close()
            raise
        reply.status = conn.status
        reply.headers = conn.headers
        return reply

    async def _exchange(self, conn: _Connection, message: tuple[bytes, ...]) -> Reply:
        try:
            self._write(conn, message)
        except BaseException:
            conn.abort()
            raise
        return await self._replied(conn)

    async def close(self) -> None:
        """Every idle connection closed; later requests fail as ``connect``."""
        self._closed = True
        for origin in self.origins.values():
            while origin.idle:
                origin.idle.pop().abort()
