"""``pcr.bench.floor_proxy``, the floors ``pcr.bench.gateway_load`` sets the gateway
against: each forwards bodies unchanged to its engines in turn and passes the reply back,
on one kept-alive connection, through uvicorn, the plain protocol and the gateway's own
server (``Direct`` requests) alike."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.fake_engine import FakeEngine
from tests.support.servers import HOST, free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started = [FakeEngine("a").start(), FakeEngine("b").start()]
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.mark.parametrize("server", ["uvicorn", "raw", "direct"])
def test_a_floor_forwards_each_body_to_its_engines_in_turn(
    engines: list[FakeEngine], server: str, tmp_path: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "pcr.bench.floor_proxy", "--port", str(port)]
    command += ["--server", server]
    for engine in engines:
        command += ["--backend", engine.url]
    log = (tmp_path / "floor.log").open("wb")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:

        def health() -> bool:
            assert process.poll() is None, (tmp_path / "floor.log").read_text()
            connection = http.client.HTTPConnection(HOST, port, timeout=5)
            try:
                connection.request("GET", "/health")
                return connection.getresponse().status == 200
            except OSError:
                return False
            finally:
                connection.close()

        wait_until(health, 60, "the floor to answer /health")
        connection = http.client.HTTPConnection(HOST, port, timeout=30)
        replies = []
        try:
            for n in range(4):  # one connection, kept alive
                body = {"model": "tiny", "prompt": [n, 1, 2, 3], "max_tokens": 1}
                connection.request(
                    "POST",
                    "/v1/completions",
                    json.dumps(body),
                    {"Content-Type": "application/json"},
                )
                reply = connection.getresponse()
                assert reply.status == 200
                replies.append(json.loads(reply.read()))
                assert connection.sock is not None  # not closed by the floor
        finally:
            connection.close()
        assert all(r["object"] == "text_completion" for r in replies)
        sent = [r["prompt"] for engine in engines for r in engine.received]
        assert sorted(p[0] for p in sent) == [0, 1, 2, 3]
        assert [len(engine.received) for engine in engines] == [2, 2]  # in turn
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
