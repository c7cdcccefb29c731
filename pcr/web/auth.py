"""API keys, tenants and per-key rate limits of ``pcr serve`` and ``pcr gateway``: one
ASGI layer (``Access``) in front of everything either service answers, the gateway's
proxied routes included.

A request names its key as ``Authorization: Bearer KEY`` (the one way: OpenAI's clients
and vLLM's server use it). Keys are held as SHA-256 digests; the digest of the key a
request shows is compared with every held one by ``hmac.compare_digest``, so neither the
key nor which key matched shows in the time taken. A key is an operator's (sees and may
do everything) or a tenant's (``Grant``: its namespaces, its models, its rate). With keys
set, ``/health`` and ``/live`` stay open, the docs pages are open when asked for and
gone otherwise, ``/metrics`` takes an operator's key, and the rest takes any key: no key
or a wrong one is 401, a key past its burst 429 with ``Retry-After``, a tenant on
``/metrics`` 403, all in the service's error shape and counted in
``pcr_http_rejected_total{reason, tenant}``. The grant rides in the request's scope
(``PRINCIPAL``) for the routes to narrow what a tenant sees (``visible``,
``routable``, ``model_allowed``); the key itself is taken out of the headers, so the
gateway never passes a client's key on to an engine.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from pcr.web.errors import error_body
from registry.core.keys import validate_namespace

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PRINCIPAL = "pcr.grant"
"""The scope key holding the request's ``Grant`` (absent when no keys are set)."""
OPEN_PATHS = frozenset({"/health", "/live"})
"""Answered without a key: a load balancer's and a supervisor's checks."""
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""FastAPI's pages about the API: open when the service is asked to serve them (``docs``),
else removed from the app (404 to a keyed request, 401 to others)."""
OPERATOR_PATHS = frozenset({"/metrics"})
"""Only an operator's key: the metrics count every tenant's requests and predictions."""
MAX_KEYS = 4_096
"""The most keys one service holds: each request compares with every one (about 0.1 µs
each), so the time taken never says which matched."""
MAX_KEY_LENGTH = 1_024
MAX_MODELS = 1_024
MAX_NAMESPACES = 4_096
MAX_RATE = 1e6
"""The largest requests per second (and burst) a key may be given."""
DIGEST_PREFIX = "sha256:"
"""A key file may name a key by its digest (``sha256:`` and 64 hex digits) instead of
the key itself, so the file holds nothing that opens the service."""
OPERATOR = "operator"
"""The tenant label of the operators' keys in the metrics."""
REJECTED_REASONS = ("unauthorized", "forbidden", "rate_limited")
ENTRY_FIELDS = frozenset({"tenant", "operator", "namespaces", "models", "rate", "burst"})


@dataclass(frozen=True)
class Grant:
    """What one key may do. ``namespaces``: a tenant's own (None: none mapped; on
    ``/v1/score`` and ``/v1/nodes`` it then sees none, through the gateway it routes over
    every backend); ``models``: the ``model`` values it may ask the gateway for (None:
    any); ``rate``/``burst``: its bucket (None: no limit)."""

    tenant: str
    operator: bool = False
    namespaces: frozenset[str] | None = None
    models: frozenset[str] | None = None
    rate: float | None = None
    burst: int | None = None


class Bucket:
    """A token bucket: ``burst`` requests at once, refilled at ``rate`` per second.
    Used from the event loop only (no lock)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.stamp = clock()

    def take(self) -> float:
        """0 when a request may go now (a token taken), else the seconds until one may."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


def digest(key: str) -> bytes:
    """The SHA-256 of a key as a request sends it (UTF-8)."""
    return hashlib.sha256(key.encode()).digest()


def check_key(key: object) -> str:
    """A key: 1 to ``MAX_KEY_LENGTH`` visible ASCII characters (what a header carries
    unchanged); ValueError otherwise, without repeating the key."""
    if not isinstance(key, str) or not key:
        raise ValueError("a key must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"a key is at most {MAX_KEY_LENGTH} characters")
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError("a key is visible ASCII characters only (no spaces)")
    return key


def _file_digest(name: str) -> bytes:
    """The digest a key file's entry name stands for: the key's, or the one it gives."""
    if name.startswith(DIGEST_PREFIX):
        hexed = name[len(DIGEST_PREFIX) :]
        if len(hexed) != 64 or any(c not in "0123456789abcdefABCDEF" for c in hexed):
            raise ValueError(f"a {DIGEST_PREFIX} key is followed by 64 hex digits")
        return bytes.fromhex(hexed)
    return digest(check_key(name))


def _names(value: object, what: str, limit: int, check: Callable[[Any], str]) -> frozenset[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list")
    if len(value) > limit:
        raise ValueError(f"{what} may list at most {limit:,}")
    return frozenset(check(item) for item in value)


def _model(value: object) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= 256 or not value.isprintable():
        raise ValueError("a model is a printable string of 1 to 256 characters")
    return value


def check_rate(value: object, what: str = "rate") -> float:
    """Requests per second: a finite number above 0, at most ``MAX_RATE``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of requests per second")
    if not 0 < value <= MAX_RATE:
        raise ValueError(f"{what} must be above 0 and at most {MAX_RATE:g} requests per second")
    return float(value)


def check_burst(value: object, what: str = "burst") -> int:
    """Requests at once: a whole number from 1 to ``MAX_RATE``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RATE:
        raise ValueError(f"{what} must be a whole number of requests from 1 to {MAX_RATE:g}")
    return value


def _grant(entry: object) -> Grant:
    """One key file entry's grant (ValueError naming what is wrong)."""
    if not isinstance(entry, dict):
        raise ValueError("each key maps to an object")
    unknown = sorted(set(entry) - ENTRY_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown field {str(unknown[0])[:40]!r} (known: {', '.join(sorted(ENTRY_FIELDS))})"
        )
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise ValueError("operator must be true or false")
    if operator and ("namespaces" in entry or "models" in entry):
        raise ValueError("an operator key sees every namespace and model: no namespaces or models")
    tenant = entry.get("tenant", OPERATOR if operator else None)
    if tenant is None:
        raise ValueError('a key needs a tenant (or "operator": true)')
    if not isinstance(tenant, str) or not 1 <= len(tenant) <= 200 or not tenant.isprintable():
        raise ValueError("a tenant is a printable string of 1 to 200 characters")
    namespaces = models = None
    if "namespaces" in entry:
        namespaces = _names(entry["namespaces"], "namespaces", MAX_NAMESPACES, validate_namespace)
    if "models" in entry:
        models = _names(entry["models"], "models", MAX_MODELS, _model)
    rate = None if entry.get("rate") is None else check_rate(entry["rate"])
    burst = None if entry.get("burst") is None else check_burst(entry["burst"])
    return Grant(tenant, operator, namespaces, models, rate, burst)


def key_file_grants(data: object) -> list[tuple[bytes, Grant]]:
    """The (digest, grant) of each key of a key file's JSON, ``{"keys": {"KEY" or
    "sha256:HEX": {"tenant": NAME, "operator": BOOL, "namespaces": [...], "models":
    [...], "rate": RPS, "burst": N}}}``; ValueError in one line for anything else."""
    table = data.get("keys") if isinstance(data, dict) and len(data) == 1 else None
    if not isinstance(table, dict):
        raise ValueError('the file must hold {"keys": {"KEY": {"tenant": NAME, ...}}}')
    if not table:
        raise ValueError("the file holds no keys")
    if len(table) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS:,} keys")
    out = []
    for number, (name, entry) in enumerate(table.items(), 1):
        try:
            out.append((_file_digest(name), _grant(entry)))
        except ValueError as exc:
            raise ValueError(f"key {number} (tenant {_tenant_of(entry)}): {exc}") from None
    return out


def _tenant_of(entry: object) -> str:
    tenant = entry.get("tenant") if isinstance(entry, dict) else None
    return repr(tenant[:40]) if isinstance(tenant, str) else "unnamed"


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call a service: the held keys (none: anyone, as without this layer),
    whether the docs pages are served, and the rate of keys without their own."""

    keys: tuple[tuple[bytes, Grant], ...] = ()
    docs: bool = True
    rate: float | None = None
    burst: int | None = None

    @classmethod
    def build(
        cls,
        operator_keys: Iterable[str] = (),
        grants: Iterable[tuple[bytes, Grant]] = (),
        *,
        docs: bool | None = None,
        rate: float | None = None,
        burst: int | None = None,
    ) -> AccessPolicy:
        """The policy of operator keys and a key file's grants; ``docs`` None: served
        only when no key is set. ValueError for a rate without keys, a duplicate key or
        too many."""
        held = [(digest(check_key(k)), Grant(OPERATOR, operator=True)) for k in operator_keys]
        held += list(grants)
        if len(held) > MAX_KEYS:
            raise ValueError(f"at most {MAX_KEYS:,} keys")
        if len({d for d, _ in held}) != len(held):
            raise ValueError("a key is given twice")
        if (rate is not None or burst is not None) and not held:
            raise ValueError("a rate limit needs keys to count by")
        if burst is not None and rate is None:
            raise ValueError("a burst needs a rate")
        return cls(tuple(held), (not held) if docs is None else docs, rate, burst)

    def limits(self, grant: Grant) -> tuple[float, int] | None:
        """The (rate, burst) of a key's bucket, or None: no limit."""
        rate = grant.rate if grant.rate is not None else self.rate
        if rate is None:
            return None
        burst = grant.burst if grant.burst is not None else self.burst
        return rate, burst if burst is not None else max(1, math.ceil(rate))


class _Rejections:
    """``pcr_http_rejected_total{reason, tenant}`` on the process' default registry (one
    counter per process, whichever service made it first); a no-op without
    prometheus-client."""

    made: _Rejections | None = None

    def __init__(self) -> None:
        try:
            prometheus: Any = importlib.import_module("prometheus_client")
        except ImportError:
            self.counter = None
            return
        self.counter = prometheus.Counter(
            "pcr_http_rejected",
            "Requests refused before the service read them: unauthorized (no key or a wrong "
            "one), forbidden (a tenant's key on an operator's path), rate_limited (past the "
            "key's burst)",
            ["reason", "tenant"],
        )
        self.counter.labels("unauthorized", "")

    @classmethod
    def get(cls) -> _Rejections:
        if cls.made is None:
            cls.made = cls()
        return cls.made

    def count(self, reason: str, tenant: str) -> None:
        if self.counter is not None:
            self.counter.labels(reason, tenant).inc()


class Access:
    """The ASGI layer: every HTTP request checked against ``policy`` before ``app``
    sees it (see the module's docstring); other scopes (the lifespan) pass through."""

    def __init__(
        self,
        app: Callable[[Message, Receive, Send], Awaitable[None]],
        policy: AccessPolicy,
        *,
        openai: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.policy = policy
        self.openai = openai
        self.keys = policy.keys
        self.open = OPEN_PATHS | DOC_PATHS if policy.docs else OPEN_PATHS
        self.buckets: dict[bytes, Bucket] = {}
        for held, grant in self.keys:
            limits = policy.limits(grant)
            if limits is not None:
                self.buckets[held] = Bucket(*limits, clock)
        self.rejections = _Rejections.get()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        held, grant = self._find(_bearer(headers))
        if grant is None:
            self.rejections.count("unauthorized", "")
            await self._refuse(
                send,
                401,
                "unauthorized",
                "a valid API key is required: Authorization: Bearer KEY",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        bucket = self.buckets.get(held)
        wait = 0.0 if bucket is None else bucket.take()
        if wait:
            self.rejections.count("rate_limited", grant.tenant)
            retry = str(max(1, math.ceil(wait))).encode()
            await self._refuse(
                send,
                429,
                "too many requests",
                "this key's rate limit is reached: retry after the seconds of Retry-After",
                [(b"retry-after", retry)],
            )
            return
        if scope["path"] in OPERATOR_PATHS and not grant.operator:
            self.rejections.count("forbidden", grant.tenant)
            await self._refuse(send, 403, "forbidden", "this path needs an operator's key")
            return
        scope[PRINCIPAL] = grant
        scope["headers"] = [(n, v) for n, v in headers if n != b"authorization"]
        await self.app(scope, receive, send)

    def _find(self, shown: str | None) -> tuple[bytes, Grant | None]:
        """The held digest and grant of the key shown; every held digest is compared
        (in constant time each), whichever matches."""
        if shown is None:
            return b"", None
        wanted = digest(shown)
        found: tuple[bytes, Grant | None] = (b"", None)
        for held, grant in self.keys:
            if hmac.compare_digest(held, wanted):
                found = (held, grant)
        return found

    async def _refuse(
        self,
        send: Send,
        status: int,
        kind: str,
        detail: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        body = error_body(kind, detail, status, openai=self.openai)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(extra or ()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key of the request's first ``Authorization: Bearer KEY`` header (the scheme's
    case aside), or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, key = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            key = key.strip()
            return key.decode("latin-1") if key else None
    return None


def grant_of(scope: Mapping[str, Any]) -> Grant | None:
    """The grant of the request's key; None when no keys are set."""
    grant: Grant | None = scope.get(PRINCIPAL)
    return grant


def visible(scope: Mapping[str, Any], names: list[str] | None) -> list[str] | None:
    """Of ``names`` (None: every one) those the request's key may score and list: all
    for an operator or without keys; for a tenant its own, in the order given (a tenant
    asking for all gets its own, sorted). A name not its own is dropped whether it
    exists or not, so the answer is the same either way."""
    grant = grant_of(scope)
    if grant is None or grant.operator:
        return names
    own = grant.namespaces or frozenset()
    if names is None:
        return sorted(own)
    return [name for name in names if name in own]


def routable(scope: Mapping[str, Any]) -> frozenset[str] | None:
    """The namespaces whose backends the gateway may send the request to (None: any):
    a tenant's own when its key maps namespaces."""
    grant = grant_of(scope)
    if grant is None or grant.operator:
        return None
    return grant.namespaces


def model_allowed(scope: Mapping[str, Any], model: object) -> bool:
    """Whether the request's key may ask for ``model`` (any, unless its key lists models)."""
    grant = grant_of(scope)
    return grant is None or grant.models is None or model in grant.models


def salted_tenant(scope: Mapping[str, Any], tenant_salts: bool) -> str | None:
    """The tenant whose own ``cache_salt`` the request gets at the engines (None: the
    request goes as sent): a tenant's key when ``tenant_salts`` is on; never an
    operator's, and never without keys."""
    grant = grant_of(scope)
    if not tenant_salts or grant is None or grant.operator:
        return None
    return grant.tenant
