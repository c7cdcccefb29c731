"""The ``pcr`` command: the fleet simulation and the inspection tools."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from pcr.cli.main import build_parser, main
from registry import PrefixCacheRegistry, block_hashes
from tests.support import REPO_ROOT
from tests.support.backends import new_namespace
from tests.support.servers import RedisServer, free_port, require_redis_server
from tests.support.waiting import wait_until

ROOT = REPO_ROOT
SMALL = ["--nodes", "3", "--requests", "120", "--kv-blocks", "256", "--mamba-slots", "16"]
RESULT_FIELDS = {
    "router", "nodes", "requests", "seed", "hit_rate_blocks", "usable_hit_rate_blocks",
    "hit_rate_tokens", "totals", "requests_per_node", "latency_ms", "consistency", "mamba",
    "listener", "seconds", "route_fallbacks", "registry_us_per_request",
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
        assert run["requests"] == 120
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


def test_simulate_a_fleet_of_more_nodes_than_the_connection_cap(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """150 nodes on a real server: more pub/sub connections (one per node's listener) than
    redis-py's default cap of 100, and routing from the fleet index over all of them."""
    out = tmp_path / "fleet.json"
    args = ["--nodes", "150", "--requests", "150", "--router", "prefix", "--kv-blocks", "64"]
    assert main(["simulate", *args, "--redis-url", redis_server.url, "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["requests"] == 150
    assert set(run["consistency"].values()) == {0}, run["consistency"]
    assert run["route_fallbacks"] == 0
    assert run["totals"]["unavailable_requests"] == 0


def test_same_seed_same_figures(tmp_path: Path) -> None:
    one_router = ("--router", "prefix", "--requests", "60", "--nodes", "2")  # later win
    first = run_simulate(tmp_path, "--seed", "7", *one_router)["runs"]
    second = run_simulate(tmp_path, "--seed", "7", *one_router)["runs"]
    other = run_simulate(tmp_path, "--seed", "8", *one_router)["runs"]
    keys = ("hit_rate_blocks", "usable_hit_rate_blocks", "hit_rate_tokens", "totals")
    assert [{k: r[k] for k in keys} for r in first] == [{k: r[k] for k in keys} for r in second]
    assert [r["totals"] for r in first] != [r["totals"] for r in other]


def test_serve_port_lets_redis_cli_watch(tmp_path: Path) -> None:
    port = free_port()
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
    assert (live["kv_entries"], live["mamba_entries"], live["state"]) == (4, 1, "live")
    assert live["epoch"] > 0
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


INVALID_MEMBERS = {"bad name": 1, "": 2, "x{y}": 3, b"\xff\xfe": 4, "tab\there": 5}


def test_stats_lists_invalid_index_members_and_gc_removes_them(
    capsys: pytest.CaptureFixture[str], prepared: dict[str, Any]
) -> None:
    from registry import NodeIndex

    client, prefix = prepared["client"], prepared["prefix"]
    client.zadd(f"{prefix}:nodes", INVALID_MEMBERS)
    invalid = NodeIndex(client, prefix).invalid()
    assert len(invalid) == len(INVALID_MEMBERS)

    rows = pcr(capsys, prepared, "stats")  # never fails because of them
    assert {r["namespace"]: r["state"] for r in rows} == {
        "node-live": "live",
        "node-dead": "dead",
        **dict.fromkeys(invalid, "invalid"),
    }
    assert capsys.readouterr().err == ""  # listed, not warned about
    code = main(["stats", "--redis-url", prepared["url"], "--key-prefix", prefix])
    table = capsys.readouterr().out
    assert code == 0
    assert "'bad name'" in table
    assert "''" in table
    assert len([line for line in table.splitlines() if "invalid" in line]) == len(invalid)

    code = main(["match", "1", "--redis-url", prepared["url"], "--key-prefix", prefix])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert all(": WARNING: " in line for line in err.splitlines()), err

    assert sorted(pcr(capsys, prepared, "gc", "--dry-run")) == sorted(["node-dead", *invalid])
    assert NodeIndex(client, prefix).invalid() == invalid  # a dry run changes nothing
    code = main(["gc", "--redis-url", prepared["url"], "--key-prefix", prefix])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "removed 1: node-dead",
        f"removed {len(invalid)} invalid node-index members: "
        + " ".join(f"'{m}'" for m in invalid).replace("\t", "\\t"),
    ]
    assert NodeIndex(client, prefix).invalid() == []
    assert [r["namespace"] for r in pcr(capsys, prepared, "stats")] == ["node-live"]


@pytest.mark.redis_server
def test_stats_warns_about_a_policy_that_evicts_registry_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_redis_server()
    with RedisServer() as server:
        admin = server.client()
        try:
            PrefixCacheRegistry(admin, "node-0").claim(lease_ttl=60)
            for policy, warned in [
                ("allkeys-lru", True),
                ("allkeys-lfu", True),
                ("allkeys-random", True),
                ("volatile-lru", False),
                ("volatile-ttl", False),
                ("noeviction", False),
            ]:
                admin.config_set("maxmemory-policy", policy)
                code = main(["stats", "--redis-url", server.url, "--json"])
                out, err = capsys.readouterr()
                assert code == 0, err
                assert [r["namespace"] for r in json.loads(out)] == ["node-0"]  # stdout: JSON
                if warned:
                    assert err.splitlines() == [
                        f"pcr stats: WARNING: maxmemory-policy is {policy}: Redis may evict "
                        "registry keys when it is full; use noeviction (or a volatile-* policy)"
                    ]
                else:
                    assert err == "", policy
            # A user that may not run CONFIG: no warning, no failure.
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.acl_setuser(
                "noconfig",
                enabled=True,
                passwords=["+noconfig-pw"],
                keys=["*"],
                channels=["*"],
                commands=["+@all", "-config"],
            )
            url = f"redis://noconfig:noconfig-pw@127.0.0.1:{server.port}/0"
            assert main(["stats", "--redis-url", url]) == 0
            assert capsys.readouterr().err == ""
        finally:
            admin.close()


def test_stats_on_fakeredis_skips_the_policy_check(capsys: pytest.CaptureFixture[str]) -> None:
    import fakeredis

    tcp = fakeredis.TcpFakeServer(("127.0.0.1", 0))
    thread = threading.Thread(target=tcp.serve_forever)
    thread.start()
    try:
        port = tcp.server_address[1]
        code = main(["stats", "--redis-url", f"redis://127.0.0.1:{port}/0"])
        out, err = capsys.readouterr()
    finally:
        tcp.shutdown()
        tcp.server_close()
        thread.join()
    assert (code, err) == (0, "")
    assert out.startswith("no namespaces")


def test_stats_checks_the_policy_of_every_cluster_primary(
    capsys: pytest.CaptureFixture[str], redis_cluster: Any
) -> None:
    host, port = redis_cluster.startup_nodes[0]
    url = f"redis+cluster://{host}:{port}"
    assert main(["stats", "--redis-url", url, "--key-prefix", "policy-check"]) == 0
    assert capsys.readouterr().err == ""
    last = redis_cluster.nodes[2].client()  # a primary: 3 masters, no replicas
    try:
        last.config_set("maxmemory-policy", "allkeys-random")
        assert main(["stats", "--redis-url", url, "--key-prefix", "policy-check"]) == 0
        err = capsys.readouterr().err
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        last.close()
    assert err.startswith("pcr stats: WARNING: maxmemory-policy is allkeys-random"), err


def test_a_redis_url_to_a_cluster_node_says_use_redis_cluster(
    capsys: pytest.CaptureFixture[str], redis_cluster: Any
) -> None:
    host, port = redis_cluster.startup_nodes[0]
    client = redis_cluster.client()
    try:
        # A key prefix whose node index lives on another node than the one in the URL.
        owner = client.get_node_from_key
        prefix = next(f"moved{i}" for i in range(1000) if owner(f"moved{i}:nodes").port != port)
    finally:
        client.close()
    code = main(["stats", "--redis-url", f"redis://{host}:{port}/0", "--key-prefix", prefix])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert "use redis+cluster://" in err


def run_pcr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pcr", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["simulate", "--nodes", "zero"], "invalid positive integer", 2),
        (["simulate", "--router", "random"], "invalid choice", 2),
        (["stats", "--bogus"], "unrecognized arguments", 2),
        (["frobnicate"], "invalid choice", 2),
        (["stats", "--redis-url", "redis://127.0.0.1:1/0"], "cannot reach Redis at 127.0.0.1:1", 1),
        (["stats", "--redis-url", "http://user:hunter2@host/"], "unsupported Redis URL scheme", 2),
        (["match", "--redis-url", "redis://127.0.0.1:1/0"], "give block hashes", 2),
        (["inspect", "bad{name", "--redis-url", "redis://127.0.0.1:1/0"], "must not contain", 2),
        (
            ["match", "1", "--namespace", "a b", "--redis-url", "redis://127.0.0.1:1/0"],
            "namespace",
            2,
        ),
    ],
)
def test_errors_are_one_clear_line(args: list[str], message: str, code: int) -> None:
    done = run_pcr(*args)
    assert done.returncode == code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]
    assert lines[0].startswith(f"pcr {args[0]}: error: " if args[0] != "frobnicate" else "pcr: ")
    assert ": error: " in lines[0]
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stderr


def test_redis_url_from_the_environment(redis_server: RedisServer) -> None:
    import os

    done = run_pcr("gc", "--dry-run", env={**os.environ, "REDIS_URL": redis_server.url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("would remove")


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ["simulate", "stats", "inspect", "match", "watch", "gc", "bench"]:
        assert main([command, "--help"]) == 0  # in-process: a subprocess proves no more
        assert "--redis-url" in capsys.readouterr().out
    done = run_pcr("stats", "--help")  # and once through the installed entry point
    assert done.returncode == 0
    assert "--redis-url" in done.stdout


def test_watch_help_gives_the_count_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "stop after this many notices (1 to 2,147,483,647)" in text
    assert main(["watch", "x", "--count", "2147483648"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "[1, 2147483647]" in error


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
    assert checked == 5  # setup, simulate, serve, gateway, simulate-cluster
    assert {"redis", "simulate", "serve", "gateway", "redis-cluster-init"} <= set(
        compose["services"]
    )
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


def _seq(found: re.Match[str]) -> str:
    """What the shell makes of ``$(seq A B)``."""
    return " ".join(map(str, range(int(found[1]), int(found[2]) + 1)))


def documented_pages() -> list[Path]:
    """README.md and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_text(page: Path) -> str:
    """A page as the site shows it: files it includes (``--8<-- "FILE"``) put in."""
    return re.sub(
        r'^--8<-- "([^"]+)"$',
        lambda found: (ROOT / found[1]).read_text(),
        page.read_text(),
        flags=re.MULTILINE,
    )


def documented_commands() -> list[list[str]]:
    """Every ``pcr ...`` command line in the code blocks of README.md and of every
    ``docs/**/*.md`` page (continuations joined)."""
    commands: list[list[str]] = []
    for page in documented_pages():
        for block in page_text(page).split("```")[1::2]:
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                line = re.sub(r"\$\(seq (\d+) (\d+)\)", _seq, line.strip().removeprefix("$ "))
                words = shlex.split(line, comments=True) if line.startswith("pcr ") else []
                if words and not words[1].endswith(":"):  # not a report's first line
                    commands.append(words)
    return commands


def test_every_pcr_command_in_the_docs_parses() -> None:
    commands = documented_commands()
    assert any(words[1] == "bridge" for words in commands)
    assert {"bridge", "gateway", "serve", "stats", "gc"} <= {words[1] for words in commands}
    parser = build_parser()
    for words in commands:
        parser.parse_args(words[1:])  # exits (SystemExit) on an unknown command or flag


README_MAX_LINES = 250


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_relative_link_in_the_readme_exists() -> None:
    text = (ROOT / "README.md").read_text()
    prose = "".join(text.split("```")[0::2])  # code blocks left out
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert relative, "no relative link found"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
