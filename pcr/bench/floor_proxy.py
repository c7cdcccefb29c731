"""The least a Python proxy on the gateway's own stack does per request: the floor under
``pcr gateway``'s cost in ``pcr.bench.gateway_load`` (issue 45).

uvicorn with httptools and uvloop (the gateway's server), one plain ASGI callable, and
the gateway's upstream client (``pcr.gateway.upstream``; ``--client aiohttp``: aiohttp's,
with the gateway's former connector settings): each
request's body read and forwarded unparsed to the next backend in turn, the reply read
whole and passed back. No JSON, tokenizer, hashing, choice, load bookkeeping, metrics
or keys: what is left is the framework's work, which no routing rule written on this
stack can go below. ``python -m pcr.bench.floor_proxy --port P --backend URL ...``.

``--server raw``: the same client behind httptools' parser on a plain asyncio protocol
(no uvicorn, no ASGI; keep-alive, one request at a time per connection, as the bench's
clients send), so the bench can say how much of the floor is uvicorn's and the ASGI's.
``--server direct``: the same ASGI callable on the gateway's own server stack
(``pcr.web.server``: its protocol with the deadlines and write coalescing, the proxied
paths taken as ``Direct`` requests, a whole reply in one message), so the bench can say
how much of the gateway's cost its server is.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import httptools
import uvicorn

from pcr.gateway.upstream import Upstream

Message = dict[str, Any]
JSON_HEADERS = [(b"content-type", b"application/json")]


class FloorProxy:
    """The ASGI callable: ``/health`` answered, everything else forwarded (by the
    gateway's upstream client, ``pcr.gateway.upstream``, or by aiohttp's)."""

    def __init__(self, backends: Sequence[str], client: str = "upstream") -> None:
        self.turns = itertools.cycle(backends)
        self.client = client
        self.http: aiohttp.ClientSession | None = None
        self.upstream = Upstream(connect_timeout=2.0, read_timeout=600.0, keep_alive=4.0)
        self.whole = False  # the reply as one message (``pcr.web.server.WHOLE``)

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        base = next(self.turns)
        if self.client == "upstream":
            reply = await self.upstream.request(
                base, b"POST", scope["path"].encode(), b"".join(chunks), JSON_HEADERS
            )
            body = await reply.read()
            reply.release()
            if self.whole:
                await send({"type": "http.response.start", "status": reply.status,
                            "headers": JSON_HEADERS, "body": body})  # fmt: skip
                return
            await send({"type": "http.response.start", "status": reply.status,
                        "headers": JSON_HEADERS})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        assert self.http is not None
        url = base + scope["path"]
        async with self.http.post(
            url, data=b"".join(chunks), headers={"Content-Type": "application/json"}
        ) as upstream:
            body = await upstream.read()
            await send(
                {
                    "type": "http.response.start",
                    "status": upstream.status,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
                self.http = aiohttp.ClientSession(
                    connector=connector, trust_env=False, auto_decompress=False
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.http is not None:
                    await self.http.close()
                await self.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _RawFloor(asyncio.Protocol):
    """``--server raw``: the same forwarding with no uvicorn and no ASGI: httptools'
    parser on the connection, a task per request calling the gateway's upstream client,
    the reply written as one send. What a gateway-owned HTTP front could go down to."""

    def __init__(self, turns: Iterator[str], upstream: Upstream) -> None:
        self.turns = turns
        self.upstream = upstream
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.chunks: list[bytes] = []
        self.answering: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's: not a subclass of asyncio.Transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.chunks)
        self.url, self.chunks = b"", []
        task = asyncio.ensure_future(self._answer(url, body))
        self.answering.add(task)  # held until done (the loop keeps only a weak one)
        task.add_done_callback(self.answering.discard)

    async def _answer(self, url: bytes, body: bytes) -> None:
        if url == b"/health":
            status, content = 200, b"{}"
        else:
            reply = await self.upstream.request(next(self.turns), b"POST", url, body, JSON_HEADERS)
            content = await reply.read()
            reply.release()
            status = reply.status
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % (status, len(content))
                + content
            )


def _serve_raw(port: int, backends: Sequence[str]) -> None:
    import uvloop

    async def serve() -> None:
        upstream = Upstream(connect_timeout=2.0, read_timeout=600.0, keep_alive=4.0)
        turns = itertools.cycle(backends)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _RawFloor(turns, upstream), "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


def _serve_direct(app: FloorProxy, port: int) -> None:
    from pcr.web.server import Direct, server_class, uvicorn_config

    app.whole = True
    paths = frozenset({b"/v1/completions", b"/v1/chat/completions"})
    config = uvicorn_config(
        app, host="127.0.0.1", port=port, loop="uvloop", direct=Direct(paths, app)
    )
    server_class()(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr.bench.floor_proxy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--client", choices=("upstream", "aiohttp"), default="upstream")
    parser.add_argument("--server", choices=("uvicorn", "raw", "direct"), default="uvicorn")
    args = parser.parse_args(argv)
    if args.server == "raw":
        _serve_raw(args.port, [b.rstrip("/") for b in args.backend])
        return 0
    app = FloorProxy([b.rstrip("/") for b in args.backend], args.client)
    if args.server == "direct":
        _serve_direct(app, args.port)
        return 0
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=args.port,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
