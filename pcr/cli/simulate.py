"""``pcr simulate``: the fleet simulation (the ``sim`` package) on Redis or an embedded
fakeredis, with sizes checked before anything is allocated."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

# -- simulate -------------------------------------------------------------------------
from pcr.cli import common
from pcr.cli.common import CommandError, UsageError, check_writable, shown_url, talking, write_json
from pcr.tables import format_table, percent

MAMBA_CHECKPOINTS = ("vllm", "last-block")
"""``--mamba-checkpoints``' choices, the default first: ``sim.checkpoints.MAMBA_CHECKPOINTS``,
spelled out so that building the parser needs no torch."""


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
    row("KV prefix hit rate (blocks)", lambda r: percent(r["hit_rate_blocks"]))
    row("usable hit rate (blocks, Mamba-aware)", lambda r: percent(r["usable_hit_rate_blocks"]))
    row("hit rate (tokens)", lambda r: percent(r["hit_rate_tokens"]))
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
    if all("bridge" in r for r in results):
        _bridge_rows(results, rows)
    row("registry µs per request (the nodes' own calls)", lambda r: r["registry_us_per_request"])
    if any("mirror" in r for r in results):
        row(
            "mirror: writes flushed / batches / resyncs",
            lambda r: (
                f"{r['mirror']['flushed']} / {r['mirror']['batches']} / {r['mirror']['resyncs']}"
                if "mirror" in r
                else "-"
            ),
        )
    row("run time (s)", lambda r: r["seconds"])
    headers = [f"{r['router']} mirrored" if r.get("mirrored") else r["router"] for r in results]
    return format_table(["", *headers], rows)


SKIPPED = ("keyed_blocks", "other_medium", "other_groups", "block_size_mismatch")
"""Blocks the bridge skips besides orphans (``registry.bridge.bridge.FollowerCounts``)."""


def _bridge_rows(results: list[dict[str, Any]], rows: list[list[object]]) -> None:
    """What the bridge did, per run (``sim.bridged``)."""
    lines: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
        (
            "bridge: batches published (lost on the way)",
            lambda b: f"{b['batches_published']} ({b['batches_dropped']})",
        ),
        (
            "bridge: blocks stored / removed",
            lambda b: f"{b['blocks_stored']} / {b['blocks_removed']}",
        ),
        (
            "bridge: gaps / replays (failed) / probes",
            lambda b: f"{b['gaps']} / {b['replays']} ({b['replay_failures']}) / {b['probes']}",
        ),
        (
            "bridge: restarts (engine restarts)",
            lambda b: f"{b['restarts']} ({b['engine_restarts']})",
        ),
        ("bridge: bad messages", lambda b: b["bad_messages"]),
        (
            "bridge: skipped blocks (orphans, other)",
            lambda b: f"{b['orphans']} ({sum(b[k] for k in SKIPPED)})",
        ),
        ("bridge: removals of unknown blocks", lambda b: b["unknown_removals"]),
        ("bridge: Redis errors", lambda b: b["redis_errors"]),
        ("bridge: catch-up after the last request (s)", lambda b: b["catch_up_seconds"]),
    ]
    for label, get in lines:
        rows.append([label, *[get(r["bridge"]) for r in results]])


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


def command_simulate(args: argparse.Namespace) -> int:
    """``pcr simulate``: checks first, then each router's run on one Redis, the table last
    (with ``--trace``: the trace replay, ``command_simulate_trace``)."""
    if trace_mode(args):
        return command_simulate_trace(args)
    check_writable(args.json)
    try:
        from sim import FleetConfig, WorkloadConfig, simulate
    except ImportError as exc:
        raise CommandError(
            f"pcr simulate needs the gpu extra ({exc}): pip install 'prefix-cache-registry[gpu]'"
        ) from None
    config = FleetConfig(
        nodes=4 if args.nodes is None else args.nodes,
        kv_blocks=512 if args.kv_blocks is None else args.kv_blocks,
        mamba_slots=args.mamba_slots,
        block_size=args.block_size,
        key_prefix=args.key_prefix,
        workload=WorkloadConfig(requests=args.requests, seed=args.seed),
        mamba_checkpoints=args.mamba_checkpoints,
    )
    _check_simulate_sizes(config)
    bridge = _bridge_config(args)
    if args.mirror and bridge is not None:
        raise UsageError("argument --mirror: not with --bridge (a bridged node writes no Redis)")
    with contextlib.ExitStack() as stack:
        if args.redis_url:
            # Every node's listener holds a pub/sub connection: room for all of them.
            connections = max(100, 2 * config.nodes + 32)
            client = stack.enter_context(common.connect(args, max_connections=connections))
            where = f"Redis at {shown_url(args.redis_url)}"
        else:
            client, where = _embedded_redis(args.serve_port, stack)
        if args.metrics_port is not None:
            _serve_metrics(args.metrics_port, stack)
        if bridge is not None:
            stack.enter_context(_expected_gaps(bridge.drop_every > 0))
        print(
            f"pcr simulate: {config.nodes} nodes x {config.kv_blocks} KV blocks, "
            f"{config.mamba_slots} Mamba slots ({config.mamba_checkpoints} checkpoints), "
            f"{args.requests} requests, seed {args.seed}, on {where}{_fed(bridge)}",
            flush=True,
        )
        results = _runs(args, client, config, bridge, where, simulate)
    print(_simulate_table(results))
    if args.json:
        document: dict[str, Any] = {"config": _config_dict(config), "runs": results}
        if bridge is not None:
            document["bridge"] = _config_dict(bridge)
        write_json(args.json, document)
    bad = {k: v for r in results for k, v in r["consistency"].items() if v}
    if bad:  # after the figures and the file: they show what went wrong
        raise CommandError(f"consistency check FAILED: {bad}")
    return 0


def _fed(bridge: Any) -> str:
    """How the fleet is fed, for the opening line: nothing said for the direct mode."""
    if bridge is None:
        return ""
    return (
        ", fed through pcr bridge (each node publishes vLLM KV events over ZeroMQ"
        + (f", every {bridge.drop_every}th batch lost on the way" if bridge.drop_every else "")
        + (", routing in lockstep with the bridge" if bridge.lockstep else "")
        + ")"
    )


def _runs(
    args: argparse.Namespace,
    client: Any,
    config: Any,
    bridge: Any,
    where: str,
    simulate: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:
    """Every router's run (and its mirrored one with ``--mirror``), in order."""
    routers = ["round-robin", "prefix"] if args.router == "both" else [args.router]
    show = not args.no_progress and sys.stderr.isatty()
    results = []
    for router in routers:
        progress = _progress_bar(router) if show else None
        with talking(where), _bridge_trouble():
            results.append(simulate(client, config, router, progress=progress, bridge=bridge))
        if args.mirror:
            mirrored = dataclasses.replace(config, mirror=True)
            progress = _progress_bar(f"{router} mirrored") if show else None
            with talking(where):
                results.append(simulate(client, mirrored, router, progress=progress))
    return results


def _bridge_config(args: argparse.Namespace) -> Any:
    """``--bridge``'s ``sim.config.BridgeConfig`` (None without it), after checking that
    the bridge extra is there: a usage error for a bad option, exit 2."""
    drop_every = args.bridge_drop_every
    if not args.bridge:
        if drop_every is not None:
            raise UsageError("argument --bridge-drop-every: only with --bridge")
        if args.bridge_lockstep:
            raise UsageError("argument --bridge-lockstep: only with --bridge")
        return None
    if drop_every == 1:
        raise UsageError("argument --bridge-drop-every: 1 would lose every batch; give 2 or more")
    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(
            f"pcr simulate --bridge needs the bridge extra (no {', '.join(missing)}): "
            "pip install 'prefix-cache-registry[bridge]'"
        )
    from sim.config import BridgeConfig

    return BridgeConfig(drop_every=drop_every or 0, lockstep=args.bridge_lockstep)


@contextlib.contextmanager
def _bridge_trouble() -> Iterator[None]:
    """The bridge stopping or never catching up, as a one-line runtime error."""
    from sim.config import BridgeStalled

    try:
        yield
    except BridgeStalled as exc:
        raise CommandError(f"pcr bridge: {exc}") from exc


class _GapFilter(logging.Filter):
    """Drops the bridge's gap warnings: with --bridge-drop-every they are the point,
    and the table counts them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("%s: gap:")


@contextlib.contextmanager
def _expected_gaps(expected: bool) -> Iterator[None]:
    logger = logging.getLogger("registry.bridge.bridge")
    gap_filter = _GapFilter()
    if expected:
        logger.addFilter(gap_filter)
    try:
        yield
    finally:
        logger.removeFilter(gap_filter)


def _serve_metrics(port: int, stack: contextlib.ExitStack) -> None:
    """Switch ``registry.metrics`` on and serve them on ``port`` (all interfaces) until
    ``stack`` closes: every registry call, the router, and each node's lease, slot pool
    and listener (``sim.node``), or the bridge (``sim.bridged``)."""
    try:
        import prometheus_client
    except ImportError:
        raise CommandError(
            "--metrics-port needs prometheus-client: pip install 'prefix-cache-registry[metrics]'"
        ) from None
    from registry import metrics

    collectors = prometheus_client.CollectorRegistry()
    try:
        server, thread = prometheus_client.start_http_server(port, registry=collectors)
    except OSError as exc:
        raise CommandError(f"cannot serve metrics on port {port}: {exc.strerror or exc}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)
        metrics.disable_metrics()

    stack.callback(stop)
    metrics.enable_metrics(collectors)


EMBEDDED_CONNECTIONS = 10_000
"""The embedded client's connection cap (fakeredis sets 100): every simulated node's
eviction listener holds a pub/sub connection of its own, so a 256-node fleet needs more."""


def _embedded_redis(serve_port: int | None, stack: contextlib.ExitStack) -> tuple[Any, str]:
    """A fakeredis client (served on 127.0.0.1:``serve_port`` when given) and its name."""
    try:
        import fakeredis
    except ImportError:
        raise CommandError(
            "the embedded Redis needs fakeredis: pip install 'prefix-cache-registry[embedded]'"
        ) from None
    if serve_port is None:
        return fakeredis.FakeRedis(max_connections=EMBEDDED_CONNECTIONS), "embedded fakeredis"
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
    client = fakeredis.FakeRedis(
        server=tcp_server.fake_server, max_connections=EMBEDDED_CONNECTIONS
    )
    return client, f"embedded fakeredis, served on 127.0.0.1:{serve_port}"


def _latency(figures: dict[str, float] | None) -> str:
    return "-" if figures is None else f"{figures['p50_ms']:.3f} / {figures['p99_ms']:.3f}"


def _config_dict(config: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)


# -- simulate --trace ------------------------------------------------------------------

TRACE_ONLY = ("window", "offset", "rate", "time_scale", "cache_fraction", "policies")
"""Options that mean something only with --trace or --generate-trace."""


def add_trace_options(sim: argparse.ArgumentParser) -> None:
    """``pcr simulate --trace FILE``: a Mooncake-format trace through simulated vLLM
    engines in simulated time (``sim.trace_replay``), instead of the fleet."""
    from pcr.cli.common import positive_arg

    def fraction(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r:.60}") from None
        if not 0 < value <= 1e6 or value != value:
            raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r:.60}")
        return value

    def milliseconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r:.60}") from None
        if not 0 <= value <= 3_600_000:
            raise argparse.ArgumentTypeError(f"must be a number of ms >= 0, not {text!r:.60}")
        return value

    group = sim.add_argument_group(
        "trace replay",
        "replay a request trace in the Mooncake format (JSON lines: timestamp ms, "
        "input_length, output_length, hash_ids of 512-token blocks) through simulated vLLM "
        "engines in simulated time, printing each routing policy's hit rate beside one "
        "infinite cache's (no Redis: --nodes engines, default 8)",
    )
    source = group.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="the trace to replay")
    source.add_argument(
        "--generate-trace",
        metavar="FILE",
        help="write a generated trace (--trace-shape) to FILE, then replay it",
    )
    group.add_argument(
        "--trace-shape",
        metavar="KEY=VALUE,...",
        default="",
        help="with --generate-trace: the generator's knobs (sim.trace_gen.TraceShape: "
        "requests, rate, seed, system_prompts, system_blocks=LOW-HIGH, zipf, new, "
        "one_off, one_off_system, first_blocks, turn_blocks, max_turns, active, "
        "output_tokens)",
    )
    group.add_argument("--window", type=positive_arg, help="requests replayed (default 2000)")
    group.add_argument("--offset", type=int, help="requests skipped first (default 0)")
    timing = group.add_mutually_exclusive_group()
    timing.add_argument("--rate", type=fraction, help="mean requests per second (default 40)")
    timing.add_argument(
        "--time-scale", type=milliseconds, help="the trace's gaps multiplied by this"
    )
    group.add_argument(
        "--cache-fraction",
        type=fraction,
        help="each engine caches this share of the window's distinct blocks over the "
        "engines (default 0.25; --kv-blocks sets blocks per engine instead)",
    )
    group.add_argument(
        "--max-running",
        type=positive_arg,
        default=2,
        help="requests an engine runs at once, the rest wait (default 2)",
    )
    group.add_argument(
        "--prefill-ms", type=milliseconds, default=6.0, help="ms per block computed (default 6)"
    )
    group.add_argument(
        "--decode-ms", type=milliseconds, default=4.0, help="ms per output token (default 4)"
    )
    group.add_argument(
        "--max-output-tokens", type=positive_arg, default=16, help="outputs capped (default 16)"
    )
    group.add_argument(
        "--policies",
        help="comma-separated: round-robin, least-load, prefix, prefix+pending, gateway, "
        "cache-aware (default all)",
    )
    # --nodes and --kv-blocks take other defaults with a trace (8 engines, a share of the
    # distinct blocks): None here, resolved by the mode.
    sim.set_defaults(nodes=None, kv_blocks=None)


def trace_mode(args: argparse.Namespace) -> bool:
    """Whether this run replays a trace; usage errors for trace options without one."""
    if args.trace is None and args.generate_trace is None:
        given = [n for n in TRACE_ONLY if getattr(args, n) is not None]
        if args.trace_shape:
            given.append("trace_shape")
        if given:
            option = "--" + given[0].replace("_", "-")
            raise UsageError(f"argument {option}: only with --trace or --generate-trace")
        return False
    if args.trace_shape and args.generate_trace is None:
        raise UsageError("argument --trace-shape: only with --generate-trace")
    for name, flag in (
        ("bridge", "--bridge"),
        ("mirror", "--mirror"),
        ("serve_port", "--serve-port"),
        ("metrics_port", "--metrics-port"),
    ):
        if getattr(args, name):
            raise UsageError(f"argument {flag}: not with a trace (the replay uses no Redis)")
    return True


def command_simulate_trace(args: argparse.Namespace) -> int:
    """``pcr simulate --trace FILE``: the replay's table (and ``--json``)."""
    from sim.trace import TraceError, arrivals, load_trace, scale_for_rate, write_trace
    from sim.trace_gen import generate, shape_from_text
    from sim.trace_replay import POLICIES, ReplayConfig, replay

    check_writable(args.json)
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(
            f"argument --policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})"
        )
    if args.offset is not None and args.offset < 0:
        raise UsageError("argument --offset: must be 0 or more")
    path = args.trace
    if args.generate_trace is not None:
        check_writable(args.generate_trace)
        try:
            shape = shape_from_text(args.trace_shape)
        except ValueError as exc:
            raise UsageError(f"argument --trace-shape: {exc}") from None
        write_trace(generate(shape), args.generate_trace)
        path = args.generate_trace
    try:
        requests = load_trace(path, offset=args.offset or 0, window=args.window or 2000)
    except TraceError as exc:
        raise CommandError(f"cannot replay the trace: {exc}") from None
    if args.time_scale is not None:
        scale = args.time_scale
    else:
        scale = scale_for_rate(requests, args.rate or 40.0)
    config = ReplayConfig(
        engines=args.nodes or 8,
        kv_blocks=args.kv_blocks,
        cache_fraction=args.cache_fraction or 0.25,
        block_size=args.block_size,
        max_running=args.max_running,
        prefill_ms=args.prefill_ms,
        decode_ms=args.decode_ms,
        max_output_tokens=args.max_output_tokens,
    )
    times = arrivals(requests, scale)
    try:
        result = replay(requests, times, config, policies)
    except ValueError as exc:
        raise CommandError(f"cannot replay the trace: {exc}") from None
    span = times[-1]
    print(
        f"pcr simulate --trace {path}: {len(requests)} requests (lines {requests[0].line}-"
        f"{requests[-1].line}) over {span:.1f} s (time scale {scale:.4g}), "
        f"{config.engines} engines x {result['kv_blocks_per_engine']} blocks of "
        f"{config.block_size} tokens ({result['distinct_blocks']} distinct blocks in the "
        f"window), {config.max_running} running each, {config.prefill_ms:g} ms a block "
        f"computed, {config.decode_ms:g} ms a token, outputs capped at "
        f"{config.max_output_tokens} tokens",
        flush=True,
    )
    print(_trace_table(result))
    if args.json:
        write_json(
            args.json,
            {
                "trace": path,
                "offset": args.offset or 0,
                "time_scale": scale,
                "config": _config_dict(config),
                **result,
            },
        )
    return 0


def _trace_table(result: dict[str, Any]) -> str:
    runs = result["runs"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    rows: list[list[object]] = [
        ["hit rate (engines' tokens)", *[percent(r["hit_rate"]) for r in runs]],
        ["of the infinite cache's", *[f"{r['ideal_fraction']:.2f}" for r in runs]],
        ["balance (max / mean requests)", *[f"{r['balance']:.2f}" for r in runs]],
        ["TTFT p50 / p99 ms", *[f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}" for r in runs]],
    ]
    headers = ["", *[r["policy"] for r in runs]]
    table = format_table(headers, rows)
    return f"{table}\none infinite cache (ideal): {percent(result['ideal_hit_rate'])}"
