"""ASGI pieces the server tests share."""

from __future__ import annotations

from typing import Any


async def lifespan(receive: Any, send: Any) -> None:
    """An app's lifespan: started at once, stopped when asked."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def lifespan_only(scope: Any, receive: Any, send: Any) -> None:
    """An app with a lifespan and nothing else (a server's own behaviour under test)."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
