"""``pcr``: run the fleet simulation and inspect or repair a live registry.

Every command that talks to Redis takes ``--redis-url`` (default: ``$REDIS_URL``, else
``redis://localhost:6379/0``). Errors are one line on stderr and a non-zero exit.
``pcr simulate`` needs the ``gpu`` extra (torch), loaded only when that command runs, so
the other commands work from a torch-free install.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

import redis

from registry.client import client_from_url
from registry.hashing import block_hashes
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.membership import NodeIndex
from registry.notices import parse_notice
from registry.redis_registry import PrefixCacheRegistry
from registry.routing import PrefixRouter

DEFAULT_URL = "redis://localhost:6379/0"


class CommandError(Exception):
    """A failure to report as one line (no traceback)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- output ---------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [
            v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else str(value)


def _percent(value: float) -> str:
    return f"{value * 100:.1f}%"


# -- connecting -----------------------------------------------------------------------


def _where(url: str) -> str:
    """The server a URL names, without user or password."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def _connect(args: argparse.Namespace) -> Any:
    url = args.redis_url
    try:
        client = client_from_url(url, socket_connect_timeout=3, socket_timeout=10)
        client.ping()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise CommandError(f"Redis at {_where(url)} refused the login: {reason}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise CommandError(f"cannot reach Redis at {_where(url)}: {reason}") from None
    return client


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- simulate -------------------------------------------------------------------------


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


def _command_simulate(args: argparse.Namespace) -> int:
    try:
        from gpu.fleet import FleetConfig, simulate
        from gpu.workload import WorkloadConfig
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
    tcp_server = None
    if args.redis_url:
        client = _connect(args)
        where = f"Redis at {_where(args.redis_url)}"
    else:
        try:
            import fakeredis
        except ImportError:
            raise CommandError(
                "the embedded Redis needs fakeredis: pip install 'prefix-cache-registry[embedded]'"
            ) from None
        if args.serve_port is not None:
            try:
                tcp_server = fakeredis.TcpFakeServer(("127.0.0.1", args.serve_port))
            except OSError as exc:
                raise CommandError(f"cannot serve on 127.0.0.1:{args.serve_port}: {exc}") from None
            tcp_server.daemon_threads = True
            threading.Thread(target=tcp_server.serve_forever, daemon=True).start()
            client = fakeredis.FakeRedis(server=tcp_server.fake_server)
            where = f"embedded fakeredis, served on 127.0.0.1:{args.serve_port}"
        else:
            client = fakeredis.FakeRedis()
            where = "embedded fakeredis"
    routers = ["round-robin", "prefix"] if args.router == "both" else [args.router]
    print(
        f"pcr simulate: {config.nodes} nodes x {config.kv_blocks} KV blocks, "
        f"{config.mamba_slots} Mamba slots, {args.requests} requests, seed {args.seed}, on {where}",
        flush=True,
    )
    results = []
    try:
        for router in routers:
            show = not args.no_progress and sys.stderr.isatty()
            progress = _progress_bar(router) if show else None
            results.append(simulate(client, config, router, progress=progress))
    finally:
        if tcp_server is not None:
            tcp_server.shutdown()
            tcp_server.server_close()
    print(_simulate_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"config": _config_dict(config), "runs": results}, handle, indent=2)
        print(f"figures written to {args.json}")
    bad = {k: v for r in results for k, v in r["consistency"].items() if v}
    if bad:
        print(f"pcr simulate: consistency check FAILED: {bad}", file=sys.stderr)
        return 1
    return 0


def _latency(figures: dict[str, float] | None) -> str:
    return "-" if figures is None else f"{figures['p50_ms']:.3f} / {figures['p99_ms']:.3f}"


def _config_dict(config: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)


# -- bench ----------------------------------------------------------------------------


def _command_bench(args: argparse.Namespace) -> int:
    from benchmarks.run import format_report, run
    from benchmarks.server import BenchServer

    if args.redis_url:
        _connect(args).close()
        report = run(args.redis_url, quick=args.quick)
    else:
        try:
            with BenchServer() as server:
                print(
                    f"pcr bench: a redis-server of its own on 127.0.0.1:{server.port}", flush=True
                )
                report = run(server.url, quick=args.quick)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
        print(f"figures written to {args.json}")
    return 0


# -- inspection -----------------------------------------------------------------------


def _namespaces(client: Any, args: argparse.Namespace) -> list[str]:
    index = NodeIndex(client, args.key_prefix)
    found = [*index.live(), *index.dead(), *(args.namespace or [])]
    return list(dict.fromkeys(found))


def _command_stats(args: argparse.Namespace) -> int:
    client = _connect(args)
    now_ms = _server_ms(client)
    rows = []
    for namespace in _namespaces(client, args):
        keys = NamespaceKeys(namespace, args.key_prefix)
        meta = {_text(k): _text(v) for k, v in client.hgetall(keys.meta).items()}
        lease = int(meta["lease_until"]) if "lease_until" in meta else None
        rows.append(
            {
                "namespace": namespace,
                "kv_entries": client.hlen(keys.kv),
                "mamba_entries": client.hlen(keys.mamba),
                "memory_bytes": _memory(client, keys.all_keys()),
                "state": "no lease" if lease is None else ("live" if lease > now_ms else "dead"),
                "lease_left_s": None if lease is None else round((lease - now_ms) / 1000, 1),
                "epoch": int(meta.get("epoch", 0)),
                "notice_seq": int(meta.get("notice_seq", 0)),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        headers = list(rows[0])
        print(format_table(headers, [[r[h] for h in headers] for r in rows]))
    else:
        print(f"no namespaces under key prefix {args.key_prefix!r}")
    return 0


def _server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _memory(client: Any, keys: Sequence[str]) -> int | None:
    try:
        return sum(int(client.memory_usage(k) or 0) for k in keys)
    except redis.ResponseError:  # servers without MEMORY (fakeredis)
        return None


def _command_inspect(args: argparse.Namespace) -> int:
    keys = NamespaceKeys(args.namespace_name, args.key_prefix)
    client = _connect(args)
    key = keys.kv if args.kind == "kv" else keys.mamba
    cursor, page = client.hscan(key, cursor=args.cursor, count=args.count)
    entries = sorted((int(h), int(b)) for h, b in page.items())
    if args.json:
        print(json.dumps({"key": key, "next_cursor": int(cursor), "entries": entries}))
        return 0
    print(f"{key}: {client.hlen(key)} entries; this page {len(entries)}")
    if entries:
        print(format_table(["hash", "block_id"], entries))
    if int(cursor):
        print(f"more: pcr inspect {args.namespace_name} --kind {args.kind} --cursor {int(cursor)}")
    return 0


def _hashes_of(args: argparse.Namespace) -> list[int]:
    if args.tokens:
        return block_hashes(args.tokens, args.block_size)
    if not args.hashes:
        raise CommandError("give block hashes, or --tokens with --block-size")
    return list(args.hashes)


def _command_match(args: argparse.Namespace) -> int:
    hashes = _hashes_of(args)
    if args.namespace_name:
        NamespaceKeys(args.namespace_name, args.key_prefix)
    client = _connect(args)
    if args.namespace_name:
        registry = PrefixCacheRegistry(client, args.namespace_name, key_prefix=args.key_prefix)
        block_ids, parent = registry.match_kv_prefix(hashes)
        mamba = registry.match_mamba_farthest(hashes[: len(block_ids)]) if block_ids else 0
        result: Any = {
            "namespace": args.namespace_name,
            "blocks": len(hashes),
            "kv_prefix": len(block_ids),
            "mamba_prefix": mamba,
            "block_ids": block_ids,
            "parent_hash": parent,
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{args.namespace_name}: {len(block_ids)} of {len(hashes)} blocks cached, "
                f"Mamba state usable up to block {mamba}; block ids {block_ids}"
            )
        return 0
    scores = PrefixRouter(client, args.key_prefix).score(hashes)
    result = [
        {"namespace": s.namespace, "kv_prefix": s.kv_prefix, "mamba_prefix": s.mamba_prefix}
        for s in sorted(scores.values(), key=lambda s: (-s.usable, s.namespace))
    ]
    if args.json:
        print(json.dumps(result))
    elif result:
        print(f"{len(hashes)} blocks; live nodes, best first:")
        print(
            format_table(
                ["namespace", "kv_prefix", "mamba_prefix"], [list(r.values()) for r in result]
            )
        )
    else:
        print("no live nodes")
    return 0


def _command_watch(args: argparse.Namespace) -> int:
    channel = NamespaceKeys(args.namespace_name, args.key_prefix).mamba_evicted_channel
    client = _connect(args)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    if not args.json:
        print(f"watching {channel} (Ctrl-C to stop)", flush=True)
    seen = 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        while args.count is None or seen < args.count:
            if deadline is not None and time.monotonic() >= deadline:
                break
            message = pubsub.get_message(timeout=0.2)
            if message is None or message["type"] not in ("message", b"message"):
                continue
            seen += 1
            try:
                notice = parse_notice(message["data"])
            except ValueError as exc:
                print(f"malformed message: {exc}", flush=True)
                continue
            if args.json:
                print(
                    json.dumps({"seq": notice.seq, "kind": notice.kind, "pairs": notice.pairs}),
                    flush=True,
                )
            else:
                pairs = " ".join(f"{b}:{h}" for b, h in notice.pairs)
                print(f"#{notice.seq} {notice.kind} {pairs}".rstrip(), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        pubsub.close()
    return 0


def _command_gc(args: argparse.Namespace) -> int:
    client = _connect(args)
    index = NodeIndex(client, args.key_prefix)
    names = index.dead() if args.dry_run else index.gc()
    verb = "would remove" if args.dry_run else "removed"
    print(json.dumps(names) if args.json else f"{verb} {len(names)}: {' '.join(names)}".rstrip())
    return 0


# -- the parser -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``pcr`` argument parser (also used by tests to check documented commands)."""
    parser = _Parser(
        prog="pcr", description="Redis-backed prefix-cache registry: simulate, inspect, repair."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def redis_options(command: argparse.ArgumentParser, url_default: str | None) -> None:
        command.add_argument(
            "--redis-url",
            default=url_default,
            help="redis://, rediss://, unix://, redis+cluster:// URL (default: $REDIS_URL"
            + (f", else {DEFAULT_URL})" if url_default else "; without it: an embedded fakeredis)"),
        )
        command.add_argument(
            "--key-prefix", default=DEFAULT_KEY_PREFIX, help="key prefix (default: pcr)"
        )

    env_url = os.environ.get("REDIS_URL")

    sim = commands.add_parser("simulate", help="the serving-fleet simulation (the main job)")
    redis_options(sim, env_url)
    sim.add_argument(
        "--serve-port", type=int, help="also serve the embedded Redis on this TCP port"
    )
    sim.add_argument("--router", choices=["round-robin", "prefix", "both"], default="both")
    sim.add_argument("--nodes", type=_positive, default=4, help="serving nodes (default 4)")
    sim.add_argument(
        "--requests", type=_positive, default=1000, help="requests per router (default 1000)"
    )
    sim.add_argument(
        "--kv-blocks", type=_positive, default=512, help="KV blocks per node (default 512)"
    )
    sim.add_argument(
        "--mamba-slots", type=_positive, default=32, help="Mamba slots per node (default 32)"
    )
    sim.add_argument(
        "--block-size", type=_positive, default=16, help="tokens per block (default 16)"
    )
    sim.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    sim.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    sim.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown only on a terminal)"
    )
    sim.set_defaults(handler=_command_simulate)

    bench = commands.add_parser("bench", help="measure every operation against raw Redis commands")
    bench.add_argument(
        "--redis-url",
        default=None,
        help="a standalone server to measure (default: a redis-server it starts itself); "
        "it is FLUSHed",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions: under a minute")
    bench.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    bench.set_defaults(handler=_command_bench)

    stats = commands.add_parser(
        "stats", help="per namespace: entries, memory, lease, epoch, notices"
    )
    redis_options(stats, env_url or DEFAULT_URL)
    stats.add_argument("--namespace", action="append", help="also show this namespace (repeatable)")
    stats.add_argument("--json", action="store_true", help="JSON output")
    stats.set_defaults(handler=_command_stats)

    inspect = commands.add_parser("inspect", help="a namespace's mappings, one page at a time")
    redis_options(inspect, env_url or DEFAULT_URL)
    inspect.add_argument("namespace_name", metavar="NAMESPACE")
    inspect.add_argument("--kind", choices=["kv", "mamba"], default="kv")
    inspect.add_argument("--cursor", type=int, default=0, help="HSCAN cursor of the page")
    inspect.add_argument("--count", type=_positive, default=50, help="about this many per page")
    inspect.add_argument("--json", action="store_true", help="JSON output")
    inspect.set_defaults(handler=_command_inspect)

    match = commands.add_parser(
        "match", help="cached prefix of hashes or tokens (one node, or all)"
    )
    redis_options(match, env_url or DEFAULT_URL)
    match.add_argument("hashes", metavar="HASH", nargs="*", type=int, help="block hashes")
    match.add_argument(
        "--namespace", dest="namespace_name", help="one node (default: every live node)"
    )
    match.add_argument("--tokens", type=int, nargs="+", help="token ids to hash instead")
    match.add_argument("--block-size", type=_positive, default=16)
    match.add_argument("--json", action="store_true", help="JSON output")
    match.set_defaults(handler=_command_match)

    watch = commands.add_parser("watch", help="follow a namespace's eviction notices")
    redis_options(watch, env_url or DEFAULT_URL)
    watch.add_argument("namespace_name", metavar="NAMESPACE")
    watch.add_argument("--count", type=_positive, help="stop after this many notices")
    watch.add_argument("--timeout", type=float, help="stop after this many seconds")
    watch.add_argument("--json", action="store_true", help="one JSON object per notice")
    watch.set_defaults(handler=_command_watch)

    gc = commands.add_parser("gc", help="remove namespaces whose lease has expired")
    redis_options(gc, env_url or DEFAULT_URL)
    gc.add_argument("--dry-run", action="store_true", help="only list them")
    gc.add_argument("--json", action="store_true", help="JSON output")
    gc.set_defaults(handler=_command_gc)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pcr`` console script and ``python -m registry``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except CommandError as exc:
        print(f"pcr {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        print(f"pcr {args.command}: error: lost the connection to Redis: {reason}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as exc:
        print(f"pcr {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
