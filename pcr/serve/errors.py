"""The scoring service's errors, in one shape for every status: the exception handlers
(``HANDLERS``) and the two middleware layers, ``Faults`` (the outermost: no fault of the
app leaves as a traceback) and ``BodyLimit`` (413 for a body over ``MAX_BODY_BYTES``).

Every error is a JSON object ``{"error": KIND, "detail": ...}`` (the OpenAI shape for the
gateway) whose detail never repeats the request.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from pcr.serve.schema import ERROR_MEANINGS, MAX_BODY_BYTES, ScoreRequest
from pcr.web.errors import ERROR_KINDS, error_body, error_content, fault_body
from registry.core.errors import RegistryError, RegistryUnavailable

log = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 10
"""Most validation errors a 422 lists; the rest are counted."""


def error_response(
    status: int,
    kind: str,
    detail: Any,
    headers: dict[str, str] | None = None,
    *,
    openai: bool = False,
) -> JSONResponse:
    """An error in the one shape (the OpenAI shape with ``openai``)."""
    return JSONResponse(
        error_content(status, kind, detail, openai), status_code=status, headers=headers
    )


def openai_shaped(request: Request) -> bool:
    """Whether the app is ``pcr gateway`` (OpenAI-shaped errors)."""
    return getattr(request.app.state, "gateway", None) is not None


def _registry_error(exc: RegistryError, openai: bool = False) -> JSONResponse:
    message = str(exc).split("\n")[0]
    if isinstance(exc, RegistryUnavailable):
        return error_response(503, "unavailable", message, openai=openai)
    return error_response(500, "registry fault", message, openai=openai)


_SHOWN_LOC = frozenset({"body", "[key]", *ScoreRequest.model_fields})
"""Parts of an error's ``loc`` that are the schema's own words; any other text (a
``load`` key, an unknown field's name) came from the request and is shown as ``*``."""


def _shown_loc(loc: Sequence[Any]) -> list[Any]:
    return [part if isinstance(part, int) or part in _SHOWN_LOC else "*" for part in loc][:5]


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    shown: list[dict[str, Any]] = [
        {
            "loc": _shown_loc(e.get("loc", ())),
            "msg": str(e.get("msg", ""))[:300],
            "type": e.get("type"),
        }
        for e in errors[:MAX_ERRORS_SHOWN]
    ]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append({"msg": f"and {len(errors) - MAX_ERRORS_SHOWN} more errors"})
    return error_response(422, ERROR_KINDS[422], shown, openai=openai_shaped(request))


def _not_json(cause: BaseException, openai: bool = False) -> JSONResponse:
    """422 for a body json.loads could not read (FastAPI answers these with a bare 400)."""
    if isinstance(cause, RecursionError):
        why = "the body nests too deeply"
    elif isinstance(cause, UnicodeDecodeError):
        why = "the body is not UTF-8"
    elif "digits" in str(cause):
        why = "an integer in the body has too many digits"
    else:
        why = "the body is not JSON"
    detail = [{"loc": ["body"], "msg": why, "type": "json_invalid"}]
    return error_response(422, ERROR_KINDS[422], detail, openai=openai)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's and FastAPI's HTTP errors (404, 405, a body that did not parse) in the
    one shape; the detail is the status' own meaning, never the request."""
    if exc.status_code == 400 and isinstance(exc.__cause__, (RecursionError, ValueError)):
        return _not_json(exc.__cause__, openai_shaped(request))
    try:
        phrase = HTTPStatus(exc.status_code).phrase.lower()
    except ValueError:
        phrase = "error"
    kind = ERROR_KINDS.get(exc.status_code, phrase)
    detail = ERROR_MEANINGS.get(exc.status_code, phrase)
    return error_response(
        exc.status_code, kind, detail, dict(exc.headers or {}), openai=openai_shaped(request)
    )


async def _registry_fault(request: Request, exc: RegistryError) -> JSONResponse:
    return _registry_error(exc, openai_shaped(request))


HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    RequestValidationError: _invalid,
    HTTPException: _http_error,
    RegistryError: _registry_fault,
}
"""The errors with a handler of their own; any other exception is ``Faults``'."""


class Faults:
    """The app's outermost middleware: an exception of the service's own code (a bug)
    before the response started is answered 500 ``internal error`` naming only its type,
    logged with its traceback, and goes no further. Starlette's own outermost layer would
    answer it too, but then raise it on, and uvicorn closes the connection of a request
    whose app raised: a keep-alive client's next request on it would fail unanswered.
    After the response started there is no answer to give: it is raised on, and the
    connection closed."""

    def __init__(self, app: Any, openai: bool = False) -> None:
        self.app = app
        self.openai = openai

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            body = fault_body(exc, scope["method"], scope["path"], openai=self.openai)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 (by Content-Length, and by
    counting a body sent without one)."""

    def __init__(self, app: Any, limit: int, openai: bool = False) -> None:
        self.app = app
        self.limit = limit
        self.openai = openai

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        received = 0
        started = refused = False

        async def counted() -> MutableMapping[str, Any]:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)
                    return {"type": "http.disconnect"}  # the app stops reading
            return message

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, watched)

    async def _refuse(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        body = error_body(
            ERROR_KINDS[413], f"bodies are limited to {self.limit:,} bytes", 413, openai=self.openai
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def too_large_body(*, openai: bool) -> bytes:
    """The 413 a body over ``MAX_BODY_BYTES`` gets, encoded."""
    return error_body(
        ERROR_KINDS[413], f"bodies are limited to {MAX_BODY_BYTES:,} bytes", 413, openai=openai
    )
