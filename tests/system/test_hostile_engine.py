"""One hostile engine cannot hurt the others (issue 43): a single ``BlockStored`` of a
million blocks, fed through ``pcr bridge`` (a process of its own, as operators run it)
into a real redis-server beside two healthy engines.

While it is written (in parts of at most ``MAX_BLOCKS_PER_WRITE`` blocks) or refused
(``--max-event-blocks``, ``--max-message-bytes``): the healthy namespaces stay live in
the node index at every sample, no client ever gets ``BUSY``, a ``PING`` never waits a
second, and a fleet view following the prefix does not load any namespace again. The
bounds are generous on purpose (CI runs this beside CPU burners): a lease of 20 s, a
second for a PING, where the fault they catch took 20-75 s.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from registry import NodeIndex
from registry.fleet.view import FleetView
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from sim.engine_events import EnginePublisher, batch, stored  # noqa: E402  (the bridge extra)

REPO_ROOT = Path(__file__).resolve().parents[2]
BS = 1  # one token per block: a million-block event is 12 MB, not 54
HUGE = 1_000_000
HEALTHY = ("healthy-a", "healthy-b")
HOSTILE = "hostile"
LEASE_TTL = 20.0
PING_BOUND = 1.0


@dataclass
class Samples:
    """What the samplers saw while the hostile event was handled."""

    rounds: int = 0
    not_live: list[tuple[float, list[str]]] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    slowest_ping: float = 0.0


class Fleet:
    """Two healthy engines and a hostile one, each publishing; ``pcr bridge`` following
    the three; samplers of the node index and PING; a fleet view."""

    def __init__(self, server: RedisServer, tmp: Path) -> None:
        self.server = server
        self.client = server.client(socket_timeout=30)
        self.engines = {name: EnginePublisher() for name in (*HEALTHY, HOSTILE)}
        self.tmp = tmp
        self.process: subprocess.Popen[bytes] | None = None
        self.samples = Samples()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.view: FleetView | None = None

    def start_bridge(self, *extra: str) -> None:
        command = [sys.executable, "-m", "pcr", "bridge", "--redis-url", self.server.url]
        for name, engine in self.engines.items():
            assert engine.replay_endpoint is not None
            command += ["--endpoint", engine.endpoint, "--namespace", name]
            command += ["--replay-endpoint", engine.replay_endpoint]
        command += ["--block-size", str(BS), "--lease-ttl", str(LEASE_TTL), "--json"]
        command += ["--stats-interval", "0", *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with (
            (self.tmp / "bridge.out").open("wb") as out,
            (self.tmp / "bridge.err").open("wb") as err,
        ):
            self.process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        for engine in self.engines.values():
            engine.wait_subscribed(60)
        index = NodeIndex(self.client)
        wait_until(lambda: set(index.live()) >= {*HEALTHY, HOSTILE}, 60, "the bridge's leases")
        for name in HEALTHY:  # each healthy engine holds a prompt already
            self.publish_small(name, 0)
        self.view = FleetView(self.client).start(60)
        self.view.sync(list(self.engines), timeout=60)

    def publish_small(self, name: str, step: int) -> int:
        rng = random.Random(f"{name}-{step}")
        hashes = [rng.getrandbits(63) for _ in range(4)]
        tokens = [rng.randrange(1, 50_000) for _ in range(4 * BS)]
        return self.engines[name].publish([stored(hashes, None, tokens, BS)])

    def sample(self) -> None:
        """Sample the node index and PING, and keep the healthy engines talking, until
        ``stop_sampling``."""
        self._threads = [
            threading.Thread(target=self._sample_leases, daemon=True),
            threading.Thread(target=self._sample_ping, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop_sampling(self) -> Samples:
        wait_until(lambda: self.samples.rounds >= 8, 60, "a few rounds of samples")
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        return self.samples

    def _sample_leases(self) -> None:
        client = self.server.client(socket_timeout=30)
        index = NodeIndex(client)
        step = 1
        try:
            while not self._stop.wait(0.25):
                live = index.live()
                missing = [n for n in HEALTHY if n not in live]
                if missing:
                    self.samples.not_live.append((time.time(), missing))
                self.samples.rounds += 1
                if self.samples.rounds % 4 == 0:  # the healthy engines keep publishing
                    for name in HEALTHY:
                        self.publish_small(name, step)
                    step += 1
        finally:
            client.close()

    def _sample_ping(self) -> None:
        client = self.server.client(socket_timeout=30)
        try:
            while not self._stop.wait(0.05):
                start = time.monotonic()
                try:
                    client.ping()
                except redis.ResponseError as exc:
                    self.samples.busy.append(str(exc))
                    continue
                took = time.monotonic() - start
                self.samples.slowest_ping = max(self.samples.slowest_ping, took)
        finally:
            client.close()

    def counts(self) -> dict[str, dict[str, Any]]:
        """Stop the bridge (SIGTERM) and read each engine's counts from its last lines."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(60) == 0, (self.tmp / "bridge.err").read_text()[-3000:]
        lines = (self.tmp / "bridge.out").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.startswith("{")]
        return {row["namespace"]: row for row in rows}

    def close(self) -> None:
        self._stop.set()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        if self.view is not None:
            self.view.close()
        for engine in self.engines.values():
            engine.close()
        self.client.close()


@pytest.fixture
def fleet(own_server: RedisServer, tmp_path: Path) -> Iterator[Fleet]:
    made = Fleet(own_server, tmp_path)
    try:
        yield made
    finally:
        made.close()


def huge_event(first_token: int = 1) -> bytes:
    """One BlockStored of a million one-token blocks (12 MB of msgpack)."""
    rng = random.Random(43)
    hashes = [rng.getrandbits(63) for _ in range(HUGE)]
    tokens = [(first_token + i) % 50_000 for i in range(HUGE * BS)]
    return batch([stored(hashes, None, tokens, BS)])


def assert_healthy(fleet: Fleet, samples: Samples) -> None:
    assert samples.rounds >= 8, samples
    assert samples.not_live == [], f"healthy leases ran out: {samples.not_live[:5]}"
    assert samples.busy == [], samples.busy[:3]
    assert samples.slowest_ping < PING_BOUND, f"a PING waited {samples.slowest_ping:.2f} s"


def hlen(fleet: Fleet, name: str) -> int:
    return int(fleet.client.hlen(f"pcr:{{{name}}}:kv"))


@pytest.mark.timeout(600)
def test_a_million_block_event_is_written_in_parts_while_the_others_keep_going(
    fleet: Fleet,
) -> None:
    payload = huge_event()
    fleet.start_bridge("--max-event-blocks", "2000000")
    assert fleet.view is not None
    fleet.sample()
    fleet.engines[HOSTILE].publish_raw(payload)
    # Wait until parts are being written, then watch the view for a while: it follows
    # the parts' records without loading anything again.
    wait_until(lambda: hlen(fleet, HOSTILE) >= 20_000, 300, "the first parts written")
    loads = fleet.view.counts.loads
    gaps = fleet.view.counts.gaps
    written = hlen(fleet, HOSTILE)
    meta = fleet.client.hgetall(f"pcr:{{{HOSTILE}}}:meta")
    time.sleep(5)  # a window to count the view's loads in, not a synchronisation
    assert (fleet.view.counts.loads, fleet.view.counts.gaps) == (loads, gaps)
    assert hlen(fleet, HOSTILE) > written  # still writing, part after part
    samples = fleet.stop_sampling()
    assert_healthy(fleet, samples)
    if hlen(fleet, HOSTILE) < HUGE:  # inside the batch: its seq and its blocks so far
        assert meta[b"bridge_seq"] == b"0", meta
        assert int(meta[b"bridge_part"]) >= 20_000, meta
    counts = fleet.counts()
    hostile = counts[HOSTILE]
    assert hostile["split_batches"] == 1
    assert hostile["writes"] >= 20_000 // 256
    assert hostile["refused_events"] == 0
    for name in HEALTHY:
        assert counts[name]["batches"] >= 3, counts[name]
        assert counts[name]["restarts"] == 0, counts[name]


@pytest.mark.timeout(300)
def test_an_event_over_max_event_blocks_is_refused_undecoded(fleet: Fleet) -> None:
    payload = huge_event()
    fleet.start_bridge()  # the default --max-event-blocks: 262,144
    fleet.sample()
    fleet.engines[HOSTILE].publish_raw(payload)
    seq = fleet.publish_small(HOSTILE, 1)  # the next batch is applied: no gap, no restart
    wait_until(
        lambda: fleet.client.hget(f"pcr:{{{HOSTILE}}}:meta", "bridge_seq") == str(seq).encode(),
        120,
        "the hostile engine's next batch",
    )
    samples = fleet.stop_sampling()
    assert_healthy(fleet, samples)
    assert hlen(fleet, HOSTILE) == 4
    counts = fleet.counts()
    hostile = counts[HOSTILE]
    assert (hostile["refused_events"], hostile["refused_blocks"]) == (1, HUGE)
    assert (hostile["gaps"], hostile["restarts"], hostile["batches"]) == (0, 0, 2)
    err = (fleet.tmp / "bridge.err").read_text()
    assert f"{HOSTILE} <-" in err
    assert "refused" in err
    assert "--max-event-blocks" in err


@pytest.mark.timeout(300)
def test_a_message_over_max_message_bytes_never_reaches_the_bridge(fleet: Fleet) -> None:
    payload = huge_event()
    fleet.start_bridge("--max-message-bytes", "1M", "--max-event-blocks", "2000000")
    fleet.sample()
    fleet.engines[HOSTILE].publish_raw(payload)
    seq = fleet.publish_small(HOSTILE, 1)
    # ZeroMQ drops the connection that carried it; once the bridge is connected again
    # the engine's next batch shows the gap, which no replay can fill (the replay holds
    # the same message): the namespace restarts and takes the batches after it.
    deadline = time.monotonic() + 120
    while int(fleet.client.hget(f"pcr:{{{HOSTILE}}}:meta", "bridge_seq") or -1) < seq:
        assert time.monotonic() < deadline, "the hostile engine's batches never came through"
        time.sleep(0.5)
        seq = fleet.publish_small(HOSTILE, seq + 1)
    samples = fleet.stop_sampling()
    assert_healthy(fleet, samples)
    assert hlen(fleet, HOSTILE) < 1_000  # never a block of the million
    counts = fleet.counts()
    assert counts[HOSTILE]["refused_events"] == 0
    assert counts[HOSTILE]["disconnects"] >= 1
    for name in HEALTHY:
        assert counts[name]["restarts"] == 0, counts[name]
