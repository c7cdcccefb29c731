"""Observers: the events the library's components publish, and who listens to them.

The registries, the script runner, the routers and the eviction listener publish what
they did here (an operation and its outcome, a prefix lookup, a score, a routing
decision, a listener's lag); an observer counts it. ``registry.metrics`` is one, which
``enable_metrics()`` subscribes, so the library never imports it (it sits on top of
the house). Nobody listens by default, and then a component pays one read of
``current`` and a ``None`` check, and never reads a clock.

Observers are called in the publishing thread, so they must be quick, thread-safe and
never raise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from registry.core.errors import RegistryError, RegistryUnavailable, StaleEpochError
from registry.core.scores import NodeScore

T = TypeVar("T")

OUTCOMES = ("ok", "unavailable", "stale_epoch", "bad_input", "fault")
"""How an operation ended: the ``outcome`` every ``Observer.record`` is given."""


class Observer(Protocol):
    """What a component publishes; each method is one event."""

    def record(self, operation: str, outcome: str, seconds: float | None) -> None:
        """One ``operation`` (a script, a read, a refused call) ended with ``outcome``
        (one of ``OUTCOMES``); ``seconds`` it took when it reached Redis, else None."""

    def prefix_query(self, queried: int, hit: int) -> None:
        """``match_kv_prefix`` looked up ``queried`` blocks; ``hit`` of them were cached."""

    def score_took(self, seconds: float) -> None:
        """One router score (live nodes and every node's score) took ``seconds``."""

    def routed(
        self, scores: Mapping[str, NodeScore], choice: str | None, hashes: Sequence[int]
    ) -> None:
        """A router chose ``choice`` among ``scores`` (None: no live node) for a prompt
        of ``hashes``."""

    def listener_lag(self, seconds: float) -> None:
        """A listener freed a notice's slots ``seconds`` after the notice was published."""


current: Observer | None = None
"""None while nobody listens; else the one observer, or a fan-out to several: what a
component reads before it publishes (and before it reads a clock)."""

_observers: tuple[Observer, ...] = ()
_lock = threading.Lock()


def subscribe(observer: Observer) -> None:
    """Pass every later event to ``observer`` too (once, however often subscribed)."""
    global current, _observers
    with _lock:
        if not any(o is observer for o in _observers):
            _observers = (*_observers, observer)
        current = _current(_observers)


def unsubscribe(observer: Observer) -> None:
    """Stop passing events to ``observer`` (no error if it was not subscribed)."""
    global current, _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)
        current = _current(_observers)


def _current(observers: tuple[Observer, ...]) -> Observer | None:
    if not observers:
        return None
    return observers[0] if len(observers) == 1 else _Fanout(observers)


class _Fanout:
    """Several observers, each given every event in turn."""

    def __init__(self, observers: tuple[Observer, ...]) -> None:
        self.observers = observers

    def record(self, operation: str, outcome: str, seconds: float | None) -> None:
        for observer in self.observers:
            observer.record(operation, outcome, seconds)

    def prefix_query(self, queried: int, hit: int) -> None:
        for observer in self.observers:
            observer.prefix_query(queried, hit)

    def score_took(self, seconds: float) -> None:
        for observer in self.observers:
            observer.score_took(seconds)

    def routed(
        self, scores: Mapping[str, NodeScore], choice: str | None, hashes: Sequence[int]
    ) -> None:
        for observer in self.observers:
            observer.routed(scores, choice, hashes)

    def listener_lag(self, seconds: float) -> None:
        for observer in self.observers:
            observer.listener_lag(seconds)


# -- publishing ----------------------------------------------------------------------


def outcome_of(exc: BaseException) -> str:
    """The outcome of a call that raised ``exc``."""
    if isinstance(exc, StaleEpochError):
        return "stale_epoch"
    if isinstance(exc, RegistryUnavailable):
        return "unavailable"
    if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, RegistryError):
        return "bad_input"
    return "fault"


def bad_input(operation: str) -> None:
    """Publish an argument check that refused a call to ``operation`` (never timed: it
    did not reach Redis)."""
    observer = current
    if observer is not None:
        observer.record(operation, "bad_input", None)


def timed(observer: Observer, operation: str, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``, published to ``observer`` as ``operation`` with its outcome and
    time."""
    started = time.perf_counter()
    try:
        result = call(*args)
    except Exception as exc:
        observer.record(operation, outcome_of(exc), time.perf_counter() - started)
        raise
    observer.record(operation, "ok", time.perf_counter() - started)
    return result


async def timed_async(
    observer: Observer, operation: str, call: Callable[..., Awaitable[T]], *args: Any
) -> T:
    """``await call(*args)``, published as ``timed`` does (the asyncio router's round
    trips are awaited)."""
    started = time.perf_counter()
    try:
        result = await call(*args)
    except Exception as exc:
        observer.record(operation, outcome_of(exc), time.perf_counter() - started)
        raise
    observer.record(operation, "ok", time.perf_counter() - started)
    return result


def timed_score(observer: Observer, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` (a router's score), its time published whatever its outcome."""
    started = time.perf_counter()
    try:
        return call(*args)
    finally:
        observer.score_took(time.perf_counter() - started)
