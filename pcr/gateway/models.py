"""Which models each backend serves (``ModelCatalog``), read from its ``/v1/models`` every
``REFRESH_S`` seconds, at start and on each ``GET /v1/models`` of the gateway.

vLLM lists its base model (``parent`` null) and each LoRA adapter it serves (``parent``:
the base model's id) there. The gateway sends a request only to the backends that list
its ``model`` (a backend whose list is not known yet, because it has not answered or
answered something else, is never left out), and hashes a request for an adapter under
that adapter's name (``pcr.gateway.tokens.chain_keys``), as the engine keys its blocks.
An adapter's name is taken as one adapter across the fleet: a backend that serves a base
model of the same name as another's adapter would be routed to by the adapter's blocks
(a worse route, never a wrong answer: the engine's own match is exact).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from pcr.gateway.backends import Backend

REFRESH_S = 5.0
"""Seconds between two reads of every backend's ``/v1/models``."""
FETCH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
MAX_MODELS = 10_000
"""Entries taken from one backend's list (the rest are ignored)."""
MAX_MODELS_BYTES = 4 << 20
"""A longer ``/v1/models`` reply is not read (the backend's models stay unknown)."""


@dataclass(frozen=True)
class Served:
    """What one backend serves: its model ids, those that are LoRA adapters, and its
    entries as it listed them (for the gateway's own ``/v1/models``)."""

    models: frozenset[str]
    adapters: frozenset[str]
    entries: tuple[dict[str, Any], ...]


def served_of(listing: Any) -> Served | None:
    """A ``/v1/models`` reply (``{"data": [{"id": ..., "parent": ...}, ...]}``) as
    ``Served``; None when it has not that shape."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    models: set[str] = set()
    adapters: set[str] = set()
    entries: list[dict[str, Any]] = []
    for entry in data[:MAX_MODELS]:
        name = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or name in models:
            continue
        models.add(name)
        entries.append(entry)
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != name:
            adapters.add(name)
    return Served(frozenset(models), frozenset(adapters), tuple(entries))


MEMO_MODELS = 256
"""Models whose serving backends are remembered between requests."""


class ModelCatalog:
    """Per backend (by namespace), what it serves, as last read; the adapters any of
    them serves. Only the event loop writes it."""

    def __init__(self) -> None:
        self.served: dict[str, Served] = {}
        self.adapters: frozenset[str] = frozenset()
        self.read_at = 0.0
        # model -> (the namespaces asked of, those serving it): answers reused until the
        # lists change (bounded: the model is the client's to name)
        self._memo: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    def learn(self, namespace: str, served: Served | None) -> None:
        """``namespace``'s list as just read (None: not known)."""
        if served is None:
            self.served.pop(namespace, None)
        else:
            self.served[namespace] = served
        self._changed()

    def keep_only(self, namespaces: Collection[str]) -> None:
        """Forget the backends no longer in the gateway's table."""
        for gone in [n for n in self.served if n not in namespaces]:
            del self.served[gone]
        self._changed()

    def _changed(self) -> None:
        self._memo.clear()
        self.adapters = frozenset().union(*(s.adapters for s in self.served.values()))

    def serving(self, model: object, namespaces: Iterable[str]) -> frozenset[str]:
        """The backends of ``namespaces`` that may serve ``model``: those that list it
        and those whose list is not known; all of them for a request that names no model
        (the engine serves its default)."""
        names = frozenset(namespaces)
        if not isinstance(model, str) or not model:
            return names
        memo = self._memo.get(model)
        if memo is not None and memo[0] == names:
            return memo[1]
        found = frozenset(
            n for n in names if (s := self.served.get(n)) is None or model in s.models
        )
        if len(self._memo) >= MEMO_MODELS:
            self._memo.clear()
        self._memo[model] = (names, found)
        return found

    def listing(self, namespaces: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every model some backend (of ``namespaces``; None: any) lists, once each (the
        first backend's entry, by namespace order)."""
        seen: dict[str, dict[str, Any]] = {}
        names = self.served if namespaces is None else set(namespaces) & self.served.keys()
        for namespace in sorted(names):
            for entry in self.served[namespace].entries:
                seen.setdefault(entry["id"], entry)
        return list(seen.values())

    async def refresh(self, http: aiohttp.ClientSession, backends: Mapping[str, Backend]) -> None:
        """Read every backend's ``/v1/models`` at once. A backend that does not answer
        keeps its last known list (while it refuses, it is passed over anyway); one that
        answers anything but a list of models is not known."""
        current = dict(backends)
        await self.read(http, current.values())
        self.keep_only(current)
        self.read_at = time.monotonic()

    async def read(self, http: aiohttp.ClientSession, backends: Iterable[Backend]) -> None:
        """Read these backends' ``/v1/models`` at once (``refresh`` without forgetting
        the others)."""
        await asyncio.gather(*(self._read(http, b) for b in backends))

    async def _read(self, http: aiohttp.ClientSession, backend: Backend) -> None:
        try:
            async with http.get(f"{backend.url}/v1/models", timeout=FETCH_TIMEOUT) as reply:
                if reply.status != 200 or (reply.content_length or 0) > MAX_MODELS_BYTES:
                    self.learn(backend.namespace, None)
                    return
                raw = await reply.content.read(MAX_MODELS_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError):
            return
        listing: Any = None
        if len(raw) <= MAX_MODELS_BYTES:
            with contextlib.suppress(ValueError, RecursionError):
                listing = json.loads(raw)
        self.learn(backend.namespace, served_of(listing))


def narrowed(serving: frozenset[str], allowed: frozenset[str] | None) -> frozenset[str]:
    """The backends serving the request's model, of ``allowed`` alone when given (a
    tenant's own)."""
    return serving if allowed is None else serving & allowed


def unknown_model(model: object) -> str:
    """The 404's message for a model no backend serves (vLLM's words)."""
    shown = model if isinstance(model, str) else json.dumps(model)[:200]
    return f"The model `{shown[:200]}` does not exist."
