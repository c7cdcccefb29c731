"""One error vocabulary: every redis-py fault maps to one registry exception, with the
retryable ones apart from those an operator must fix, and no secret in any message."""

from __future__ import annotations

import pytest
from redis import exceptions as rx

from registry.core.errors import (
    RegistryError,
    RegistryFault,
    RegistryMisconfigured,
    RegistryOutOfMemory,
    RegistryPermissionError,
    RegistryQuotaExceeded,
    RegistryUnavailable,
    RegistryWrongType,
    StaleEpochError,
    translate,
)

CASES: list[tuple[BaseException, type[RegistryError]]] = [
    (rx.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
     RegistryUnavailable),
    (rx.TimeoutError("Timeout reading from socket"), RegistryUnavailable),
    (TimeoutError("timed out"), RegistryUnavailable),
    (rx.BusyLoadingError("Redis is loading the dataset in memory"), RegistryUnavailable),
    (rx.ClusterDownError("The cluster is down"), RegistryUnavailable),
    (rx.MasterDownError("Link with MASTER is down"), RegistryUnavailable),
    (rx.TryAgainError("Multiple keys request during rehashing of slot"), RegistryUnavailable),
    (rx.ReadOnlyError("You can't write against a read only replica."), RegistryUnavailable),
    (rx.ResponseError("BUSY Redis is busy running a script."), RegistryUnavailable),
    (rx.RedisClusterException("Redis Cluster cannot be connected."), RegistryUnavailable),
    (rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
     RegistryOutOfMemory),
    (rx.ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: x"),
     RegistryOutOfMemory),
    (rx.AuthenticationError("invalid username-password pair or user is disabled."),
     RegistryPermissionError),
    (rx.NoPermissionError("this user has no permissions to run the 'get' command"),
     RegistryPermissionError),
    (rx.ResponseError("The user executing the script can't run this command or subcommand"),
     RegistryPermissionError),
    (rx.ResponseError("The user executing the script can't access at least one of the keys "
                      "mentioned in the command arguments script: 9026, on @user_script:108."),
     RegistryPermissionError),
    (rx.ResponseError("QUOTA namespace n holds 10 entries, limit 10: this write would make "
                      "it 12; nothing was applied"), RegistryQuotaExceeded),
    (rx.ResponseError("QUOTA_INVALID pcr:quota:{n} does not hold a whole number of entries: "
                      "set it again with pcr quota set"), RegistryMisconfigured),
    (rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
     RegistryWrongType),
    (rx.RedisClusterException("Cluster mode is not enabled on this node"),
     RegistryMisconfigured),
    (rx.MovedError("7798 127.0.0.1:33127"), RegistryMisconfigured),
    (rx.ResponseError("ERR DB index is out of range"), RegistryMisconfigured),
    (rx.ResponseError("ERR unknown command 'EVALSHA'"), RegistryMisconfigured),
]  # fmt: skip


@pytest.mark.parametrize(("error", "expected"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_each_fault_maps_to_one_registry_error(
    error: BaseException, expected: type[RegistryError]
) -> None:
    mapped = translate(error, "namespace 'n': register_kv")
    assert type(mapped) is expected
    assert str(mapped).startswith("namespace 'n': register_kv: ")
    assert "\n" not in str(mapped)
    retryable = isinstance(mapped, RegistryUnavailable)
    assert retryable != isinstance(mapped, RegistryFault)


def test_a_quota_refusal_carries_its_figures() -> None:
    """What the scripts reply (``lua/_prelude.lua`` ``over_quota``), as the error's
    fields, and a message that names the way out."""
    reply = (
        "QUOTA namespace node-a:7 holds 4096 engine blocks, limit 4096: this write would "
        "make it 4352; nothing was applied"
    )
    refused = translate(rx.ResponseError(reply), "bridge_apply", write=True)
    assert isinstance(refused, RegistryQuotaExceeded)
    figures = (refused.held, refused.limit, refused.after)
    assert (refused.namespace, figures, refused.what) == (
        "node-a:7",
        (4096, 4096, 4352),
        "engine blocks",
    )
    assert str(refused) == (
        "bridge_apply: refused by the entry quota of namespace 'node-a:7': it holds 4096 "
        "engine blocks, the limit is 4096, and this write would make it 4352; nothing of it "
        "was applied (evict entries, or have an admin raise the limit: pcr quota set "
        "node-a:7 N)"
    )


def test_a_write_that_may_have_run_says_so() -> None:
    timeout = rx.TimeoutError("Timeout reading from socket")
    write = translate(timeout, "w", write=True)
    read = translate(timeout, "r")
    assert isinstance(write, RegistryUnavailable)
    assert isinstance(read, RegistryUnavailable)
    assert write.outcome_unknown
    assert "may or may not have run" in str(write)
    assert not read.outcome_unknown
    busy = translate(rx.ResponseError("BUSY Redis is busy running a script."), "w", write=True)
    assert isinstance(busy, RegistryUnavailable)
    assert not busy.outcome_unknown  # refused before running


def test_registry_errors_pass_through_and_bugs_are_not_swallowed() -> None:
    stale = StaleEpochError("n", 7, "superseded")
    assert translate(stale, "x") is stale
    assert translate(ValueError("a bug"), "x") is None
    assert translate(KeyError("a bug"), "x") is None
