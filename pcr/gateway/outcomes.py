"""One proxied request's bookkeeping: its start and end in the backend's load (and so in
what the load exchange tells the other replicas) and in the blocks counted as arriving
there (``pcr.gateway.pending``), and its outcome in the metrics."""

from __future__ import annotations

import time

from pcr.gateway.backends import Backend
from pcr.gateway.balance import Choice
from pcr.gateway.pending import Sent
from pcr.gateway.state import GatewayState
from pcr.gateway.tokens import PromptIds


def started(
    state: GatewayState, backend: Backend, prefill: int, choice: Choice, ids: PromptIds | None
) -> Sent | None:
    """The request sent to ``backend``: its load, the prompt root's kin and the mean
    prefill count it, its blocks count as arriving there (the record returned, for its
    end); the exchange is nudged; the metrics count its prompt."""
    prompt = ids.count if ids else 0
    root = ids.root if ids else None
    sent = state.sent(backend, choice, ids)
    load = backend.load
    load.in_flight += 1
    load.pending += prefill
    rule = state.config.rule
    now = time.monotonic()
    load.recent.add(float(prefill or 1), now, rule.half_life)
    state.kin.record(root, backend.namespace, now, rule.half_life)
    if prompt:
        state.mean_prefill += (prefill - state.mean_prefill) * 0.05
    state.exchange.nudge()
    if state.metrics.on:
        counted = backend.metrics(state.metrics)
        counted.in_flight.inc()
        if prompt:
            counted.prompt_tokens.inc(prompt)
            counted.predicted.inc(choice.cached)
    return sent


def ended(
    state: GatewayState,
    backend: Backend,
    prefill: int,
    sent: Sent | None = None,
    ok: bool = False,
) -> None:
    """The request over at ``backend``: its load no longer counts it; its blocks no
    longer count as arriving there (``ok``: a success, after the grace)."""
    state.unsent(backend, sent, ok)
    load = backend.load
    load.in_flight = max(0, load.in_flight - 1)
    load.pending = max(0.0, load.pending - prefill)
    state.exchange.nudge()
    if state.metrics.on:
        backend.metrics(state.metrics).in_flight.dec()


class Ending:
    """``ended`` once: ``told`` (with whether the reply succeeded) before a reply's last
    bytes go to the client; called again, as a no-op, when the exchange is over whatever
    happened (a request that ends there never reached ``told``: a failure, its pending
    blocks dropped at once). The other replicas hear of the end in the exchange's next
    batch (``LoadExchange.nudge``), never by a round trip of its own."""

    def __init__(
        self, state: GatewayState, backend: Backend, prefill: int, sent: Sent | None = None
    ) -> None:
        self.state = state
        self.backend = backend
        self.prefill = prefill
        self.sent = sent
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            ended(self.state, self.backend, self.prefill, sent=self.sent)

    def told(self, ok: bool) -> None:
        if not self.done:
            self.done = True
            ended(self.state, self.backend, self.prefill, sent=self.sent, ok=ok)


def count_error(state: GatewayState, backend: Backend, kind: str) -> None:
    """A failed request of ``backend``, by ``kind`` (connect, timeout, protocol, ...)."""
    if state.metrics.on:
        counted = backend.metrics(state.metrics)
        counted.errors[kind].inc()
        counted.failed.inc()


def client_closed(state: GatewayState, backend: Backend) -> None:
    """A request of ``backend`` whose client went away before its reply's end: counted
    as its own result, not as the backend's failure."""
    if state.metrics.on:
        counted = backend.metrics(state.metrics)
        counted.errors["cancelled"].inc()
        counted.closed.inc()


def answered(
    state: GatewayState, backend: Backend, status: int, arrived: float, *, first_byte: bool
) -> None:
    """A reply passed on whole (``first_byte``: its time is also the first byte's): its
    duration, and ok or failed by its status."""
    if not state.metrics.on:
        return
    took = time.perf_counter() - arrived
    counted = backend.metrics(state.metrics)
    if first_byte:
        counted.first_byte.observe(took)
    counted.latency.observe(took)
    if status >= 500:
        counted.errors["status"].inc()
        counted.failed.inc()
    else:
        counted.ok.inc()
