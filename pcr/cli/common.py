"""What every ``pcr`` command shares: limits, exit codes, one-line errors, argument
types, ``--json`` files and connecting to Redis (errors mapped by ``registry.core.errors``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn
from urllib.parse import urlsplit

from redis.connection import parse_url

from registry.core.errors import (
    REDIS_ERRORS,
    RegistryError,
    RegistryUnavailable,
    translate,
)
from registry.core.keys import validate_key_prefix, validate_namespace
from registry.transport.client import (
    CLUSTER_SCHEMES,
    PLAIN_SCHEMES,
    bounded_options,
    client_from_url,
)

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


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(text: str) -> str:
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


def int_in(low: int, high: int, what: str) -> Callable[[str], int]:
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


positive_arg = int_in(1, MAX_INT64, "positive integer")
port_arg = int_in(1, 65535, "TCP port")
cursor_arg = int_in(0, MAX_CURSOR, "HSCAN cursor")
page_arg = int_in(1, MAX_PAGE, "page size")
seed_arg = int_in(-(2**63), MAX_INT64, "seed")
hash_arg = int_in(1, MAX_INT64, "block hash")
token_arg = int_in(-(2**63), MAX_INT64, "token id")
block_size_arg = int_in(1, MAX_BLOCK_SIZE, "block size")
notices_arg = int_in(1, MAX_NOTICES, "notice count")


def number_in(
    low: float,
    high: float,
    *,
    above: bool = False,
    invalid: Callable[[str], str],
    out_of_range: Callable[[str], str],
) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (in (low, high] with ``above``);
    ``invalid`` and ``out_of_range`` word the error for the text given."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(invalid(text)) from None
        if not math.isfinite(value) or not low <= value <= high or (above and value == low):
            raise argparse.ArgumentTypeError(out_of_range(text))
        return value

    return parse


def seconds_in(low: float, high: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in [low, high] ((low, high] with
    ``above``)."""
    bounds = f"{'(' if above else '['}{low:g}, {high:.0f}]"
    return number_in(
        low,
        high,
        above=above,
        invalid=lambda text: f"invalid number of seconds: {text!r:.60}",
        out_of_range=lambda text: f"seconds must be a finite number in {bounds}, not {text!r:.60}",
    )


seconds_arg = seconds_in(0, MAX_WATCH_SECONDS)
"""An argparse type: a finite number of seconds in [0, MAX_WATCH_SECONDS]."""


def namespace_arg(text: str) -> str:
    try:
        return validate_namespace(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def key_prefix_arg(text: str) -> str:
    try:
        return validate_key_prefix(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def url_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the Redis URL must not be empty")
    return text


def check_writable(path: str | None) -> None:
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


def write_json(path: str, document: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
    except OSError as exc:
        raise CommandError(f"cannot write {path!r}: {exc.strerror or exc}") from None
    print(f"figures written to {one_line(path)}")


def warn_user(command: str, message: str) -> None:
    sys.stderr.write(f"pcr {command}: WARNING: {one_line(message)}\n")
    sys.stderr.flush()


# -- connecting -----------------------------------------------------------------------


def shown_url(url: str) -> str:
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


def url_scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


@contextlib.contextmanager
def talking(what: str) -> Iterator[None]:
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
def connect(args: argparse.Namespace, *, max_connections: int | None = None) -> Iterator[Any]:
    """A client for ``--redis-url`` that answered PING; closed at the end of the block.
    ``max_connections`` raises redis-py's cap (100 connections per pool) for commands
    that hold many at once (``pcr simulate``: a pub/sub connection per node)."""
    url: str = args.redis_url
    where = shown_url(url)
    if url_scheme(url) == "unix" and not where:
        raise UsageError("argument --redis-url: a unix:// URL names the socket: unix:///PATH")
    options: dict[str, Any] = (
        {} if max_connections is None else {"max_connections": max_connections}
    )
    try:
        client = client_from_url(url, **bounded_options(options))  # at most CALL_BOUND per call
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
    scheme = url_scheme(url)
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


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
