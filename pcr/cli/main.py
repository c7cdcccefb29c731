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

Redis faults are mapped to the registry's error vocabulary by ``registry.core.errors.translate``
(the project's one mapping), so the CLI and the library word them alike.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import RedisClusterException, RedisError

# -- the parser -----------------------------------------------------------------------
from pcr.cli.bench import command_bench
from pcr.cli.bridge import add_parser as add_bridge_parser
from pcr.cli.common import (
    DEFAULT_URL,
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    EXIT_USAGE,
    MAX_BLOCK_SIZE,
    MAX_CURSOR,
    MAX_NOTICES,
    MAX_PAGE,
    MAX_WATCH_SECONDS,
    CommandError,
    Parser,
    UsageError,
    block_size_arg,
    cursor_arg,
    hash_arg,
    key_prefix_arg,
    namespace_arg,
    notices_arg,
    one_line,
    page_arg,
    port_arg,
    positive_arg,
    seconds_arg,
    seed_arg,
    shown_url,
    token_arg,
    url_arg,
)
from pcr.cli.gateway import add_parser as add_gateway_parser
from pcr.cli.inspection import (
    command_gc,
    command_inspect,
    command_match,
    command_stats,
    command_watch,
)
from pcr.cli.quota import add_parser as add_quota_parser
from pcr.cli.serve import add_parser as add_serve_parser
from pcr.cli.setup import add_parser as add_setup_parser
from pcr.cli.simulate import MAMBA_CHECKPOINTS, add_trace_options, command_simulate
from registry.core.errors import (
    RegistryError,
    translate,
)
from registry.core.keys import DEFAULT_KEY_PREFIX

BENCH_SIZES = (16, 64, 512, 8192)


def _bench_sizes(text: str) -> tuple[int, ...]:
    """``--sizes``: a comma-separated subset of the sizes ``pcr bench`` knows."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sizes: {text!r:.40}") from None
    if not sizes or not set(sizes) <= set(BENCH_SIZES):
        known = ",".join(map(str, BENCH_SIZES))
        raise argparse.ArgumentTypeError(f"sizes must be among {known}, not {text!r:.40}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """The ``pcr`` argument parser (also used by tests to check documented commands)."""
    parser = Parser(
        prog="pcr", description="Redis-backed prefix-cache registry: simulate, inspect, repair."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    env_url = os.environ.get("REDIS_URL") or None  # set but empty: as if unset
    url = env_url or DEFAULT_URL
    _add_simulate(commands, env_url)
    _add_bench(commands)
    _add_stats(commands, url)
    _add_inspect(commands, url)
    _add_match(commands, url)
    _add_watch(commands, url)
    _add_gc(commands, url)
    add_setup_parser(commands, url)
    add_quota_parser(commands, _redis_options, url)
    add_bridge_parser(commands, _redis_options, url)
    add_serve_parser(commands, _redis_options, url)
    add_gateway_parser(commands, _redis_options, url)
    return parser


def _redis_options(command: argparse.ArgumentParser, url_default: str | None) -> None:
    """``--redis-url`` (``url_default``: None for an embedded fakeredis) and ``--key-prefix``."""
    command.add_argument(
        "--redis-url",
        type=url_arg,
        default=url_default,
        help="redis://, rediss://, unix://, redis+cluster:// URL (default: $REDIS_URL"
        + (f", else {DEFAULT_URL})" if url_default else "; without it: an embedded fakeredis)"),
    )
    command.add_argument(
        "--key-prefix",
        type=key_prefix_arg,
        default=DEFAULT_KEY_PREFIX,
        help="key prefix (default: pcr)",
    )


def _add_simulate(commands: Any, url_default: str | None) -> None:
    """``pcr simulate``: the fleet and its workload; then how it is fed (``_simulate_modes``)."""
    sim = commands.add_parser("simulate", help="the serving-fleet simulation (the main job)")
    _redis_options(sim, url_default)
    sim.add_argument(
        "--serve-port", type=port_arg, help="also serve the embedded Redis on this TCP port"
    )
    sim.add_argument("--router", choices=["round-robin", "prefix", "both"], default="both")
    sim.add_argument("--nodes", type=positive_arg, default=4, help="serving nodes (default 4)")
    sim.add_argument(
        "--requests", type=positive_arg, default=1000, help="requests per router (default 1000)"
    )
    sim.add_argument(
        "--kv-blocks", type=positive_arg, default=512, help="KV blocks per node (default 512)"
    )
    sim.add_argument(
        "--mamba-slots", type=positive_arg, default=32, help="Mamba slots per node (default 32)"
    )
    sim.add_argument(
        "--block-size", type=positive_arg, default=16, help="tokens per block (default 16)"
    )
    sim.add_argument("--seed", type=seed_arg, default=0, help="workload seed (default 0)")
    sim.add_argument(
        "--mamba-checkpoints",
        choices=MAMBA_CHECKPOINTS,
        default=MAMBA_CHECKPOINTS[0],
        help="where a node keeps Mamba state: vllm (default) at each prompt's last block "
        "boundary before its last token and where it shares a prefix with a cached one, as "
        "vLLM does; last-block at its last full block only",
    )
    sim.add_argument(
        "--json", metavar="FILE", help="also write the figures to FILE (checked before the run)"
    )
    sim.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown only on a terminal)"
    )
    _simulate_modes(sim)
    add_trace_options(sim)
    sim.set_defaults(handler=command_simulate, command_parser=sim)


def _simulate_modes(sim: argparse.ArgumentParser) -> None:
    """``pcr simulate``'s other ways to run: through the bridge, with mirrored owners,
    with metrics served."""
    sim.add_argument(
        "--bridge",
        action="store_true",
        help="feed the fleet through pcr bridge: each node keeps its own cache and publishes "
        "vLLM KV events (ZeroMQ) instead of writing Redis; one bridge follows them all into "
        "their namespaces (needs the bridge extra)",
    )
    sim.add_argument(
        "--bridge-lockstep",
        action="store_true",
        help="with --bridge: route each request only once the bridge has applied every batch "
        "sent (then the figures match the direct mode's); by default the router reads "
        "whatever the bridge has applied so far",
    )
    sim.add_argument(
        "--bridge-drop-every",
        type=positive_arg,
        metavar="N",
        help="with --bridge: send every Nth batch of a node to its replay buffer only, as if "
        "the subscription lost it (the bridge sees a gap and replays it); N >= 2",
    )
    sim.add_argument(
        "--mirror",
        action="store_true",
        help="also run each router with mirrored owners (registry.MirroredRegistry: each "
        "node answers its own calls locally and writes behind to Redis); the table shows "
        "the registry cost per request of both runs side by side",
    )
    sim.add_argument(
        "--metrics-port",
        type=port_arg,
        help="serve Prometheus metrics on this TCP port (all interfaces) while it runs "
        "(needs the metrics extra)",
    )


def _add_bench(commands: Any) -> None:
    """The ``pcr bench`` subcommand and its options."""
    bench = commands.add_parser("bench", help="measure every operation against raw Redis commands")
    bench.add_argument(
        "--redis-url",
        type=url_arg,
        default=None,
        help="a standalone server to measure (default: a redis-server it starts itself); "
        "it is FLUSHed",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions: under a minute")
    bench.add_argument(
        "--sizes",
        type=_bench_sizes,
        default=BENCH_SIZES,
        help="the prompt sizes to measure, comma-separated (default: 16,64,512,8192)",
    )
    bench.add_argument(
        "--fleet",
        "--view",
        dest="fleet",
        action="store_true",
        help="instead: one routing decision, in process from the fleet view beside "
        "Dynamo's RadixTree (pip install ai-dynamo-runtime) at 16, 64, 256 and 1,024 nodes "
        "(16 and 256 with --quick), on long prompts each held by a few nodes at different "
        "lengths (the headline) and on a realistic fleet of shorter prefixes; then through "
        "Redis over 16, 64 and 256 live namespaces (16 and 64 with --quick), from the view "
        "and exactly, on a "
        "standalone server and a 3-master cluster of its own (or on --redis-url only, which "
        "may then be a redis+cluster:// URL); then a write's way to a view, a view's cold "
        "start and an owner write's cost",
    )
    bench.add_argument(
        "--durability",
        action="store_true",
        help="instead: a write's cost with and without wait_replicas=1, side by side on "
        "a primary with a replica and a 3-master cluster with a replica each, of its own",
    )
    bench.add_argument(
        "--best-case",
        action="store_true",
        help="with --fleet: also the labelled best case (every node holding one chain)",
    )
    bench.add_argument(
        "--json", metavar="FILE", help="also write the figures to FILE (checked before the run)"
    )
    bench.set_defaults(handler=command_bench, command_parser=bench)


def _add_stats(commands: Any, url_default: str | None) -> None:
    """The ``pcr stats`` subcommand and its options."""
    stats = commands.add_parser(
        "stats", help="per namespace: entries, memory, lease, epoch, notices"
    )
    _redis_options(stats, url_default)
    stats.add_argument(
        "--namespace",
        type=namespace_arg,
        action="append",
        help="also show this namespace (repeatable)",
    )
    stats.add_argument("--json", action="store_true", help="JSON output")
    stats.set_defaults(handler=command_stats, command_parser=stats)


def _add_inspect(commands: Any, url_default: str | None) -> None:
    """The ``pcr inspect`` subcommand and its options."""
    inspect = commands.add_parser("inspect", help="a namespace's mappings, one page at a time")
    _redis_options(inspect, url_default)
    inspect.add_argument("namespace_name", metavar="NAMESPACE", type=namespace_arg)
    inspect.add_argument("--kind", choices=["kv", "mamba"], default="kv")
    inspect.add_argument(
        "--cursor", type=cursor_arg, default=0, help=f"HSCAN cursor of the page (0 to {MAX_CURSOR})"
    )
    inspect.add_argument(
        "--count", type=page_arg, default=50, help=f"about this many per page (1 to {MAX_PAGE})"
    )
    inspect.add_argument("--json", action="store_true", help="JSON output")
    inspect.set_defaults(handler=command_inspect, command_parser=inspect)


def _add_match(commands: Any, url_default: str | None) -> None:
    """The ``pcr match`` subcommand and its options."""
    match = commands.add_parser(
        "match", help="cached prefix of hashes or tokens (one node, or all)"
    )
    _redis_options(match, url_default)
    match.add_argument(
        "hashes", metavar="HASH", nargs="*", type=hash_arg, help="block hashes (1 to 2^63-1)"
    )
    match.add_argument(
        "--namespace",
        dest="namespace_name",
        type=namespace_arg,
        help="one node (default: every live node)",
    )
    match.add_argument("--tokens", type=token_arg, nargs="+", help="token ids to hash instead")
    match.add_argument(
        "--block-size",
        type=block_size_arg,
        default=16,
        help=f"tokens per block (1 to {MAX_BLOCK_SIZE})",
    )
    match.add_argument("--json", action="store_true", help="JSON output")
    match.set_defaults(handler=command_match, command_parser=match)


def _add_watch(commands: Any, url_default: str | None) -> None:
    """The ``pcr watch`` subcommand and its options."""
    watch = commands.add_parser("watch", help="follow a namespace's eviction notices")
    _redis_options(watch, url_default)
    watch.add_argument("namespace_name", metavar="NAMESPACE", type=namespace_arg)
    watch.add_argument(
        "--count", type=notices_arg, help=f"stop after this many notices (1 to {MAX_NOTICES:,})"
    )
    watch.add_argument(
        "--timeout",
        type=seconds_arg,
        help=f"stop after this many seconds (0 to {MAX_WATCH_SECONDS:.0f})",
    )
    watch.add_argument("--json", action="store_true", help="one JSON object per notice")
    watch.set_defaults(handler=command_watch, command_parser=watch)


def _add_gc(commands: Any, url_default: str | None) -> None:
    """The ``pcr gc`` subcommand and its options."""
    gc = commands.add_parser(
        "gc", help="remove namespaces whose lease has expired, and invalid node-index members"
    )
    _redis_options(gc, url_default)
    gc.add_argument("--dry-run", action="store_true", help="only list them")
    gc.add_argument("--json", action="store_true", help="JSON output")
    gc.set_defaults(handler=command_gc, command_parser=gc)


# -- the entry point ------------------------------------------------------------------


def _say(command: str | None, message: str, label: str = "error") -> None:
    prog = f"pcr {command}" if command else "pcr"
    text = f"{prog}: {label}: {message}" if label else f"{prog}: {message}"
    with contextlib.suppress(Exception):  # nothing more can be said without a stderr
        sys.stderr.write(_scrub(one_line(text)) + "\n")
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
    """Entry point of the ``pcr`` console script and ``python -m pcr``: returns the
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
                handler.quiet = ("registry.fleet.membership",)
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
    except (RedisError, RedisClusterException) as exc:  # one that no talking block named
        error = translate(exc, f"Redis at {shown_url(url)}" if url else "Redis")
        _say(command, str(error or exc))
        return EXIT_RUNTIME
    except Exception as exc:
        _say(command, f"internal error: {type(exc).__name__}: {exc}")
        return EXIT_RUNTIME


class _OneLineLog(logging.Handler):
    """Library log records and Python warnings as one line each on stderr, while
    ``main`` runs (the last-resort handler would print tracebacks)."""

    LOGGERS = ("registry", "gpu", "sim", "pcr")

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
