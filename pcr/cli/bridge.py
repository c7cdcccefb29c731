"""``pcr bridge``: follow engines' KV-event streams into bridged namespaces."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pcr.cli import common
from pcr.cli.common import CommandError, UsageError, shown_url, talking
from registry.bridge.source import ENGINES, EngineSource

STATUS_FIELDS = (
    "batches",
    "blocks_stored",
    "blocks_removed",
    "clears",
    "gaps",
    "restarts",
    "bad_messages",
    "orphans",
    "redis_errors",
    "refused_events",
    "dropped_messages",
    "quota_refused_blocks",
)


def endpoint(text: str) -> str:
    """An argparse type: a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH)."""
    from registry.bridge.source import checked_endpoint

    try:
        return checked_endpoint(text, "endpoint")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_arg(text: str) -> int:
    """An argparse type: a positive count of bytes or blocks, ``K``/``M``/``G`` suffixes
    taken as powers of 1,024 (``64M``)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    body = text.strip().upper().replace("_", "").replace(",", "")
    scale = units.get(body[-1:], 1)
    digits = body[:-1] if body[-1:] in units else body
    if not digits.isdigit() or not 1 <= int(digits) * scale <= 1 << 40:
        raise argparse.ArgumentTypeError(
            f"expected a positive whole number such as 262144 or 64M, not {text!r:.40}"
        )
    return int(digits) * scale


def media(text: str) -> tuple[str, ...]:
    """An argparse type: ``GPU`` or ``GPU,CPU``: the media whose blocks are followed."""
    names = tuple(part.strip().upper() for part in text.split(","))
    if not names or not all(n and n.isalnum() and len(n) <= 32 for n in names):
        raise argparse.ArgumentTypeError(
            f"media must be names such as GPU or GPU,CPU: {text!r:.40}"
        )
    if len(set(names)) != len(names) or len(names) > 8:
        raise argparse.ArgumentTypeError(f"media must be 1 to 8 distinct names: {text!r:.40}")
    return names


def add_parser(commands: Any, redis_options: Any, url_default: str) -> None:
    """The ``pcr bridge`` subcommand."""
    bridge = commands.add_parser(
        "bridge",
        help="follow vLLM / SGLang KV-event streams (ZeroMQ) into bridged namespaces",
        description="Follow engines' KV-cache events into Redis. Give --endpoint and "
        "--namespace once per engine (the i-th namespace follows the i-th endpoint); "
        "--replay-endpoint either never or once per engine ('-' for an engine without one).",
    )
    redis_options(bridge, url_default)
    _add_engine_options(bridge)
    _add_run_options(bridge)
    bridge.set_defaults(handler=command_bridge, command_parser=bridge)


def _add_engine_options(bridge: Any) -> None:
    """The options that say which engines are followed, and into which namespaces."""
    from pcr.cli.common import block_size_arg

    bridge.add_argument("--engine", choices=ENGINES, default="vllm", help="default: vllm")
    bridge.add_argument(
        "--endpoint",
        type=endpoint,
        action="append",
        required=True,
        help="the engine's PUB socket, e.g. tcp://10.0.0.7:5557 (repeatable)",
    )
    bridge.add_argument(
        "--replay-endpoint",
        type=lambda t: None if t == "-" else endpoint(t),
        action="append",
        help="the engine's replay (ROUTER) socket, e.g. tcp://10.0.0.7:5558 (repeatable)",
    )
    bridge.add_argument(
        "--namespace",
        dest="namespaces",
        type=common.namespace_arg,
        action="append",
        required=True,
        help="the namespace the engine feeds (repeatable, one per --endpoint)",
    )
    bridge.add_argument(
        "--engine-url",
        action="append",
        help="the engine's HTTP base URL, e.g. http://10.0.0.7:8000, announced for pcr "
        "gateway (repeatable, once per --endpoint, '-' for none)",
    )
    bridge.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    bridge.add_argument(
        "--block-size",
        type=block_size_arg,
        help="tokens per block routers hash with (default: the engine's, from its first event)",
    )
    bridge.add_argument("--medium", type=media, default=("GPU",), help="GPU (default) or GPU,CPU")


def _add_run_options(bridge: Any) -> None:
    """The options that say how the bridge runs: the lease, silence, counts, duration."""
    from pcr.cli.common import seconds_arg

    bridge.add_argument(
        "--lease-ttl", type=seconds_arg, default=10.0, help="lease length in seconds (default 10)"
    )
    bridge.add_argument(
        "--silence-timeout",
        type=seconds_arg,
        default=30.0,
        help="seconds without a word from an engine before its lease is left to run out "
        "(default 30)",
    )
    bridge.add_argument(
        "--stats-interval",
        type=seconds_arg,
        default=30.0,
        help="print each engine's counts this often (seconds; 0: only at the end)",
    )
    bridge.add_argument(
        "--duration", type=seconds_arg, help="stop after this many seconds (default: until stopped)"
    )
    bridge.add_argument("--json", action="store_true", help="print counts as JSON lines")
    _add_bound_options(bridge)


def _add_bound_options(bridge: Any) -> None:
    """The bounds on what one engine can cost the bridge and Redis."""
    from registry.bridge.bounds import (
        DEFAULT_MAX_EVENT_BLOCKS,
        DEFAULT_MAX_MESSAGE_BYTES,
        DEFAULT_MAX_QUEUE_BYTES,
    )

    bridge.add_argument(
        "--max-message-bytes",
        type=size_arg,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="the largest message read from an engine; ZeroMQ refuses larger ones as they "
        "arrive (default 64M)",
    )
    bridge.add_argument(
        "--max-queue-bytes",
        type=size_arg,
        default=DEFAULT_MAX_QUEUE_BYTES,
        help="bytes of messages one engine may have waiting; more are dropped, counted, "
        "and the gap resynced (default 256M)",
    )
    bridge.add_argument(
        "--max-event-blocks",
        type=size_arg,
        default=DEFAULT_MAX_EVENT_BLOCKS,
        help="blocks one event may list; a larger event is refused undecoded and counted "
        "(default 262144: more than a GPU's prefix cache holds)",
    )


def sources(args: argparse.Namespace) -> list[EngineSource]:
    """One ``EngineSource`` per ``--endpoint``; usage errors for counts that do not pair."""
    endpoints, namespaces = args.endpoint, args.namespaces
    replays = args.replay_endpoint or [None] * len(endpoints)
    if len(namespaces) != len(endpoints):
        raise UsageError(
            f"give one --namespace per --endpoint ({len(endpoints)} endpoints, "
            f"{len(namespaces)} namespaces)"
        )
    if len(replays) != len(endpoints):
        raise UsageError(
            f"give --replay-endpoint once per --endpoint, '-' for none ({len(endpoints)} "
            f"endpoints, {len(replays)} replay endpoints)"
        )
    urls = [None if u == "-" else u for u in args.engine_url or [None] * len(endpoints)]
    if len(urls) != len(endpoints):
        raise UsageError(
            f"give --engine-url once per --endpoint, '-' for none ({len(endpoints)} "
            f"endpoints, {len(urls)} engine URLs)"
        )
    if len(set(namespaces)) != len(namespaces):
        raise UsageError("each engine needs a namespace of its own")
    if args.lease_ttl < 0.1 or args.silence_timeout < 0.1:
        raise UsageError("--lease-ttl and --silence-timeout must be at least 0.1 s")
    try:
        return [
            EngineSource(
                namespace=ns,
                endpoint=ep,
                replay_endpoint=replay,
                engine=args.engine,
                topic=args.topic,
                block_size=args.block_size,
                media=args.medium,
                engine_url=url,
            )
            for ns, ep, replay, url in zip(namespaces, endpoints, replays, urls, strict=True)
        ]
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


@contextmanager
def _stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM (and SIGHUP) end the bridge cleanly, as Ctrl-C does."""
    previous = {}
    for number in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            previous[number] = signal.signal(number, lambda *_: stop.set())
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def command_bridge(args: argparse.Namespace) -> int:
    """``pcr bridge``: follow the engines until stopped (or ``--duration``), printing
    each engine's counts every ``--stats-interval`` and at the end."""
    followed = sources(args)
    needed = {"zmq": "pyzmq", "msgpack": "msgpack"}  # module: package
    missing = [
        package for name, package in needed.items() if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise CommandError(
            f"pcr bridge needs {' and '.join(missing)}: pip install 'prefix-cache-registry[bridge]'"
        )
    from registry.bridge.bridge import Bridge

    with common.connect(args) as client:
        try:
            bridge = Bridge(
                client,
                followed,
                key_prefix=args.key_prefix,
                lease_ttl=args.lease_ttl,
                silence_timeout=args.silence_timeout,
                max_message_bytes=args.max_message_bytes,
                max_queue_bytes=args.max_queue_bytes,
                max_event_blocks=args.max_event_blocks,
            )
        except ImportError as exc:
            raise CommandError(str(exc)) from None
        where = shown_url(args.redis_url)
        for source in followed:
            replay = f", replay {source.replay_endpoint}" if source.replay_endpoint else ""
            print(
                f"pcr bridge: {source.engine} {source.endpoint}{replay} -> namespace "
                f"{source.namespace!r} on Redis at {where}",
                flush=True,
            )
        stop = threading.Event()
        deadline = None if args.duration is None else time.monotonic() + args.duration
        bridge.start()
        try:
            with _stopped_by_signals(stop), talking(f"Redis at {where}"):
                next_status = time.monotonic() + (args.stats_interval or float("inf"))
                while not stop.wait(0.2):
                    now = time.monotonic()
                    if bridge.error is not None:
                        raise CommandError(f"the bridge stopped: {bridge.error}")
                    if deadline is not None and now >= deadline:
                        break
                    if now >= next_status:
                        _print_counts(bridge.counts(), args.json)
                        next_status = now + args.stats_interval
        except KeyboardInterrupt:  # Ctrl-C: the counts, then exit 130 as every command
            bridge.stop()
            _print_counts(bridge.counts(), args.json)
            raise
        finally:
            bridge.stop()
        _print_counts(bridge.counts(), args.json)
    return 0


def _print_counts(counts: dict[str, dict[str, int]], as_json: bool) -> None:
    for namespace, values in counts.items():
        if as_json:
            print(json.dumps({"namespace": namespace, **values}), flush=True)
        else:
            shown = " ".join(f"{name}={values[name]}" for name in STATUS_FIELDS)
            print(f"{namespace}: {shown}", flush=True)
