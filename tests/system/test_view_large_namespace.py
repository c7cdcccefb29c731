"""A fleet view loads a namespace of 1.1 million entries once, in pages, and then
follows it (issue 43: two views re-snapshotted such a namespace every few seconds for
minutes: one ``fleet_snapshot`` script read it for longer than the client's read
timeout, the load failed, and the view started over, each try holding Redis for
seconds). On a real redis-server: the view holds exactly the map, loads it once, a
``PING`` meanwhile never waits a second, and a write after the load reaches the view
as a record, without another load."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from registry import PrefixCacheRegistry
from registry.fleet.snapshots import PAGED_ABOVE
from registry.fleet.view import FleetView
from tests.support.servers import RedisServer

ENTRIES = 1_100_000
FILL_BATCH = 10_000
PINGER = """
import signal, sys, time, redis
client, slowest = redis.Redis.from_url(sys.argv[1], socket_timeout=60), [0.0]
def done(*_):
    print(slowest[0], flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
client.ping()
print("ready", flush=True)
while True:
    start = time.monotonic()
    client.ping()
    slowest[0] = max(slowest[0], time.monotonic() - start)
    time.sleep(0.05)
"""


@pytest.mark.timeout(600)
def test_a_large_namespace_is_loaded_once_in_pages(own_server: RedisServer) -> None:
    client = own_server.client(socket_timeout=60)
    registry = PrefixCacheRegistry(client, "large")
    registry.claim(600.0)
    small = PrefixCacheRegistry(client, "small")
    small.claim(600.0)
    small.register_kv([0, 1], [11, 12])
    pipe = client.pipeline(transaction=False)
    for first in range(1, ENTRIES + 1, FILL_BATCH):  # the map as a bridge would leave it
        fields = {h: h % 4096 for h in range(first, min(first + FILL_BATCH, ENTRIES + 1))}
        pipe.hset(registry.keys.kv, mapping=fields)
        pipe.execute()
    assert client.hlen(registry.keys.kv) == ENTRIES > PAGED_ABOVE

    # PING from a process of its own: the view's thread holds this process's GIL while
    # it turns a million hashes into ints, which says nothing about Redis.
    pinger = subprocess.Popen(
        [sys.executable, "-c", PINGER, own_server.url], stdout=subprocess.PIPE, text=True
    )
    assert pinger.stdout is not None
    assert pinger.stdout.readline().strip() == "ready"
    view = FleetView(client)
    try:
        view.start(timeout=300)
        view.sync(["large", "small"], timeout=300)
        held = view.held("large")
        assert held is not None
        assert len(held[0]) == ENTRIES
        assert held[1] == frozenset()
        assert view.held("small") == (frozenset({11, 12}), frozenset())
        loads, paged = view.counts.loads, view.counts.paged_loads
        assert paged == 1
        registry.register_kv([0], [ENTRIES + 7])  # a record, applied as one
        view.sync(["large"], timeout=60)
        held = view.held("large")
        assert held is not None
        assert ENTRIES + 7 in held[0]
        time.sleep(5)  # a window to count loads in, not a synchronisation
        assert (view.counts.loads, view.counts.paged_loads, view.counts.errors) == (
            loads,
            paged,
            0,
        )
    finally:
        view.close()
        pinger.send_signal(signal.SIGTERM)
        out, _ = pinger.communicate(timeout=60)
        client.close()
    slowest = float(out.split()[-1])
    assert slowest < 1.0, f"a PING waited {slowest:.2f} s while the view loaded"
