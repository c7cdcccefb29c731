"""What the gateway itself answers, in plain ASGI: whole responses, its errors in the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``, and the headers that
pass between client and backend (hop-by-hop ones dropped both ways)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from pcr.web.errors import error_content

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ERROR_KIND = {
    400: "bad request",
    404: "not found",
    415: "unsupported media type",
    499: "client closed request",
    502: "bad gateway",
    503: "unavailable",
}
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",  # the whole body is sent at once: no "100 Continue" to wait for
    }
)


HOP_BYTES = frozenset(name.encode() for name in HOP_HEADERS)
OWN_HEADERS = frozenset({"date", "server"})
"""A backend's reply headers the gateway does not pass on: the ``Date`` is the gateway's
own (uvicorn's, one header, not two), and no ``Server`` tells the engine's versions."""
REPLY_DROPPED = HOP_HEADERS | OWN_HEADERS
REPLY_DROPPED_BYTES = frozenset(name.encode() for name in REPLY_DROPPED)
JSON_HEADERS = [(b"content-type", b"application/json")]


async def respond(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    whole: bool = False,
) -> None:
    """A whole response: its head (with the body's length) and its body; ``whole``: in
    one message, where the server takes it so (``pcr.web.server.WHOLE``)."""
    if whole:
        start = {"type": "http.response.start", "status": status, "body": body}
        start["headers"] = JSON_HEADERS if headers is None else headers
        await send(start)
        return
    head = list(JSON_HEADERS if headers is None else headers)
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def error_body(status: int, message: str) -> bytes:
    """The OpenAI error shape, for what the gateway itself answers."""
    content = error_content(status, ERROR_KIND[status], message, True)
    return json.dumps(content, separators=(",", ":")).encode()


async def answer_error(send: Send, status: int, message: str) -> None:
    await respond(send, status, error_body(status, message))


def openai_error(status: int, message: str) -> JSONResponse:
    """The OpenAI error shape, for what the gateway itself answers (FastAPI's routes)."""
    return JSONResponse(error_content(status, ERROR_KIND[status], message, True), status)


def json_body(raw: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's ``Content-Type`` is ``application/json`` (parameters such as
    ``charset`` aside): the completion endpoints take nothing else, so a browser's
    cross-site ``text/plain`` POST (which needs no CORS preflight) never reaches an engine."""
    for name, value in raw:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def forwarded_headers(
    raw: list[tuple[bytes, bytes]], backend_key: str | None = None
) -> list[tuple[bytes, bytes]]:
    """The request's headers for the backend, as the server parsed them (ASGI gives
    names in lower case; no hop-by-hop one); with ``backend_key``, the engines' own key
    in place of any ``Authorization`` sent."""
    if backend_key is None:
        return [item for item in raw if item[0] not in HOP_BYTES]
    headers = [item for item in raw if item[0] not in HOP_BYTES and item[0] != b"authorization"]
    headers.append((b"authorization", f"Bearer {backend_key}".encode("latin-1")))
    return headers


def backend_auth(backend_key: str | None) -> dict[str, str] | None:
    """The headers every request of the gateway's own to an engine carries."""
    return None if backend_key is None else {"Authorization": f"Bearer {backend_key}"}


def reply_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A backend's reply headers (lower-case names) for an ASGI response start."""
    return [item for item in raw if item[0] not in REPLY_DROPPED_BYTES]
