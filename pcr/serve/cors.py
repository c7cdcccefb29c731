"""Which browser origins may call ``pcr serve`` and ``pcr gateway`` (``--allowed-origins``):
none unless some are given, then Starlette's CORS middleware for those alone.

It wraps the whole ASGI app, outside FastAPI's own layers, so the gateway's proxied
routes (taken before those layers, ``ScoringApp.proxied``) answer preflights and carry
``Access-Control-Allow-Origin`` like every other route. A refused preflight gets the
service's error shape (``pcr.web.errors``) instead of Starlette's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from pcr.web.errors import error_body

METHODS = ("GET", "POST")
"""Every method the services answer (besides the preflight's ``OPTIONS``)."""


class OriginPolicy(CORSMiddleware):
    """Starlette's ``CORSMiddleware`` for ``origins`` (no credentials: the services set
    no cookies; any request header, so browser SDKs may send their own), its refusals in
    the service's error shape (the OpenAI one with ``openai``)."""

    def __init__(self, app: Any, origins: Sequence[str], *, openai: bool) -> None:
        super().__init__(app, allow_origins=origins, allow_methods=METHODS, allow_headers=("*",))
        self.openai = openai

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode("latin-1").removeprefix("Disallowed CORS ")
        detail = f"cross-origin request refused (not allowed: {refused})"
        headers = {
            name: value
            for name, value in response.headers.items()
            if name not in ("content-type", "content-length")
        }
        body = error_body("bad request", detail, response.status_code, openai=self.openai)
        return Response(body, response.status_code, headers, media_type="application/json")


def allow_origins(app: Any, origins: Sequence[str], *, openai: bool) -> Any:
    """``app`` answering cross-origin requests of ``origins`` (``*``: any); ``app``
    itself, untouched, without any."""
    if not origins:
        return app
    return OriginPolicy(app, list(dict.fromkeys(origins)), openai=openai)
