"""Which way a runner sends the scripts, and loading the Redis Functions library.

A runner prefers the Functions library of its own version (``registry.transport.lua``):
FCALL needs no Lua of the user's own and no ``+evalsha``/``+script|load``. It finds out
by sending: a first call by FCALL that the server answers "Function not found" (the
library of this version is not loaded: ``pcr setup`` never ran, or ran with another
version), "unknown command" (Redis older than 7) or a refusal of FCALL itself (a user
granted ``+evalsha`` only) was run nowhere, and goes again by EVALSHA, as every call of
that runner does from then on. So a server with the library costs no extra round trip, and
one without it one refused FCALL per runner.

A library that goes missing later (a restart without persistence, ``FUNCTION FLUSH``, a
new shard that ``pcr setup`` did not reach) is the same: the call that meets it is sent
again by EVALSHA (every call tolerates a re-sent copy: writes by their request ids), with
a warning. A user that may not run EVALSHA either gets a permission error that says the
library is missing and how to load it, never a wrong reply; its runner tries FCALL again
at its next call, so loading the library puts it back to work without a restart.

The rule is without I/O (``RouteChoice``), shared by ``ScriptRunner`` and
``AsyncScriptRunner``; ``load_library`` is the admin step behind ``pcr setup``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from registry.core.errors import (
    REDIS_ERRORS,
    RegistryMisconfigured,
    RegistryPermissionError,
    translate,
)
from registry.core.validation import text
from registry.transport.lua import (
    VERSION_OPERATION,
    function_name,
    function_verb,
    library_name,
    library_source,
    script_operations,
)

log = logging.getLogger(__name__)


class Route(enum.Enum):
    """How a call is sent: FCALL of the library's function, or EVALSHA of the script."""

    FUNCTIONS = "functions"
    SCRIPTS = "scripts"


def function_missing(reply: Any) -> bool:
    """Whether an FCALL's error reply says it ran nowhere because the server does not
    offer the function to this user: not loaded, no FCALL command, FCALL not granted."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply).lower()
    return (
        "function not found" in text
        or ("unknown command" in text and "fcall" in text)
        or ("permission" in text and "'fcall" in text)
    )


def scripts_refused(reply: Any) -> bool:
    """Whether an error reply refuses EVALSHA or SCRIPT LOAD themselves (the user holds
    neither: it was granted ``+fcall`` only)."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply).lower()
    return "permission" in text and ("'evalsha'" in text or "'script" in text)


def missing_library_hint() -> str:
    """What a user that may not run scripts is told when the library is not there."""
    return (
        f"the registry's Redis Functions library {library_name()} is not loaded on this "
        "server (or FCALL is not granted) and this user may not run the scripts by "
        "EVALSHA: load it as an admin with `pcr setup --redis-url URL` (every client "
        "version needs its own library), or grant +evalsha +script|load"
    )


class RouteChoice:
    """One runner's way of sending, decided by the replies (no I/O: the rule both
    runners share). ``route`` is None until a call has told, then ``Route.FUNCTIONS``
    or ``Route.SCRIPTS``; a runner may be shared by threads (a lost race only costs a
    call one more FCALL)."""

    __slots__ = ("route",)

    def __init__(self, client: Any = None) -> None:
        self.route: Route | None = None
        if client is not None and not callable(getattr(client, "fcall", None)):
            self.route = Route.SCRIPTS  # a stand-in client that offers no FCALL

    def first(self) -> Route:
        """The route a call tries first."""
        return Route.SCRIPTS if self.route is Route.SCRIPTS else Route.FUNCTIONS

    def after_functions(self, replies: Sequence[Any]) -> bool:
        """Whether ``replies`` (of a call by FCALL) are the call's answer; False when
        the call must be sent again by EVALSHA (a function is missing), as every later
        call will be."""
        if not any(function_missing(reply) for reply in replies):
            self.route = Route.FUNCTIONS
            return True
        for reply in replies:  # discarded: let go of their frames (a cycle otherwise)
            if isinstance(reply, BaseException):
                reply.__traceback__ = None
        if self.route is Route.FUNCTIONS:
            log.warning(
                "the Redis Functions library %s is no longer offered (%s): the scripts "
                "go by EVALSHA from now on",
                library_name(),
                next(r for r in replies if function_missing(r)),
            )
        self.route = Route.SCRIPTS
        return False

    def after_scripts(self, replies: list[Any]) -> list[Any]:
        """``replies`` of a call by EVALSHA, a refusal of EVALSHA itself replaced by one
        that says how to load the library; after such a refusal the next call tries
        FCALL again (the library may have been loaded since)."""
        refused = [i for i, reply in enumerate(replies) if scripts_refused(reply)]
        if not refused:
            return replies
        self.route = None
        out = list(replies)
        for i in refused:
            out[i] = NoPermissionError(f"{replies[i]}; {missing_library_hint()}")
        return out


def as_function_call(command: tuple[Any, ...]) -> tuple[Any, ...]:
    """An ``("EVALSHA", sha, numkeys, ...)`` command of one of the registry's scripts as
    the FCALL of its function (a command that is not one is returned as it is)."""
    if command[0] != "EVALSHA":
        return command
    operation = script_operations().get(command[1])
    if operation is None:
        return command
    return (function_verb(operation), function_name(operation), *command[2:])


def probe_command() -> tuple[Any, ...]:
    """The FCALL of the library's version function: no keys, no writes."""
    return ("FCALL", function_name(VERSION_OPERATION), 0)


# -- the admin step ------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """What ``load_library`` did: the library's name, the servers it was loaded on
    (``Redis at host:port`` for each primary of a cluster), those that already held it
    (left as they were, without ``replace``), and the other ``pcr_v*`` libraries the
    servers hold (older or newer clients' versions, kept)."""

    name: str
    loaded: tuple[str, ...]
    present: tuple[str, ...]
    others: tuple[str, ...]


def load_library(client: Any, *, replace: bool = False, where: str = "the server") -> Loaded:
    """Load this client's Functions library (``FUNCTION LOAD``) on a standalone server,
    Sentinel's master, or every primary of a Redis Cluster (replicas receive it from
    their primary by replication; a failover keeps it). A server that already holds it
    is left as it is unless ``replace`` (``FUNCTION LOAD REPLACE``). Needs an admin
    user (``FUNCTION LOAD``; ``FUNCTION LIST`` to name the other versions). ``where``
    names a standalone server in ``Loaded`` and in errors (a cluster's primaries are
    named by their addresses).

    Raises ``RegistryMisconfigured`` for a server without Redis Functions (before 7.0),
    ``RegistryPermissionError`` for a user that may not load functions, and the other
    registry errors of ``translate`` (unreachable: ``RegistryUnavailable``)."""
    name, source = library_name(), library_source()
    loaded: list[str] = []
    present: list[str] = []
    others: set[str] = set()
    for at, server in _servers(client, where):
        command = ("FUNCTION", "LOAD", *(("REPLACE",) if replace else ()), source)
        try:
            try:
                server.execute_command(*command)
                loaded.append(at)
            except ResponseError as exc:
                if "already exists" not in str(exc):
                    raise
                present.append(at)
            others.update(_libraries(server))
        except REDIS_ERRORS as exc:
            raise _load_error(exc, at) from exc
    others.discard(name)
    return Loaded(name, tuple(loaded), tuple(present), tuple(sorted(others)))


def _servers(client: Any, where: str) -> list[tuple[str, Any]]:
    """(its name, a client of that server) for each server the library goes on."""
    primaries = getattr(client, "get_primaries", None)
    if callable(primaries) and hasattr(client, "nodes_manager"):  # a Redis Cluster
        nodes = primaries()
        return [(f"Redis at {node.name}", client.get_redis_connection(node)) for node in nodes]
    return [(where, client)]


def _libraries(server: Any) -> list[str]:
    """The ``pcr_v*`` libraries ``server`` holds (none listed when FUNCTION LIST is
    refused: it only informs)."""
    try:
        listed = server.execute_command("FUNCTION", "LIST", "LIBRARYNAME", "pcr_v*")
    except ResponseError:
        return []
    names = []
    for library in listed:
        fields = dict(library) if isinstance(library, dict) else _pairs(library)
        names += [text(v) for k, v in fields.items() if text(k) == "library_name"]
    return names


def _pairs(flat: Any) -> dict[Any, Any]:
    """A RESP2 map (a flat list: key, value, ...) as a dict."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _load_error(exc: BaseException, where: str) -> Exception:
    text = str(exc).lower()
    what = f"loading the Functions library on {where}"
    if isinstance(exc, ResponseError) and "unknown command" in text and "function" in text:
        return RegistryMisconfigured(
            f"{what}: this server has no Redis Functions (they need Redis 7.0 or newer); "
            "the registry runs its scripts by EVALSHA there (grant its users +evalsha "
            "+script|load)"
        )
    if isinstance(exc, NoPermissionError) or "noperm" in text or "no permissions" in text:
        return RegistryPermissionError(
            f"{what}: this user may not load functions ({str(exc).splitlines()[0]}); run "
            "pcr setup as an admin user (FUNCTION LOAD is an admin's command)"
        )
    error = translate(exc, what, write=True)
    return error if error is not None else RegistryMisconfigured(f"{what}: {exc}")
