"""``pcr bench``: run the benchmarks against a server of its own or ``--redis-url``."""

from __future__ import annotations

import argparse

# -- bench ----------------------------------------------------------------------------
from pcr import common
from pcr.common import (
    CommandError,
    UsageError,
    _check_writable,
    _scheme,
    _talking,
    _where,
    _write_json,
)
from pcr.servers import RedisClusterServers, RedisServer
from registry.client import CLUSTER_SCHEMES, client_from_url

BENCH_SCHEMES = ("redis", "rediss", "unix")


def _command_bench(args: argparse.Namespace) -> int:
    _check_writable(args.json)
    if args.view and args.fleet:
        raise UsageError("argument --view: not with --fleet")
    if args.best_case and not args.view:
        raise UsageError("argument --best-case: only with --view")
    if args.view:
        return _command_bench_view(args)
    if args.fleet:
        return _command_bench_fleet(args)
    from pcr.bench import run as bench

    if args.redis_url:
        if _scheme(args.redis_url) not in BENCH_SCHEMES:
            raise UsageError(
                "argument --redis-url: pcr bench measures one standalone server: "
                "give a redis://, rediss:// or unix:// URL"
            )
        with common.connect(args):
            pass
        with _talking(f"Redis at {_where(args.redis_url)}"):
            report = bench.run(args.redis_url, quick=args.quick, sizes=args.sizes)
    else:
        try:
            with RedisServer() as server:
                print(
                    f"pcr bench: a redis-server of its own on 127.0.0.1:{server.port}", flush=True
                )
                with _talking(f"Redis at 127.0.0.1:{server.port}"):
                    report = bench.run(server.url, quick=args.quick, sizes=args.sizes)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    print(bench.format_report(report))
    if args.json:
        _write_json(args.json, report)
    return 0


def _command_bench_view(args: argparse.Namespace) -> int:
    """``pcr bench --view``: the in-process fleet view beside Dynamo's RadixTree; then,
    on a redis-server of its own, a write's way to a view, a cold start, a write's cost."""
    if args.redis_url:
        raise UsageError("argument --redis-url: pcr bench --view uses no Redis")
    from pcr.bench import view

    nodes = (16, 256) if args.quick else (16, 64, 256, 1024)
    report = view.run(nodes, rounds=2 if args.quick else 10, best=args.best_case)
    print("\n".join(view.format_report(report)), flush=True)
    try:
        with RedisServer() as server, _talking(f"Redis at 127.0.0.1:{server.port}"):
            report["redis"] = view.measure_redis(server.url, quick=args.quick)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    print("\n".join(view.format_redis(report["redis"])))
    if args.json:
        _write_json(args.json, report)
    return 0


def _command_bench_fleet(args: argparse.Namespace) -> int:
    """``pcr bench --fleet``: routing at fleet scale, on a standalone server and a 3-master
    cluster of its own, or on ``--redis-url`` only."""
    import time

    from pcr.bench import fleet

    started = time.perf_counter()
    results = []
    if args.redis_url:
        scheme = _scheme(args.redis_url)
        if scheme not in (*BENCH_SCHEMES, *CLUSTER_SCHEMES):
            raise UsageError(
                "argument --redis-url: pcr bench --fleet measures a standalone server or a "
                "cluster: give a redis://, rediss://, unix://, redis+cluster:// or "
                "rediss+cluster:// URL"
            )
        deployment = "cluster" if scheme in CLUSTER_SCHEMES else "standalone"
        with common.connect(args):
            pass
        client = client_from_url(args.redis_url)
        try:
            with _talking(f"Redis at {_where(args.redis_url)}"):
                results.append(fleet.measure(client, deployment, quick=args.quick))
        except RuntimeError as exc:  # the fleet was not as filled (see fleet.measure)
            raise CommandError(str(exc)) from None
        finally:
            client.close()
    else:
        try:
            with RedisServer() as server:
                print(
                    f"pcr bench --fleet: a redis-server of its own on 127.0.0.1:{server.port}",
                    flush=True,
                )
                with server.client() as client, _talking(f"Redis at 127.0.0.1:{server.port}"):
                    results.append(fleet.measure(client, "standalone", quick=args.quick))
            with RedisClusterServers(masters=3) as cluster:
                ports = ", ".join(str(node.port) for node in cluster.nodes)
                print(
                    f"pcr bench --fleet: a 3-master Redis Cluster of its own on ports {ports}",
                    flush=True,
                )
                with (
                    cluster.client() as cluster_client,
                    _talking(f"Redis Cluster at {cluster.url}"),
                ):
                    results.append(fleet.measure(cluster_client, "cluster", quick=args.quick))
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    report = {
        "quick": args.quick,
        "fleet": fleet.report(results, args.quick),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print("\n".join(fleet.format_rows(report["fleet"])))
    print(f"\n{'quick' if args.quick else 'full'} fleet run, {report['seconds']} s")
    if args.json:
        _write_json(args.json, report)
    return 0
