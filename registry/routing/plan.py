"""The plan both routers share (``PrefixRouter`` in ``registry.routing.routing``,
``AsyncPrefixRouter`` in ``registry.routing.aio_routing``): checking and packing the
prompt, the ``lua/score.lua`` calls, their replies as scores (``NodeScore``), choosing
the best. No I/O here: each router adds only its round trips.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from registry.core.keys import NamespaceKeys, validate_namespace
from registry.core.scores import NodeScore
from registry.core.validation import prefix_hashes


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
