"""The HTTP server both services run on: uvicorn with deadlines of its own protocol class.

A request's headers must arrive within ``header_timeout`` seconds of the connection
opening (or of the request's first byte on a kept-alive connection), its body within
``body_timeout`` seconds of its headers, so a slow client cannot hold a connection;
malformed HTTP, and a request too slow, get the service's JSON error shape
(``pcr.web.errors``), not uvicorn's text. uvicorn is imported only when a server is built,
so importing this module costs nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import ctypes
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

# Shared by pcr serve and pcr gateway (their apps and their command lines).
DEFAULT_MAX_CONNECTIONS = 64
"""Requests using Redis at once, and connections per Redis node: one event loop's worth
(each request holds a connection for one loopback round trip; the loop, not Redis, is
what runs out first)."""
DEFAULT_POOL_TIMEOUT = 5.0
"""Seconds a request waits for its turn before 503: past Redis' own bounds (1 s connect,
2 s read, one retry), so only a Redis that hangs or a service overloaded for seconds
reaches it."""
HEADER_TIMEOUT = 10.0
"""Seconds for a request's headers, from the connection's start or the request's first byte."""
BODY_TIMEOUT = 20.0
"""Seconds for a request's body, from its headers: a 1M-token body (~8 MB of JSON) needs
~4 Mbit/s, the 32 MiB limit ~14 Mbit/s; a slow client holds a connection 30 s at most."""
KEEP_ALIVE_TIMEOUT = 120
"""Seconds an idle keep-alive connection stays open: longer than the clients' own pools
keep an idle connection (aiohttp 15 s, httpx 5 s, Go's net/http and reqwest 90 s), so the
client closes it first. A server that closes first races with the client's next request
on that connection, which then fails unless the client retries it (aiohttp and urllib3
retry only idempotent methods, never a POST). uvicorn's own default is 5 s."""
LINGER = 2.0
"""Seconds a connection stays half-open after its last answer, for the answer to arrive."""
TICK_S = 1.0
"""Seconds between the server's ticks (the date header, a stop asked for without a
signal) while a connection is open; uvicorn's own are 0.1 s apart, and each wake-up of
an idle process costs ~0.3 ms of CPU on these machines (3 ms a second at ten a second).
A signal wakes it at once."""
IDLE_TICK_S = 30.0
"""Seconds between the server's ticks while no connection is open: nothing uses the
date header then, and a new connection wakes the loop for a tick at once (before its
first request is read), so its answers carry the date of now."""


def listen_url(host: str, port: int, scheme: str = "http") -> str:
    """``http://host:port`` (or ``scheme``'s), an IPv6 address in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def say_line(line: str, stream: TextIO) -> None:
    """``line`` and its newline in one write, flushed: the workers of one gateway share
    their stdout, and ``print`` writes a line's text and its newline apart where output
    is unbuffered (``PYTHONUNBUFFERED``), so two workers' ready lines came out as
    ``ready...ready...`` and an empty line, which a supervisor waiting for the line
    never sees. One write of a line (shorter than ``PIPE_BUF``) to a pipe is never
    interleaved with another's."""
    stream.write(line + "\n")
    stream.flush()


def server_class(ready: str = "") -> Any:
    """uvicorn's server class for ``pcr serve`` and ``pcr gateway``; ``ready`` is the line
    it prints on stdout once it accepts connections (its app started)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM, SIGHUP and Ctrl-C end it cleanly (exit 0), as
        they end ``pcr bridge``: uvicorn itself raises the signal again once stopped. It
        says when it is ready: the signal a supervisor or a test waits for."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if ready and self.started and not self.should_exit:
                say_line(ready, sys.stdout)

        async def main_loop(self) -> None:
            """uvicorn's loop of ticks, one every ``TICK_S`` while a connection is open
            (each updates the date header, as uvicorn's every tenth does), else every
            ``IDLE_TICK_S``; woken at once by a stopping signal, and by a connection
            opened while none was."""
            loop = asyncio.get_running_loop()
            woken = asyncio.Event()
            self._wake = lambda: loop.call_soon_threadsafe(woken.set)
            connections = self.server_state.connections
            # a connection opened on an idle server: its tick now (``_Deadlines``)
            self.server_state.wake_ticks = woken.set  # type: ignore[attr-defined]
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 10) % 864_000  # uvicorn's count of 0.1 s ticks
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(TICK_S if connections else IDLE_TICK_S):
                        await woken.wait()
                woken.clear()
                should_exit = await self.on_tick(counter)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            wake = getattr(self, "_wake", None)
            if wake is not None:
                with contextlib.suppress(RuntimeError):  # the loop already closed
                    wake()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {}
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                with contextlib.suppress(ValueError, OSError):  # not the main thread
                    previous[number] = signal.signal(number, self.handle_exit)
            try:
                yield
            finally:
                for number, handler in previous.items():
                    signal.signal(number, handler)

    return Server


if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpToolsProtocol
else:
    _HttpToolsProtocol = object  # the base _protocol_class gives once uvicorn is imported

HEAD_LIMIT = 16 << 10
"""Bytes a request's line and headers may take (h11's limit, nginx's default buffers):
past it, 431."""


HEAD_LINE = 64
"""Bytes of a head the parser's callbacks do not show (its method, version, line ends),
allowed for each message that ends in one read (``_Deadlines.data_received``)."""


class _HeadTooLarge(Exception):
    """Raised from the parser's callbacks: the request's head is over ``HEAD_LIMIT``."""


@dataclass(frozen=True)
class Direct:
    """Requests an app takes straight from the server's protocol: a ``POST`` whose path
    is one of ``paths`` as sent (no percent-escape; the query aside) goes to ``app`` (an
    ASGI callable that answers its own faults and checks its own keys) with no layer of
    uvicorn's between (its proxy-headers middleware: nothing of ours reads the client's
    address or scheme), and its response head is written without uvicorn's general
    checks (``_DirectCycle``). Every other request (those paths spelt with escapes
    included) goes through the whole app, which routes them to the same place."""

    paths: frozenset[bytes]
    app: Any


def leaving(receive: Any) -> Any:
    """The cycle of a ``Direct`` request whose ``receive`` this is (the app was handed
    the cycle's own, unwrapped), for ``watch_leave``, ``unwatch_leave`` and ``left``;
    None for any other request (or a ``receive`` a layer wrapped)."""
    owner = getattr(receive, "__self__", None)
    return owner if isinstance(owner, _DirectCycle) else None


def _protocol_class(
    header_timeout: float, body_timeout: float, openai: bool = False, direct: Direct | None = None
) -> type[Any]:
    """uvicorn's httptools protocol (llhttp, a C parser: about half the CPU of h11's per
    request) with the request deadlines, a limit on the head, and JSON for what uvicorn
    answers itself (malformed HTTP: 400, a head over ``HEAD_LIMIT``: 431): ``_Deadlines``
    on uvicorn's class, imported only now; ``direct``: the app's ``Direct`` requests."""
    import httptools
    from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert httptools  # imported first: a missing httptools fails here, not per connection
    attributes = {
        "header_timeout": header_timeout,
        "body_timeout": body_timeout,
        "openai_errors": openai,
        "direct": direct,
        "direct_cycle": None if direct is None else _direct_cycle_class(),
        "high_water": HIGH_WATER_LIMIT,
    }
    return type("Protocol", (_Deadlines, HttpToolsProtocol), attributes)


def _direct_cycle_class() -> type[Any]:
    """uvicorn's request cycle with ``_DirectCycle``'s response head (uvicorn imported now)."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle

    return type("DirectCycle", (_DirectCycle, RequestResponseCycle), {"status_lines": STATUS_LINE})


if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _Cycle
else:
    _Cycle = object  # the base _direct_cycle_class gives once uvicorn is imported

_FALL_BACK = frozenset({b"transfer-encoding", b"connection"})
"""Response headers whose meaning uvicorn's own ``send`` works out (``_DirectCycle``)."""
_NAME_RE = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_VALUE_RE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
"""What a header's name and value may not hold (as uvicorn checks)."""


WHOLE = "pcr.whole"
"""The scope extension of a ``Direct`` request: its response may come as one message,
``http.response.start`` with its ``body`` (the whole of it; ``content-length`` is the
server's to write), head and body then going out in one write."""
_WHOLE_EXTENSIONS: dict[str, dict[str, Any]] = {WHOLE: {}}
ARRIVED = "pcr.arrived"
"""A ``Direct`` request's scope key: ``time.perf_counter()`` as the bytes that completed
its head came off the connection, before the server parsed them: where the app's
"time since the request arrived" starts (the gateway's ``pcr_gateway_overhead_seconds``
and request durations), so the server's own part of a request is counted too."""


class _Signal:
    """What uvicorn's protocol calls a cycle's ``message_event`` (it calls ``set`` as the
    body comes, ends, or the client leaves), lighter than an ``asyncio.Event`` made per
    request: a flag, and a future only while a ``receive`` waits for the body."""

    __slots__ = ("flag", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flag = False
        self.loop = loop
        self.waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self.flag = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    async def wait(self) -> bool:
        while not self.flag:
            waiter = self.waiter = self.loop.create_future()
            await waiter
        return True


_NOTHING: Callable[[], None] = lambda: None  # noqa: E731  (a finished cycle's on_response)


class _DirectCycle(_Cycle):
    """uvicorn's request cycle for a ``Direct`` request, made per request with only its
    own values (the rest are class defaults), the body kept as the bytes that came (the
    usual single chunk is handed over uncopied), a ``_Signal`` for uvicorn's event, and
    the service's answer to a fault of the app (as ``pcr.serve.errors.Faults``: an
    exception before the response started is answered 500 ``internal error`` in the
    service's JSON shape, logged, and the connection kept; after, the connection is
    closed). Its response head takes a shorter way for what those apps send (lower-case
    names, a ``content-length`` or a streamed body): one pass over the headers, checked
    as uvicorn checks them; a whole response in one message (``WHOLE``) written at
    once; any other head (a ``connection`` or ``transfer-encoding`` header, a status
    without a body) and every later message go through uvicorn's own ``send``."""

    status_lines: ClassVar[dict[int, bytes]] = {}  # uvicorn's (``_direct_cycle_class``)
    # uvicorn's per-request state, its starting values shared (a request sets its own)
    disconnected = False
    more_body = True
    response_started = False
    response_complete = False
    chunked_encoding: bool | None = None
    expected_content_length = 0
    access_log = False
    body: bytes = b""  # type: ignore[assignment]  # ``+=`` of the first chunk onto b"" copies nothing
    openai_errors = False
    task: asyncio.Task[None] | None = None  # the request's task, while it runs
    watching_leave = False
    left = False
    """Whether the client's connection was lost while ``watch_leave`` held (and the
    request's task was cancelled for it)."""

    def __init__(self, protocol: Any, scope: Any, keep_alive: bool) -> None:
        # not uvicorn's __init__: only what differs per request
        self.scope = scope
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.logger = protocol.logger
        self.access_logger = protocol.access_logger
        self.default_headers = protocol.server_state.default_headers
        self.message_event = _Signal(protocol.loop)  # type: ignore[assignment]
        self.waiting_for_100_continue = protocol.expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = protocol.on_response_complete
        self.openai_errors = protocol.openai_errors

    async def run_asgi(self, app: Any) -> None:
        try:
            result = await app(self.scope, self.receive, self.send)
        except Exception as exc:
            if self.response_started:
                self.logger.error("Exception in ASGI application\n", exc_info=exc)
                self.transport.close()
            else:
                await self._fault(exc)
        except BaseException as exc:  # cancelled (the server stopping), as uvicorn does
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        else:
            if result is not None:
                self.logger.error("ASGI callable should return None, but returned '%s'.", result)
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                self.logger.error("ASGI callable returned without starting response.")
                await self.send_500_response()
            elif not self.response_complete and not self.disconnected:
                self.logger.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = _NOTHING
            self.task = None

    def watch_leave(self) -> bool:
        """From now until ``unwatch_leave``, the client's connection lost before the
        response completes cancels this request's task, and ``left`` says so (at once
        where it is lost already): the app learns of a client that left while it waits
        on something else, with no task or timer of its own. False where this cycle's
        task is not known (the app must watch another way)."""
        if self.task is None:
            return False
        self.watching_leave = True
        if self.disconnected and not self.response_complete:
            self.lost()
        return True

    def unwatch_leave(self) -> None:
        self.watching_leave = False

    def lost(self) -> None:
        """The client's connection is gone (or answered and ended by the server) before
        the response completed: a ``receive`` reads a disconnect, a ``send`` writes
        nothing, and a request watching for it (``watch_leave``) is cancelled."""
        self.disconnected = True
        self.message_event.set()
        task = self.task
        if self.watching_leave and not self.left and task is not None:
            self.left = True
            task.cancel()

    async def _fault(self, exc: Exception) -> None:
        """``pcr.serve.errors.Faults``' answer to an exception of the app's own code."""
        from pcr.web.errors import fault_body

        scope = self.scope
        body = fault_body(exc, scope["method"], scope["path"], openai=self.openai_errors)
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"application/json")],
                         "body": body})  # fmt: skip

    async def receive(self) -> Any:
        """uvicorn's ``receive``, the body handed over as it came (no copy)."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            signal = self.message_event
            if not signal.flag:  # type: ignore[attr-defined]
                await signal.wait()
            signal.flag = False  # type: ignore[attr-defined]
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = self.body
        self.body = b""
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Any) -> None:
        if self.response_started or message["type"] != "http.response.start":
            await super().send(message)
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # as uvicorn's own send waits
        if self.disconnected:
            return
        status = message["status"]
        if status < 200 or status in (204, 304):
            await self._uvicorns(message)
            return
        content = [self.status_lines[status]]
        whole = message.get("body")
        length = None if whole is None else len(whole)
        for name, value in (*self.default_headers, *message.get("headers", ())):
            if name == b"content-length" and whole is not None:
                raise RuntimeError("A whole response's content-length is the server's.")
            if name in _FALL_BACK:
                await self._uvicorns(message)
                return
            if _NAME_RE.search(name) or _VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header.")
            if name == b"content-length" and length is None:
                length = int(value.decode())
            content += (name, b": ", value, b"\r\n")
        self.response_started = True
        self.waiting_for_100_continue = False
        if whole is not None:
            content += (b"content-length: %d\r\n" % len(whole),)
            if not self.keep_alive:
                content.append(b"connection: close\r\n")
            content += (b"\r\n", whole)
            self.transport.write_now(b"".join(content))  # type: ignore[attr-defined]
            self.chunked_encoding = False
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
            return
        if length is None:
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        else:
            self.chunked_encoding = False
            self.expected_content_length = length
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))

    async def _uvicorns(self, start: Any) -> None:
        """A head left to uvicorn's ``send``; a whole response's as its two messages."""
        whole = start.get("body")
        if whole is None:
            await super().send(start)
            return
        headers = list(start.get("headers", ()))
        if start["status"] >= 200 and start["status"] not in (204, 304):  # those have none
            headers.append((b"content-length", b"%d" % len(whole)))
        await super().send({"type": "http.response.start", "status": start["status"],
                            "headers": headers})  # fmt: skip
        await super().send({"type": "http.response.body", "body": whole})


class _Deadlines(_HttpToolsProtocol):
    """What ``_protocol_class`` adds to uvicorn's httptools protocol (its base once
    uvicorn is imported): a connection whose client must send each request's headers within
    ``header_timeout`` seconds (of the connection opening, or of the request's first
    byte on a kept-alive connection) and its body within ``body_timeout`` seconds of
    its headers. Past a deadline the client gets 408 JSON (a new connection that sent
    nothing is only closed, as an idle keep-alive one is) and the connection closes.

    ``phase`` is what the client owes, from the parser's callbacks: ``new`` (a
    connection that sent nothing yet), ``headers`` (a request begun), ``body`` (its
    headers in, its body not), None (the request is in: nothing is owed)."""

    header_timeout = HEADER_TIMEOUT
    body_timeout = BODY_TIMEOUT
    openai_errors = False
    direct: Direct | None = None
    direct_cycle: Any = None
    _deadline: asyncio.TimerHandle | None = None
    _waiting_for: str | None = None
    phase: str | None = "new"
    _head = 0  # bytes of the current request's head seen by the callbacks
    _unfinished = 0  # bytes received while a head stayed incomplete
    _began = False  # a message began in the data being read
    _fed = 0  # bytes of the data being read known to precede the current head (about)
    _head_from = 0  # ``_fed`` when the current message began
    _arrived = 0.0  # time.perf_counter() as the data being read came (``ARRIVED``)
    high_water = 65536  # uvicorn's HIGH_WATER_LIMIT (``_protocol_class``)
    _too_large = False
    _lingering = False
    _idle_since: float | None = None  # when the last response ended; None: a request runs
    _idle_timer: asyncio.TimerHandle | None = None  # the keep-alive deadline's check
    _running: Any = None  # the Direct request whose task started last

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(Coalescing(transport))  # type: ignore[arg-type]
        if len(self.connections) == 1:  # the server was idle: its ticks slowed down
            wake = getattr(self.server_state, "wake_ticks", None)
            if wake is not None:
                wake()  # its tick runs before this connection's first request is read
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # after the last answer: read and drop until the client closes
        self._began = False
        self._fed = 0
        self._arrived = time.perf_counter()  # a Direct request's ARRIVED
        super().data_received(data)
        if self._lingering or self.transport.is_closing():
            return  # answered and ended by the parser's callbacks (400, 431)
        if self.phase in ("new", "headers"):  # a head that never ends (one long line)
            # Only what went to the head counts: one begun in this data may follow the
            # end of a body read with it (a busy server reads in larger pieces), whose
            # bytes the parser's callbacks counted (``_fed``, ``_head_from``)
            if self._began:
                self._unfinished = max(0, len(data) - self._head_from)
            else:
                self._unfinished += len(data)
            if self._unfinished > HEAD_LIMIT:
                self._refuse_head()
                return
        else:
            self._unfinished = 0
        self._watch()

    # the parser's callbacks (uvicorn's, plus what the client owes and the head's size)

    # on_message_begin, on_url and on_header are uvicorn's (0.54) with the head counted
    # in the same call: the parser calls them about eight times a request

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        headers: list[tuple[bytes, bytes]] = []
        self.headers = headers
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
        }
        self.phase = "headers"
        self._head = 0
        self._began = True
        self._head_from = self._fed

    def on_url(self, url: bytes) -> None:
        self._head += len(url)
        if self._head > HEAD_LIMIT:
            self._too_large = True
            raise _HeadTooLarge  # feed_data raises the parser's error: send_400_response
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value) + 4
        if self._head > HEAD_LIMIT:
            self._too_large = True
            raise _HeadTooLarge
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.phase = "body"
        if self.direct is None or not self._start_direct(self.direct):
            super().on_headers_complete()

    def _start_direct(self, direct: Direct) -> bool:
        """Start a ``Direct`` request as uvicorn starts any (its scope, a cycle, a task,
        or queued behind a pipelined one); False: not one (uvicorn's way then)."""
        parser = self.parser
        if parser.get_method() != b"POST" or self.limit_concurrency is not None or self.root_path:
            return False
        path, _, query = self.url.partition(b"?")
        if path not in direct.paths or b"#" in query or parser.should_upgrade():
            return False
        scope = self.scope
        scope["method"] = "POST"
        version = parser.get_http_version()
        if version != "1.1":
            scope["http_version"] = version
        scope["path"] = path.decode("ascii")
        scope["raw_path"] = path
        scope["query_string"] = query
        scope["extensions"] = _WHOLE_EXTENSIONS  # type: ignore[typeddict-item]
        scope[ARRIVED] = self._arrived  # type: ignore[literal-required]
        previous = self.cycle
        self.cycle = self.direct_cycle(self, scope, version != "1.0" and parser.should_keep_alive())
        if previous is None or previous.response_complete:
            self._start_asgi_task(self.cycle, direct.app)
        else:  # pipelined: after the one before it
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, direct.app))
        return True

    def on_body(self, body: bytes) -> None:  # uvicorn's (0.54), its bytes counted
        self._fed += len(body)
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > self.high_water:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self.phase = None
        self._fed += self._head + HEAD_LINE  # the head before its body (about)
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._refuse_head()
        else:
            _answer(self, 400, "the request is not valid HTTP/1.1")

    def _refuse_head(self) -> None:
        _answer(self, 431, f"request headers are limited to {HEAD_LIMIT:,} bytes")

    def on_response_complete(self) -> None:
        """uvicorn's, but the keep-alive deadline is one timer per connection, checked
        when it fires against when the connection went idle (``_idle_since``), not a
        timer made and cancelled per request."""
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self.flow.resume_reading()
            if self.pipeline:  # the next pipelined request, already read
                self._idle_since = None
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._idle_since = self.loop.time()
                if self._idle_timer is None:
                    self._idle_timer = self.loop.call_later(
                        self.timeout_keep_alive, self._idle_check
                    )
        self._watch()

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # a request began (or the connection ends): not idle

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return  # busy: its response arms the deadline again
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self._idle_timer = self.loop.call_later(left, self._idle_check)
        else:
            self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._lost()
        super().connection_lost(exc)

    def _lost(self) -> None:
        """The Direct requests of this connection still answering are told it is gone
        (``_DirectCycle.lost``): the last one read, and the one running (where requests
        were pipelined, an earlier one)."""
        for cycle in (self.cycle, self._running):
            if isinstance(cycle, _DirectCycle) and not cycle.response_complete:
                cycle.lost()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """uvicorn's (0.54), the task kept on a ``Direct`` request's cycle (its client's
        leaving cancels it, ``_DirectCycle.watch_leave``)."""
        if not isinstance(cycle, _DirectCycle):
            super()._start_asgi_task(cycle, app)
            return
        if self.config.reset_contextvars:
            task = self.loop.create_task(cycle.run_asgi(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        cycle.task = task
        self._running = cycle

    # the deadlines

    def _watch(self) -> None:
        """Arm the deadline of what the connection now waits for from the client."""
        waiting = None if self.transport.is_closing() else self.phase
        if waiting == self._waiting_for:
            return  # the same wait goes on: its deadline stands
        self._stop()
        self._waiting_for = waiting
        if waiting is not None:
            if waiting != "new":
                self._unset_keepalive_if_required()  # a request has begun: not idle
            seconds = self.body_timeout if waiting == "body" else self.header_timeout
            self._deadline = self.loop.call_later(seconds, self._expired, seconds)

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.phase == "new":  # nothing sent: closed, as an idle connection is
            self.transport.close()
            return
        what = "body" if self.phase == "body" else "headers"
        _answer(self, 408, f"the request's {what} did not arrive within {seconds:g} s")

    def linger(self) -> None:
        """Half-close after a last answer (``_linger``); once only."""
        if self._lingering:
            return
        self._stop()
        self._unset_keepalive_if_required()
        self._lingering = _linger(self.transport)


class Coalescing:
    """A transport whose writes within one turn of the event loop go out as one send:
    uvicorn writes a response's head and its body separately, and on these machines each
    send to a local peer costs a wake-up of the other core. Streamed chunks that arrive
    in later turns go out as they come (a turn later at most). Everything else is the
    transport's own."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._ended = False  # write_eof called: later writes are dropped, as on a closed one

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._ended:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def write_now(self, data: bytes) -> None:
        """``data`` sent now, after what this turn wrote before it (a whole response:
        nothing of it is left to join)."""
        if self._ended:
            return
        if self._pending:
            self._pending.append(data)
            self.flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        if self._ended:
            return
        self.flush()
        self._ended = True
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        closing: bool = self._transport.is_closing()  # asked a few times per request
        return closing

    def get_write_buffer_size(self) -> int:
        size: int = self._transport.get_write_buffer_size()
        return size + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _linger(transport: Any) -> bool:
    """End a connection after its last answer: send FIN at once and close only when the
    client does (or after ``LINGER`` seconds), what it still sends read and dropped, so
    closing with unread data cannot reset the connection and lose the answer on its way
    (a lingering close, as nginx and Apache do). Whether it lingers (else: closed)."""
    if not transport.can_write_eof():
        transport.close()
        return False
    transport.write_eof()
    asyncio.get_running_loop().call_later(LINGER, transport.close)
    return True


def _answer(protocol: Any, status: int, detail: str) -> None:
    """Answer ``status`` in the service's JSON shape and close the connection. Only where
    no answer to the request has begun (else closing is all that is left); the app's
    request, if one runs, reads a disconnect."""
    from pcr.web.errors import ERROR_KINDS, error_body

    if getattr(protocol, "_lingering", False):
        return  # already answered and ending: a second answer would follow the FIN
    cycle = protocol.cycle
    if protocol.phase in ("new", "headers"):  # a next request, no answer of its own yet
        fresh = cycle is None or cycle.response_complete
    else:
        fresh = cycle is None or not cycle.response_started
    if fresh:
        body = error_body(
            ERROR_KINDS[status], detail, status, openai=getattr(protocol, "openai_errors", False)
        )
        phrase = HTTPStatus(status).phrase
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        protocol.transport.write(head.encode("latin-1") + body)
    protocol._lost()  # its Direct requests: as when the connection is lost
    if cycle is not None and not isinstance(cycle, _DirectCycle) and not cycle.response_complete:
        cycle.disconnected = True  # the app reads a disconnect and sends nothing
        cycle.message_event.set()
    protocol.linger()


def uvicorn_config(
    app: Any,
    *,
    header_timeout: float = HEADER_TIMEOUT,
    body_timeout: float = BODY_TIMEOUT,
    keep_alive_timeout: int = KEEP_ALIVE_TIMEOUT,
    openai_errors: bool = False,
    direct: Direct | None = None,
    **options: Any,
) -> Any:
    """The ``uvicorn.Config`` ``pcr serve`` runs ``app`` with: its deadlines, no
    WebSocket upgrades (the app has none), no access log, no ``Server`` header (no
    versions told; the ``Date`` header is uvicorn's alone); ``options`` (host, port,
    log_level, ``ssl_*`` from ``pcr.web.tls.server_tls``, ...) go to ``uvicorn.Config``."""
    import uvicorn

    options.setdefault("log_level", "warning")
    options.setdefault("server_header", False)
    return uvicorn.Config(
        app,
        http=_protocol_class(header_timeout, body_timeout, openai_errors, direct),
        ws="none",
        timeout_keep_alive=keep_alive_timeout,
        access_log=False,
        lifespan="on",
        **options,
    )


def enable_metrics() -> None:
    """The registry's Prometheus metrics on ``/metrics`` (routing decisions, score
    times), when prometheus-client is installed."""
    from registry import metrics

    with contextlib.suppress(ImportError, RuntimeError):  # not installed; already on
        metrics.enable_metrics()


def run_app(
    app: Any, sock: socket.socket, args: argparse.Namespace, name: str, **options: Any
) -> int:
    """Run ``app`` on the bound ``sock`` with the deadlines of ``args`` (``limit_options``)
    until a signal ends it, saying ``pcr NAME: ready on http://HOST:PORT`` (``https://``
    with TLS options) on stdout once it accepts connections; ``options`` go to
    ``uvicorn_config``."""
    config = uvicorn_config(
        app,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        direct=getattr(app, "direct", None),
        **options,
    )
    host, port = sock.getsockname()[:2]
    scheme = "https" if options.get("ssl_certfile") else "http"
    server = server_class(f"pcr {name}: ready on {listen_url(host, port, scheme)}")(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


RESPAWN_AFTER_S = 10.0
"""Seconds a worker must have run for its exit to be met with a new one (``serve_workers``);
one that exits sooner stops the service: a start that fails would fail again."""


def serve_workers(
    count: int,
    serve: Callable[[int], int],
    respawn_after: float = RESPAWN_AFTER_S,
    started: Callable[[], None] | None = None,
) -> int | None:
    """Fork ``count`` worker processes, each returning ``serve(index)`` (None is returned
    in the parent only: a worker returns its own exit status, up through the caller, so
    its errors are reported as a single process's are). The parent supervises: SIGTERM,
    SIGINT and SIGHUP go to every worker, and its status is then 0; a worker that exits
    on its own (killed for memory, crashed) after ``respawn_after`` seconds is replaced
    by a new one of the same index, the others serving meanwhile; one that exits sooner
    stops the others, and the parent's status is its. Fork before any thread or event
    loop starts (each worker builds its own app; the parent never starts either). A
    worker dies with the parent (Linux). ``started`` is called in the parent once the
    first workers are forked (to close what only they use)."""
    children: dict[int, tuple[int, float]] = {}  # pid -> (index, when it started)
    told: set[int] = set()  # the workers asked to stop (once each: a second SIGTERM
    # during a worker's shutdown, its handlers restored, would kill it mid-way)
    stopping = False

    def stop(_signum: int = 0, _frame: Any = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            if pid not in told:
                told.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    before = {number: signal.getsignal(number) for number in signals}
    starting = list(range(count))  # the indexes of the workers to start
    supervising = False
    code = 0
    while True:
        for index in starting:
            # held while forking: a new worker must not run the parent's ``stop``
            signal.pthread_sigmask(signal.SIG_BLOCK, signals)
            pid = os.fork()
            if pid == 0:
                for number, handler in before.items():  # as the first workers had them
                    signal.signal(number, handler)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
                _die_with_parent()
                return serve(index)
            children[pid] = (index, time.monotonic())
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        if not supervising:  # the first workers are out: the parent's own part
            supervising = True
            if started is not None:
                started()
            for number in signals:
                signal.signal(number, stop)
        starting = []
        if not children:
            return code
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code
        index, began = children.pop(pid, (-1, 0.0))
        exit_code = os.waitstatus_to_exitcode(status)
        if pid in told and exit_code == -signal.SIGTERM:
            exit_code = 0  # asked to stop before its own handlers were in place
        if not stopping and index >= 0 and time.monotonic() - began >= respawn_after:
            how = f"signal {-exit_code}" if exit_code < 0 else f"status {exit_code}"
            say_line(f"worker {index} (pid {pid}) ended with {how}; starting another", sys.stderr)
            starting = [index]
            continue
        if exit_code != 0 and code == 0:
            code = exit_code if exit_code > 0 else 1
        stop()  # one worker gone as it started, or the service stopping: all stop


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
