"""``pcr gateway --workers N``: N processes on one port (SO_REUSEPORT), each a replica of
its own, all serving and all routing by cached prefix, stopped together."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess
from tests.support.waiting import wait_until
from tests.system.test_gateway import BLOCK, cache, complete

pytest.importorskip("fastapi")


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    made = [FakeEngine("a").start(), FakeEngine("b").start()]
    try:
        yield made
    finally:
        for engine in made:
            engine.stop()


def _two_workers(
    redis_server: RedisServer, engines: list[FakeEngine], names: list[str]
) -> ServeProcess:
    args = ["--redis-url", redis_server.url, "--block-size", str(BLOCK), "--workers", "2"]
    for name, engine in zip(names, engines, strict=True):
        args += ["--backend", f"{name}={engine.url}"]
    return ServeProcess(*args, path="/health", command="gateway").start()


def _every_worker_answers(base: str, parent: int) -> None:
    """Each worker of ``parent`` answers ``/health`` on the one port (a new connection
    each time: the kernel spreads them over the workers' sockets), as its own replica."""
    replicas: set[str] = set()

    def all_answered() -> bool:
        reply = httpx.get(f"{base}/health", timeout=10)
        if reply.status_code == 200:
            replicas.add(reply.json()["replica"])
        return len(replicas) == len(_children(parent))

    wait_until(all_answered, 60, "every worker answering on the one port")
    assert replicas == {f"{os.uname().nodename}-{pid}" for pid in _children(parent)}


def _children(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    stat = handle.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
                found.add(int(entry))
    return found


def test_two_workers_share_one_port_and_both_route_by_prefix(
    redis_server: RedisServer, engines: list[FakeEngine]
) -> None:
    tag = uuid.uuid4().hex[:8]
    names = [f"gw-a-{tag}", f"gw-b-{tag}"]
    client = redis_server.client()
    prompt = list(range(10, 43))  # 8 whole blocks, cached on b alone
    cache(client, names[1], prompt)
    proc = _two_workers(redis_server, engines, names)
    try:
        assert proc.process is not None
        wait_until(lambda: len(_children(proc.process.pid)) == 2, 30, "two workers")
        _every_worker_answers(proc.base, proc.process.pid)
        served = [complete(proc.base, {"prompt": prompt})["by"] for _ in range(8)]
        assert served == ["b"] * 8
        pids = _children(proc.process.pid)
    finally:
        code = proc.stop()
        client.close()
    assert code == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def _age(pid: int) -> float:
    """Seconds since ``pid`` started (from /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        stat = handle.read()
    started = int(stat[stat.rfind(b")") + 2 :].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as handle:
        return float(handle.read().split()[0]) - started


@pytest.mark.timeout(400)  # three waits of 12 s for workers to settle, four starts
def test_a_worker_killed_is_replaced_and_the_gateway_goes_on(
    redis_server: RedisServer, engines: list[FakeEngine]
) -> None:
    """A worker the kernel kills (out of memory) once it has run a while is replaced by
    a new one on the same port; the other worker is untouched; the gateway answers and
    routes by prefix on, and stops cleanly."""
    tag = uuid.uuid4().hex[:8]
    names = [f"gw-a-{tag}", f"gw-b-{tag}"]
    client = redis_server.client()
    prompt = list(range(10, 43))
    cache(client, names[1], prompt)
    proc = _two_workers(redis_server, engines, names)
    seen: set[int] = set()
    try:
        assert proc.process is not None
        parent = proc.process.pid
        wait_until(lambda: len(_children(parent)) == 2, 30, "two workers")
        first = _children(parent)
        seen |= first
        # past the supervisor's RESPAWN_AFTER_S (10 s), with room for a slow fork
        wait_until(lambda: all(_age(pid) > 12.0 for pid in first), 60, "workers settled")
        for victim in sorted(first):  # either one: the first worker's socket too
            _kill_and_serve_on(proc.base, parent, victim, prompt)
            seen |= _children(parent)
        assert len(_children(parent)) == 2
        assert not first & _children(parent)  # both replaced, one after the other
        _every_worker_answers(proc.base, parent)
        served = [complete(proc.base, {"prompt": prompt})["by"] for _ in range(8)]
        assert served == ["b"] * 8
    finally:
        code = proc.stop()
        client.close()
    assert code == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in seen)


def _kill_and_serve_on(base: str, parent: int, victim: int, prompt: list[int]) -> None:
    """Kill ``victim`` as the out-of-memory killer would: once it is gone, every request
    (a new connection each, spread by the kernel) is answered by the other worker while
    the new one starts; then the new one is there."""
    before = _children(parent)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: victim not in _children(parent), 30, "the killed worker gone")
    served = [complete(base, {"prompt": prompt})["by"] for _ in range(8)]
    assert served == ["b"] * 8
    wait_until(lambda: len(_children(parent) - before) == 1, 60, "a new worker")
    new = (_children(parent) - before).pop()
    assert (before - {victim}) <= _children(parent)  # the other untouched
    wait_until(lambda: _age(new) > 12.0, 60, "the new worker settled")
