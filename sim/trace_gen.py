"""Traces in the Mooncake format with a shape of one's choosing (``sim.trace`` reads them),
so that a routing rule is tuned on more than one file.

A seeded generator draws requests arriving as a Poisson process at ``rate`` per second.
Each request, as ``sim.workload`` does for prompts:

* opens a conversation (``new``): one of ``system_prompts`` shared system prompts,
  picked by a Zipf law of exponent ``zipf``, then a first user message;
* is a one-off (``one_off``): a system prompt (with probability ``one_off_system``) or
  nothing shared, then a message no other request sends;
* or is the next turn of one of the ``active`` open conversations: its previous prompt
  (the last, partial block completed by the answer: a new id), an answer and a message;
  a conversation closes after ``max_turns``.

Lengths are in the trace's 512-token blocks (``hash_ids`` entries); every prompt ends
with a partial block of 1 to 512 tokens. Ids are numbered in order of first use, as the
Mooncake traces number theirs.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from registry.core.validation import is_number
from sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

Span = tuple[int, int]


@dataclass(frozen=True)
class TraceShape:
    """Knobs of a generated trace (lengths in 512-token blocks, both ends included)."""

    requests: int = 2000
    rate: float = 40.0
    """Mean arrivals per second."""
    seed: int = 0
    system_prompts: int = 128
    system_blocks: Span = (2, 12)
    zipf: float = 1.2
    new: float = 0.30
    """Share of requests that open a conversation."""
    one_off: float = 0.20
    one_off_system: float = 0.5
    first_blocks: Span = (4, 20)
    turn_blocks: Span = (1, 8)
    max_turns: int = 8
    active: int = 128
    output_tokens: Span = (8, 512)


SPANS = ("system_blocks", "first_blocks", "turn_blocks", "output_tokens")
SHARES = ("new", "one_off", "one_off_system")


def check_shape(shape: TraceShape) -> None:
    """``ValueError`` (``TypeError`` for a wrong kind) naming the first bad field."""
    for name in ("requests", "system_prompts", "max_turns", "active"):
        value = getattr(shape, name)
        if not is_number(value, integer=True) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
    if not is_number(shape.seed, integer=True):
        raise ValueError(f"seed must be an integer, not {shape.seed!r}")
    for name in ("rate", "zipf"):
        value = getattr(shape, name)
        if not is_number(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
    for name in SHARES:
        value = getattr(shape, name)
        if not is_number(value) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a share between 0 and 1, not {value!r}")
    if shape.new + shape.one_off > 1:
        raise ValueError(f"new + one_off must be at most 1, not {shape.new + shape.one_off:g}")
    for name in SPANS:
        span = getattr(shape, name)
        low = 0 if name == "output_tokens" else 1
        if (
            not isinstance(span, tuple)
            or len(span) != 2
            or not all(is_number(v, integer=True) for v in span)
            or not low <= span[0] <= span[1]
        ):
            raise ValueError(f"{name} must be two integers {low} <= low <= high, not {span!r}")


def shape_from_text(text: str, base: TraceShape | None = None) -> TraceShape:
    """``KEY=VALUE[,KEY=VALUE...]`` over ``base`` (spans as ``LOW-HIGH`` or one number),
    checked; ``ValueError`` naming an unknown key or a bad value."""
    shape = base or TraceShape()
    fields = {f.name: f for f in dataclasses.fields(TraceShape)}
    changes: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(
                f"{part!r} is not KEY=VALUE with KEY one of {', '.join(sorted(fields))}"
            )
        value = value.strip()
        try:
            if key in SPANS:
                low, _, high = value.partition("-")
                changes[key] = (int(low), int(high or low))
            elif fields[key].type in ("int", int):
                changes[key] = int(value)
            else:
                changes[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: not a number") from None
    shape = dataclasses.replace(shape, **changes)  # type: ignore[arg-type]
    check_shape(shape)
    return shape


@dataclass
class _Talk:
    ids: list[int]
    turns: int = 1


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, count: int) -> list[int]:
        made = list(range(self.next, self.next + count))
        self.next += count
        return made


def generate(shape: TraceShape) -> Iterator[TraceRequest]:
    """The requests of a trace of ``shape``, in arrival order (reproducible by seed)."""
    check_shape(shape)
    rng = random.Random(shape.seed)
    ids = _Ids()
    systems = [ids.fresh(rng.randint(*shape.system_blocks)) for _ in range(shape.system_prompts)]
    weights = [1 / (rank + 1) ** shape.zipf for rank in range(len(systems))]
    active: list[_Talk] = []
    clock = 0.0
    for number in range(shape.requests):
        if number:
            clock += rng.expovariate(shape.rate) * 1000
        roll = rng.random()
        if roll < shape.one_off:
            shared = rng.choices(systems, weights)[0] if rng.random() < shape.one_off_system else []
            blocks = shared + ids.fresh(rng.randint(*shape.first_blocks))
        elif roll < shape.one_off + shape.new or not active:
            talk = _Talk(
                rng.choices(systems, weights)[0] + ids.fresh(rng.randint(*shape.first_blocks))
            )
            active.append(talk)
            if len(active) > shape.active:
                active.pop(0)
            blocks = talk.ids
        else:
            talk = rng.choice(active)
            # The previous prompt's partial last block is completed by the answer: its
            # full form is a new block, then the answer and the next message.
            talk.ids = talk.ids[:-1] + ids.fresh(1 + rng.randint(*shape.turn_blocks))
            talk.turns += 1
            if talk.turns >= shape.max_turns:
                active.remove(talk)
            blocks = talk.ids
        last = rng.randint(1, TRACE_BLOCK_TOKENS)
        yield TraceRequest(
            line=number + 1,
            timestamp_ms=float(round(clock)),
            input_length=(len(blocks) - 1) * TRACE_BLOCK_TOKENS + last,
            output_length=rng.randint(*shape.output_tokens),
            hash_ids=tuple(blocks),
        )
