"""``pcr``: run the fleet simulation and inspect or repair a live registry.

Every command that talks to Redis takes ``--redis-url`` (default: ``$REDIS_URL``, else
``redis://localhost:6379/0``). ``pcr simulate`` needs the ``gpu`` extra (torch), loaded only
when that command runs, so the other commands work from a torch-free install.

Errors never show a traceback: each is exactly one line on stderr,
``pcr COMMAND: error: MESSAGE``, and the exit status says which kind it was:

* 2: a usage error, found before anything slow starts: an unknown option, a number out of
  its range (NaN, infinities and huge values included), a namespace or key prefix that
  breaks the naming rule, a malformed ``--redis-url``, a ``--json FILE`` that cannot be
  written;
* 1: a runtime error: Redis unreachable, lost, refusing the login or a command (ACL),
  out of memory, a key of the wrong type, a URL that does not fit the server (cluster or
  not, database index), a server that does not speak the Redis protocol; also any
  unexpected failure, reported as ``internal error: ...``;
* 130: interrupted (Ctrl-C), with the one line ``pcr COMMAND: interrupted``.

Redis faults are mapped to the registry's error vocabulary by ``registry.errors.translate``
(the project's one mapping), so the CLI and the library word them alike.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from registry.client import CLUSTER_SCHEMES, PLAIN_SCHEMES, client_from_url
from registry.errors import (
    REDIS_ERRORS,
    RegistryError,
    RegistryUnavailable,
    translate,
)
from registry.hashing import block_hashes
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, validate_key_prefix, validate_namespace
from registry.membership import NodeIndex
from registry.notices import parse_notice
from registry.redis_registry import PrefixCacheRegistry
from registry.routing import PrefixRouter

DEFAULT_URL = "redis://localhost:6379/0"

MAX_INT64 = 2**63 - 1
MAX_CURSOR = 2**64 - 1
"""HSCAN cursors are unsigned 64-bit numbers."""
MAX_PAGE = 10_000
"""The largest ``pcr inspect --count``: HSCAN returns about this many entries per page."""
MAX_BLOCK_SIZE = 1 << 20
"""The largest ``pcr match --block-size`` (tokens per block)."""
MAX_WATCH_SECONDS = 365 * 24 * 3600.0
"""The largest ``pcr watch --timeout`` (a year; leave it out to watch until Ctrl-C)."""
MAX_NOTICES = 2**31 - 1
"""The largest ``pcr watch --count``."""

EVICTING_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
"""``maxmemory-policy`` values under which Redis may evict the registry's keys (they
have no TTL, so the ``volatile-*`` policies never pick them)."""

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """A runtime failure to report as one line (no traceback); exit status 1."""


class UsageError(CommandError):
    """Bad arguments found after parsing (before anything slow ran); exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n"
        )


def _one_line(text: str) -> str:
    """``text`` with every character that could end a line or move the cursor escaped."""
    if text.isprintable():
        return text
    return "".join(
        ch
        if ch.isprintable() or ch == " "
        else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        for ch in text
    )


# -- argument types (each raises ArgumentTypeError: a usage error, exit 2) ------------


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what}: {text!r:.60}") from None
        if not low <= value <= high:
            shown = (
                str(value)
                if len(str(value)) <= 40
                else f"{str(value)[:20]}...({len(str(value))} digits)"
            )
            raise argparse.ArgumentTypeError(f"{what} must be in [{low}, {high}], not {shown}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


_positive = _int_in(1, MAX_INT64, "positive integer")
_port = _int_in(1, 65535, "TCP port")
_cursor = _int_in(0, MAX_CURSOR, "HSCAN cursor")
_page = _int_in(1, MAX_PAGE, "page size")
_seed = _int_in(-(2**63), MAX_INT64, "seed")
_hash = _int_in(1, MAX_INT64, "block hash")
_token = _int_in(-(2**63), MAX_INT64, "token id")
_block_size = _int_in(1, MAX_BLOCK_SIZE, "block size")
_notices = _int_in(1, MAX_NOTICES, "notice count")


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds in [0, MAX_WATCH_SECONDS]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r:.60}") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_WATCH_SECONDS:
        raise argparse.ArgumentTypeError(
            f"seconds must be a finite number in [0, {MAX_WATCH_SECONDS:.0f}], not {text!r:.60}"
        )
    return value


def _namespace(text: str) -> str:
    try:
        return validate_namespace(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _key_prefix(text: str) -> str:
    try:
        return validate_key_prefix(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _url(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the Redis URL must not be empty")
    return text


def _check_writable(path: str | None) -> None:
    """Fail now (usage error) if ``--json PATH`` cannot be written, not after a long run.

    Opens the file for appending (creating it if needed, never truncating it, never
    blocking on a FIFO) and removes it again if it did not exist before.
    """
    if path is None:
        return
    try:
        existed = os.path.lexists(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"argument --json: cannot write {path!r}: {reason}") from None
    os.close(fd)
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(path)


def _write_json(path: str, document: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
    except OSError as exc:
        raise CommandError(f"cannot write {path!r}: {exc.strerror or exc}") from None
    print(f"figures written to {_one_line(path)}")


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


def _warn(command: str, message: str) -> None:
    sys.stderr.write(f"pcr {command}: WARNING: {_one_line(message)}\n")
    sys.stderr.flush()


# -- connecting -----------------------------------------------------------------------


def _where(url: str) -> str:
    """The server a URL names, without user or password (never raises)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ in the host
        return "the server in --redis-url"
    if parts.scheme == "unix":
        return parts.path
    try:
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
    except ValueError:  # a bad port, or several hosts (Sentinel)
        return parts.netloc.rpartition("@")[2] or "localhost"


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


@contextlib.contextmanager
def _talking(what: str) -> Iterator[None]:
    """Turn Redis faults inside the block into registry errors naming ``what``."""
    try:
        yield
    except BrokenPipeError:  # our own stdout or stderr (redis-py wraps its socket errors)
        raise
    except REDIS_ERRORS as exc:
        error = translate(exc, what)
        if error is None:
            raise
        raise error from exc


@contextlib.contextmanager
def _connect(args: argparse.Namespace) -> Iterator[Any]:
    """A client for ``--redis-url`` that answered PING; closed at the end of the block."""
    url: str = args.redis_url
    where = _where(url)
    if _scheme(url) == "unix" and not where:
        raise UsageError("argument --redis-url: a unix:// URL names the socket: unix:///PATH")
    try:
        client = client_from_url(url, socket_connect_timeout=3, socket_timeout=10)
    except REDIS_ERRORS as exc:  # a cluster client connects at once
        raise _connect_error(exc, where) from None
    except Exception as exc:
        raise _bad_url_or_server(url, where, exc) from None
    try:
        try:
            answered = client.ping()
        except REDIS_ERRORS as exc:
            raise _connect_error(exc, where) from None
        except Exception as exc:
            raise _bad_url_or_server(url, where, exc) from None
        if not answered:
            raise CommandError(f"Redis at {where} answered PING with {answered!r:.40}")
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _bad_url_or_server(url: str, where: str, exc: Exception) -> CommandError:
    """A usage error when ``exc`` (not a Redis error) is about the URL itself; else the
    server's answers confused redis-py: a runtime error."""
    if isinstance(exc, TypeError) and "keyword argument" in str(exc):
        # An option in the URL's query that this kind of connection does not take.
        return UsageError(f"argument --redis-url: unsupported option: {exc}")
    if isinstance(exc, (TypeError, ValueError)) and not _url_is_well_formed(url):
        return UsageError(f"argument --redis-url: {exc}")
    return _not_redis(where, exc)


def _url_is_well_formed(url: str) -> bool:
    """Whether redis-py can parse ``url`` (Sentinel URLs are parsed before any I/O)."""
    scheme = _scheme(url)
    if scheme not in (*PLAIN_SCHEMES, *CLUSTER_SCHEMES):
        return False
    try:
        parse_url(CLUSTER_SCHEMES.get(scheme, scheme) + url[len(scheme) :])  # type: ignore[no-untyped-call]
    except (TypeError, ValueError):
        return False
    return True


def _connect_error(exc: BaseException, where: str) -> RegistryError:
    error = translate(exc, f"Redis at {where}")
    if error is None or isinstance(error, RegistryUnavailable):
        error = translate(exc, f"cannot reach Redis at {where}") or RegistryUnavailable(
            f"cannot reach Redis at {where}: {type(exc).__name__}: {exc}"
        )
    return error


def _not_redis(where: str, exc: BaseException) -> CommandError:
    return CommandError(
        f"Redis at {where} gave an answer that is not the Redis protocol "
        f"({type(exc).__name__}: {str(exc).strip()[:200]}); is it a Redis server?"
    )


def _text(value: Any) -> str:
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


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


def _check_simulate_sizes(config: Any) -> None:
    """Reject fleet sizes the simulation cannot run, as a usage error, before it starts.

    The place for the size checks of ``gpu/fleet.py`` (to come): call them here and turn
    their ``ValueError`` into ``UsageError`` (exit 2). Until then the parser's ranges
    (positive, at most 2^63-1) are the only check.
    """


def _command_simulate(args: argparse.Namespace) -> int:
    _check_writable(args.json)
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
    _check_simulate_sizes(config)
    routers = ["round-robin", "prefix"] if args.router == "both" else [args.router]
    with contextlib.ExitStack() as stack:
        if args.redis_url:
            client = stack.enter_context(_connect(args))
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


# -- bench ----------------------------------------------------------------------------

BENCH_SCHEMES = ("redis", "rediss", "unix")


def _command_bench(args: argparse.Namespace) -> int:
    _check_writable(args.json)
    try:
        from benchmarks.run import format_report, run
        from benchmarks.server import BenchServer
    except ImportError as exc:
        raise CommandError(f"pcr bench needs the benchmarks package ({exc})") from None

    if args.redis_url:
        if _scheme(args.redis_url) not in BENCH_SCHEMES:
            raise UsageError(
                "argument --redis-url: pcr bench measures one standalone server: "
                "give a redis://, rediss:// or unix:// URL"
            )
        with _connect(args):
            pass
        with _talking(f"Redis at {_where(args.redis_url)}"):
            report = run(args.redis_url, quick=args.quick)
    else:
        try:
            with BenchServer() as server:
                print(
                    f"pcr bench: a redis-server of its own on 127.0.0.1:{server.port}", flush=True
                )
                with _talking(f"Redis at 127.0.0.1:{server.port}"):
                    report = run(server.url, quick=args.quick)
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None
    print(format_report(report))
    if args.json:
        _write_json(args.json, report)
    return 0


# -- inspection -----------------------------------------------------------------------


def _eviction_warning(client: Any) -> str | None:
    """A warning when the server's ``maxmemory-policy`` may evict registry keys; None
    when it may not, or when CONFIG is refused (ACL) or unknown (fakeredis)."""
    reply: Any
    try:
        if isinstance(client, RedisCluster):  # every primary holds registry keys
            reply = client.config_get("maxmemory-policy", target_nodes=RedisCluster.PRIMARIES)
        else:
            reply = client.config_get("maxmemory-policy")
    except ResponseError:
        return None
    policies: set[str] = set()
    if isinstance(reply, dict):
        for key, value in reply.items():
            if isinstance(value, dict):  # a cluster client: one reply per node
                policies.update(
                    _text(v) for k, v in value.items() if _text(k) == "maxmemory-policy"
                )
            elif _text(key) == "maxmemory-policy":
                policies.add(_text(value))
    evicting = sorted(policies & set(EVICTING_POLICIES))
    if not evicting:
        return None
    return (
        f"maxmemory-policy is {', '.join(evicting)}: Redis may evict registry keys when it "
        "is full; use noeviction (or a volatile-* policy)"
    )


def _index_members(client: Any, key_prefix: str) -> tuple[list[str], list[str]]:
    """The valid namespaces of the node index (live, then dead) and its invalid members."""
    with _talking(f"node index {key_prefix}:nodes"):
        index = NodeIndex(client, key_prefix)
        return [*index.live(), *index.dead()], index.invalid()


def _command_stats(args: argparse.Namespace) -> int:
    server = f"Redis at {_where(args.redis_url)}"
    with _connect(args) as client:
        with _talking(server):
            warning = _eviction_warning(client)
        namespaces, invalid = _index_members(client, args.key_prefix)
        with _talking(server):
            now_ms = _server_ms(client)
        rows = [
            _stats_row(client, namespace, args.key_prefix, now_ms)
            for namespace in dict.fromkeys([*namespaces, *(args.namespace or [])])
        ]
    rows += [_invalid_row(member, args.json) for member in invalid]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        headers = list(rows[0])
        print(format_table(headers, [[r[h] for h in headers] for r in rows]))
    else:
        print(f"no namespaces under key prefix {args.key_prefix!r}")
    if warning is not None:  # after the figures: a failed run prints its error line only
        _warn(args.command, warning)
    return 0


def _stats_row(client: Any, namespace: str, key_prefix: str, now_ms: int) -> dict[str, Any]:
    keys = NamespaceKeys(namespace, key_prefix)
    with _talking(f"namespace {namespace!r}, key {keys.meta!r}"):
        meta = {_text(k): _text(v) for k, v in client.hgetall(keys.meta).items()}
    with _talking(f"namespace {namespace!r}, key {keys.kv!r}"):
        kv_entries = client.hlen(keys.kv)
    with _talking(f"namespace {namespace!r}, key {keys.mamba!r}"):
        mamba_entries = client.hlen(keys.mamba)
    with _talking(f"namespace {namespace!r}"):
        memory = _memory(client, keys.all_keys())
    lease = _int_or_none(meta.get("lease_until"))
    return {
        "namespace": namespace,
        "kv_entries": kv_entries,
        "mamba_entries": mamba_entries,
        "memory_bytes": memory,
        "state": "no lease" if lease is None else ("live" if lease > now_ms else "dead"),
        "lease_left_s": None if lease is None else round((lease - now_ms) / 1000, 1),
        "epoch": _int_or_none(meta.get("epoch", 0)),
        "notice_seq": _int_or_none(meta.get("notice_seq", 0)),
    }


def _invalid_row(member: str, as_json: bool) -> dict[str, Any]:
    """A stats row for a node-index member that is not a valid namespace (quoted in the
    table, where it may be empty or hold spaces)."""
    return {
        "namespace": member if as_json else f"'{_one_line(member)}'",
        "kv_entries": None,
        "mamba_entries": None,
        "memory_bytes": None,
        "state": "invalid",
        "lease_left_s": None,
        "epoch": None,
        "notice_seq": None,
    }


def _server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _memory(client: Any, keys: Sequence[str]) -> int | None:
    try:
        return sum(int(client.memory_usage(k) or 0) for k in keys)
    except ResponseError:  # servers without MEMORY (fakeredis), or an ACL refusing it
        return None


def _command_inspect(args: argparse.Namespace) -> int:
    keys = NamespaceKeys(args.namespace_name, args.key_prefix)
    key = keys.kv if args.kind == "kv" else keys.mamba
    with _connect(args) as client, _talking(f"key {key!r}"):
        cursor, page = client.hscan(key, cursor=args.cursor, count=args.count)
        total = None if args.json else client.hlen(key)
    entries = []
    for field, value in page.items():
        pair = _int_or_none(field), _int_or_none(value)
        if pair[0] is None or pair[1] is None:
            raise CommandError(
                f"key {key!r} holds an entry that is not two integers: "
                f"{_text(field)!r:.60} -> {_text(value)!r:.60}; something else wrote it"
            )
        entries.append(pair)
    entries.sort()
    if args.json:
        print(json.dumps({"key": key, "next_cursor": int(cursor), "entries": entries}))
        return 0
    print(f"{key}: {total} entries; this page {len(entries)}")
    if entries:
        print(format_table(["hash", "block_id"], entries))
    if int(cursor):
        print(f"more: pcr inspect {args.namespace_name} --kind {args.kind} --cursor {int(cursor)}")
    return 0


def _hashes_of(args: argparse.Namespace) -> list[int]:
    if args.tokens and args.hashes:
        raise UsageError("give block hashes or --tokens, not both")
    if args.tokens:
        return block_hashes(args.tokens, args.block_size)
    if not args.hashes:
        raise UsageError("give block hashes, or --tokens with --block-size")
    return list(args.hashes)


def _command_match(args: argparse.Namespace) -> int:
    hashes = _hashes_of(args)
    namespace: str | None = args.namespace_name
    with _connect(args) as client, _talking(f"Redis at {_where(args.redis_url)}"):
        if namespace is None:
            scores = PrefixRouter(client, args.key_prefix).score(hashes)
        else:
            registry = PrefixCacheRegistry(client, namespace, key_prefix=args.key_prefix)
            block_ids, parent = registry.match_kv_prefix(hashes)
            mamba = registry.match_mamba_farthest(hashes[: len(block_ids)]) if block_ids else 0
    if namespace is None:
        return _print_scores(args, len(hashes), scores)
    result = {
        "namespace": namespace,
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
            f"{namespace}: {len(block_ids)} of {len(hashes)} blocks cached, "
            f"Mamba state usable up to block {mamba}; block ids {block_ids}"
        )
    return 0


def _print_scores(args: argparse.Namespace, blocks: int, scores: dict[str, Any]) -> int:
    result = [
        {"namespace": s.namespace, "kv_prefix": s.kv_prefix, "mamba_prefix": s.mamba_prefix}
        for s in sorted(scores.values(), key=lambda s: (-s.usable, s.namespace))
    ]
    if args.json:
        print(json.dumps(result))
    elif result:
        print(f"{blocks} blocks; live nodes, best first:")
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
    with _connect(args) as client, _talking(f"channel {channel!r}"):
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(channel)
            _confirmed(pubsub, channel, _where(args.redis_url))
            if not args.json:
                print(f"watching {channel} (Ctrl-C to stop)", flush=True)
            _follow(pubsub, args)
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()
    return 0


SUBSCRIBE_SECONDS = 10.0
"""How long ``pcr watch`` waits for Redis to confirm its subscription."""


def _confirmed(pubsub: Any, channel: str, where: str) -> None:
    """Wait for Redis to confirm the subscription: a refusal (an ACL without the channel)
    is an error now, and "watching" is printed only once notices can arrive."""
    deadline = time.monotonic() + SUBSCRIBE_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=min(left, 1.0))
        if message is None:
            continue
        if _text(message.get("type")) == "subscribe":
            return
        raise CommandError(f"Redis at {where} answered SUBSCRIBE with {message!r:.100}")
    raise CommandError(
        f"Redis at {where} did not confirm the subscription to {channel!r} within "
        f"{SUBSCRIBE_SECONDS:.0f} s"
    )


def _follow(pubsub: Any, args: argparse.Namespace) -> None:
    seen = 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
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
            print(f"malformed message: {_one_line(str(exc))}", flush=True)
            continue
        if args.json:
            print(
                json.dumps({"seq": notice.seq, "kind": notice.kind, "pairs": notice.pairs}),
                flush=True,
            )
        else:
            pairs = " ".join(f"{b}:{h}" for b, h in notice.pairs)
            print(f"#{notice.seq} {notice.kind} {pairs}".rstrip(), flush=True)


def _command_gc(args: argparse.Namespace) -> int:
    with _connect(args) as client, _talking(f"node index {args.key_prefix}:nodes"):
        index = NodeIndex(client, args.key_prefix)
        if args.dry_run:
            invalid = index.invalid()
            names = index.dead()
        else:
            invalid = index.remove_invalid()
            names = index.gc()
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps([*names, *invalid]))
        return 0
    print(f"{verb} {len(names)}: {' '.join(names)}".rstrip())
    if invalid:
        shown = " ".join(f"'{_one_line(m)}'" for m in invalid)
        print(f"{verb} {len(invalid)} invalid node-index members: {shown}")
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
            type=_url,
            default=url_default,
            help="redis://, rediss://, unix://, redis+cluster:// URL (default: $REDIS_URL"
            + (f", else {DEFAULT_URL})" if url_default else "; without it: an embedded fakeredis)"),
        )
        command.add_argument(
            "--key-prefix",
            type=_key_prefix,
            default=DEFAULT_KEY_PREFIX,
            help="key prefix (default: pcr)",
        )

    env_url = os.environ.get("REDIS_URL") or None  # set but empty: as if unset

    sim = commands.add_parser("simulate", help="the serving-fleet simulation (the main job)")
    redis_options(sim, env_url)
    sim.add_argument(
        "--serve-port", type=_port, help="also serve the embedded Redis on this TCP port"
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
    sim.add_argument("--seed", type=_seed, default=0, help="workload seed (default 0)")
    sim.add_argument(
        "--json", metavar="FILE", help="also write the figures to FILE (checked before the run)"
    )
    sim.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown only on a terminal)"
    )
    sim.set_defaults(handler=_command_simulate, command_parser=sim)

    bench = commands.add_parser("bench", help="measure every operation against raw Redis commands")
    bench.add_argument(
        "--redis-url",
        type=_url,
        default=None,
        help="a standalone server to measure (default: a redis-server it starts itself); "
        "it is FLUSHed",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions: under a minute")
    bench.add_argument(
        "--json", metavar="FILE", help="also write the figures to FILE (checked before the run)"
    )
    bench.set_defaults(handler=_command_bench, command_parser=bench)

    stats = commands.add_parser(
        "stats", help="per namespace: entries, memory, lease, epoch, notices"
    )
    redis_options(stats, env_url or DEFAULT_URL)
    stats.add_argument(
        "--namespace",
        type=_namespace,
        action="append",
        help="also show this namespace (repeatable)",
    )
    stats.add_argument("--json", action="store_true", help="JSON output")
    stats.set_defaults(handler=_command_stats, command_parser=stats)

    inspect = commands.add_parser("inspect", help="a namespace's mappings, one page at a time")
    redis_options(inspect, env_url or DEFAULT_URL)
    inspect.add_argument("namespace_name", metavar="NAMESPACE", type=_namespace)
    inspect.add_argument("--kind", choices=["kv", "mamba"], default="kv")
    inspect.add_argument(
        "--cursor", type=_cursor, default=0, help=f"HSCAN cursor of the page (0 to {MAX_CURSOR})"
    )
    inspect.add_argument(
        "--count", type=_page, default=50, help=f"about this many per page (1 to {MAX_PAGE})"
    )
    inspect.add_argument("--json", action="store_true", help="JSON output")
    inspect.set_defaults(handler=_command_inspect, command_parser=inspect)

    match = commands.add_parser(
        "match", help="cached prefix of hashes or tokens (one node, or all)"
    )
    redis_options(match, env_url or DEFAULT_URL)
    match.add_argument(
        "hashes", metavar="HASH", nargs="*", type=_hash, help="block hashes (1 to 2^63-1)"
    )
    match.add_argument(
        "--namespace",
        dest="namespace_name",
        type=_namespace,
        help="one node (default: every live node)",
    )
    match.add_argument("--tokens", type=_token, nargs="+", help="token ids to hash instead")
    match.add_argument(
        "--block-size",
        type=_block_size,
        default=16,
        help=f"tokens per block (1 to {MAX_BLOCK_SIZE})",
    )
    match.add_argument("--json", action="store_true", help="JSON output")
    match.set_defaults(handler=_command_match, command_parser=match)

    watch = commands.add_parser("watch", help="follow a namespace's eviction notices")
    redis_options(watch, env_url or DEFAULT_URL)
    watch.add_argument("namespace_name", metavar="NAMESPACE", type=_namespace)
    watch.add_argument("--count", type=_notices, help="stop after this many notices")
    watch.add_argument(
        "--timeout",
        type=_seconds,
        help=f"stop after this many seconds (0 to {MAX_WATCH_SECONDS:.0f})",
    )
    watch.add_argument("--json", action="store_true", help="one JSON object per notice")
    watch.set_defaults(handler=_command_watch, command_parser=watch)

    gc = commands.add_parser(
        "gc", help="remove namespaces whose lease has expired, and invalid node-index members"
    )
    redis_options(gc, env_url or DEFAULT_URL)
    gc.add_argument("--dry-run", action="store_true", help="only list them")
    gc.add_argument("--json", action="store_true", help="JSON output")
    gc.set_defaults(handler=_command_gc, command_parser=gc)
    return parser


# -- the entry point ------------------------------------------------------------------


def _say(command: str | None, message: str, label: str = "error") -> None:
    prog = f"pcr {command}" if command else "pcr"
    text = f"{prog}: {label}: {message}" if label else f"{prog}: {message}"
    with contextlib.suppress(Exception):  # nothing more can be said without a stderr
        sys.stderr.write(_scrub(_one_line(text)) + "\n")
        sys.stderr.flush()


_SECRETS: list[str] = []
"""Passwords of the URL in use, never to be printed."""


def _scrub(text: str) -> str:
    for secret in _SECRETS:
        text = text.replace(secret, "***")
    return text


def _remember_secrets(url: str | None) -> None:
    _SECRETS.clear()
    if url:
        with contextlib.suppress(ValueError):
            password = urlsplit(url).password
            if password and len(password) >= 3:
                from urllib.parse import unquote

                _SECRETS.extend({password, unquote(password)})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pcr`` console script and ``python -m registry``: returns the
    exit status (0 fine, 1 runtime error, 2 usage error, 130 interrupted); errors are one
    line on stderr, never a traceback."""
    command: str | None = None
    url: str | None = None
    handler = _OneLineLog()
    _tolerant_stdout()
    try:
        with warnings.catch_warnings(), handler.installed():
            warnings.showwarning = handler.show_warning
            parser = build_parser()
            try:
                args, extra = parser.parse_known_args(argv)
                if extra:  # said by the command's parser: "pcr stats: error: ..."
                    args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
            except SystemExit as exc:  # --help, or a usage error already printed
                sys.stdout.flush()  # here, where a broken pipe is still caught
                return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            command = handler.command = args.command
            url = getattr(args, "redis_url", None)
            _remember_secrets(url)
            if command in ("stats", "gc"):  # these list invalid node-index members
                handler.quiet = ("registry.membership",)
            run: Callable[[argparse.Namespace], int] = args.handler
            code = run(args)
            sys.stdout.flush()
            return code
    except KeyboardInterrupt:
        _say(command, "interrupted", label="")
        return EXIT_INTERRUPTED
    except UsageError as exc:
        _say(command, f"{exc} (see pcr {command} --help)" if command else str(exc))
        return EXIT_USAGE
    except (CommandError, RegistryError) as exc:
        _say(command, str(exc))
        return EXIT_RUNTIME
    except BrokenPipeError:
        _quiet_stdout()
        _say(command, "standard output was closed (broken pipe)")
        return EXIT_RUNTIME
    except (RedisError, RedisClusterException) as exc:  # one that no _talking block named
        error = translate(exc, f"Redis at {_where(url)}" if url else "Redis")
        _say(command, str(error or exc))
        return EXIT_RUNTIME
    except Exception as exc:
        _say(command, f"internal error: {type(exc).__name__}: {exc}")
        return EXIT_RUNTIME


class _OneLineLog(logging.Handler):
    """Library log records and Python warnings as one line each on stderr, while
    ``main`` runs (the last-resort handler would print tracebacks)."""

    LOGGERS = ("registry", "gpu", "benchmarks")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.command: str | None = None
        self.quiet: tuple[str, ...] = ()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        loggers = [logging.getLogger(name) for name in self.LOGGERS]
        for logger in loggers:
            logger.addHandler(self)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.quiet and record.name.startswith(self.quiet):
            return
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            message += f" ({type(exc).__name__}: {str(exc).strip()[:200]})"
        _say(self.command, message, label=record.levelname)

    def show_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        _say(self.command, f"{category.__name__}: {message}", label="WARNING")


def _tolerant_stdout() -> None:
    """On a terminal that is not UTF-8, print what it cannot show as escapes instead of
    failing (a namespace or invalid index member may hold any character)."""
    stdout = sys.stdout
    if isinstance(stdout, io.TextIOWrapper) and stdout.errors == "strict":
        with contextlib.suppress(LookupError, ValueError):
            if codecs.lookup(stdout.encoding).name != "utf-8":
                stdout.reconfigure(errors="backslashreplace")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the flush at exit cannot fail on the broken pipe."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
