"""The least a Python proxy on the gateway's own stack does per request: the floor under
``pcr gateway``'s cost in ``pcr.bench.gateway_load`` (issue 45).

uvicorn with httptools and uvloop (the gateway's server), one plain ASGI callable, and
the gateway's upstream client (``pcr.gateway.upstream``; ``--client aiohttp``: aiohttp's,
with the gateway's former connector settings): each
request's body read and forwarded unparsed to the next backend in turn, the reply read
whole and passed back. No JSON, tokenizer, hashing, choice, load bookkeeping, metrics
or keys: what is left is the framework's work, which no routing rule written on this
stack can go below. ``python -m pcr.bench.floor_proxy --port P --backend URL ...``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

import aiohttp
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr.bench.floor_proxy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--client", choices=("upstream", "aiohttp"), default="upstream")
    args = parser.parse_args(argv)
    config = uvicorn.Config(
        FloorProxy([b.rstrip("/") for b in args.backend], args.client),
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
