"""The plan both routers share (``PrefixRouter`` in ``registry.routing.routing``,
``AsyncPrefixRouter`` in ``registry.routing.aio_routing``): what a router holds and
checks (``RouterBase``), checking and packing the prompt, the ``lua/score.lua`` calls,
their replies as scores (``NodeScore``), choosing the best. No I/O here: each router
adds only its round trips.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import eq
from typing import TYPE_CHECKING, Any

from registry.core import observe
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.core.scores import NodeScore, checked_hybrid
from registry.core.validation import prefix_hashes

if TYPE_CHECKING:
    from registry.fleet.view import FleetView

ScoreCall = tuple[tuple[str, str, str], tuple[bytes, str]]
"""The (keys, args) of one ``lua/score.lua`` call."""


class RouterBase:
    """What both routers hold and decide without I/O: their settings, checked; the
    live-node cache; whether the fleet view answers; the ``score`` round for Redis and
    its replies as scores; the choice, published. Each router adds its round trips, and
    builds what does them in ``_attach``."""

    def __init__(
        self,
        client: Any,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        hybrid: bool | None = None,
        live_cache_ttl: float = 1.0,
        exact: bool = False,
        view: FleetView | None = None,
    ) -> None:
        if not isinstance(exact, bool):
            raise TypeError("exact must be True or False")
        if view is not None and exact:
            raise ValueError("a router scores exactly or from a fleet view, not both")
        self.view = view
        """A started ``registry.fleet.view.FleetView`` to score from (memory work, no
        round trip; it may lag the writes by the time a change record takes to arrive:
        ``view.sync()`` waits for them) while it follows Redis, asking Redis when it has
        not for ``registry.fleet.view.STALE_S`` seconds; or None: Redis, exactly, per
        namespace."""
        self.client = client
        self.key_prefix = key_prefix
        self.hybrid = checked_hybrid(hybrid)
        self.live_cache_ttl = live_cache_ttl
        self.exact = exact
        """Always per namespace (``lua/score.lua``), never from a view: the reference
        a view is checked against."""
        self._live: tuple[float, list[str]] = (float("-inf"), [])
        self._keys: dict[str, NamespaceKeys] = {}
        self._attach(client, key_prefix)

    def _attach(self, client: Any, key_prefix: str) -> None:
        """Build what the router does its round trips with (its script runner...)."""

    def _cached_live(self) -> list[str] | None:
        """The live nodes listed less than ``live_cache_ttl`` seconds ago, else None."""
        fetched_at, names = self._live
        return names if time.monotonic() - fetched_at < self.live_cache_ttl else None

    def _remember_live(self, names: list[str]) -> None:
        self._live = (time.monotonic(), names)

    def _viewed(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None
    ) -> dict[str, NodeScore] | None:
        """The scores from the fleet view while it follows Redis; None: ask Redis."""
        view = self.view
        if view is not None and view.fresh():
            return view.score(hashes, namespaces, hybrid=self.hybrid, everyone=True)
        return None

    def _choosing_from_view(self) -> bool:
        """Whether ``best`` can choose from the view's longest prefix alone: a fresh
        view, and no observer asking for every score."""
        view = self.view
        return view is not None and observe.current is None and view.fresh()

    def _best_viewed(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None,
        namespaces: Iterable[str] | None,
    ) -> str | None:
        """``best`` from the longest prefix the view finds and the namespaces holding it
        (no score built, no other match resolved); the live nodes are all looked at
        only when none matches."""
        view = self.view
        assert view is not None
        chosen = None if namespaces is None else chosen_namespaces(namespaces)
        top, tied = view.match(hashes, chosen, hybrid=self.hybrid).top()
        if top > 0:
            return least_loaded(tied, load)
        live = view.live_nodes()
        if chosen is not None:
            wanted = set(chosen)
            live = [n for n in live if n in wanted]
        return least_loaded(live, load)

    def _score_round(self, names: Sequence[str], packed: bytes) -> tuple[list[ScoreCall], str]:
        """The ``score`` calls for ``names`` and what they do, for error messages."""
        calls = score_calls(names, packed, self.key_prefix, self._keys, hybrid=self.hybrid)
        return calls, routing_context(names)

    def _scores(self, names: Sequence[str], replies: Sequence[Any]) -> dict[str, NodeScore]:
        return scores_from_replies(names, replies, hybrid=self.hybrid)

    def _chosen(
        self,
        scores: Mapping[str, NodeScore],
        load: Mapping[str, float] | None,
        hashes: Sequence[int],
    ) -> str | None:
        """``best_of`` the scores, published to an observer as a routing decision."""
        choice = best_of(scores, load)
        observer = observe.current
        if observer is not None:
            observer.routed(scores, choice, hashes)
        return choice


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """A prompt's hashes checked (cut before the first sentinel: it can never match) and
    packed for ``lua/score.lua``: 19 zero-padded digits each, once for all namespaces."""
    wanted = prefix_hashes(hashes)
    return b"".join(b"%019d" % h for h in wanted)


def chosen_namespaces(namespaces: Iterable[str]) -> list[str]:
    """The namespaces a caller asked for, each checked against the naming rule."""
    return [validate_namespace(n) for n in namespaces]


def score_calls(
    names: Sequence[str],
    packed: bytes,
    key_prefix: str,
    keys_cache: dict[str, NamespaceKeys],
    *,
    hybrid: bool | None,
) -> list[ScoreCall]:
    """The (keys, args) of one ``score`` script call per namespace (``keys_cache`` keeps
    each namespace's key names between calls)."""
    mode = "0" if hybrid is False else "1"
    calls: list[ScoreCall] = []
    for name in names:
        keys = keys_cache.get(name)
        if keys is None:
            keys = keys_cache[name] = NamespaceKeys(name, key_prefix)
        calls.append(((keys.kv, keys.mamba, keys.meta), (packed, mode)))
    return calls


def routing_context(names: Sequence[str]) -> str:
    """What a routing call is doing, for error messages."""
    return f"routing over {len(names)} namespaces"


def scores_from_replies(
    names: Sequence[str], replies: Sequence[Any], *, hybrid: bool | None
) -> dict[str, NodeScore]:
    """The scripts' replies as scores; a namespace without a live lease (-1) is left out.
    With ``hybrid=None`` each reply's third value says whether its namespace is a hybrid
    model's node, and so which prefix its engine can reuse."""
    scores = {}
    for name, reply in zip(names, replies, strict=True):
        if reply == -1:
            continue  # no live lease: never scored
        kv_prefix, mamba_prefix = int(reply[0]), int(reply[1])
        if hybrid is None:
            reuses_mamba = len(reply) > 2 and int(reply[2]) == 1
            usable = mamba_prefix if reuses_mamba else kv_prefix
        else:
            usable = mamba_prefix if hybrid else kv_prefix
        scores[name] = NodeScore(name, kv_prefix, mamba_prefix, usable)
    return scores


def least_loaded(names: Iterable[str], load: Mapping[str, float] | None) -> str | None:
    """The namespace of ``names`` with the lowest ``load`` (missing = 0), ties to the
    first in sort order; None for no names. (All in C, no pair built per name: a view's
    choice may weigh hundreds of namespaces holding the same prefix.) Raises
    ``TypeError`` or ``ValueError`` when a load it reads is not a number or is NaN."""
    if not load:
        return min(names, default=None)
    listed = list(names)
    if not listed:
        return None
    loads = checked_loads(listed, list(map(load.get, listed, repeat(0))))
    lowest = min(loads)
    if loads.count(lowest) == 1:
        return listed[loads.index(lowest)]
    return min(compress(listed, map(eq, loads, repeat(lowest))))


def checked_loads(names: Sequence[str], loads: list[Any]) -> list[Any]:
    """``loads`` (one per name) if each is a number and none is NaN; else ``TypeError``
    or ``ValueError`` naming the first namespace whose load is not. One ``sum`` in C
    checks the common case (it refuses what is not a number and carries a NaN); a bool
    passes as 0 or 1."""
    try:
        total = sum(loads)
    except TypeError:
        total = float("nan")
    if total == total:
        return loads
    for name, value in zip(names, loads, strict=True):
        try:
            0 + value  # what sum refused
        except TypeError:
            kind = type(value).__name__
            raise TypeError(f"the load of {name!r} must be a number, not {kind}") from None
        if value != value:
            raise ValueError(f"the load of {name!r} must be a number, not NaN")
    return loads  # +inf and -inf, summed to NaN: each a number


def best_of(scores: Mapping[str, NodeScore], load: Mapping[str, float] | None = None) -> str | None:
    """The longest usable prefix; ties go to the lowest ``load`` (missing = 0), then to
    the first namespace in sort order. None when ``scores`` is empty. Raises
    ``TypeError`` or ``ValueError`` when a load is not a number or is NaN."""
    if not scores:
        return None
    listed = list(scores.values())
    names = [s.namespace for s in listed]
    weights = checked_loads(names, list(map(load.get, names, repeat(0)))) if load else None
    if weights is None:
        return min(listed, key=lambda s: (-s.usable, s.namespace)).namespace
    chosen = min(range(len(listed)), key=lambda i: (-listed[i].usable, weights[i], names[i]))
    return names[chosen]
