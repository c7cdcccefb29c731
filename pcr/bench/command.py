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
from pcr.servers import RedisServer

BENCH_SCHEMES = ("redis", "rediss", "unix")


def _command_bench(args: argparse.Namespace) -> int:
    _check_writable(args.json)
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
