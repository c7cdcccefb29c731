"""``pcr simulate --bridge``: the fleet's nodes publish engine KV events instead of
writing the registry, one ``pcr bridge`` follows them into their namespaces, and the
audit (each node's cached blocks against its bridged namespace) reads 0.

No test waits on a clock: the run itself waits until the bridge has applied every
batch (each namespace's ``bridge_seq``), and the leases are long enough or irrelevant
(writes are fenced by epoch, not by lease)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from pcr.cli.main import main
from registry import PrefixCacheRegistry
from sim import FleetConfig, WorkloadConfig, simulate
from sim.config import BridgeConfig
from tests.support import REPO_ROOT
from tests.support.servers import RedisServer

SMALL = ["--nodes", "3", "--requests", "120", "--kv-blocks", "256", "--mamba-slots", "16"]
CONFIG = FleetConfig(
    nodes=3, kv_blocks=256, mamba_slots=16, workload=WorkloadConfig(requests=120, seed=0)
)
SKIPPED = ("orphans", "keyed_blocks", "other_medium", "other_groups", "block_size_mismatch")


def check_bridged(run: dict[str, Any]) -> None:
    """Consistent, and every block really went through the bridge."""
    assert set(run["consistency"].values()) == {0}, run["consistency"]
    bridge = run["bridge"]
    assert bridge["batches_published"] > 0
    assert bridge["batches"] == bridge["batches_published"]  # each applied once
    assert bridge["blocks_stored"] > 0
    assert bridge["blocks_removed"] == run["totals"]["kv_evictions"] > 0
    for key in ("bad_messages", "unknown_removals", "restarts", "redis_errors", *SKIPPED):
        assert bridge[key] == 0, (key, bridge)
    namespaces = run["namespaces"]
    assert len(namespaces) == run["nodes"]
    assert all(ns["kv_entries"] > 0 for ns in namespaces.values()), namespaces
    listed = sum(ns["kv_entries"] for ns in namespaces.values())
    assert bridge["blocks_stored"] - bridge["blocks_removed"] == listed
    assert sum(ns["mamba_entries"] for ns in namespaces.values()) == run["mamba"]["in_use"] > 0
    assert "publish KV events (one batch)" in run["latency_ms"]
    assert not {"match_kv_prefix", "register_kv", "evict_kv"} & set(run["latency_ms"])


def run_cli(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "figures.json"
    assert main(["simulate", "--bridge", *SMALL, "--json", str(out), *extra]) == 0
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def test_the_bridged_fleet_on_the_embedded_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = run_cli(tmp_path)
    runs = {run["router"]: run for run in figures["runs"]}
    assert set(runs) == {"round-robin", "prefix"}
    for run in runs.values():
        check_bridged(run)
        assert run["bridge"]["batches_dropped"] == run["bridge"]["gaps"] == 0
    assert figures["bridge"]["drop_every"] == 0
    table = capsys.readouterr().out
    assert "embedded fakeredis, fed through pcr bridge" in table
    assert "consistency: blocks missing from registry" in table
    assert "bridge: blocks stored / removed" in table


def test_lost_batches_are_replayed_and_only_the_bridge_writes() -> None:
    client = fakeredis.FakeRedis()
    # A short lease: a lost last batch is found by the bridge's probe of the quiet
    # engine after a third of it (writes are fenced by epoch, so a lapse changes nothing).
    bridge = BridgeConfig(drop_every=7, lease_ttl=1.5)
    run = simulate(client, CONFIG, "prefix", bridge=bridge)
    check_bridged(run)
    assert run["bridge"]["batches_dropped"] > 0
    assert run["bridge"]["gaps"] > 0
    # Every namespace the run wrote is a bridged one: the nodes never wrote Redis.
    metas = sorted(k.decode() for k in client.scan_iter("pcr:{*}:meta"))
    assert metas == [f"pcr:{{sim-prefix-engine-{i}}}:meta" for i in range(CONFIG.nodes)]
    for i in range(CONFIG.nodes):
        registry = PrefixCacheRegistry(client, f"sim-prefix-engine-{i}")
        info = registry.info()
        assert info.bridge_engine == "vllm"
        assert info.bridge_block_size == CONFIG.block_size
        assert info.bridge_seq is not None
        # A block's checkpoint leaves with it: the bridge keeps no engine hash of a
        # block the engine dropped.
        assert client.hlen(registry.keys.engine_blocks) == info.kv_entries > 0


@pytest.mark.parametrize("frames", [3, 4], ids=["vllm<=0.25 replies", "vllm>=0.26 replies"])
def test_engines_that_store_blocks_twice_as_vllm_does(frames: int) -> None:
    """Prompts sent again (retries, regenerations) make the engines store a fully cached
    prompt's last block a second time, as vLLM does; with batches lost and replayed in
    either reply form, every engine's cache still equals its namespace. In lockstep, so a
    prompt sent again is routed to the node that holds it (without it, whether the bridge
    applied the first copy before the resend is routed is a race, and no copy may form)."""
    config = FleetConfig(
        nodes=3,
        kv_blocks=256,
        mamba_slots=16,
        workload=WorkloadConfig(requests=120, seed=0, resend=0.3),
    )
    bridge = BridgeConfig(
        drop_every=7, lease_ttl=1.5, duplicate_blocks=True, replay_frames=frames, lockstep=True
    )
    run = simulate(fakeredis.FakeRedis(), config, "prefix", bridge=bridge)
    assert set(run["consistency"].values()) == {0}, run["consistency"]
    counts = run["bridge"]
    assert counts["copies_stored"] >= 1
    assert counts["gaps"] > 0
    assert counts["replays"] > 0
    assert (counts["unknown_removals"], counts["replay_failures"], counts["restarts"]) == (0, 0, 0)
    # A copy's removal unlists nothing: more evictions than unlisted blocks.
    assert counts["blocks_removed"] < run["totals"]["kv_evictions"]


def test_lockstep_routing_gives_the_direct_modes_figures() -> None:
    """With the router waiting for the bridge, the bridged namespaces (own hashes from
    the events' token ids, block ids as positions) route exactly as the registry the
    nodes write themselves."""
    direct = simulate(fakeredis.FakeRedis(), CONFIG, "prefix")
    bridged = simulate(
        fakeredis.FakeRedis(),
        CONFIG,
        "prefix",
        bridge=BridgeConfig(lockstep=True, lease_ttl=3600.0),  # never lapses mid-run
    )
    check_bridged(bridged)
    for key in ("hit_rate_blocks", "usable_hit_rate_blocks", "hit_rate_tokens", "totals"):
        assert bridged[key] == direct[key], key
    assert list(bridged["requests_per_node"].values()) == list(direct["requests_per_node"].values())
    assert bridged["totals"]["mamba_restores"] > 0


def test_the_bridged_fleet_on_a_real_server(tmp_path: Path, redis_server: RedisServer) -> None:
    figures = run_cli(tmp_path, "--redis-url", redis_server.url, "--router", "prefix")
    (run,) = figures["runs"]
    check_bridged(run)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--bridge-drop-every", "3"], "only with --bridge"),
        (["--bridge-lockstep"], "only with --bridge"),
        (["--bridge", "--bridge-drop-every", "1"], "give 2 or more"),
    ],
)
def test_bridge_options_usage_errors(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["simulate", *SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert len(err.strip().splitlines()) == 1


NO_BRIDGE_EXTRA = """
import sys
sys.modules["zmq"] = None  # as if pyzmq and msgpack were not installed
sys.modules["msgpack"] = None
from pcr.cli.main import main
code = main(["simulate", "--nodes", "2", "--requests", "20", "--router", "prefix", *sys.argv[1:]])
assert "zmq" not in [m for m, v in sys.modules.items() if v is not None], "zmq was imported"
sys.exit(code)
"""


def test_plain_simulate_needs_no_bridge_extra() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", NO_BRIDGE_EXTRA, *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=100,
            check=False,
        )

    plain = run()
    assert plain.returncode == 0, plain.stderr
    assert "consistency: leaked mamba slots" in plain.stdout
    bridged = run("--bridge")
    assert bridged.returncode == 1, bridged.stderr
    assert "needs the bridge extra" in bridged.stderr
    assert "prefix-cache-registry[bridge]" in bridged.stderr
