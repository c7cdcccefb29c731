"""Megatron-Core's two dicts, as live read-only views of a registry.

Megatron-Core's allocators read the registry's ``kv_hash_to_block_id`` and
``mamba_hash_to_block_id`` directly (``.get(parent_hash, -1)``, ``in``, ``==`` in its
tests). :class:`HashMapView` gives them a ``Mapping[int, int]`` over the registry's storage:
each lookup is one command (``HGET``, ``HEXISTS``, ``HLEN`` on Redis), iteration is a
scan (``HSCAN``: an entry present throughout is seen exactly once, one added or removed
meanwhile may be seen or not), and every attempt to write through it raises
``TypeError`` naming the registry method to call instead.
"""

from __future__ import annotations

import operator
from collections.abc import ItemsView, Iterator, Mapping
from typing import Any, NoReturn, Protocol

from registry.core.types import MAX_HASH


class MapSource(Protocol):
    """What a view reads of a registry (``RegistryBase`` has it): one lookup per call."""

    def _view_get(self, kind: str, h: int) -> int | None: ...

    def _view_contains(self, kind: str, h: int) -> bool: ...

    def _view_len(self, kind: str) -> int: ...

    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]: ...


class HashMapView(Mapping[int, int]):
    """``hash -> block id`` of one map ("kv" or "mamba") of a registry, read live."""

    __slots__ = ("_kind", "_registry")

    def __init__(self, registry: MapSource, kind: str) -> None:
        if kind not in ("kv", "mamba"):
            raise ValueError(f"kind must be 'kv' or 'mamba', not {kind!r}")
        self._registry = registry
        self._kind = kind

    def __getitem__(self, key: object) -> int:
        h = _hash_key(key)
        block_id = None if h is None else self._registry._view_get(self._kind, h)
        if block_id is None:
            raise KeyError(key)
        return block_id

    def get(self, key: object, default: Any = None) -> Any:  # one command, not two
        h = _hash_key(key)
        block_id = None if h is None else self._registry._view_get(self._kind, h)
        return default if block_id is None else block_id

    def __contains__(self, key: object) -> bool:
        h = _hash_key(key)
        return h is not None and self._registry._view_contains(self._kind, h)

    def __len__(self) -> int:
        return self._registry._view_len(self._kind)

    def __iter__(self) -> Iterator[int]:
        return (h for h, _ in self._registry._view_items(self._kind))

    def items(self) -> ItemsView[int, int]:
        return _Items(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self._registry._view_items(self._kind)) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{self._kind}_hash_to_block_id of {self._registry!r}>"

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        verbs = "register_kv / evict_kv" if self._kind == "kv" else "register_mamba / evict_mamba"
        raise TypeError(
            f"{self._kind}_hash_to_block_id is a read-only view of the registry: "
            f"change it with {verbs} (or clear_{self._kind} / reset)"
        )

    __setitem__ = __delitem__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse


class _Items(ItemsView[int, int]):
    """``items()`` read in one scan, not one lookup per key."""

    _mapping: HashMapView

    def __iter__(self) -> Iterator[tuple[int, int]]:
        view = self._mapping
        return iter(view._registry._view_items(view._kind))


def _hash_key(key: object) -> int | None:
    """``key`` as a hash that can be stored, or None (then it is in no map)."""
    if isinstance(key, bool):
        return None
    try:
        h = operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        return None
    return h if 1 <= h <= MAX_HASH else None
