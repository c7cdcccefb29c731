"""Load the Lua scripts shipped in ``registry/lua`` (the top-level ``lua/`` folder).

Each write, membership and routing operation has one ``.lua`` file named after the
Python method that calls it (reads of one key are plain HMGET/HGET and need none);
``_prelude.lua`` (shared constants and helpers) is put in front of every body, so
each loaded script is still one self-contained, atomic unit on the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

OPERATIONS = (
    "register_kv",
    "evict_kv",
    "register_mamba",
    "evict_mamba",
    "clear_kv",
    "clear_mamba",
    "reset",
    "claim",
    "renew",
    "announce",
    "live_nodes",
    "gc_namespace",
    "forget_node",
    "score",
)


def register_scripts(client: Any, operations: Iterable[str] = OPERATIONS) -> dict[str, Any]:
    """``{operation: Script}`` for ``client`` (no round trip: redis-py hashes locally)."""
    return {op: client.register_script(script_source(op)) for op in operations}


PRELUDE = "_prelude"


@cache
def lua_folder() -> Traversable:
    """``registry/lua`` in an installed wheel; the top-level ``lua/`` in a source tree."""
    shipped = resources.files("registry").joinpath("lua")
    if shipped.is_dir():
        return shipped
    source = Path(__file__).resolve().parent.parent / "lua"
    if source.is_dir():
        return source
    raise FileNotFoundError("the registry's Lua scripts are missing: neither registry/lua nor lua/")


def _read(name: str) -> str:
    return lua_folder().joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def script_source(operation: str) -> str:
    """The full source sent to Redis for ``operation``: prelude, then the body."""
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; known: {', '.join(OPERATIONS)}")
    return f"{_read(PRELUDE)}\n{_read(operation)}"
