"""``pcr bench``: run the benchmarks against a server of its own or ``--redis-url``."""

from __future__ import annotations

import argparse
from typing import Any

from pcr.bench.servers import RedisClusterServers, RedisServer

# -- bench ----------------------------------------------------------------------------
from pcr.cli import common
from pcr.cli.common import (
    CommandError,
    UsageError,
    check_writable,
    shown_url,
    talking,
    url_scheme,
    write_json,
)
from registry.transport.client import CLUSTER_SCHEMES, client_from_url

BENCH_SCHEMES = ("redis", "rediss", "unix")


def command_bench(args: argparse.Namespace) -> int:
    check_writable(args.json)
    if args.best_case and not args.fleet:
        raise UsageError("argument --best-case: only with --fleet")
    if args.fleet:
        return _command_bench_fleet(args)
    if args.durability:
        return _command_bench_durability(args)
    from pcr.bench import run as bench

    if args.redis_url:
        if url_scheme(args.redis_url) not in BENCH_SCHEMES:
            raise UsageError(
                "argument --redis-url: pcr bench measures one standalone server: "
                "give a redis://, rediss:// or unix:// URL"
            )
        with common.connect(args):
            pass
        with talking(f"Redis at {shown_url(args.redis_url)}"):
            report = bench.run(args.redis_url, quick=args.quick, sizes=args.sizes)
    else:
        try:
            with RedisServer() as server:
                print(
                    f"pcr bench: a redis-server of its own on 127.0.0.1:{server.port}", flush=True
                )
                with talking(f"Redis at 127.0.0.1:{server.port}"):
                    report = bench.run(server.url, quick=args.quick, sizes=args.sizes)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    print(bench.format_report(report))
    if args.json:
        write_json(args.json, report)
    return 0


def _command_bench_durability(args: argparse.Namespace) -> int:
    """``pcr bench --durability``: a write and a confirmed read, with and without
    ``wait_replicas=1``."""
    from pcr.bench import durability

    if args.redis_url:
        raise UsageError("argument --durability: runs on servers of its own, not --redis-url")
    try:
        report = durability.run(quick=args.quick)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    print(durability.format_report(report))
    if args.json:
        write_json(args.json, report)
    return 0


def _command_bench_fleet(args: argparse.Namespace) -> int:
    """``pcr bench --fleet`` (alias ``--view``): one routing decision on long prompts and
    over a realistic fleet, in process from the fleet view beside Dynamo's RadixTree;
    then through Redis
    (a standalone server and a 3-master cluster of its own, or ``--redis-url`` only),
    from the view and exactly; then a write's way to a view, a cold start and an owner
    write's cost."""
    import time

    from pcr.bench import fleet, view

    started = time.perf_counter()
    deployment = _fleet_deployment(args)
    nodes = (16, 256) if args.quick else (16, 64, 256, 1024)
    in_process = view.run(nodes, rounds=2 if args.quick else 10, best=args.best_case)
    print("\n".join(view.format_report(in_process)), flush=True)
    try:
        if args.redis_url:
            rows, redis = _fleet_on_url(args, deployment)
        else:
            rows, redis = _fleet_on_own_servers(args)
    except RuntimeError as exc:  # a server that did not start, a fleet not as filled
        raise CommandError(str(exc)) from None
    report = {
        "quick": args.quick,
        "in_process": in_process,
        "fleet": fleet.report(rows, args.quick),
        "redis": redis,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print("\n".join(fleet.format_rows(report["fleet"])))
    print("\n".join(view.format_redis(redis)))
    print(f"\n{'quick' if args.quick else 'full'} fleet run, {report['seconds']} s")
    if args.json:
        write_json(args.json, report)
    return 0


def _fleet_deployment(args: argparse.Namespace) -> str:
    """What ``--redis-url`` names (``standalone`` or ``cluster``; ``standalone`` without
    it), checked and reached before anything is measured."""
    if not args.redis_url:
        return "standalone"
    scheme = url_scheme(args.redis_url)
    if scheme not in (*BENCH_SCHEMES, *CLUSTER_SCHEMES):
        raise UsageError(
            "argument --redis-url: pcr bench --fleet measures a standalone server or a "
            "cluster: give a redis://, rediss://, unix://, redis+cluster:// or "
            "rediss+cluster:// URL"
        )
    with common.connect(args):
        pass
    return "cluster" if scheme in CLUSTER_SCHEMES else "standalone"


def _fleet_on_url(args: argparse.Namespace, deployment: str) -> tuple[list[dict[str, Any]], Any]:
    """The through-Redis rows and a write's way to a view, on ``--redis-url`` only."""
    from pcr.bench import fleet, view

    client = client_from_url(args.redis_url)
    try:
        with talking(f"Redis at {shown_url(args.redis_url)}"):
            rows = fleet.measure(client, deployment, quick=args.quick, best=args.best_case)
            redis = view.measure_redis(args.redis_url, quick=args.quick)
    finally:
        client.close()
    return rows, redis


def _fleet_on_own_servers(args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    """The through-Redis rows on a redis-server and a 3-master cluster of its own, and a
    write's way to a view on the former."""
    from pcr.bench import fleet, view

    with RedisServer() as server:
        print(
            f"pcr bench --fleet: a redis-server of its own on 127.0.0.1:{server.port}",
            flush=True,
        )
        with server.client() as client, talking(f"Redis at 127.0.0.1:{server.port}"):
            rows = fleet.measure(client, "standalone", quick=args.quick, best=args.best_case)
            redis = view.measure_redis(server.url, quick=args.quick)
    with RedisClusterServers(masters=3) as cluster:
        ports = ", ".join(str(node.port) for node in cluster.nodes)
        print(
            f"pcr bench --fleet: a 3-master Redis Cluster of its own on ports {ports}",
            flush=True,
        )
        with cluster.client() as cluster_client, talking(f"Redis Cluster at {cluster.url}"):
            rows += fleet.measure(cluster_client, "cluster", quick=args.quick, best=args.best_case)
    return rows, redis
