"""``pcr bridge`` as an operator runs it: usage errors, a refused Redis, a running bridge
that ``pcr stats`` and ``pcr match`` see, SIGTERM and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pcr.cli.main import main
from sim.engine_events import EnginePublisher, engine_chain, prompt, stored
from tests.support import REPO_ROOT
from tests.support.servers import RedisServer, refused_port
from tests.support.waiting import wait_until

BS = 16


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bridge", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a", "--namespace", "b"],
         "one --namespace per --endpoint"),
        (["--endpoint", "http://127.0.0.1:1", "--namespace", "a"], "ZeroMQ endpoint"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a{b}"], "hash-tag"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a", "--medium", "G PU"], "media"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a", "--engine", "trt"],
         "invalid choice"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a", "--block-size", "0"],
         "block"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a",
          "--replay-endpoint", "tcp://127.0.0.1:2", "--replay-endpoint", "-"],
         "--replay-endpoint once per --endpoint"),
        (["--endpoint", "tcp://127.0.0.1:1", "--endpoint", "tcp://127.0.0.1:2",
          "--namespace", "a", "--namespace", "a"], "namespace of its own"),
        (["--endpoint", "tcp://127.0.0.1:1", "--namespace", "a", "--lease-ttl", "0"],
         "at least 0.1 s"),
        (["--namespace", "a"], "--endpoint"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    with refused_port() as port:
        code, _out, err = run_main(capsys, "--redis-url", f"redis://127.0.0.1:{port}", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("pcr bridge: error:"), err
    assert says in err
    assert "Traceback" not in err


def test_a_refused_redis_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with refused_port() as port:
        code, _out, err = run_main(
            capsys,
            "--redis-url",
            f"redis://127.0.0.1:{port}",
            "--endpoint",
            "tcp://127.0.0.1:1",
            "--namespace",
            "a",
        )
    assert code == 1
    assert err.count("\n") == 1
    assert err.startswith("pcr bridge: error:")
    assert "Traceback" not in err


@pytest.fixture
def engine() -> Iterator[EnginePublisher]:
    with EnginePublisher() as publisher:
        yield publisher


def start_bridge(url: str, engine: EnginePublisher, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    assert engine.replay_endpoint is not None
    command = [
        sys.executable, "-m", "pcr", "bridge", "--redis-url", url,
        "--endpoint", engine.endpoint, "--replay-endpoint", engine.replay_endpoint,
        "--namespace", "engine-0", "--block-size", str(BS), "--stats-interval", "0", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def stop(process: subprocess.Popen[str], how: int) -> tuple[int, str, str]:
    try:
        process.send_signal(how)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err


def stats(url: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["stats", "--redis-url", url, "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_running_bridge_feeds_stats_and_match_and_stops_cleanly(
    redis_server: RedisServer,
    engine: EnginePublisher,
    capsys: pytest.CaptureFixture[str],
    how: int,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    process = start_bridge(redis_server.url, engine, "--json")
    try:
        engine.wait_subscribed(timeout=60)
        tokens = prompt(3, 5, BS)
        engine.publish([stored(engine_chain(tokens, BS), None, tokens, BS)])
        wait_until(
            lambda: any(r["kv_entries"] == 5 for r in stats(redis_server.url, capsys)),
            what="the bridged blocks in pcr stats",
        )
        (row,) = stats(redis_server.url, capsys)
        assert row["namespace"] == "engine-0"
        assert row["state"] == "live"
        assert row["bridged_from"] == f"vllm {engine.endpoint} bs={BS}"

        hashes = " ".join(map(str, tokens))
        assert main(["match", "--redis-url", redis_server.url, "--block-size", str(BS),
                     "--json", "--tokens", *hashes.split()]) == 0  # fmt: skip
        matched = json.loads(capsys.readouterr().out)
        assert json.dumps(matched).count("engine-0") >= 1
    finally:
        code, out, err = stop(process, how)
    assert "Traceback" not in err
    if how == signal.SIGTERM:
        assert code == 0, err
    else:
        assert code == 130, err
        assert err.strip().endswith("pcr bridge: interrupted"), err
    final = json.loads(out.strip().splitlines()[-1])
    assert final["namespace"] == "engine-0"
    assert final["blocks_stored"] == 5
    assert final["bad_messages"] == 0


def test_duration_ends_the_bridge_with_its_counts(
    redis_server: RedisServer, engine: EnginePublisher
) -> None:
    process = start_bridge(redis_server.url, engine, "--duration", "1")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"pcr bridge: vllm {engine.endpoint}, replay ")
    assert lines[-1].startswith("engine-0: batches=0 blocks_stored=0")
