"""The ``pcr`` command: the fleet simulation and the inspection tools."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry import PrefixCacheRegistry, block_hashes
from registry.cli import build_parser, main
from tests.conftest import new_namespace
from tests.gpu_helpers import wait_until
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--nodes", "3", "--requests", "250", "--kv-blocks", "256", "--mamba-slots", "16"]
RESULT_FIELDS = {
    "router", "nodes", "requests", "seed", "hit_rate_blocks", "usable_hit_rate_blocks",
    "hit_rate_tokens", "totals", "requests_per_node", "latency_ms", "consistency", "mamba",
    "listener", "seconds", "route_fallbacks",
}  # fmt: skip


def run_simulate(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "figures.json"
    assert main(["simulate", *SMALL, "--json", str(out), *extra]) == 0
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def check_runs(figures: dict[str, Any]) -> None:
    runs = {run["router"]: run for run in figures["runs"]}
    assert set(runs) == {"round-robin", "prefix"}
    for run in runs.values():
        assert set(run) == RESULT_FIELDS
        assert run["requests"] == 250
        assert set(run["consistency"].values()) == {0}, run["consistency"]
        assert run["route_fallbacks"] == 0
        assert run["totals"]["unavailable_requests"] == run["totals"]["reclaims"] == 0
        assert run["totals"]["kv_evictions"] > 0  # the pools were under pressure
        assert {"match_kv_prefix", "register_kv", "evict_kv"} <= set(run["latency_ms"])
    # Prefix-aware routing keeps conversations where their prefixes are cached.
    assert runs["prefix"]["hit_rate_tokens"] > runs["round-robin"]["hit_rate_tokens"]
    assert runs["prefix"]["hit_rate_blocks"] > runs["round-robin"]["hit_rate_blocks"]


def test_simulate_on_the_embedded_redis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = run_simulate(tmp_path)
    check_runs(figures)
    table = capsys.readouterr().out
    assert "consistency: leaked mamba slots" in table
    assert "embedded fakeredis" in table


def test_simulate_on_a_real_server(tmp_path: Path, redis_server: RedisServer) -> None:
    check_runs(run_simulate(tmp_path, "--redis-url", redis_server.url))


def test_simulate_on_a_real_cluster(tmp_path: Path, redis_cluster: Any) -> None:
    host, port = redis_cluster.startup_nodes[0]
    figures = run_simulate(tmp_path, "--redis-url", f"redis+cluster://{host}:{port}")
    check_runs(figures)


def test_same_seed_same_figures(tmp_path: Path) -> None:
    first = run_simulate(tmp_path, "--seed", "7")["runs"]
    second = run_simulate(tmp_path, "--seed", "7")["runs"]
    other = run_simulate(tmp_path, "--seed", "8")["runs"]
    keys = ("hit_rate_blocks", "usable_hit_rate_blocks", "hit_rate_tokens", "totals")
    assert [{k: r[k] for k in keys} for r in first] == [{k: r[k] for k in keys} for r in second]
    assert [r["totals"] for r in first] != [r["totals"] for r in other]


def test_serve_port_lets_redis_cli_watch(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["simulate", *SMALL, "--router", "prefix", "--serve-port", str(port)]) == 0


@pytest.fixture
def prepared(redis_server: RedisServer) -> dict[str, Any]:
    """A live owner with two cached prompts and a dead one, under a prefix of their own."""
    prefix = f"cli{new_namespace()[2:10]}"
    client = redis_server.client()
    live = PrefixCacheRegistry(client, "node-live", key_prefix=prefix)
    live.claim(lease_ttl=60)
    tokens = list(range(100, 164))
    hashes = block_hashes(tokens, 16)
    live.register_kv([10, 11, 12, 13], hashes)
    live.register_mamba([12], [hashes[2]])
    dead = PrefixCacheRegistry(client, "node-dead", key_prefix=prefix)
    dead.claim(lease_ttl=0.05)
    dead.register_kv([1], hashes[:1])
    wait_until(lambda: "node-dead" not in _live(client, prefix), what="lease runs out")
    return {
        "url": redis_server.url,
        "prefix": prefix,
        "tokens": tokens,
        "hashes": hashes,
        "client": client,
    }


def _live(client: Any, prefix: str) -> list[str]:
    from registry import live_nodes

    return live_nodes(client, prefix)


def pcr(capsys: pytest.CaptureFixture[str], prepared: dict[str, Any], *args: str) -> Any:
    code = main(
        [*args, "--redis-url", prepared["url"], "--key-prefix", prepared["prefix"], "--json"]
    )
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_stats_shows_each_namespace(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    rows = {r["namespace"]: r for r in pcr(capsys, prepared, "stats")}
    assert set(rows) == {"node-live", "node-dead"}
    live, dead = rows["node-live"], rows["node-dead"]
    assert (live["kv_entries"], live["mamba_entries"], live["state"], live["epoch"]) == (
        4,
        1,
        "live",
        1,
    )
    assert (dead["kv_entries"], dead["state"]) == (1, "dead")
    assert live["memory_bytes"] > 0


def test_inspect_pages_through_the_mappings(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    page = pcr(capsys, prepared, "inspect", "node-live")
    assert sorted(map(tuple, page["entries"])) == sorted(
        zip(prepared["hashes"], [10, 11, 12, 13], strict=True)
    )
    mamba = pcr(capsys, prepared, "inspect", "node-live", "--kind", "mamba")
    assert mamba["entries"] == [[prepared["hashes"][2], 12]]


def test_match_by_hashes_tokens_and_across_nodes(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    hashes = [str(h) for h in prepared["hashes"][:3]]
    one = pcr(capsys, prepared, "match", "--namespace", "node-live", *hashes)
    assert (one["kv_prefix"], one["mamba_prefix"], one["block_ids"]) == (3, 3, [10, 11, 12])
    tokens = [str(t) for t in prepared["tokens"]]
    by_tokens = pcr(capsys, prepared, "match", "--namespace", "node-live", "--tokens", *tokens)
    assert by_tokens["kv_prefix"] == 4
    every = pcr(capsys, prepared, "match", "--tokens", *tokens)
    assert every == [{"namespace": "node-live", "kv_prefix": 4, "mamba_prefix": 3}]  # dead: absent


def test_watch_prints_notices_as_they_arrive(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    registry = PrefixCacheRegistry(prepared["client"], "node-live", key_prefix=prepared["prefix"])
    channel = registry.keys.mamba_evicted_channel

    def evict_when_watched() -> None:
        wait_until(lambda: prepared["client"].pubsub_numsub(channel)[0][1] > 0, what="subscriber")
        registry.evict_kv(prepared["hashes"][2:3])
        registry.register_mamba([11], [prepared["hashes"][1]])
        registry.clear_mamba()

    thread = threading.Thread(target=evict_when_watched)
    thread.start()
    args = ["watch", "node-live", "--count", "2", "--timeout", "20"]
    assert (
        main([*args, "--redis-url", prepared["url"], "--key-prefix", prepared["prefix"], "--json"])
        == 0
    )
    thread.join()
    notices = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(n["kind"], n["pairs"]) for n in notices] == [
        ("cascade", [[12, prepared["hashes"][2]]]),
        ("clear", []),
    ]


def test_gc_removes_only_the_dead(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    assert pcr(capsys, prepared, "gc", "--dry-run") == ["node-dead"]
    assert pcr(capsys, prepared, "gc") == ["node-dead"]
    assert [r["namespace"] for r in pcr(capsys, prepared, "stats")] == ["node-live"]


def run_pcr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "registry", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--nodes", "zero"], "invalid positive integer"),
        (["simulate", "--router", "random"], "invalid choice"),
        (["stats", "--bogus"], "unrecognized arguments"),
        (["frobnicate"], "invalid choice"),
        (["stats", "--redis-url", "redis://127.0.0.1:1/0"], "cannot reach Redis at 127.0.0.1:1"),
        (["stats", "--redis-url", "http://user:hunter2@host/"], "unsupported Redis URL scheme"),
        (["match", "--redis-url", "redis://127.0.0.1:1/0"], "give block hashes"),
        (["inspect", "bad{name", "--redis-url", "redis://127.0.0.1:1/0"], "must not contain"),
        (["match", "1", "--namespace", "a b", "--redis-url", "redis://127.0.0.1:1/0"], "namespace"),
    ],
)
def test_errors_are_one_clear_line(args: list[str], message: str) -> None:
    done = run_pcr(*args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stderr


def test_redis_url_from_the_environment(redis_server: RedisServer) -> None:
    import os

    done = run_pcr("gc", "--dry-run", env={**os.environ, "REDIS_URL": redis_server.url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would remove")


def test_every_command_has_help() -> None:
    for command in ["simulate", "stats", "inspect", "match", "watch", "gc"]:
        done = run_pcr(command, "--help")
        assert done.returncode == 0
        assert "--redis-url" in done.stdout


def test_compose_commands_exist() -> None:
    """Every pcr command and flag docker-compose.yml runs is one the parser accepts."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    parser = build_parser()
    checked = 0
    for name, service in compose["services"].items():
        command = service.get("command")
        words = command if isinstance(command, list) else shlex.split(command or "")
        if words[:1] != ["pcr"]:
            continue
        parser.parse_args(words[1:])  # exits (SystemExit) on an unknown command or flag
        checked += 1
        assert "build" in service, name
    assert checked == 2
    assert {"redis", "simulate", "redis-cluster-init"} <= set(compose["services"])
    cluster_nodes = [
        s for s in compose["services"].values() if "redis-cluster" in s.get("profiles", [])
    ]
    assert len(cluster_nodes) == 8  # six nodes, the init job, the cluster simulation


def test_quickstart_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Mamba cascade fired callback [[3, 5]]" in done.stdout
