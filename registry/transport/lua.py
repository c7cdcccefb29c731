"""The Lua folder, and the two forms its scripts reach Redis in.

Each write, membership and routing operation has one ``.lua`` file named after the
Python method that calls it; ``_prelude.lua`` holds the constants and helpers they share.

* **Scripts** (``script_source``, ``script_sha``): the prelude put in front of one body,
  run by EVALSHA of its SHA1 and loaded by SCRIPT LOAD on NOSCRIPT. Any user with
  ``+evalsha +script|load`` can run them, and also any Lua of their own.
* **A Redis Functions library** (``library_source``): every body generated, at run time,
  into one library (Redis 7), loaded once by an admin (``pcr setup``,
  ``registry.transport.functions.load_library``) and run by users who hold only
  ``+fcall``/``+fcall_ro``: no user can run Lua of their own. The prelude is there once;
  each body is a function of the library and its callback hands it ``KEYS`` and ``ARGV``
  as the names the bodies use, so a body runs as it does as a script. The library's
  name and its functions' names carry a hash of what it is built from, so a client only
  ever calls the functions of its own version, and two versions can be loaded side by
  side while a fleet upgrades.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

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
    "bridge_apply",
    "bridge_resume",
    "mirror_resync",
    "mirror_apply",
    "fleet_snapshot",
    "gateway_load",
)

PRELUDE = "_prelude"

READ_ONLY = frozenset({"score", "fleet_snapshot"})
"""Operations that never write: functions flagged ``no-writes``, called by FCALL_RO
(which a replica also answers, and which a user may hold without ``+fcall``). A
no-writes function also runs while the server is over ``maxmemory``."""

RUN_OVER_MAXMEMORY = frozenset(
    {
        "renew",
        "announce",
        "live_nodes",
        "evict_kv",
        "evict_mamba",
        "clear_kv",
        "clear_mamba",
        "reset",
        "gc_namespace",
        "forget_node",
    }
)
"""Operations flagged ``allow-oom``: they free memory or keep a lease, and run while the
server is over ``maxmemory`` (as scripts they do too: Redis refuses a script there only
at its first write that may add memory, and these write a removal first). Every other
writing function is refused whole over ``maxmemory``, before it runs (a function's
flags are checked up front): nothing of it is written, ``RegistryOutOfMemory``."""

VERSION_OPERATION = "version"
"""The library's one function that is not a script: no keys, no writes, replies with
the library's name (what ``load_library`` and the runners' probe call)."""


@cache
def lua_folder() -> Traversable:
    """``registry/lua`` in an installed wheel; the top-level ``lua/`` in a source tree."""
    shipped = resources.files("registry").joinpath("lua")
    if shipped.is_dir():
        return shipped
    source = Path(__file__).resolve().parents[2] / "lua"
    if source.is_dir():
        return source
    raise FileNotFoundError("the registry's Lua scripts are missing: neither registry/lua nor lua/")


def read_script(name: str) -> str:
    """The text of one file of the Lua folder (``name`` without ``.lua``)."""
    return lua_folder().joinpath(f"{name}.lua").read_text(encoding="utf-8")


def _known(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; known: {', '.join(OPERATIONS)}")


@cache
def script_source(operation: str) -> str:
    """The full source sent to Redis for ``operation``: prelude, then the body."""
    _known(operation)
    return f"{read_script(PRELUDE)}\n{read_script(operation)}"


@cache
def script_sha(operation: str) -> str:
    """The SHA1 Redis knows ``operation``'s script by (computed here, no round trip)."""
    return hashlib.sha1(script_source(operation).encode("utf-8")).hexdigest()


@cache
def script_operations() -> dict[str, str]:
    """Each script's SHA1 -> its operation (how a built EVALSHA command is recognised)."""
    return {script_sha(operation): operation for operation in OPERATIONS}


# -- the Functions library ----------------------------------------------------------------

_VERSION = "__PCR_VERSION__"  # stands for the version in the template until it is hashed

_HEAD = f"""#!lua name=pcr_v{_VERSION}
-- The prefix-cache registry's scripts as one Redis Functions library, generated from
-- lua/*.lua by registry/transport/lua.py; load it with `pcr setup`. The prelude comes
-- once; each script's body is a function, whose callback hands it KEYS and ARGV.
local KEYS, ARGV
"""

_RUN = """
-- One call: the body sees this call's KEYS and ARGV (calls never overlap), which are
-- let go of once it has answered.
local function run(body, keys, args)
  KEYS, ARGV = keys, args
  local reply = body()
  KEYS, ARGV = nil, nil
  return reply
end
"""

_BODY = """
local function {local_name}()
{body}
end
"""

_REGISTER = """redis.register_function{{
  function_name = '{function}',
  callback = function(keys, args) return run({local_name}, keys, args) end,
  flags = {{{flags}}},
}}
"""

_REGISTER_VERSION = """redis.register_function{{
  function_name = '{function}',
  callback = function() return 'pcr_v{version}' end,
  flags = {{'no-writes'}},
}}
"""


def function_flags(operation: str) -> tuple[str, ...]:
    """The Redis Functions flags ``operation``'s function is registered with."""
    if operation in READ_ONLY:
        return ("no-writes",)
    if operation in RUN_OVER_MAXMEMORY:
        return ("allow-oom",)
    return ()


def _template(operations: Iterable[str]) -> str:
    parts = [_HEAD, read_script(PRELUDE), _RUN]
    registrations = []
    for operation in operations:
        local_name = f"op_{operation}"
        parts.append(_BODY.format(local_name=local_name, body=read_script(operation).rstrip()))
        flags = ", ".join(f"'{flag}'" for flag in function_flags(operation))
        registrations.append(
            _REGISTER.format(
                function=f"pcr_{operation}_v{_VERSION}", local_name=local_name, flags=flags
            )
        )
    registrations.append(
        _REGISTER_VERSION.format(function=f"pcr_{VERSION_OPERATION}_v{_VERSION}", version=_VERSION)
    )
    return "".join(parts) + "\n" + "".join(registrations)


@cache
def _library() -> tuple[str, str]:
    """(the version, the library's source): the version is the first 12 hex digits of
    the SHA1 of the source with the version left out, so any change to a script, the
    prelude, a flag or this generator gives another library."""
    template = _template(OPERATIONS)
    version = hashlib.sha1(template.encode("utf-8")).hexdigest()[:12]
    return version, template.replace(_VERSION, version)


def library_version() -> str:
    """The version of this client's library: 12 hex digits."""
    return _library()[0]


def library_name() -> str:
    """The name this client's library is loaded under: ``pcr_v<version>``."""
    return f"pcr_v{library_version()}"


def library_source() -> str:
    """The library's source, as ``FUNCTION LOAD`` takes it."""
    return _library()[1]


@cache
def function_name(operation: str) -> str:
    """The name of ``operation``'s function in this client's library
    (``pcr_<operation>_v<version>``; ``VERSION_OPERATION`` names the probe)."""
    if operation != VERSION_OPERATION:
        _known(operation)
    return f"pcr_{operation}_v{library_version()}"


def function_verb(operation: str) -> str:
    """``FCALL_RO`` for a read-only operation, else ``FCALL``."""
    return "FCALL_RO" if operation in READ_ONLY else "FCALL"


def clear_caches() -> None:
    """Forget every source, SHA1 and the library built so far (for a caller that
    changes what ``read_script`` returns: a benchmark's variant of the scripts)."""
    for cached in (script_source, script_sha, script_operations, _library, function_name):
        cached.cache_clear()
