"""The Redis Functions library built from ``lua/`` and the rule that picks FCALL or
EVALSHA (``registry.transport.lua``, ``registry.transport.functions``), without a
server: what the library holds, that its name follows its content, which replies send a
call again by EVALSHA, and the admin step's errors."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from registry.core.errors import RegistryMisconfigured, RegistryPermissionError
from registry.transport import lua
from registry.transport.functions import (
    Route,
    RouteChoice,
    as_function_call,
    function_missing,
    load_library,
    scripts_refused,
)
from registry.transport.scripts import script_command

# Error replies as redis-py raises them (its NOPERM class drops the prefix).
NOT_LOADED = ResponseError("Function not found")
OLD_SERVER = ResponseError("unknown command 'FCALL', with args beginning with: 'pcr_x' '0' ")
OLD_SERVER_62 = ResponseError("unknown command `FCALL_RO`, with args beginning with: ")
FCALL_NOT_GRANTED = NoPermissionError("this user has no permissions to run the 'fcall' command")
KEY_REFUSED = NoPermissionError("this user has no permissions to access one of the keys used")
EVALSHA_REFUSED = NoPermissionError("this user has no permissions to run the 'evalsha' command")
LOAD_REFUSED = NoPermissionError("this user has no permissions to run the 'script|load' command")
FENCED = ResponseError("STALE_EPOCH namespace epoch is 2, this owner holds 1")


@pytest.fixture
def fresh_library() -> Iterator[None]:
    """Caches cleared before and after (a test that changes what the scripts read)."""
    lua.clear_caches()
    yield
    lua.clear_caches()


def registrations(source: str) -> dict[str, str]:
    """Function name -> its flags text, as the library registers them."""
    found = re.findall(r"function_name = '(\w+)',\n.*\n  flags = \{([^}]*)\}", source)
    return dict(found)


def test_the_library_registers_each_script_once_with_its_flags() -> None:
    source = lua.library_source()
    version = lua.library_version()
    assert re.fullmatch(r"[0-9a-f]{12}", version)
    assert source.startswith(f"#!lua name=pcr_v{version}\n")
    assert lua.library_name() == f"pcr_v{version}"
    registered = registrations(source)
    expected = {f"pcr_{op}_v{version}": op for op in lua.OPERATIONS}
    expected[f"pcr_version_v{version}"] = "version"
    assert set(registered) == set(expected)
    for name, operation in expected.items():
        flags = registered[name]
        if operation in lua.READ_ONLY or operation == "version":
            assert flags == "'no-writes'", name
        elif operation in lua.RUN_OVER_MAXMEMORY:
            assert flags == "'allow-oom'", name
        else:
            assert flags == "", name
    # The prelude comes once, every body once: the same text the scripts run.
    assert source.count(lua.read_script(lua.PRELUDE)) == 1
    for operation in lua.OPERATIONS:
        assert lua.read_script(operation).rstrip() in source


def test_the_version_follows_the_scripts(
    fresh_library: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any change to a body gives another library name and other function names, so a
    client never calls an older library's functions (and the same scripts give the same
    name in every process)."""
    shipped = lua.library_version()
    lua.clear_caches()
    assert lua.library_version() == shipped
    read = lua.read_script

    def changed(name: str) -> str:
        text = read(name)
        return text + "\n-- changed\n" if name == "renew" else text

    monkeypatch.setattr(lua, "read_script", changed)
    lua.clear_caches()
    assert lua.library_version() != shipped
    assert lua.function_name("score").endswith(lua.library_version())
    assert lua.library_source().count("-- changed") == 1


def test_commands_by_route() -> None:
    keys, args = ["pcr:{a}:kv", "pcr:{a}:mamba", "pcr:{a}:meta"], ["0" * 18 + "1", "1"]
    score = script_command(Route.FUNCTIONS, "score", keys, args)
    assert score == ("FCALL_RO", lua.function_name("score"), 3, *keys, *args)
    write = script_command(Route.FUNCTIONS, "register_kv", keys, args)
    assert write[:2] == ("FCALL", lua.function_name("register_kv"))
    evalsha = script_command(Route.SCRIPTS, "register_kv", keys, args)
    assert evalsha == ("EVALSHA", lua.script_sha("register_kv"), 3, *keys, *args)
    assert as_function_call(evalsha) == write  # a batch built by EVALSHA, sent by FCALL
    assert as_function_call(("EVALSHA", "f" * 40, 0)) == ("EVALSHA", "f" * 40, 0)
    assert as_function_call(("HMGET", "k", "f")) == ("HMGET", "k", "f")


@pytest.mark.parametrize(
    ("reply", "missing"),
    [
        (NOT_LOADED, True),
        (OLD_SERVER, True),
        (OLD_SERVER_62, True),
        (FCALL_NOT_GRANTED, True),
        (KEY_REFUSED, False),  # a refusal of the call itself: EVALSHA would be refused too
        (FENCED, False),
        (NoScriptError("No matching script. Please use EVAL."), False),
        (ResponseError("The user executing the script can't run this command"), False),
        ("OK", False),
        (None, False),
    ],
)
def test_which_replies_say_the_function_is_missing(reply: Any, missing: bool) -> None:
    assert function_missing(reply) is missing


def test_scripts_refused() -> None:
    assert scripts_refused(EVALSHA_REFUSED)
    assert scripts_refused(LOAD_REFUSED)
    assert not scripts_refused(KEY_REFUSED)
    assert not scripts_refused(FCALL_NOT_GRANTED)
    assert not scripts_refused(NOT_LOADED)


def test_the_route_is_decided_by_the_first_reply_and_kept() -> None:
    choice = RouteChoice()
    assert (choice.route, choice.first()) == (None, Route.FUNCTIONS)
    assert choice.after_functions(["OK", FENCED])  # an answer, errors included
    assert (choice.route, choice.first()) == (Route.FUNCTIONS, Route.FUNCTIONS)

    without = RouteChoice()
    assert not without.after_functions(["OK", NOT_LOADED])  # one shard without it: resend all
    assert (without.route, without.first()) == (Route.SCRIPTS, Route.SCRIPTS)
    assert without.after_scripts(["OK", FENCED]) == ["OK", FENCED]
    assert without.route is Route.SCRIPTS


def test_a_library_that_goes_missing_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    choice = RouteChoice()
    assert choice.after_functions(["OK"])
    with caplog.at_level(logging.WARNING, logger="registry.transport.functions"):
        assert not choice.after_functions([NOT_LOADED])
    assert choice.route is Route.SCRIPTS
    assert [r.getMessage() for r in caplog.records] == [
        f"the Redis Functions library {lua.library_name()} is no longer offered (Function "
        "not found): the scripts go by EVALSHA from now on"
    ]


def test_a_user_that_may_not_run_scripts_is_told_to_load_the_library() -> None:
    """Refused EVALSHA after a missing function: the reply says what to do, and the
    next call tries FCALL again (the library may be loaded by then)."""
    choice = RouteChoice()
    assert not choice.after_functions([NOT_LOADED])
    (reply,) = choice.after_scripts([EVALSHA_REFUSED])
    assert isinstance(reply, NoPermissionError)
    text = str(reply)
    assert text.startswith("this user has no permissions to run the 'evalsha' command; ")
    assert lua.library_name() in text
    assert "pcr setup --redis-url URL" in text
    assert (choice.route, choice.first()) == (None, Route.FUNCTIONS)


class Refusing:
    """A standalone client whose FUNCTION commands all fail with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.sent: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> Any:
        self.sent.append(args)
        raise self.error


def test_loading_on_a_server_without_functions_says_so() -> None:
    client = Refusing(ResponseError("unknown command 'FUNCTION', with args beginning with: 'LOAD'"))
    with pytest.raises(RegistryMisconfigured, match=r"need Redis 7\.0 or newer") as raised:
        load_library(client, where="Redis at db:6379")
    assert str(raised.value).startswith("loading the Functions library on Redis at db:6379: ")
    assert "EVALSHA" in str(raised.value)
    assert [args[:2] for args in client.sent] == [("FUNCTION", "LOAD")]


def test_loading_as_a_user_without_the_grant_says_so() -> None:
    refused = NoPermissionError("this user has no permissions to run the 'function|load' command")
    with pytest.raises(RegistryPermissionError, match="run pcr setup as an admin user"):
        load_library(Refusing(refused))
