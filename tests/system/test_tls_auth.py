"""TLS (``rediss://``) and passwords (``requirepass``, ACL users) against a real redis-server.

TLS: a throwaway CA and a server certificate for 127.0.0.1 / localhost are made with the
``openssl`` command line (``tests/support/certificates.py``); the server keeps its plain
port (``RedisServer`` PINGs it to know the server is up) and listens for TLS on a second
free port, which the tests use.

Passwords: the server gets ``requirepass`` with ``CONFIG SET`` right after it starts,
because ``RedisServer`` PINGs without a password and could not see a ``--requirepass``
server come up. A wrong password must fail with redis-py's ``AuthenticationError`` (raised
as is, or chained to the registry's own error), and the password must appear in no
exception text, log record or ``pcr`` output.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast
from urllib.parse import quote

import pytest
import redis

from pcr.cli.main import main
from registry import PrefixCacheRegistry
from registry.core.errors import RegistryError
from tests.support import REPO_ROOT
from tests.support.backends import new_namespace
from tests.support.certificates import TlsFiles, make_tls_files
from tests.support.servers import HOST, RedisServer, free_port, require_redis_server

ROOT = REPO_ROOT

PASSWORD = "s3cret-Pa55"
ALICE_PASSWORD = "alice-pw"
# A password that must be percent-encoded in a URL (@ : / %).
BOB_PASSWORD = "b@d:p/ss%w0rd"
WRONG_PASSWORD = "Wr0ng-Hunter2-Xy"
UNREACHABLE_PASSWORD = "Unreach-Pw-9q"
LOGGERS = ("registry", "gpu", "redis")
CLI_TIMEOUT = 60
# What a failed call raises: redis-py's error itself, or the registry's own error type
# wrapping it (``RegistryUnavailable`` ... ``from exc``); the redis error is in the chain.
FAILURE = (redis.ConnectionError, RegistryError)

pytestmark = pytest.mark.redis_server


# -- helpers --------------------------------------------------------------------------


def raw(registry: PrefixCacheRegistry) -> redis.Redis:
    """The registry's redis-py client (``from_url`` on a plain URL makes a ``redis.Redis``)."""
    return cast(redis.Redis, registry.client)


def exercise(registry: PrefixCacheRegistry) -> None:
    """Register, match and evict through ``registry``, then close its client."""
    try:
        registry.register_kv([10, 11, 12], [101, 102, 103])
        assert registry.match_kv_prefix([101, 102, 103, 104]) == ([10, 11, 12], 103)
        assert registry.evict_kv([103]) == {103}
        assert registry.match_kv_prefix([101, 102, 103]) == ([10, 11], 102)
    finally:
        raw(registry).close()


def exception_chain(exc: BaseException) -> list[BaseException]:
    """An exception and every exception chained to it (``__cause__``/``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def redis_error(exc: BaseException, kind: type[BaseException]) -> BaseException:
    """The ``kind`` redis-py error raised, or chained to the registry's error."""
    for link in exception_chain(exc):
        if isinstance(link, kind):
            return link
    raise AssertionError(f"no {kind.__name__} in the chain of {exc!r}")


def exception_texts(exc: BaseException) -> list[str]:
    """str() and repr() of an exception and of every exception chained to it."""
    texts: list[str] = []
    for link in exception_chain(exc):
        texts += [str(link), repr(link), *map(str, link.args)]
    return texts


def log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every captured record's message, raw arguments and formatted exception."""
    texts = [caplog.text]
    for record in caplog.records:
        texts += [record.getMessage(), repr(record.args), str(record.exc_text or "")]
    return texts


def capture_debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)


def run_pcr(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pcr ARGS`` in a subprocess (no $REDIS_URL), output captured."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "pcr", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *secrets: str) -> str:
    """A failed ``pcr`` run: non-zero exit, one stderr line, no traceback, no secret."""
    output = f"exit {result.returncode}\nstdout: {result.stdout!r}\nstderr: {result.stderr!r}"
    assert result.returncode != 0, output
    assert "Traceback" not in result.stderr, output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("pcr stats: error: "), output
    for secret in secrets:
        assert secret not in result.stdout, output
        assert secret not in result.stderr, output
    return lines[0]


# -- TLS ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsServer:
    server: RedisServer
    tls_port: int
    files: TlsFiles

    def url(self, *, trust_ca: bool = True) -> str:
        """A rediss:// URL to the TLS port that verifies the certificate (with our CA)."""
        query = "ssl_cert_reqs=required"
        if trust_ca:
            query = f"ssl_ca_certs={quote(str(self.files.ca_cert), safe='')}&{query}"
        return f"rediss://{HOST}:{self.tls_port}/0?{query}"


_NO_TLS_BUILD = re.compile(r"BUILD_TLS|TLS.*not (supported|built)|not built with TLS", re.I)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    """A redis-server with its plain port (for RedisServer's PING) and a TLS port."""
    require_redis_server()
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    last_error: RuntimeError | None = None
    for _ in range(3):  # the TLS port is only free when checked: retry on a taken one
        tls_port = free_port()
        server = RedisServer(
            [
                "--tls-port", str(tls_port),
                "--tls-cert-file", str(files.server_cert),
                "--tls-key-file", str(files.server_key),
                "--tls-ca-cert-file", str(files.ca_cert),
                "--tls-auth-clients", "no",
            ]
        )  # fmt: skip
        try:
            server.start()
        except RuntimeError as exc:
            if _NO_TLS_BUILD.search(str(exc)):
                pytest.skip(f"this redis-server build has no TLS support: {exc}")
            last_error = exc
            continue
        try:
            yield TlsServer(server, tls_port, files)
        finally:
            server.stop()
        return
    raise AssertionError(f"the TLS redis-server did not start: {last_error}")


def test_tls_register_match_evict(tls_server: TlsServer) -> None:
    registry = PrefixCacheRegistry.from_url(tls_server.url(), new_namespace())
    try:
        # rediss:// gives TLS connections.
        assert raw(registry).connection_pool.connection_class is redis.SSLConnection
    finally:
        raw(registry).close()
    exercise(PrefixCacheRegistry.from_url(tls_server.url(), new_namespace()))


def test_tls_with_keyword_options(tls_server: TlsServer) -> None:
    url = f"rediss://localhost:{tls_server.tls_port}/0"
    registry = PrefixCacheRegistry.from_url(
        url,
        new_namespace(),
        ssl_ca_certs=str(tls_server.files.ca_cert),
        ssl_cert_reqs="required",
    )
    exercise(registry)


def test_tls_port_refuses_plain_connections(tls_server: TlsServer) -> None:
    registry = PrefixCacheRegistry.from_url(
        f"redis://{HOST}:{tls_server.tls_port}/0",
        new_namespace(),
        socket_connect_timeout=3,
        socket_timeout=3,
    )
    try:
        with pytest.raises(FAILURE) as info:
            registry.match_kv_prefix([1, 2])
    finally:
        raw(registry).close()
    redis_error(info.value, redis.ConnectionError)


def test_tls_without_the_ca_fails_verification(tls_server: TlsServer) -> None:
    registry = PrefixCacheRegistry.from_url(tls_server.url(trust_ca=False), new_namespace())
    try:
        with pytest.raises(FAILURE) as info:
            registry.register_kv([1], [11])
    finally:
        raw(registry).close()
    for error in (info.value, redis_error(info.value, redis.ConnectionError)):
        message = str(error)
        assert "certificate verify failed" in message.lower(), message
        assert "\n" not in message


def test_cli_stats_over_tls(tls_server: TlsServer, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = new_namespace()
    registry = PrefixCacheRegistry.from_url(tls_server.url(), namespace)
    try:
        registry.claim()
        registry.register_kv([7, 8], [71, 72])
    finally:
        raw(registry).close()
    assert main(["stats", "--redis-url", tls_server.url(), "--json"]) == 0
    out = capsys.readouterr().out
    assert f'"namespace": "{namespace}"' in out
    assert '"kv_entries": 2' in out


def test_cli_stats_over_tls_without_the_ca_is_one_line(tls_server: TlsServer) -> None:
    line = assert_one_line_error(run_pcr("stats", "--redis-url", tls_server.url(trust_ca=False)))
    assert f"{HOST}:{tls_server.tls_port}" in line
    assert "certificate verify failed" in line.lower(), line


# -- passwords ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    """A redis-server with ``requirepass PASSWORD`` and ACL users ``alice`` and ``bob``."""
    require_redis_server()
    with RedisServer() as server:
        admin = server.client()
        try:
            admin.config_set("requirepass", PASSWORD)
        finally:
            admin.close()
        admin = server.client(password=PASSWORD)  # the default user, after AUTH
        try:
            for user, password in (("alice", ALICE_PASSWORD), ("bob", BOB_PASSWORD)):
                # ACL SETUSER <user> on ><password> ~* &* +@all
                assert admin.acl_setuser(
                    user,
                    enabled=True,
                    passwords=[f"+{password}"],
                    keys=["*"],
                    channels=["*"],
                    commands=["+@all"],
                )
        finally:
            admin.close()
        yield server


def auth_url(server: RedisServer, user: str = "", password: str = PASSWORD) -> str:
    return f"redis://{quote(user, safe='')}:{quote(password, safe='')}@{HOST}:{server.port}/0"


def test_unauthenticated_is_refused(auth_server: RedisServer) -> None:
    registry = PrefixCacheRegistry.from_url(auth_server.url, new_namespace())
    try:
        with pytest.raises(FAILURE) as info:
            registry.match_kv_prefix([1])
    finally:
        raw(registry).close()
    redis_error(info.value, redis.AuthenticationError)


@pytest.mark.parametrize(
    ("user", "password"),
    [("", PASSWORD), ("default", PASSWORD), ("alice", ALICE_PASSWORD), ("bob", BOB_PASSWORD)],
    ids=["requirepass", "default-user", "acl-user", "acl-user-percent-encoded"],
)
def test_password_in_the_url(auth_server: RedisServer, user: str, password: str) -> None:
    exercise(PrefixCacheRegistry.from_url(auth_url(auth_server, user, password), new_namespace()))


def test_password_as_keyword_arguments(auth_server: RedisServer) -> None:
    exercise(PrefixCacheRegistry.from_url(auth_server.url, new_namespace(), password=PASSWORD))
    exercise(
        PrefixCacheRegistry.from_url(
            auth_server.url, new_namespace(), username="alice", password=ALICE_PASSWORD
        )
    )


def test_acl_user_is_who_the_server_sees(auth_server: RedisServer) -> None:
    registry = PrefixCacheRegistry.from_url(
        auth_url(auth_server, "alice", ALICE_PASSWORD), new_namespace()
    )
    try:
        assert raw(registry).acl_whoami() in ("alice", b"alice")
    finally:
        raw(registry).close()


def test_client_repr_hides_the_password(auth_server: RedisServer) -> None:
    registry = PrefixCacheRegistry.from_url(auth_url(auth_server), new_namespace())
    try:
        registry.match_kv_prefix([1])
        for text in (repr(registry), repr(raw(registry)), repr(raw(registry).connection_pool)):
            assert PASSWORD not in text, text
    finally:
        raw(registry).close()


@pytest.mark.parametrize(
    "user", ["", "default", "alice", "nobody"], ids=["requirepass", "default", "alice", "nobody"]
)
def test_wrong_password_fails_without_showing_it(
    auth_server: RedisServer, caplog: pytest.LogCaptureFixture, user: str
) -> None:
    capture_debug_logs(caplog)
    url = auth_url(auth_server, user, WRONG_PASSWORD)
    registry = PrefixCacheRegistry.from_url(url, new_namespace())
    try:
        with pytest.raises(FAILURE) as info:
            registry.register_kv([1], [11])
        with pytest.raises(FAILURE) as info_read:
            registry.match_kv_prefix([11])
    finally:
        raw(registry).close()
    redis_error(info.value, redis.AuthenticationError)
    redis_error(info_read.value, redis.AuthenticationError)
    texts = [
        *exception_texts(info.value),
        *exception_texts(info_read.value),
        repr(raw(registry)),
        *log_texts(caplog),
    ]
    for text in texts:
        assert WRONG_PASSWORD not in text, text
        assert quote(WRONG_PASSWORD, safe="") not in text, text


def test_cli_wrong_password_is_one_line_without_it(auth_server: RedisServer) -> None:
    for user in ("", "alice"):
        result = run_pcr("stats", "--redis-url", auth_url(auth_server, user, WRONG_PASSWORD))
        line = assert_one_line_error(result, WRONG_PASSWORD)
        assert f"{HOST}:{auth_server.port}" in line
        assert re.search(r"auth|password", line, re.I), line


def test_cli_right_password_works(auth_server: RedisServer) -> None:
    result = run_pcr("stats", "--redis-url", auth_url(auth_server, "alice", ALICE_PASSWORD))
    assert result.returncode == 0, result.stderr
    assert ALICE_PASSWORD not in result.stdout + result.stderr


def test_cli_unreachable_rediss_url_is_one_line_without_the_password() -> None:
    url = f"rediss://user:{UNREACHABLE_PASSWORD}@{HOST}:1/0"
    line = assert_one_line_error(run_pcr("stats", "--redis-url", url), UNREACHABLE_PASSWORD)
    assert f"cannot reach Redis at {HOST}:1" in line, line


def test_unreachable_rediss_url_error_hides_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    capture_debug_logs(caplog)
    url = f"rediss://user:{UNREACHABLE_PASSWORD}@{HOST}:1/0"
    registry = PrefixCacheRegistry.from_url(url, new_namespace(), socket_connect_timeout=3)
    try:
        with pytest.raises(FAILURE) as info:
            registry.match_kv_prefix([1])
    finally:
        raw(registry).close()
    redis_error(info.value, redis.ConnectionError)
    for text in [*exception_texts(info.value), repr(raw(registry)), *log_texts(caplog)]:
        assert UNREACHABLE_PASSWORD not in text, text
