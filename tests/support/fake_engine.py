"""Fake OpenAI-compatible engines for ``pcr gateway``'s tests: a Starlette app on uvicorn
in a thread of the test process, on a free loopback port, that answers
``/v1/completions`` and ``/v1/chat/completions`` (streamed and not), ``/v1/models`` and
``/metrics`` like vLLM, and records what it was sent.

``models`` is what its ``/v1/models`` lists (``model_list``: a base model and its LoRA
adapters, each adapter with its ``parent`` as vLLM lists them; None: the 404 an engine
without that route would answer); ``models_read`` counts the reads.

What a test can make it do: hold every reply until ``release`` is set (requests stay in
flight), stream chunks one at a time as ``chunk_gate`` is released, report a queue and a
KV-cache usage on ``/metrics``, answer a status of the test's choosing, and notice a
client that went away (``cancelled``). ``stop()`` closes the port (connections refused);
``kill()`` first resets every open connection, as an engine that dies mid-reply;
``start()`` opens it again on the same port. With ``certfile`` and ``keyfile`` it serves
HTTPS (``url`` says https://), and with ``client_ca`` too it requires a client certificate
signed by that CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.servers import free_port
from tests.support.waiting import wait_until


@dataclass
class FakeEngine:
    name: str
    port: int = field(default_factory=free_port)
    chunks: int = 3
    status: int = 200
    waiting: float = 0.0
    kv_usage: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    in_flight: int = 0
    models: list[dict[str, Any]] | None = field(default_factory=lambda: model_list("tiny"))
    models_read: int = 0
    certfile: str | None = None
    keyfile: str | None = None
    client_ca: str | None = None
    api_key: str | None = None
    """As vLLM's ``--api-key``: ``/v1/*`` answers 401 without ``Authorization: Bearer``
    this key."""

    def __post_init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.chunk_gate: threading.Semaphore | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        scheme = "https" if self.certfile else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _tls(self) -> dict[str, Any]:
        """uvicorn's TLS options: none, a certificate, or one and clients' required."""
        if not self.certfile:
            return {}
        options: dict[str, Any] = {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}
        if self.client_ca:
            options.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    # -- the app -------------------------------------------------------------------------

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/models", self._models),
                Route("/metrics", self._metrics),
            ]
        )

    async def _held(self, request: Request) -> bool:
        """Wait for ``release``; False when the client went away meanwhile."""
        while not self.release.is_set():
            if await request.is_disconnected():
                return False
            await asyncio.sleep(0.005)  # a thread's Event: polled from the loop
        return True

    def _refused(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return JSONResponse({"error": {"message": "Unauthorized"}}, 401)

    async def _complete(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        body = await request.json()
        with self._lock:
            self.received.append(body)
            self.in_flight += 1
        try:
            if not await self._held(request):
                with self._lock:
                    self.cancelled += 1
                return Response(status_code=499)
            if self.status != 200:
                return JSONResponse({"error": {"message": "engine says no"}}, self.status)
            if body.get("stream") is True:
                return StreamingResponse(self._chunks(request), media_type="text/event-stream")
            with self._lock:
                self.completed += 1
            return JSONResponse({"object": "text_completion", "by": self.name, "choices": []})
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _chunks(self, request: Request) -> Any:
        try:
            for i in range(self.chunks):
                gate = self.chunk_gate
                while gate is not None and not gate.acquire(blocking=False):
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                    await asyncio.sleep(0.005)
                yield f"data: {json.dumps({'by': self.name, 'i': i})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            with self._lock:
                self.completed += 1
        except asyncio.CancelledError:
            with self._lock:
                self.cancelled += 1
            raise

    async def _models(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        with self._lock:
            self.models_read += 1
        if self.models is None:
            return JSONResponse({"detail": "Not Found"}, 404)
        return JSONResponse({"object": "list", "data": self.models})

    async def _metrics(self, _request: Request) -> Response:
        lines = [
            f'vllm:num_requests_running{{model_name="tiny"}} {float(self.in_flight)}',
            f'vllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}',
            f'vllm:kv_cache_usage_perc{{model_name="tiny"}} {self.kv_usage}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    # -- running -------------------------------------------------------------------------

    def start(self) -> FakeEngine:
        config = uvicorn.Config(
            self.app(),
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            lifespan="off",
            **self._tls(),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        server = self._server
        wait_until(lambda: server.started, 30, f"fake engine {self.name}")
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self._server = self._thread = None

    def kill(self) -> None:
        """Stop at once, as an engine that dies: every open connection is reset, mid-reply
        or not (``stop()`` would wait for a reply held on ``chunk_gate``), then the port
        closes like ``stop()``'s."""
        server = self._server
        if server is not None:
            for connection in list(server.server_state.connections):
                connection.loop.call_soon_threadsafe(connection.transport.abort)
        self.stop()


def model_list(base: str, *adapters: str) -> list[dict[str, Any]]:
    """A ``/v1/models`` listing as vLLM writes it: the base model (``parent`` null), then
    each LoRA adapter (``parent``: the base model)."""
    entries = [{"id": base, "object": "model", "root": base, "parent": None}]
    for name in adapters:
        entries.append({"id": name, "object": "model", "root": f"/loras/{name}", "parent": base})
    return entries


def wait_in_flight(engine: FakeEngine, count: int, timeout: float = 30.0) -> None:
    wait_until(lambda: engine.in_flight >= count, timeout, f"{count} requests at {engine.name}")


@contextlib.contextmanager
def engine_pair(*, started: bool = True) -> Iterator[list[FakeEngine]]:
    """Two fake engines, ``a`` and ``b`` (started, or left for the test to start once it
    has set their models), stopped at the end whatever happened."""
    made = [FakeEngine("a"), FakeEngine("b")]
    try:
        if started:
            for engine in made:
                engine.start()
        yield made
    finally:
        for engine in made:
            engine.stop()


def tagged_names(prefix: str) -> list[str]:
    """Two namespaces no other test uses: ``PREFIX-a-TAG``, ``PREFIX-b-TAG``."""
    tag = uuid.uuid4().hex[:8]
    return [f"{prefix}-a-{tag}", f"{prefix}-b-{tag}"]


def gateway_args(
    redis_url: str, engines: Sequence[FakeEngine], names: Sequence[str], block: int
) -> list[str]:
    """``pcr gateway``'s arguments in front of ``engines``, each backend named by
    ``names`` (in order), at ``block`` tokens a block."""
    args = ["--redis-url", redis_url, "--block-size", str(block)]
    for name, engine in zip(names, engines, strict=True):
        args += ["--backend", f"{name}={engine.url}"]
    return args
