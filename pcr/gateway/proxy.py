"""The gateway's proxied routes (``POST /v1/completions``, ``POST /v1/chat/completions``)
as one plain ASGI endpoint: the body passes through as bytes, with no FastAPI parsing or
validation on the way; a body that is not ``application/json`` is refused (415) unread.

Per request: the prompt's tokens as the engine will compute them
(``pcr.gateway.tokens``), then the backends in the order to try them
(``GatewayState.choose``, ``pcr.gateway.state``), then the request forwarded to the best
one and its reply passed on, whole or, when ``stream`` is true, chunk by chunk
(server-sent events as they come). A failure before the backend's first byte (refused,
reset, timed out connecting) is retried once on the next best backend; a client that
disconnects cancels the upstream request (the engine aborts it). A backend's own answer
(its 4xx, its errors) is passed through as it is; what the gateway answers itself has
the OpenAI shape (``pcr.gateway.replies``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from pcr.gateway.backends import Backend
from pcr.gateway.balance import Choice
from pcr.gateway.models import narrowed, unknown_model
from pcr.gateway.outcomes import Ending, answered, client_closed, count_error, ended, started
from pcr.gateway.replies import (
    Message,
    Receive,
    Send,
    answer_error,
    error_body,
    forwarded_headers,
    json_body,
    reply_headers,
    respond,
)
from pcr.gateway.state import GatewayState
from pcr.gateway.tokens import (
    BadBody,
    PromptIds,
    chain_keys,
    prompt_ids,
    prompt_tokens,
    salted_body,
)
from pcr.gateway.upstream import Reply, UpstreamError
from pcr.web.auth import model_allowed, routable, salted_tenant
from pcr.web.server import ARRIVED, WHOLE, leaving

NONE: dict[str, Any] = {}

PROXIED = {"/v1/completions": False, "/v1/chat/completions": True}
"""The proxied paths, and whether each takes chat messages."""
WATCH_AFTER_S = 0.05
"""Seconds into a request after which its client's leaving is watched for (and cancels
it); one that leaves earlier is found out then. Only where the server does not tell of
it itself (``_Leaving``: the requests it takes straight from its protocol)."""


class Proxy:
    """The proxied routes' ASGI endpoint, with the gateway's state and body limit."""

    paths = PROXIED

    def __init__(self, gateway: GatewayState, limit: int, too_large: bytes) -> None:
        self.gateway = gateway
        self.limit = limit
        self.too_large = too_large
        self.arming = _Arming()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        """One proxied request: read, tokenize, choose, forward, answer (here, not in a
        function this calls: each frame between the task and the upstream's wait is
        passed through at every wake-up of the request)."""
        chat = PROXIED[scope["path"]]
        # from the head's arrival where the server says (its parse counted), else now
        arrived = scope.get(ARRIVED) or time.perf_counter()
        state = self.gateway
        state.arrived()  # after a pause: the engines' figures and the tick at once
        if not json_body(scope["headers"]):
            await answer_error(send, 415, "the body must be JSON (Content-Type: application/json)")
            return
        raw = await _read_body(scope, receive, self.limit)
        if raw is None:  # gone mid-body, or stopped by the body deadline (answered 408)
            return
        if raw == 413:
            await respond(send, 413, self.too_large)
            return
        assert isinstance(raw, bytes)
        size = state.config.block_size
        routed = state.config.policy != "round-robin"
        hashed = state.config.policy == "prefix"
        adapters = state.models.adapters  # a salt, an adapter: hashed as the engine does
        tenant = salted_tenant(scope, state.config.tenant_salts)
        try:  # a large body in the helper process: never parsed on the loop
            body, ids = await state.parser.parse(
                raw, chat, state.max_tokens, size if routed else None, hashed, adapters, tenant
            )
            if tenant is not None:  # its own cache on the engines (``tenant_salt``)
                raw = salted_body(raw, body["cache_salt"])
            if not model_allowed(scope, body.get("model")):  # a tenant's key lists its models
                await answer_error(send, 404, "the model is not available to this key")
                return
            if not state.backends:
                await answer_error(send, 503, "no backend is configured or announced")
                return
            serving = state.models.serving(body.get("model"), state.backends)
            if not serving:  # no backend lists the model (pcr.gateway.models)
                await answer_error(send, 404, unknown_model(body.get("model")))
                return
            if routed and ids is None:
                tokens = await prompt_tokens(state.tokenizer, body, chat)
                keys = chain_keys(body, adapters)
                ids = None if tokens is None else await prompt_ids(tokens, size, hashed, keys)
        except BadBody as refused:  # not JSON, or a prompt over the model's length
            await answer_error(send, 400, str(refused))
            return
        # those serving its model; for a tenant, of its own backends
        order, outcome = await state.choose(ids, narrowed(serving, routable(scope)))
        if state.metrics.on:
            state.metrics.routed_as[outcome].inc()
        cycle = leaving(receive)  # the server tells of the client's leaving: no watcher
        watch: Watch
        if cycle is not None and cycle.watch_leave():
            watch = _Leaving(cycle)
        else:
            watch = _ClientWatch(receive, self.arming)
        try:
            await _forward(state, scope, send, body, raw, order, ids, arrived, watch)
        except asyncio.CancelledError:
            if not watch.left:
                raise  # the server is stopping
            watch.uncancel()  # the client left: nobody to answer
        finally:
            watch.stop()


async def _read_body(scope: Message, receive: Receive, limit: int) -> bytes | int | None:
    """The request's body; None when the client left first; 413 when it is over
    ``limit`` bytes (by its Content-Length, or counted as it arrives)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                return 413
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return 413
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Arming:
    """The requests whose client's leaving is watched from ``WATCH_AFTER_S`` into each,
    in arrival order, behind one timer for all of them (a timer per request costs more
    than the request's own bookkeeping)."""

    def __init__(self) -> None:
        # a queue read from the front: an OrderedDict finds its first item at once, a
        # dict past every slot deleted before it (as ``pcr.gateway.pending``'s queues)
        self.waiting: OrderedDict[_ClientWatch, float] = OrderedDict()
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, kept: ``asyncio.get_running_loop`` makes a ``getpid``
        system call each time (CPython 3.11), which costs microseconds on these machines."""
        loop = self.loop
        if loop is None or not loop.is_running():
            loop = self.loop = asyncio.get_running_loop()
        return loop

    def add(self, watch: _ClientWatch, loop: asyncio.AbstractEventLoop) -> None:
        self.waiting[watch] = loop.time() + WATCH_AFTER_S
        if self.timer is None:
            self.timer = loop.call_later(WATCH_AFTER_S, self._due, loop)

    def remove(self, watch: _ClientWatch) -> None:
        self.waiting.pop(watch, None)

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        now = loop.time()
        waiting = self.waiting
        while waiting:
            watch, at = next(iter(waiting.items()))  # the oldest: added in time order
            if at > now:
                self.timer = loop.call_later(at - now, self._due, loop)
                return
            del waiting[watch]
            watch.watch()


class _ClientWatch:
    """Cancels the request's task when its client disconnects (until ``stop``): while
    the gateway waits for a backend's reply, nothing else would notice (vLLM sends
    nothing, not even headers, until a non-streamed completion is done), and while it
    streams, a chunk sent to a client that left is dropped without a word."""

    def __init__(self, receive: Receive, arming: _Arming) -> None:
        loop = arming.running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task = task
        self.receive = receive
        self.left = False
        self.stopped = False
        self.gone: asyncio.Future[None] | None = None
        # Watched from WATCH_AFTER_S on: most replies (and every instant one) are done
        # before, and reading for the disconnect takes a task of its own.
        self.arming = arming
        arming.add(self, loop)

    def watch(self) -> None:
        if not self.stopped:
            self.gone = self.task.get_loop().create_task(_disconnected(self.receive))
            self.gone.add_done_callback(self._left)

    def _left(self, gone: asyncio.Future[None]) -> None:
        if not self.stopped and not gone.cancelled() and gone.exception() is None:
            self.left = True
            self.task.cancel()

    def uncancel(self) -> None:
        self.task.uncancel()

    def stop(self) -> None:
        """Before the response's last message (after it the server reads a disconnect)."""
        if not self.stopped:
            self.stopped = True
            self.arming.remove(self)
            if self.gone is not None:
                self.gone.remove_done_callback(self._left)
                self.gone.cancel()


class _Leaving:
    """``_ClientWatch``'s part where the server itself tells of the client's leaving
    (a ``Direct`` request: ``pcr.web.server.leaving``): the request's task is cancelled
    when the connection is lost, with no task reading for it and no timer."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle

    @property
    def left(self) -> bool:
        return bool(self.cycle.left)

    def uncancel(self) -> None:
        self.cycle.task.uncancel()  # the cycle keeps its task until the request ends

    def stop(self) -> None:
        self.cycle.unwatch_leave()


Watch = _ClientWatch | _Leaving
"""How a request learns that its client left (``left``, ``uncancel``, ``stop``)."""


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _forward(
    state: GatewayState,
    scope: Message,
    send: Send,
    body: dict[str, Any],
    raw: bytes,
    order: list[Choice],
    ids: PromptIds | None,
    arrived: float,
    watch: Watch,
) -> None:
    """Send to the best backend, once more to the next best on a failure before its
    first byte; answer with the reply, or the error."""
    stream = body.get("stream") is True
    prompt = ids.count if ids else 0
    headers = forwarded_headers(scope["headers"], state.config.backend_api_key)
    query = scope.get("query_string", b"")
    target = scope["path"].encode() + (b"?" + query if query else b"")
    method = scope["method"].encode()
    client = state.upstream
    assert client is not None
    tried = 0
    for choice in order[:2]:  # the best, and once more on the next best
        backend = state.backends.get(choice.namespace)
        if backend is None:
            continue
        tried += 1
        prefill = max(0, prompt - choice.cached)
        # written first (where a connection is pooled): the engine starts on it while the
        # request is counted here, and no other decision runs before it is counted
        exchange = client.send(backend.url, method, target, raw, headers)
        try:
            sent = started(state, backend, prefill, choice, ids)
        except BaseException:
            exchange.abandon()
            raise
        try:
            if state.metrics.on:
                state.metrics.overhead.observe(time.perf_counter() - arrived)
            upstream = await exchange.reply()
        except UpstreamError as failed:  # before the backend's reply began
            ended(state, backend, prefill, sent=sent)
            count_error(state, backend, failed.kind)
            if failed.kind == "connect":
                backend.mark(state.metrics, up=False)
            if tried == 1 and len(order) > 1:
                if state.metrics.on:
                    backend.metrics(state.metrics).retries.inc()
                continue
            watch.stop()
            await answer_error(send, 502, f"backend {backend.namespace!r} failed: {failed.kind}")
            return
        except asyncio.CancelledError:
            ended(state, backend, prefill, sent=sent)
            if watch.left:
                client_closed(state, backend)
            raise
        end = Ending(state, backend, prefill, sent)
        try:
            if stream:
                await _streamed(state, backend, upstream, send, arrived, watch, end)
            else:
                whole = WHOLE in scope.get("extensions", NONE)
                await _whole(state, backend, upstream, send, arrived, watch, end, whole)
        finally:
            end()
        return
    watch.stop()
    await answer_error(send, 503, "no backend could take the request")


async def _whole(
    state: GatewayState,
    backend: Backend,
    upstream: Reply,
    send: Send,
    arrived: float,
    watch: Watch,
    end: Ending,
    whole: bool = False,
) -> None:
    """A reply read whole; a client that leaves meanwhile cancels it (``_ClientWatch``);
    ``whole``: passed on as one message (``pcr.web.server.WHOLE``)."""
    try:
        content = await upstream.read()
    except asyncio.CancelledError:
        upstream.close()  # drops the connection: the engine aborts the request
        if watch.left:
            client_closed(state, backend)
        raise
    except UpstreamError as failed:
        upstream.close()
        count_error(state, backend, failed.kind)
        watch.stop()
        await answer_error(send, 502, f"backend {backend.namespace!r} broke off its reply")
        return
    upstream.release()
    watch.stop()
    end.told(ok=200 <= upstream.status < 300)
    answered(state, backend, upstream.status, arrived, first_byte=True)
    await respond(send, upstream.status, content, reply_headers(upstream.headers), whole)


async def _streamed(
    state: GatewayState,
    backend: Backend,
    upstream: Reply,
    send: Send,
    arrived: float,
    watch: Watch,
    end: Ending,
) -> None:
    """The backend's chunks as they come; a client that leaves closes the upstream
    (``_ClientWatch`` cancels this task); a reply broken off ends with an error event."""
    kind = upstream.header(b"content-type")
    events = kind is not None and kind.startswith(b"text/event-stream")
    complete = broken = False
    try:
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": reply_headers(upstream.headers),
            }
        )
        first = True
        try:
            async for chunk in upstream.chunks():
                if first and chunk:
                    first = False
                    if state.metrics.on:
                        backend.metrics(state.metrics).first_byte.observe(
                            time.perf_counter() - arrived
                        )
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
        except UpstreamError as failed:
            broken = True
            count_error(state, backend, failed.kind)
        watch.stop()
        end.told(ok=complete and 200 <= upstream.status < 300)
        last = _stream_error(backend) if broken and events else b""
        await send({"type": "http.response.body", "body": last})  # say so, as engines do
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()
        if complete:
            answered(state, backend, upstream.status, arrived, first_byte=False)
        elif not broken and watch.left:
            client_closed(state, backend)
        elif not broken and state.metrics.on:  # the server stopping
            backend.metrics(state.metrics).errors["cancelled"].inc()


def _stream_error(backend: Backend) -> bytes:
    """A server-sent event saying the backend broke off (OpenAI's error shape)."""
    return b"data: " + error_body(502, f"backend {backend.namespace!r} broke off") + b"\n\n"
