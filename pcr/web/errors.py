"""The one error shape of the project's HTTP services (``pcr serve``, ``pcr gateway``).

``pcr serve`` answers ``{"error": KIND, "detail": ...}``; ``pcr gateway``, whose clients
speak the OpenAI API, answers the same facts in the OpenAI shape. Neither ever repeats
the request's data.
"""

from __future__ import annotations

import json
import logging
from typing import Any

_faults = logging.getLogger("pcr.serve.errors")  # the name operators have filtered on

ERROR_KINDS = {
    400: "bad request",
    404: "not found",
    405: "method not allowed",
    408: "request timeout",
    413: "request too large",
    422: "invalid request",
    431: "request headers too large",
    503: "unavailable",
}
"""The ``error`` of each status; a 500 is ``registry fault`` (an operator must act) or
``internal error`` (a fault of the service), a 503 of ``/health`` is ``unhealthy``."""


def fault_body(exc: BaseException, method: str, path: str, *, openai: bool = False) -> bytes:
    """The answer to an exception of a service's own code (a bug) before its response
    began: logged with its traceback, and the body of a 500 ``internal error`` naming
    only the exception's type (``pcr.serve.errors.Faults``, and the server's cycle for
    a ``Direct`` request)."""
    _faults.error("internal error on %s %s", method, path, exc_info=exc)
    return error_body("internal error", type(exc).__name__, 500, openai=openai)


def error_body(kind: str, detail: Any, status: int = 500, *, openai: bool = False) -> bytes:
    """The one error shape, encoded (also for the protocol-level answers of ``pcr serve``
    and ``pcr gateway``)."""
    return json.dumps(error_content(status, kind, detail, openai), separators=(",", ":")).encode()


def error_content(status: int, kind: str, detail: Any, openai: bool = False) -> dict[str, Any]:
    """``{"error": KIND, "detail": ...}``, or for ``pcr gateway`` (whose clients speak
    the OpenAI API) the same facts in the OpenAI shape ``{"error": {"message", "type",
    "param", "code"}}``: ``message`` the kind and the detail in words, ``type`` OpenAI's
    name for the status, ``code`` the status."""
    if not openai:
        return {"error": kind, "detail": detail}
    return {
        "error": {
            "message": in_words(kind, detail),
            "type": openai_type(status),
            "param": None,
            "code": status,
        }
    }


def openai_type(status: int) -> str:
    """The OpenAI error type of an HTTP status."""
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def in_words(kind: str, detail: Any) -> str:
    if isinstance(detail, str):
        return f"{kind}: {detail}" if detail and detail != kind else kind
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", ()))
                parts.append(f"{where}: {item.get('msg', '')}" if where else str(item.get("msg")))
        return f"{kind}: " + "; ".join(parts) if parts else kind
    return kind
