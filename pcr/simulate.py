"""``pcr simulate``: the fleet simulation (the ``sim`` package) on Redis or an embedded
fakeredis, with sizes checked before anything is allocated."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

# -- simulate -------------------------------------------------------------------------
from pcr import common
from pcr.common import CommandError, UsageError, _check_writable, _talking, _where, _write_json
from pcr.tables import _percent, format_table


def _progress_bar(label: str) -> Callable[[int, int], None]:
    last = [-1]

    def show(done: int, total: int) -> None:
        filled = 30 * done // total
        if filled != last[0] or done == total:
            last[0] = filled
            end = "\n" if done == total else ""
            sys.stderr.write(
                f"\r{label:>12} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}{end}"
            )
            sys.stderr.flush()

    return show


def _simulate_table(results: list[dict[str, Any]]) -> str:
    rows: list[list[object]] = []

    def row(label: str, get: Callable[[dict[str, Any]], object]) -> None:
        rows.append([label, *[get(r) for r in results]])

    row("requests", lambda r: r["requests"])
    row("KV prefix hit rate (blocks)", lambda r: _percent(r["hit_rate_blocks"]))
    row("usable hit rate (blocks, Mamba-aware)", lambda r: _percent(r["usable_hit_rate_blocks"]))
    row("hit rate (tokens)", lambda r: _percent(r["hit_rate_tokens"]))
    row("prefill tokens saved", lambda r: r["totals"]["prefill_tokens_saved"])
    row("KV blocks evicted", lambda r: r["totals"]["kv_evictions"])
    row("Mamba restores", lambda r: r["totals"]["mamba_restores"])
    row(
        "Mamba slots freed (LRU evictions)",
        lambda r: f"{r['mamba']['freed']} ({r['mamba']['evicted']})",
    )
    for op in sorted({op for r in results for op in r["latency_ms"]}):
        rows.append([f"{op} p50 / p99 ms", *[_latency(r["latency_ms"].get(op)) for r in results]])
    for key in results[0]["consistency"]:
        rows.append(
            [f"consistency: {key.replace('_', ' ')}", *[r["consistency"][key] for r in results]]
        )
    row("run time (s)", lambda r: r["seconds"])
    return format_table(["", *[r["router"] for r in results]], rows)


def _check_simulate_sizes(config: Any) -> None:
    """Reject fleet sizes the simulation cannot run (``sim.check_fleet_config``: computed
    from the shapes, before anything is allocated) as a usage error, exit 2."""
    from sim import FleetConfigError, check_fleet_config

    try:
        check_fleet_config(config)
    except FleetConfigError as exc:
        option = {"mamba_slots": "--mamba-slots", "kv_blocks": "--kv-blocks"}.get(
            exc.field, "--" + exc.field.replace("_", "-")
        )
        raise UsageError(f"argument {option}: {exc}") from None


def _command_simulate(args: argparse.Namespace) -> int:
    _check_writable(args.json)
    try:
        from sim import FleetConfig, WorkloadConfig, simulate
    except ImportError as exc:
        raise CommandError(
            f"pcr simulate needs the gpu extra ({exc}): pip install 'prefix-cache-registry[gpu]'"
        ) from None
    config = FleetConfig(
        nodes=args.nodes,
        kv_blocks=args.kv_blocks,
        mamba_slots=args.mamba_slots,
        block_size=args.block_size,
        key_prefix=args.key_prefix,
        workload=WorkloadConfig(requests=args.requests, seed=args.seed),
    )
    _check_simulate_sizes(config)
    routers = ["round-robin", "prefix"] if args.router == "both" else [args.router]
    with contextlib.ExitStack() as stack:
        if args.redis_url:
            client = stack.enter_context(common.connect(args))
            where = f"Redis at {_where(args.redis_url)}"
        else:
            client, where = _embedded_redis(args.serve_port, stack)
        print(
            f"pcr simulate: {config.nodes} nodes x {config.kv_blocks} KV blocks, "
            f"{config.mamba_slots} Mamba slots, {args.requests} requests, seed {args.seed}, "
            f"on {where}",
            flush=True,
        )
        results = []
        for router in routers:
            show = not args.no_progress and sys.stderr.isatty()
            progress = _progress_bar(router) if show else None
            with _talking(where):
                results.append(simulate(client, config, router, progress=progress))
    print(_simulate_table(results))
    if args.json:
        _write_json(args.json, {"config": _config_dict(config), "runs": results})
    bad = {k: v for r in results for k, v in r["consistency"].items() if v}
    if bad:  # after the figures and the file: they show what went wrong
        raise CommandError(f"consistency check FAILED: {bad}")
    return 0


def _embedded_redis(serve_port: int | None, stack: contextlib.ExitStack) -> tuple[Any, str]:
    """A fakeredis client (served on 127.0.0.1:``serve_port`` when given) and its name."""
    try:
        import fakeredis
    except ImportError:
        raise CommandError(
            "the embedded Redis needs fakeredis: pip install 'prefix-cache-registry[embedded]'"
        ) from None
    if serve_port is None:
        return fakeredis.FakeRedis(), "embedded fakeredis"
    try:
        tcp_server = fakeredis.TcpFakeServer(("127.0.0.1", serve_port))
    except OSError as exc:
        raise CommandError(
            f"cannot serve on 127.0.0.1:{serve_port}: {exc.strerror or exc}"
        ) from None
    tcp_server.daemon_threads = True
    threading.Thread(target=tcp_server.serve_forever, daemon=True).start()

    def stop() -> None:
        tcp_server.shutdown()
        tcp_server.server_close()

    stack.callback(stop)
    client = fakeredis.FakeRedis(server=tcp_server.fake_server)
    return client, f"embedded fakeredis, served on 127.0.0.1:{serve_port}"


def _latency(figures: dict[str, float] | None) -> str:
    return "-" if figures is None else f"{figures['p50_ms']:.3f} / {figures['p99_ms']:.3f}"


def _config_dict(config: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)
