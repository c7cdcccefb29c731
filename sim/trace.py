"""Request traces in the Mooncake format, as the routing benchmarks replay them.

The public Mooncake FAST'25 traces (``kvcache-ai/Mooncake``, ``FAST25-release/traces``)
are JSON lines, one request each::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}

``timestamp`` is the arrival in milliseconds, ``input_length`` and ``output_length``
count tokens, and ``hash_ids`` names the prompt's blocks of ``TRACE_BLOCK_TOKENS`` (512)
tokens, the last one possibly partial: two requests that list the same leading ids share
that prefix. A replay maps one id to one engine block of ``block_size`` tokens whose
token ids are derived from the id alone (:class:`PromptMaker`), and the last block's
length from ``input_length`` (its share of a 512-token block, at least one token), so a
replay keeps the trace's sharing and relative lengths at any block size.

This module parses and checks a trace (:func:`parse_trace`, :func:`load_trace`: one
:class:`TraceError` naming the line and the field for anything malformed), cuts a window
of it (``offset``, ``window``), turns timestamps into arrival seconds under a time scale
(:func:`arrivals`), builds the prompts, and computes what one infinite cache would hit
(:func:`ideal`), the ceiling any router's hit rate is measured against. ``sim.trace_gen``
writes traces of the same format with a tunable shape.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from registry.core.validation import is_number

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""
MAX_TRACE_BLOCKS = 100_000
"""The most ids one request may list (51 M tokens at 512 a block): past it a line is
refused before its list is built into a prompt."""
MAX_ID = 2**63 - 1
VOCABULARY = 32_000
"""Token ids of derived prompts lie in [``FIRST_TOKEN``, vocabulary)."""
FIRST_TOKEN = 4
"""Below it: ids a tokenizer keeps for special tokens."""
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that is not in the Mooncake format; the message names the line and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    line: int
    """Its line in the file (1-based), for messages."""
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r} (a request needs {', '.join(FIELDS)})")
    return record[name]


def _count(value: object, name: str, where: str, low: int) -> int:
    """A plain int of at least ``low`` (never a bool, a float or a string)."""
    if not is_number(value, integer=True):
        raise TraceError(f"{where}: {name} must be an integer, not {type(value).__name__}")
    number = cast(int, value)
    if number < low:
        raise TraceError(f"{where}: {name} must be at least {low}, not {number}")
    return number


def parse_line(text: str, line: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRequest:
    """One JSON line as a :class:`TraceRequest`, or :class:`TraceError` saying what is
    wrong with it. ``input_length`` must fit the ids: more than ``len - 1`` blocks of
    ``block_tokens``, at most ``len``."""
    where = f"line {line}"
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: a request is a JSON object, not {type(record).__name__}")
    stamp = _field(record, "timestamp", where)
    if not is_number(stamp) or not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, not {stamp!r}")
    input_length = _count(_field(record, "input_length", where), "input_length", where, 1)
    output_length = _count(_field(record, "output_length", where), "output_length", where, 0)
    ids = _field(record, "hash_ids", where)
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: hash_ids must be a non-empty list of integers")
    if len(ids) > MAX_TRACE_BLOCKS:
        raise TraceError(f"{where}: hash_ids lists {len(ids)} blocks; at most {MAX_TRACE_BLOCKS}")
    if not set(map(type, ids)) <= {int} or min(ids) < 0 or max(ids) > MAX_ID:
        for i, value in enumerate(ids):
            if not is_number(value, integer=True) or not 0 <= value <= MAX_ID:
                raise TraceError(
                    f"{where}: hash_ids[{i}] = {value!r} is not an integer in [0, 2**63-1]"
                )
    low, high = (len(ids) - 1) * block_tokens, len(ids) * block_tokens
    if not low < input_length <= high:
        raise TraceError(
            f"{where}: input_length {input_length} does not fit {len(ids)} hash_ids of "
            f"{block_tokens} tokens (more than {low}, at most {high})"
        )
    return TraceRequest(line, float(stamp), input_length, output_length, tuple(ids))


def parse_trace(
    lines: Iterable[str],
    *,
    offset: int = 0,
    window: int | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """The requests of a trace's lines, after skipping ``offset`` requests and keeping
    ``window`` (None: all the rest). Blank lines are skipped; lines past the window are
    not read. Timestamps must not decrease (a trace lists requests in arrival order);
    an empty window is an error."""
    _count(offset, "offset", "the window", 0)
    if window is not None:
        _count(window, "window", "the window", 1)
    requests: list[TraceRequest] = []
    seen = 0
    last = -math.inf
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        request = parse_line(text, number, block_tokens)
        if request.timestamp_ms < last:
            raise TraceError(
                f"line {number}: timestamp {request.timestamp_ms:g} is before the previous "
                f"request's {last:g} (a trace lists requests in arrival order)"
            )
        last = request.timestamp_ms
        seen += 1
        if seen <= offset:
            continue
        requests.append(request)
        if window is not None and len(requests) == window:
            break
    if not requests:
        raise TraceError(
            f"the trace has {seen} requests, none past an offset of {offset}"
            if seen
            else "the trace lists no requests"
        )
    return requests


def load_trace(
    path: str | Path,
    *,
    offset: int = 0,
    window: int | None = None,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """:func:`parse_trace` of a file; ``TraceError`` names the file too (and an
    unreadable one)."""
    try:
        with open(path, encoding="utf-8") as lines:
            return parse_trace(lines, offset=offset, window=window, block_tokens=block_tokens)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None


def arrivals(requests: Sequence[TraceRequest], time_scale: float = 1.0) -> list[float]:
    """Each request's arrival in seconds after the first one's, the gaps multiplied by
    ``time_scale`` (0.1: ten times as fast; 0: all at once)."""
    if not is_number(time_scale) or not math.isfinite(time_scale) or time_scale < 0:
        raise ValueError(f"time_scale must be a finite number >= 0, not {time_scale!r}")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    return [(r.timestamp_ms - start) * time_scale / 1000 for r in requests]


def scale_for_rate(requests: Sequence[TraceRequest], rate: float) -> float:
    """The time scale that replays ``requests`` at ``rate`` requests per second on
    average (1.0 when they all arrive at once)."""
    if not is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite number > 0, not {rate!r}")
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    if span <= 0:
        return 1.0
    return (len(requests) - 1) / rate / span


class PromptMaker:
    """Token ids for trace requests at ``block_size`` tokens a block: each id's tokens are
    drawn from a hash of the id (the same id gives the same block everywhere, different
    ids differ), the last block cut to the request's share of its 512-token block."""

    def __init__(
        self,
        block_size: int,
        *,
        vocabulary: int = VOCABULARY,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        if not is_number(block_size, integer=True) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, not {block_size!r}")
        if not is_number(vocabulary, integer=True) or vocabulary <= FIRST_TOKEN + 1:
            raise ValueError(f"vocabulary must be an int > {FIRST_TOKEN + 1}, not {vocabulary!r}")
        self.block_size = block_size
        self.vocabulary = vocabulary
        self.block_tokens = block_tokens
        self._blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The ``block_size`` token ids of ``hash_id``'s block."""
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            span = self.vocabulary - FIRST_TOKEN
            made: list[int] = []
            counter = 0
            while len(made) < self.block_size:
                digest = hashlib.blake2b(
                    f"{hash_id}:{counter}".encode(), digest_size=64, person=b"pcr-trace"
                ).digest()
                made.extend(
                    FIRST_TOKEN + int.from_bytes(digest[i : i + 4], "little") % span
                    for i in range(0, len(digest), 4)
                )
                counter += 1
            tokens = self._blocks[hash_id] = tuple(made[: self.block_size])
        return tokens

    def last_block_tokens(self, request: TraceRequest) -> int:
        """How many tokens the request's last block keeps (1 to ``block_size``)."""
        rest = request.input_length - (len(request.hash_ids) - 1) * self.block_tokens
        return max(1, min(self.block_size, math.ceil(rest * self.block_size / self.block_tokens)))

    def prompt_length(self, request: TraceRequest) -> int:
        return (len(request.hash_ids) - 1) * self.block_size + self.last_block_tokens(request)

    def prompt(self, request: TraceRequest) -> list[int]:
        """The request's prompt as token ids."""
        tokens: list[int] = []
        for hash_id in request.hash_ids[:-1]:
            tokens.extend(self.block(hash_id))
        tokens.extend(self.block(request.hash_ids[-1])[: self.last_block_tokens(request)])
        return tokens


def full_blocks(request: TraceRequest, maker: PromptMaker) -> int:
    """How many of the request's blocks are complete at ``maker``'s block size (only
    complete blocks are cached)."""
    last_full = maker.last_block_tokens(request) == maker.block_size
    return len(request.hash_ids) - (0 if last_full else 1)


def hit_limit(prompt_tokens: int, block_size: int) -> int:
    """The most blocks a prompt can hit: vLLM computes the last token again for its
    logits, so a hit covers at most ``prompt_tokens - 1`` tokens."""
    return (prompt_tokens - 1) // block_size


@dataclass(frozen=True)
class Ideal:
    """What one infinite cache, shared by the whole fleet, would hit."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    distinct_blocks: int
    """Distinct complete blocks (prefixes) of the window: a cache that holds them all
    misses nothing twice."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_keys(requests: Iterable[TraceRequest]) -> Iterator[list[int]]:
    """Each request's blocks as prefix keys: the same key for the same id after the same
    ids (an id that a trace lists after different prefixes is a different block)."""
    keys: dict[tuple[int, int], int] = {}
    for request in requests:
        chain: list[int] = []
        parent = -1
        for hash_id in request.hash_ids:
            parent = keys.setdefault((parent, hash_id), len(keys))
            chain.append(parent)
        yield chain


def ideal(requests: Sequence[TraceRequest], block_size: int) -> Ideal:
    """The infinite-cache hit rate, counted as an engine counts it: prompt tokens, and
    for each prompt the cached leading complete blocks' tokens, at most
    :func:`hit_limit` blocks."""
    maker = PromptMaker(block_size)
    cached: set[int] = set()
    prompt_tokens = hit_tokens = 0
    for request, chain in zip(requests, prefix_keys(requests), strict=True):
        length = maker.prompt_length(request)
        complete = chain[: full_blocks(request, maker)]
        hit = 0
        for key in complete[: hit_limit(length, block_size)]:
            if key not in cached:
                break
            hit += 1
        prompt_tokens += length
        hit_tokens += hit * block_size
        cached.update(complete)
    return Ideal(len(requests), prompt_tokens, hit_tokens, len(cached))


def dump_request(request: TraceRequest) -> str:
    """One request as a Mooncake JSON line (the timestamp an int when it is whole)."""
    stamp: float | int = request.timestamp_ms
    if float(stamp).is_integer():
        stamp = int(stamp)
    return json.dumps(
        {
            "timestamp": stamp,
            "input_length": request.input_length,
            "output_length": request.output_length,
            "hash_ids": list(request.hash_ids),
        }
    )


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> int:
    """Write ``requests`` as a Mooncake trace; returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for request in requests:
            out.write(dump_request(request) + "\n")
            count += 1
    return count
