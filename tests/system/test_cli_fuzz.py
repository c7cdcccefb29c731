"""``pcr`` never shows a traceback.

Usage errors exit 2, runtime errors exit 1, each with exactly one line on stderr
(``pcr COMMAND: error: MESSAGE``); Ctrl-C exits 130 with one line. Proved by a bounded
fuzz of argv and ``$REDIS_URL`` (URLs, numbers, namespaces, key prefixes, paths) against
a real server, a dead port and servers that are not Redis (garbage replies, connections
closed at once, silence), run in-process, and by one explicit test for each input that
used to fail; a few runs of the installed ``pcr`` script show that a real terminal's
stderr gets the same single line.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import pcr.bench.run
import pcr.cli.bench
import pcr.cli.common as cli
import pcr.cli.inspection
import pcr.cli.simulate
from pcr.cli.common import MAX_CURSOR, MAX_PAGE
from pcr.cli.main import main
from registry import NodeIndex, PrefixCacheRegistry, StaleEpochError, block_hashes
from registry.core.keys import validate_key_prefix, validate_namespace
from tests.support import REPO_ROOT
from tests.support.servers import RedisServer, refused_port, require_redis_server
from tests.support.waiting import wait_until

ROOT = REPO_ROOT
PREFIX = "fz"
SECRET = "hunter2-secret"
QUICK = "socket_timeout=0.2&socket_connect_timeout=0.2"
"""Only for the server that never answers: its runs end after the timeout (the outcome is
the same however long it is); servers that answer get the CLI's own timeouts."""


# -- servers that are not Redis -------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    server: NotRedis

    def handle(self) -> None:
        server = self.server
        with server.lock:
            server.connections.add(self.request)
        try:
            if server.mode == "close":
                return  # socketserver closes the connection
            if server.mode == "silent":
                server.stopping.wait()
                return
            while True:
                data = self.request.recv(65536)
                if not data:
                    return
                self.request.sendall(self.answer(data))
        except OSError:
            return
        finally:
            with server.lock:
                server.connections.discard(self.request)

    def answer(self, data: bytes) -> bytes:
        if self.server.mode == "handshake":  # enough of Redis to connect (RESP3), then not
            words = data.split(b"\r\n")
            command = words[2].upper() if len(words) > 2 else b""
            if command == b"HELLO":
                return b"%2\r\n+server\r\n+redis\r\n+proto\r\n:3\r\n"
            if command == b"PING":
                return b"+PONG\r\n"
            if command == b"CLIENT":
                return b"+OK\r\n"
        return self.server.reply


class NotRedis(socketserver.ThreadingTCPServer):
    """A loopback TCP server that is not Redis: it answers every read with ``reply``
    (mode "reply"), or only after a Redis-like handshake ("handshake"), closes each
    connection at once ("close"), or never answers ("silent"). ``stop()`` ends every
    connection and joins every thread."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, mode: str, reply: bytes = b"") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.reply = reply
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self._thread = threading.Thread(
            target=self.serve_forever, args=(0.05,), name=f"not-redis-{mode}"
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/0" + (
            f"?{QUICK}" if self.mode == "silent" else ""
        )

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self._thread.join()
        with self.lock:
            connections = list(self.connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.server_close()  # joins the handler threads


NOT_REDIS = {
    "garbage": ("reply", b"\x00\xff garbage\r\n"),
    "http": ("reply", b"HTTP/1.1 400 Bad Request\r\n\r\n"),
    "ok-to-all": ("reply", b"+OK\r\n"),
    "error-to-all": ("reply", b"-ERR nope\r\n"),
    "huge-array": ("reply", b"*99999999999\r\n"),
    "closes": ("close", b""),
    "silent": ("silent", b""),
    "pong-then-garbage": ("handshake", b"\x00 garbage\r\n"),
    "pong-then-errors": ("handshake", b"-ERR nope\r\n"),
    "pong-then-ok": ("handshake", b"+OK\r\n"),
}
NONSENSE = "pong-then-ok"
"""Well-formed replies that make no sense: the one case where ``internal error: ...``
(one line, exit 1) is the expected answer, so it is kept out of the fuzz."""


@dataclass
class Targets:
    """Everything the fuzz points the CLI at, and what each URL should give."""

    server: RedisServer
    dead_port: int
    not_redis: dict[str, NotRedis]
    tmp: Path
    urls: dict[str, list[str]] = field(default_factory=dict)  # kind -> URLs
    paths: list[tuple[str, bool]] = field(default_factory=list)  # (path, writable)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    """A real server with a live and a dead node, a dead port, servers that are not Redis."""
    require_redis_server()
    tmp = tmp_path_factory.mktemp("cli-fuzz")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        dead_port = stack.enter_context(refused_port())
        not_redis = {}
        for name, (mode, reply) in NOT_REDIS.items():
            not_redis[name] = NotRedis(mode, reply)
            stack.callback(not_redis[name].stop)
        _prepare(server)
        t = Targets(server, dead_port, not_redis, tmp)
        port, dead_port = server.port, t.dead_port
        fuzzed = [s for name, s in not_redis.items() if name != NONSENSE]
        t.urls = {
            "ok": [
                server.url,
                f"redis://127.0.0.1:{port}",
                f"redis://localhost:{port}/0",
                f"redis://default:{SECRET}@127.0.0.1:{port}/0",  # nopass: any password works
            ],
            "runtime": [
                f"redis://127.0.0.1:{dead_port}/0",
                f"redis://:{SECRET}@127.0.0.1:{dead_port}/0",
                f"rediss://user:{SECRET}@127.0.0.1:{dead_port}/0",
                f"redis+cluster://127.0.0.1:{dead_port}",
                f"redis+cluster://127.0.0.1:{port}",
                f"redis://127.0.0.1:{port}/99999",
                f"redis://nobody:{SECRET}@127.0.0.1:{port}/0",
                f"rediss://127.0.0.1:{port}/0?{QUICK}",  # TLS to a plain server: no answer
                "unix:///nonexistent-dir/redis.sock",
                *[s.url() for s in fuzzed],
                *[s.url("redis+cluster") for s in fuzzed],
            ],
            "usage": [
                "redis://127.0.0.1:99999/0",
                "redis://127.0.0.1:abc/0",
                f"http://user:{SECRET}@127.0.0.1/",
                "redis://[::1/0",
                f"redis://127.0.0.1:{port}/0?socket_timeout=abc",
                f"redis://127.0.0.1:{port}/0?ssl_cert_reqs=required",
                "redis+sentinel://127.0.0.1/no-port",
                "redis+sentinel://127.0.0.1:1/",
                "127.0.0.1:6379",
                "unix://",
                "",
                "  ",
            ],
        }
        missing = tmp / "missing" / "figures.json"
        a_file = tmp / "a-file"
        a_file.write_text("")
        t.paths = [
            (str(tmp / "figures.json"), True),
            (str(a_file), True),
            (str(missing), False),
            (str(tmp), False),  # a directory
            (str(a_file / "figures.json"), False),  # under a file
            ("", False),
        ]
        yield t


def _prepare(server: RedisServer) -> None:
    """Under key prefix ``fz``: node-live (live, cached blocks) and node-dead."""
    client = server.client()
    try:
        live = PrefixCacheRegistry(client, "node-live", key_prefix=PREFIX)
        live.claim(lease_ttl=3600)
        hashes = block_hashes(list(range(64)), 16)
        live.register_kv([1, 2, 3, 4], hashes)
        live.register_mamba([2], hashes[1:2])
        dead = PrefixCacheRegistry(client, "node-dead", key_prefix=PREFIX)
        dead.claim(lease_ttl=3600)
        client.zadd(f"{PREFIX}:nodes", {"node-dead": 1})  # its lease ran out long ago
    finally:
        client.close()


# -- what each argument should do ------------------------------------------------------


@dataclass
class Case:
    """One generated run: argv, $REDIS_URL, and the exit status it must give."""

    command: str
    argv: list[str]
    env_url: str | None  # None: $REDIS_URL unset
    expected: int
    created: str | None = None  # a --json path that must not be left behind on failure


def _valid_int(text: str, low: int, high: int) -> bool:
    try:
        return low <= int(text) <= high
    except ValueError:
        return False


def _valid_seconds(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and 0 <= value <= cli.MAX_WATCH_SECONDS


def _valid_name(text: str, check: Any) -> bool:
    try:
        check(text)
    except (TypeError, ValueError):
        return False
    return True


JUNK_NUMBERS = ["nan", "NaN", "inf", "-inf", "1e309", "1.5", "0x10", "", " ", "one", "9" * 5000]


def mostly(good: st.SearchStrategy[str], bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``good`` about five times in six, so runs get past the parser often."""
    return st.integers(0, 5).flatmap(lambda n: bad if n == 0 else good)


def numbers(low: int, high: int, small: int | None = None) -> st.SearchStrategy[str]:
    """Text for an integer option: in range, just outside, huge, or not a number."""
    top = high if small is None else min(high, small)
    return mostly(
        st.integers(low, top).map(str),
        st.one_of(
            st.sampled_from([low - 1, high + 1, -(2**64), 2**64, 10**30]).map(str),
            st.sampled_from(JUNK_NUMBERS),
        ),
    )


names = mostly(
    st.sampled_from(["node-live", "node-dead", "n1", "é", "-dash", "a=b"]),
    st.one_of(st.sampled_from(["", " ", "a b", "x{y}", "ns\n", "z" * 201]), st.text(max_size=8)),
)
prefixes = mostly(
    st.sampled_from([PREFIX, "pcr", "other"]),
    st.one_of(st.sampled_from(["", "p{", "a b"]), st.text(max_size=6)),
)
timeouts = mostly(
    st.sampled_from(["0", "0.01", "0.05"]),
    st.sampled_from(["nan", "inf", "-inf", "-1", "1e309", "4e7", "x", ""]),
)


@st.composite
def cases(draw: st.DrawFn, t: Targets) -> Case:
    command = draw(
        st.sampled_from(["stats", "inspect", "match", "watch", "gc", "simulate", "bench"])
    )
    options: list[str] = []
    positionals: list[str] = []
    valid = True  # every argument passes the parser
    usage = False  # a usage error found after parsing
    created = None

    def option(flag: str, text: str, ok: bool) -> None:
        nonlocal valid
        options.append(f"{flag}={text}")
        valid = valid and ok

    def sometimes() -> bool:
        return draw(st.booleans())

    long_run = command in ("simulate", "bench")  # never on a working server: too slow
    kinds = ["runtime", "usage"] if long_run else ["ok", "ok", "runtime", "usage"]
    kind = draw(st.sampled_from(kinds))
    url = draw(st.sampled_from(t.urls[kind]))
    source = draw(st.sampled_from(["argv", "env", "both"]))
    if command == "bench":
        source = "argv"  # bench ignores $REDIS_URL: without --redis-url it starts a server
    env_url: str | None = None
    if source in ("argv", "both"):
        options.append(f"--redis-url={url}")
        if source == "both":  # the option wins over the environment
            env_url = draw(st.sampled_from(["", *t.urls["ok"], *t.urls["usage"]]))
        elif sometimes():
            env_url = ""
    else:
        env_url = url
        if not url:  # an empty $REDIS_URL counts as unset: the default is localhost:6379
            options.append(f"--redis-url={t.urls['runtime'][0]}")
            kind = "runtime"
    if not url.strip() and source != "env":
        valid = False  # the parser refuses an empty --redis-url
    elif env_url is not None and source == "env" and url and not url.strip():
        valid = False  # the parser checks a default from $REDIS_URL too
    if kind == "usage" and url.strip():
        usage = True
    if (
        command == "bench"
        and kind == "runtime"
        and not url.startswith(("redis:", "rediss:", "unix:"))
    ):
        usage = True  # bench measures standalone servers only

    if command in ("stats", "inspect", "match", "watch", "gc", "simulate") and sometimes():
        prefix = draw(prefixes)
        option("--key-prefix", prefix, _valid_name(prefix, validate_key_prefix))
    if command == "stats":
        for _ in range(draw(st.integers(0, 2))):
            ns = draw(names)
            option("--namespace", ns, _valid_name(ns, validate_namespace))
    elif command in ("inspect", "watch"):
        ns = draw(names)
        positionals.append(ns)
        valid = valid and _valid_name(ns, validate_namespace)
        if command == "inspect":
            if sometimes():
                which = draw(st.sampled_from(["kv", "mamba", "kv", "mamba", "both", ""]))
                option("--kind", which, which in ("kv", "mamba"))
            if sometimes():
                text = draw(numbers(0, MAX_CURSOR))
                option("--cursor", text, _valid_int(text, 0, MAX_CURSOR))
            if sometimes():
                text = draw(numbers(1, MAX_PAGE))
                option("--count", text, _valid_int(text, 1, MAX_PAGE))
        else:
            text = draw(timeouts)  # always: a watch without one only ends on Ctrl-C
            option("--timeout", text, _valid_seconds(text))
            if sometimes():
                text = draw(numbers(1, cli.MAX_NOTICES))
                option("--count", text, _valid_int(text, 1, cli.MAX_NOTICES))
    elif command == "match":
        which = draw(st.sampled_from(["hashes", "tokens"] * 4 + ["both", "neither"]))
        given_hashes = which in ("hashes", "both")
        given_tokens = which in ("tokens", "both")
        if given_hashes:
            for _ in range(draw(st.integers(1, 3))):
                text = draw(numbers(1, cli.MAX_INT64))
                positionals.append(text)
                valid = valid and _valid_int(text, 1, cli.MAX_INT64)
        if given_tokens:
            text = draw(numbers(-(2**63), cli.MAX_INT64))
            option("--tokens", text, _valid_int(text, -(2**63), cli.MAX_INT64))
        if given_hashes == given_tokens:
            usage = True
        if sometimes():
            ns = draw(names)
            option("--namespace", ns, _valid_name(ns, validate_namespace))
        block_size = 16
        if sometimes():
            text = draw(numbers(1, cli.MAX_BLOCK_SIZE))
            option("--block-size", text, _valid_int(text, 1, cli.MAX_BLOCK_SIZE))
            if _valid_int(text, 1, cli.MAX_BLOCK_SIZE):
                block_size = int(text)
        if given_tokens and block_size > 1:
            usage = True  # one token makes no complete block: nothing to look up
    elif command == "gc" and sometimes():
        options.append("--dry-run")
    elif command == "simulate":
        for flag in ("--nodes", "--requests", "--kv-blocks", "--mamba-slots", "--block-size"):
            if sometimes():
                text = draw(numbers(1, cli.MAX_INT64, small=8))
                option(flag, text, _valid_int(text, 1, cli.MAX_INT64))
        if sometimes():
            text = draw(numbers(-(2**63), cli.MAX_INT64))
            option("--seed", text, _valid_int(text, -(2**63), cli.MAX_INT64))
        if sometimes():
            text = draw(numbers(1, 65535))
            option("--serve-port", text, _valid_int(text, 1, 65535))
        if sometimes():
            router = draw(st.sampled_from(["prefix", "both", "random"]))
            option("--router", router, router != "random")
    if command in ("simulate", "bench") and sometimes():
        path, writable = draw(st.sampled_from(t.paths))
        options.append(f"--json={path}")
        if not writable:
            usage = True
        elif not os.path.exists(path):
            created = path
    if command in ("stats", "inspect", "match", "watch", "gc") and sometimes():
        options.append("--json")

    options = draw(st.permutations(options))
    argv = [command, *options, *(["--", *positionals] if positionals else [])]
    expected = 2 if not valid or usage else {"ok": 0, "runtime": 1, "usage": 2}[kind]
    return Case(command, argv, env_url, expected, created)


def check_one_line_error(case: Case, code: int, out: str, err: str) -> None:
    shown = f"argv={case.argv!r} REDIS_URL={case.env_url!r}\nexit {code}\nout={out!r}\nerr={err!r}"
    assert code == case.expected, shown
    assert "Traceback" not in err, shown
    assert "internal error" not in err, shown
    assert SECRET not in out + err, shown
    lines = err.splitlines()
    if code == 0:
        assert all(": WARNING: " in line for line in lines), shown
    else:
        assert len(lines) == 1, shown
        assert lines[0].startswith(f"pcr {case.command}: error: "), shown
    if code != 0 and case.created is not None:
        assert not os.path.exists(case.created), f"{shown}\n--json file left behind"


@pytest.fixture(scope="module")
def fuzz_cases(targets: Targets) -> st.SearchStrategy[Case]:
    return cases(targets)


def test_fuzzed_argv_and_environment_give_one_line_and_the_right_exit(
    targets: Targets, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(case=cases(targets))
    def run(case: Case) -> None:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            if case.env_url is None:
                patch.delenv("REDIS_URL", raising=False)
            else:
                patch.setenv("REDIS_URL", case.env_url)
            code = main(case.argv)
        out, err = capsys.readouterr()
        event(f"{case.command} exit {case.expected}")
        check_one_line_error(case, code, out, err)

    run()


# -- the inputs that used to fail, one by one -----------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(capsys: pytest.CaptureFixture[str], expected: int, *argv: str) -> str:
    """Run ``pcr ARGV``; check the exit status and the one stderr line; return it."""
    code, out, err = run_main(capsys, *argv)
    shown = f"argv={argv!r}\nexit {code}\nout={out!r}\nerr={err!r}"
    assert code == expected, shown
    assert "Traceback" not in err, shown
    lines = err.splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith(f"pcr {argv[0]}: "), shown
    return lines[0]


def test_cluster_url_to_nothing(targets: Targets, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(
        capsys, 1, "stats", "--redis-url", f"redis+cluster://127.0.0.1:{targets.dead_port}"
    )
    assert f"cannot reach Redis at 127.0.0.1:{targets.dead_port}" in line


def test_cluster_url_to_a_standalone_server_says_use_redis(
    targets: Targets, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("stats", "gc"):
        url = f"redis+cluster://127.0.0.1:{targets.server.port}"
        line = one_line(capsys, 1, command, "--redis-url", url)
        assert "use redis:// instead of redis+cluster://" in line


def test_database_index_out_of_range(targets: Targets, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(
        capsys, 1, "stats", "--redis-url", f"redis://127.0.0.1:{targets.server.port}/99999"
    )
    assert "database index" in line


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--count", "0"),
        ("--count", str(MAX_PAGE + 1)),
        ("--count", str(10**30)),
        ("--count", "9" * 5000),
        ("--count", "nan"),
        ("--cursor", "-1"),
        ("--cursor", str(2**64)),
        ("--cursor", str(10**30)),
        ("--cursor", "inf"),
    ],
)
def test_inspect_bounds_count_and_cursor(
    targets: Targets, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    line = one_line(
        capsys, 2, "inspect", "node-live", "--redis-url", targets.server.url, option, value
    )
    assert f"argument {option}" in line
    assert len(line) < 300


def test_inspect_accepts_the_bounds(targets: Targets, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["inspect", "node-live", "--redis-url", targets.server.url, "--key-prefix", PREFIX]
    code, _, err = run_main(capsys, *argv, "--count", str(MAX_PAGE), "--cursor", "0")
    assert (code, err) == (0, "")
    code, _, err = run_main(capsys, *argv, "--count", "1", "--cursor", str(MAX_CURSOR))
    assert (code, err) == (0, "")


@pytest.mark.parametrize("command", ["simulate", "bench"])
@pytest.mark.parametrize("where", ["missing-dir", "a-directory", "under-a-file", "empty"])
def test_unwritable_json_is_refused_before_the_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    where: str,
) -> None:
    (tmp_path / "a-file").write_text("")
    path = {
        "missing-dir": tmp_path / "missing" / "figures.json",
        "a-directory": tmp_path,
        "under-a-file": tmp_path / "a-file" / "figures.json",
        "empty": "",
    }[where]

    def must_not_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run started")

    monkeypatch.setattr(pcr.bench.run, "run", must_not_run)
    monkeypatch.setattr(pcr.cli.bench, "RedisServer", must_not_run)
    monkeypatch.setattr(pcr.cli.simulate, "_embedded_redis", must_not_run)
    monkeypatch.setattr(cli, "connect", must_not_run)
    line = one_line(capsys, 2, command, "--json", str(path))
    assert "argument --json: cannot write" in line
    assert capsys.readouterr().out == ""


def test_a_writable_json_path_is_not_left_behind_when_the_run_fails(
    targets: Targets, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "figures.json"
    dead = f"redis://127.0.0.1:{targets.dead_port}/0"
    for command in ("simulate", "bench"):
        one_line(capsys, 1, command, "--redis-url", dead, "--json", str(path))
        assert not path.exists()


@pytest.mark.parametrize("port", ["0", "-1", "65536", "70000", str(2**64), "nan", "http"])
def test_serve_port_out_of_range(capsys: pytest.CaptureFixture[str], port: str) -> None:
    line = one_line(capsys, 2, "simulate", "--serve-port", port)
    assert "argument --serve-port" in line


@pytest.mark.parametrize("namespace", ["", " ", "a b", "x{y}", "tab\there", "z" * 201])
@pytest.mark.parametrize("command", ["match", "stats", "inspect", "watch"])
def test_bad_namespace_is_a_usage_error(
    targets: Targets, capsys: pytest.CaptureFixture[str], command: str, namespace: str
) -> None:
    url = ["--redis-url", targets.server.url]
    argv = {
        "match": ["match", "1", f"--namespace={namespace}", *url],
        "stats": ["stats", f"--namespace={namespace}", *url],
        "inspect": ["inspect", *url, "--", namespace],
        "watch": ["watch", "--timeout", "0", *url, "--", namespace],
    }[command]
    line = one_line(capsys, 2, *argv)
    assert "namespace" in line
    if not namespace:
        assert "namespace must not be empty" in line


@pytest.mark.parametrize("timeout", ["nan", "NaN", "inf", "-inf", "-1", "1e309", "4e7", "soon"])
def test_watch_timeout_must_be_finite_and_bounded(
    targets: Targets, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    line = one_line(
        capsys, 2, "watch", "ns", "--redis-url", targets.server.url, f"--timeout={timeout}"
    )
    assert "argument --timeout" in line


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["simulate", "--nodes", "nan"], "--nodes"),
        (["simulate", "--requests", "inf"], "--requests"),
        (["simulate", "--kv-blocks", str(2**63)], "--kv-blocks"),
        (["simulate", "--mamba-slots", "1e3"], "--mamba-slots"),
        (["simulate", "--block-size", "-5"], "--block-size"),
        (["simulate", "--seed", str(2**70)], "--seed"),
        (["match", "--tokens", "nan"], "--tokens"),
        (["match", "--tokens", "1", "--block-size", "0"], "--block-size"),
        (["match", "--", str(2**63)], "HASH"),
        (["match", "--", "0"], "HASH"),
        (["watch", "ns", "--count", "inf"], "--count"),
        (["watch", "ns", "--count", "0"], "--count"),
    ],
)
def test_numbers_reject_nan_inf_and_huge_values(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str
) -> None:
    line = one_line(capsys, 2, *argv)
    assert f"argument {option}" in line


def test_tokens_that_make_no_complete_block_are_a_usage_error_before_any_server(
    targets: Targets, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fewer tokens than a block give nothing to look up, so no server would be asked:
    even a dead one would read as "0 of 0 blocks cached". One line, exit 2, instead."""
    dead = f"redis://127.0.0.1:{targets.dead_port}/0"
    for url in (dead, targets.server.url):
        line = one_line(
            capsys, 2, "match", "--namespace", "node-live", "--tokens", "1", "2", "--redis-url", url
        )
        assert "--tokens: 2 token(s) make no complete block of 16" in line
    line = one_line(
        capsys, 1, "match", "--namespace", "n", "--tokens", "7", "--block-size", "1",
        "--redis-url", dead,
    )  # fmt: skip
    assert "127.0.0.1" in line


def test_an_acl_user_without_the_commands_is_one_line_naming_the_fix(
    targets: Targets, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = targets.server.client()
    try:
        admin.acl_setuser(
            "weak", enabled=True, passwords=[f"+{SECRET}"], keys=["*"], commands=["+ping"]
        )
        url = f"redis://weak:{SECRET}@127.0.0.1:{targets.server.port}/0"
        for argv in (
            ["stats"],
            ["gc", "--dry-run"],
            ["inspect", "node-live"],
            ["match", "1"],
            ["match", "1", "--namespace", "node-live"],
            ["watch", "node-live", "--timeout", "1"],
        ):
            line = one_line(capsys, 1, *argv, "--redis-url", url, "--key-prefix", PREFIX)
            assert "lacks a command" in line, line
            assert "grant it" in line, line
            assert SECRET not in line
    finally:
        admin.acl_deluser("weak")
        admin.close()


def test_wrongtype_keys_are_one_line(targets: Targets, capsys: pytest.CaptureFixture[str]) -> None:
    admin = targets.server.client()
    prefix = "wrongtype"
    try:
        owner = PrefixCacheRegistry(admin, "node-w", key_prefix=prefix)
        owner.claim(lease_ttl=3600)
        admin.set(owner.keys.kv, "a string, not a hash")
        common = ["--redis-url", targets.server.url, "--key-prefix", prefix]
        for argv in (
            ["stats"],
            ["inspect", "node-w"],
            ["match", "1", "--namespace", "node-w"],
        ):
            line = one_line(capsys, 1, *argv, *common)
            assert "holds another Redis type" in line, line
        assert "'node-w'" in one_line(capsys, 1, "stats", *common)  # stats names the namespace
        admin.delete(owner.keys.kv)
        admin.set(f"{prefix}:nodes", "not a zset")
        for argv in (["stats"], ["gc"], ["match", "1"]):
            line = one_line(capsys, 1, *argv, *common)
            assert "holds another Redis type" in line, line
    finally:
        for key in admin.scan_iter(f"{prefix}:*"):
            admin.delete(key)
        admin.close()


@pytest.mark.redis_server
@pytest.mark.parametrize(
    "argv",
    [
        ["stats"],
        ["gc"],
        ["inspect", "node-live"],
        ["match", "1", "2"],
        ["match", "1", "--namespace", "node-live"],
        ["watch", "node-live", "--timeout", "5"],
    ],
)
def test_redis_lost_right_after_connecting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    require_redis_server()
    with RedisServer() as server:
        _prepare(server)
        connect = cli.connect

        @contextlib.contextmanager
        def connect_then_lose_it(args: Any) -> Iterator[Any]:
            with connect(args) as client:
                server.stop()  # between PING and the command's first call
                yield client

        monkeypatch.setattr(cli, "connect", connect_then_lose_it)
        line = one_line(capsys, 1, *argv, "--redis-url", server.url, "--key-prefix", PREFIX)
    assert "unavailable" in line.lower() or "cannot reach" in line, line


@pytest.mark.redis_server
def test_redis_lost_while_watching(capsys: pytest.CaptureFixture[str]) -> None:
    require_redis_server()
    with RedisServer() as server:
        admin = server.client()
        channel = "pcr:{ns-lost}:mamba-evicted"

        def stop_once_subscribed() -> None:
            try:
                wait_until(lambda: admin.pubsub_numsub(channel)[0][1] > 0, what="subscribed")
            finally:
                admin.close()
                server.stop()

        thread = threading.Thread(target=stop_once_subscribed)
        thread.start()
        try:
            argv = ["watch", "ns-lost", "--timeout", "60", "--redis-url", server.url]
            line = one_line(capsys, 1, *argv)
        finally:
            thread.join()
    assert "unavailable" in line.lower(), line


def test_ctrl_c_exits_130_with_one_line(
    targets: Targets, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pcr.cli.inspection, "_follow", interrupted)
    line = one_line(capsys, 130, "watch", "ns", "--redis-url", targets.server.url)
    assert line == "pcr watch: interrupted"


def test_an_unexpected_exception_is_one_internal_error_line(
    targets: Targets, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(NodeIndex, "collect_dead", broken)
    line = one_line(capsys, 1, "gc", "--redis-url", targets.server.url)
    assert line == "pcr gc: error: internal error: RuntimeError: boom\\nsecond line"


def test_registry_errors_are_runtime_errors(
    targets: Targets, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stale(*args: Any) -> Any:
        raise StaleEpochError("node-x", 3, "superseded")

    monkeypatch.setattr(NodeIndex, "collect_dead", stale)
    line = one_line(capsys, 1, "gc", "--redis-url", targets.server.url)
    assert line == "pcr gc: error: namespace 'node-x': superseded"


@pytest.mark.parametrize("name", sorted(NOT_REDIS))
@pytest.mark.parametrize(
    "argv",
    [
        ["stats"],
        ["gc"],
        ["inspect", "ns"],
        ["match", "1"],
        ["match", "1", "--namespace", "ns"],
        ["watch", "ns", "--count", "1", "--timeout", "0.5"],
    ],
)
def test_a_server_that_is_not_redis_is_one_line(
    targets: Targets, capsys: pytest.CaptureFixture[str], name: str, argv: list[str]
) -> None:
    server = targets.not_redis[name]
    url = server.url()
    line = one_line(capsys, 1, *argv, "--redis-url", url)
    if server.mode != "handshake":  # the connection itself failed
        assert f"Redis at 127.0.0.1:{server.port}" in line, line
    if name != NONSENSE:
        assert "internal error" not in line, line


@pytest.mark.parametrize("name", sorted(NOT_REDIS))
def test_a_cluster_url_to_a_server_that_is_not_redis_is_one_line(
    targets: Targets, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    port = targets.not_redis[name].port
    url = targets.not_redis[name].url("redis+cluster")
    line = one_line(capsys, 1, "stats", "--redis-url", url)
    assert f"127.0.0.1:{port}" in line, line
    assert "internal error" not in line, line


def test_a_sentinel_url_to_a_dead_port_is_one_line(
    targets: Targets, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis+sentinel://127.0.0.1:{targets.dead_port}/mymaster"
    line = one_line(capsys, 1, "stats", "--redis-url", url)
    assert "no sentinel names a master" in line, line
    assert f"127.0.0.1:{targets.dead_port}" in line, line


def test_a_redis_error_escaping_every_handler_is_translated(
    targets: Targets, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: Any) -> Any:
        raise redis.ConnectionError("Error 111 connecting. Connection refused.")

    monkeypatch.setattr(pcr.cli.inspection, "_print_scores", refused)
    line = one_line(capsys, 1, "match", "1", "--redis-url", targets.server.url)
    assert "Redis unavailable" in line
    assert f"127.0.0.1:{targets.server.port}" in line


# -- the installed script, on a real stderr --------------------------------------------


def pcr_command() -> list[str]:
    script = Path(sys.executable).with_name("pcr")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pcr"]


def run_pcr(
    *args: str, env_url: str | None = None, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | extra_env
    if env_url is not None:
        env["REDIS_URL"] = env_url
    return subprocess.run(
        [*pcr_command(), *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, check=False,
    )  # fmt: skip


def test_the_script_prints_one_line_and_no_traceback(targets: Targets) -> None:
    admin = targets.server.client()
    try:
        admin.set("script:{bad}:kv", "a string")
        runs = [
            (1, run_pcr("stats", "--redis-url", f"redis+cluster://127.0.0.1:{targets.dead_port}")),
            (1, run_pcr("stats", env_url=f"redis://127.0.0.1:{targets.server.port}/99999")),
            (2, run_pcr("watch", "ns", "--timeout", "nan", "--redis-url", targets.server.url)),
            (
                2,
                run_pcr("inspect", "ns", "--count", str(10**30), "--redis-url", targets.server.url),
            ),
            (
                1,
                run_pcr(
                    "inspect", "bad", "--key-prefix", "script", "--redis-url", targets.server.url
                ),
            ),
            (
                1,
                run_pcr(
                    "stats", "--redis-url", f"redis://127.0.0.1:{targets.not_redis['garbage'].port}"
                ),
            ),
            (2, run_pcr("simulate", "--json", str(targets.tmp / "missing" / "x.json"))),
        ]
    finally:
        admin.delete("script:{bad}:kv")
        admin.close()
    for expected, done in runs:
        shown = f"{done.args}\nexit {done.returncode}\nstderr={done.stderr!r}"
        assert done.returncode == expected, shown
        assert "Traceback" not in done.stderr, shown
        assert len(done.stderr.splitlines()) == 1, shown
        assert ": error: " in done.stderr, shown


def test_the_script_exits_130_on_sigint_with_one_line(targets: Targets) -> None:
    process = subprocess.Popen(
        [*pcr_command(), "watch", "ns-sigint", "--redis-url", targets.server.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # printed once Redis confirmed the subscription
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert first.startswith("watching "), (first, err)
    assert process.returncode == 130, err
    assert err.splitlines() == ["pcr watch: interrupted"], err


def test_the_script_survives_a_closed_stdout(targets: Targets) -> None:
    """``pcr ... | head -0``: a broken pipe is at most one line, never a traceback at exit
    (argparse itself ignores a failed write of ``--help``)."""
    for args in (["stats", "--redis-url", targets.server.url, "--key-prefix", PREFIX], ["--help"]):
        read, write = os.pipe()
        os.close(read)  # nobody reads: every write gets EPIPE
        try:
            done = subprocess.run(
                [*pcr_command(), *args],
                stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT, check=False,
            )  # fmt: skip
        finally:
            os.close(write)
        assert "Traceback" not in done.stderr, done.stderr
        assert "Exception ignored" not in done.stderr, done.stderr
        if args[0] == "stats":
            assert done.returncode == 1, done.stderr
            assert done.stderr == "pcr stats: error: standard output was closed (broken pipe)\n"
        else:
            assert len(done.stderr.splitlines()) <= 1, done.stderr


def test_the_script_prints_any_namespace_on_an_ascii_terminal(targets: Targets) -> None:
    url = targets.server.url
    done = run_pcr("stats", "--namespace", "é-node", "--redis-url", url, PYTHONIOENCODING="ascii")
    assert (done.returncode, done.stderr) == (0, "")
    assert "\\xe9-node" in done.stdout
