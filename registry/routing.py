"""``PrefixRouter``: which live node already holds the longest prefix of a prompt.

Given a started fleet view (``registry.fleet.view.FleetView``), the router scores from
it: memory work, no round trip, the view following every namespace's change records
(it may lag a write by the time its record takes to arrive). Without one, or while the
view has not heard from Redis for ``registry.fleet.view.STALE_S`` seconds, it asks
Redis, the truth: one ``score`` costs one round trip per Redis node, a pipeline on a
standalone server; on Redis Cluster ``ScriptRunner.run_many`` groups the calls by the
primary serving their slot, writes to every primary, then reads every reply, so the
shards work at the same time (redis-py's cluster pipeline would first send a blocking
``COMMAND GETKEYS`` per call; it is used only when the slot map moved, to follow the
redirections). Each namespace's score is one script (``lua/score.lua``): a binary search
over the parent chain for the KV prefix, then (``hybrid`` routers only) the farthest
Mamba checkpoint inside it, at a cost bounded by the smaller of the namespace's Mamba
entries and the prefix, and -1 for a namespace without a live lease. The prompt's hashes
travel packed in one argument, encoded once for all namespaces.

A router never writes and never claims an epoch. It is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from registry import metrics as _metrics
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_namespace
from registry.membership import NodeIndex
from registry.scripts import ScriptRunner
from registry.validation import prefix_hashes

if TYPE_CHECKING:
    from registry.fleet.view import FleetView


@dataclass(frozen=True)
class NodeScore:
    """How much of a prompt one live node has cached, in blocks."""

    namespace: str
    kv_prefix: int  # leading blocks with KV cached
    mamba_prefix: int  # leading blocks usable with Mamba state (farthest checkpoint <= kv_prefix);
    # 0 from a router built with hybrid=False, which skips the Mamba lookup
    usable: int  # what routing ranks by: what this node's engine can reuse (see Hybrid)

    @classmethod
    def of(cls, namespace: str, kv_prefix: int, mamba_prefix: int, usable: int) -> NodeScore:
        """A score built without the frozen dataclass's per-field checks: a router
        builds one per live member on every decision (hundreds), from checked values."""
        score = object.__new__(cls)
        fields = score.__dict__
        fields["namespace"] = namespace
        fields["kv_prefix"] = kv_prefix
        fields["mamba_prefix"] = mamba_prefix
        fields["usable"] = usable
        return score


class PrefixRouter:
    """Scores live nodes for a prompt's block hashes and picks the best one."""

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
        self._index = NodeIndex(client, key_prefix)
        self._runner = ScriptRunner(client)
        self._lock = threading.Lock()
        self._live: tuple[float, list[str]] = (float("-inf"), [])
        self._keys: dict[str, NamespaceKeys] = {}

    def live_nodes(self) -> list[str]:
        """Namespaces with a live lease (cached for ``live_cache_ttl`` seconds; a node
        that died within that time is still never scored: each score checks its lease)."""
        with self._lock:
            fetched_at, names = self._live
        if time.monotonic() - fetched_at < self.live_cache_ttl:
            return names
        names = self._index.live()
        with self._lock:
            self._live = (time.monotonic(), names)
        return names

    def score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None = None
    ) -> dict[str, NodeScore]:
        """Per live namespace (all, or those given), the cached prefix of ``hashes``."""
        observer = _metrics.active
        if observer is not None:
            return observer.timed_score(self._score, hashes, namespaces)
        return self._score(hashes, namespaces)

    def _score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None
    ) -> dict[str, NodeScore]:
        view = self.view
        if view is not None and view.fresh():
            return view.score(hashes, namespaces, hybrid=self.hybrid, everyone=True)
        packed = pack_hashes(hashes)
        names = self.live_nodes() if namespaces is None else chosen_namespaces(namespaces)
        if not names:
            return {}
        replies = self._run_pipeline(names, packed)
        return scores_from_replies(names, replies, hybrid=self.hybrid)

    def best(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None = None,
        namespaces: Iterable[str] | None = None,
    ) -> str | None:
        """The live node with the longest usable prefix; ties go to the lowest ``load``
        (missing = 0), then to the first namespace in sort order. None if none is live."""
        view = self.view
        if view is not None and _metrics.active is None and view.fresh():
            return self._best_viewed(hashes, load, namespaces)
        scores = self.score(hashes, namespaces)
        choice = best_of(scores, load)
        observer = _metrics.active
        if observer is not None:
            observer.routed(scores, choice, hashes)
        return choice

    def _best_viewed(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None,
        namespaces: Iterable[str] | None,
    ) -> str | None:
        """``best`` from the view's matches only (no score built for the others); the
        live nodes are all looked at only when none matches."""
        view = self.view
        assert view is not None
        chosen = None if namespaces is None else chosen_namespaces(namespaces)
        usable = view.match(hashes, chosen, hybrid=self.hybrid)
        loads = load or {}
        if usable:
            top = max(usable.values())
            if top > 0:
                tied = [n for n, u in usable.items() if u == top]
                return min(tied, key=lambda n: (loads.get(n, 0), n))
        live = view.live_nodes()
        if chosen is not None:
            wanted = set(chosen)
            live = [n for n in live if n in wanted]
        if not live:
            return None
        return min(live, key=lambda n: (loads.get(n, 0), n))

    def _run_pipeline(self, names: list[str], packed: bytes) -> list[Any]:
        calls = score_calls(names, packed, self.key_prefix, self._keys, hybrid=self.hybrid)
        return self._runner.run_many("score", calls, context=routing_context(names))


# -- the rules both routers share (PrefixRouter here, AsyncPrefixRouter in aio_routing) --


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
) -> list[tuple[tuple[str, str, str], tuple[bytes, str]]]:
    """The (keys, args) of one ``score`` script call per namespace (``keys_cache`` keeps
    each namespace's key names between calls)."""
    mode = "0" if hybrid is False else "1"
    calls = []
    for name in names:
        keys = keys_cache.get(name)
        if keys is None:
            keys = keys_cache[name] = NamespaceKeys(name, key_prefix)
        calls.append(((keys.kv, keys.mamba, keys.meta), (packed, mode)))
    return calls


def routing_context(names: Sequence[str]) -> str:
    """What a routing call is doing, for error messages."""
    return f"routing over {len(names)} namespaces"


def checked_hybrid(hybrid: object) -> bool | None:
    """``hybrid`` as a router takes it: None (the default) ranks each namespace by what
    its engine can reuse: the Mamba-aware prefix where the namespace holds Mamba state
    (a hybrid model's node: meta's ``mamba_seen``, set by its first Mamba entry since
    its owner's claim), the KV prefix where it never held any (an attention-only node).
    True ranks every namespace by the Mamba-aware prefix, False by the KV prefix (and
    skips the Mamba lookup)."""
    if hybrid is not None and not isinstance(hybrid, bool):
        raise TypeError(f"hybrid must be True, False or None, not {type(hybrid).__name__}")
    return hybrid


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


def best_of(scores: Mapping[str, NodeScore], load: Mapping[str, float] | None = None) -> str | None:
    """The longest usable prefix; ties go to the lowest ``load`` (missing = 0), then to
    the first namespace in sort order. None when ``scores`` is empty."""
    if not scores:
        return None
    loads = load or {}
    return min(
        scores.values(), key=lambda s: (-s.usable, loads.get(s.namespace, 0), s.namespace)
    ).namespace
