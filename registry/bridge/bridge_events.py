"""Decoding vLLM and SGLang KV-cache event batches (the input side of ``pcr bridge``).

Engines publish what their prefix cache stored and removed as msgpack batches on a ZeroMQ
PUB socket (``/work/shared/ENGINES.md`` has the wire facts). This module only decodes:
no sockets, no Redis. Two payload layouts exist in the wild (an array layout, where each
event is ``[tag, field, ...]``, and a map layout, where each event is ``{"type": tag,
...}``); both are accepted, events are told apart by their tag, and anything malformed
raises :class:`BadEvent` naming the field, never another exception type.

Decoding rules shared by both layouts:

- fields are read by name (map) or by their declared order (array); fields the module
  does not know, and trailing array elements past the known ones, are ignored, so
  fields that engines append in later releases do not break decoding;
- fields may be missing (trailing in the array layout, at their default in the map
  layout) and then read as ``None``; only ``block_hashes`` and ``token_ids`` of
  ``BlockStored`` and ``block_hashes`` of ``BlockRemoved`` are required (every engine
  release sends them, and the array layout cannot omit a field before them);
- events of an unknown type are skipped and counted in :attr:`EventBatch.unknown`;
- a ``bool`` is never accepted where an ``int`` is expected.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NewType, TypeAlias, cast

from registry.core.validation import is_number

EngineHash = NewType("EngineHash", int)
"""An engine's block hash in one canonical form: an unsigned 64-bit int in [0, 2**64-1]."""

HASH_MODULUS = 2**64
"""Signed hashes below 0 are mapped into the unsigned range by adding this."""
MIN_SIGNED_HASH = -(2**63)
"""The smallest int hash accepted (SGLang's signed 64-bit hashes)."""
MAX_UNSIGNED_HASH = 2**64 - 1
"""The largest int hash accepted (vLLM's unsigned 64-bit hashes)."""
MAX_TOKEN = 2**63 - 1
"""Token ids are int64 (the chain packs them so)."""
HASH_BYTES_USED = 8
"""A bytes hash is read as its last this-many bytes, big-endian (vLLM's int form)."""
SEQ_BYTES = 8
"""The sequence frame of a ZeroMQ message: 8 bytes, big-endian unsigned."""
FRAME_COUNT = 3
"""A published message is ``[topic, seq, payload]``."""

TAG_STORED = "BlockStored"
TAG_REMOVED = "BlockRemoved"
TAG_CLEARED = "AllBlocksCleared"

# Field order of the array layout (after the tag), as the engines declare them. Names
# this module does not keep (lora_name, extra_keys, ...) are listed so that the positions
# of the later ones stay right.
STORED_FIELDS: tuple[str, ...] = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx")


class BadEvent(ValueError):
    """A message, batch or event that does not follow the engines' wire format."""


@dataclass(frozen=True)
class BlockStored:
    """The engine stored these blocks (one hash per block, chained from the parent)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int | None
    lora_id: int | None
    medium: str | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    lora_name: str | None = None
    salt: str | None = None
    """The cache salt the first block's extra keys carry (vLLM publishes it only for a
    prompt's first block, so only an event without a parent has one)."""
    keyed: bool = False
    """Whether a block carries extra keys the registry's chain cannot fold in (multimodal
    inputs, prompt embeddings, keys in no known place): then the engine's hash covers
    more than the tokens, the salt and the LoRA name."""


@dataclass(frozen=True)
class BlockRemoved:
    """The engine evicted these blocks from its cache (of ``medium``, if given)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache: every block it announced is gone."""


Event: TypeAlias = "BlockStored | BlockRemoved | AllBlocksCleared"


@dataclass(frozen=True)
class EventBatch:
    """One published batch: its events in order, how many unknown ones were skipped, and
    how many were refused for listing more blocks than allowed (with their blocks)."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    unknown: int
    refused: int = 0
    refused_blocks: int = 0

    def blocks(self) -> int:
        """The blocks its stores and removals list."""
        return sum(
            len(e.block_hashes) for e in self.events if isinstance(e, (BlockStored, BlockRemoved))
        )


class _Refused:
    """An event left undecoded for listing more blocks than allowed."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks


def engine_hash(value: object, field: str = "block hash") -> EngineHash:
    """Map an engine's hash (signed int, unsigned int or digest bytes) to the one canonical
    unsigned 64-bit form, so that the same block compares equal however it was sent."""
    if isinstance(value, bool):
        raise BadEvent(f"{field} must be an int or bytes, not bool")
    if isinstance(value, int):
        if not MIN_SIGNED_HASH <= value <= MAX_UNSIGNED_HASH:
            raise BadEvent(f"{field} {value} is outside [-2**63, 2**64-1]")
        return EngineHash(value + HASH_MODULUS if value < 0 else value)
    if isinstance(value, (bytes, bytearray)):
        if len(value) < HASH_BYTES_USED:
            raise BadEvent(
                f"{field} is {len(value)} bytes long; a bytes hash needs at least {HASH_BYTES_USED}"
            )
        return EngineHash(int.from_bytes(value[-HASH_BYTES_USED:], "big", signed=False))
    raise BadEvent(f"{field} must be an int or bytes, not {type(value).__name__}")


def _int(value: object, field: str, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (never a bool) at or above ``minimum``."""
    if not is_number(value, integer=True):
        raise BadEvent(f"{field} must be an int, not {type(value).__name__}")
    number = cast(int, value)
    if minimum is not None and number < minimum:
        raise BadEvent(f"{field} must be at least {minimum}, not {number}")
    return number


def _optional_int(value: object, field: str, *, minimum: int | None = None) -> int | None:
    """An int field that may be nil."""
    return None if value is None else _int(value, field, minimum=minimum)


def _optional_str(value: object, field: str) -> str | None:
    """A text field that may be nil."""
    if value is None or isinstance(value, str):
        return value
    raise BadEvent(f"{field} must be a string or nil, not {type(value).__name__}")


def _list(value: object, field: str) -> list[Any]:
    """Return ``value`` if it is a msgpack array (decoded as a list)."""
    if not isinstance(value, list):
        raise BadEvent(f"{field} must be an array, not {type(value).__name__}")
    return value


def _hashes(value: object, field: str) -> tuple[EngineHash, ...]:
    """A list of block hashes, each normalised."""
    return tuple(engine_hash(item, f"{field}[{i}]") for i, item in enumerate(_list(value, field)))


def _fields(
    raw: list[Any] | Mapping[Any, Any], names: tuple[str, ...], required: tuple[str, ...], tag: str
) -> dict[str, Any]:
    """Name an event's fields: by declared order (array layout, tag already dropped) or by
    key (map layout); missing ones are absent, unknown ones dropped, required ones checked."""
    if isinstance(raw, list):
        found = dict(zip(names, raw, strict=False))
    else:
        found = {name: raw[name] for name in names if name in raw}
    for name in required:
        if name not in found:
            raise BadEvent(f"{tag} is missing its required field {name}")
    return found


def _tokens(tokens: list[Any], field: str) -> tuple[int, ...]:
    """Token ids: ints (never bools) that fit in int64; checked at C speed when they are
    all plain ints, one by one (naming the first bad one) otherwise."""
    if not set(map(type, tokens)) <= {int}:
        tokens = [int(_int(token, f"{field}[{i}]")) for i, token in enumerate(tokens)]
    if tokens and (min(tokens) < MIN_SIGNED_HASH or max(tokens) > MAX_TOKEN):
        bad = next(t for t in tokens if not MIN_SIGNED_HASH <= t <= MAX_TOKEN)
        raise BadEvent(f"{field}[{tokens.index(bad)}] = {bad} does not fit in int64")
    return tuple(tokens)


def _block_stored(raw: list[Any] | Mapping[Any, Any], where: str) -> BlockStored:
    """Build a ``BlockStored`` from its fields, checking every type."""
    tag = f"{where} {TAG_STORED}"
    f = _fields(raw, STORED_FIELDS, ("block_hashes", "token_ids"), tag)
    token_ids = _tokens(_list(f["token_ids"], f"{tag} token_ids"), f"{tag} token_ids")
    block_size = _optional_int(f.get("block_size"), f"{tag} block_size", minimum=1)
    if block_size is not None and len(token_ids) % block_size:
        raise BadEvent(
            f"{tag} token_ids holds {len(token_ids)} tokens, not a multiple of "
            f"block_size {block_size}"
        )
    parent = f.get("parent_block_hash")
    lora_name = _optional_str(f.get("lora_name"), f"{tag} lora_name")
    salt, keyed = _extra_keys(f.get("extra_keys"), lora_name, parent is None, f"{tag} extra_keys")
    return BlockStored(
        block_hashes=_hashes(f["block_hashes"], f"{tag} block_hashes"),
        parent_block_hash=None
        if parent is None
        else engine_hash(parent, f"{tag} parent_block_hash"),
        token_ids=token_ids,
        block_size=block_size,
        lora_id=_optional_int(f.get("lora_id"), f"{tag} lora_id"),
        medium=_optional_str(f.get("medium"), f"{tag} medium"),
        group_idx=_optional_int(f.get("group_idx"), f"{tag} group_idx", minimum=0),
        kv_cache_spec_kind=_optional_str(f.get("kv_cache_spec_kind"), f"{tag} kv_cache_spec_kind"),
        lora_name=lora_name,
        salt=salt,
        keyed=keyed,
    )


def _extra_keys(
    value: object, lora_name: str | None, at_start: bool, field: str
) -> tuple[str | None, bool]:
    """(the cache salt, whether other keys are present) from ``extra_keys``: nil, or one
    entry per listed block, nil or that block's keys untagged in vLLM's order (the LoRA
    name when ``lora_name`` is set, ``(mm_identifier, offset)`` pairs, the cache salt on
    a prompt's first block, prompt-embedding digests). Keys that do not start with
    ``lora_name`` (when set), or anything past it but one string in the first entry of
    an event that starts a prompt (``at_start``), count as other keys."""
    if value is None:
        return None, False
    salt = None
    for i, entry in enumerate(_list(value, field)):
        keys: object = [] if entry is None else entry
        if not isinstance(keys, list):
            return None, True
        if lora_name is not None and keys:
            if keys[0] != lora_name:
                return None, True
            keys = keys[1:]
        if not keys:
            continue
        if i == 0 and at_start and len(keys) == 1 and isinstance(keys[0], str):
            salt = keys[0]
            continue
        return None, True
    return salt, False


def _block_removed(raw: list[Any] | Mapping[Any, Any], where: str) -> BlockRemoved:
    """Build a ``BlockRemoved`` from its fields, checking every type."""
    tag = f"{where} {TAG_REMOVED}"
    f = _fields(raw, REMOVED_FIELDS, ("block_hashes",), tag)
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], f"{tag} block_hashes"),
        medium=_optional_str(f.get("medium"), f"{tag} medium"),
        group_idx=_optional_int(f.get("group_idx"), f"{tag} group_idx", minimum=0),
    )


def _event(raw: object, where: str) -> Event | None:
    """Decode one event of either layout by its tag; ``None`` for an unknown type."""
    body: list[Any] | Mapping[Any, Any]
    if isinstance(raw, list):
        if not raw:
            raise BadEvent(f"{where} is an empty array; it needs a type tag first")
        tag, body = raw[0], raw[1:]
        tag_field = f"{where} tag"
    elif isinstance(raw, dict):
        if "type" not in raw:
            raise BadEvent(f"{where} is a map without a 'type' field")
        tag, body = raw["type"], raw
        tag_field = f"{where} type"
    else:
        raise BadEvent(f"{where} must be an array or a map, not {type(raw).__name__}")
    if not isinstance(tag, str):
        raise BadEvent(f"{tag_field} must be a string, not {type(tag).__name__}")
    if tag == TAG_STORED:
        return _block_stored(body, where)
    if tag == TAG_REMOVED:
        return _block_removed(body, where)
    if tag == TAG_CLEARED:
        return AllBlocksCleared()
    return None


def _batch(raw: object) -> EventBatch:
    """Decode a batch of either layout from the unpacked msgpack value."""
    if isinstance(raw, list):
        if len(raw) < 2:
            raise BadEvent(f"batch is an array of {len(raw)} elements; it needs [ts, events]")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        for name in ("ts", "events"):
            if name not in raw:
                raise BadEvent(f"batch map is missing its required field {name}")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise BadEvent(f"batch must be an array or a map, not {type(raw).__name__}")
    if not is_number(ts):
        raise BadEvent(f"batch ts must be a number, not {type(ts).__name__}")
    if not math.isfinite(ts):
        raise BadEvent(f"batch ts must be finite, not {ts}")
    decoded: list[Event] = []
    unknown = refused = refused_blocks = 0
    for i, item in enumerate(_list(events, "batch events")):
        if isinstance(item, _Refused):
            refused += 1
            refused_blocks += item.blocks
            continue
        event = _event(item, f"events[{i}]")
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return EventBatch(
        ts=float(ts),
        events=tuple(decoded),
        data_parallel_rank=_optional_int(rank, "batch data_parallel_rank", minimum=0),
        unknown=unknown,
        refused=refused,
        refused_blocks=refused_blocks,
    )


def decode_batch(payload: bytes, max_event_blocks: int | None = None) -> EventBatch:
    """Decode one msgpack event batch (vLLM's array or map layout, or SGLang's array
    layout); raise :class:`BadEvent` for anything that does not follow the format.

    With ``max_event_blocks``, an event listing more block hashes than that is refused
    (counted in ``refused``) before its fields become Python objects: its size is read
    from the msgpack headers, the event skipped in C (``_unpack_refusing``)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise BadEvent(f"payload must be bytes, not {type(payload).__name__}")
    try:
        # Imported here so that the registry imports without the optional dependency.
        msgpack = importlib.import_module("msgpack")
    except ImportError as exc:
        raise BadEvent(
            "decoding engine events needs the msgpack package (pip install msgpack)"
        ) from exc
    data = bytes(payload)
    try:
        raw: object
        if max_event_blocks is not None and len(data) > max_event_blocks:
            raw = _unpack_refusing(msgpack, data, max_event_blocks)
        else:  # each listed hash takes a byte at least: no event can be over the limit
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise BadEvent(f"payload is not a msgpack value: {type(exc).__name__}: {exc}") from exc
    try:
        return _batch(raw)
    except BadEvent:
        raise
    except Exception as exc:  # e.g. an unhashable map key met by a lookup
        raise BadEvent(f"malformed batch: {type(exc).__name__}: {exc}") from exc


def _kind(data: bytes, offset: int) -> str:
    """The msgpack type at ``offset``: ``"array"``, ``"map"`` or ``"other"``."""
    if offset >= len(data):
        return "other"
    first = data[offset]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    return "other"


def _listed_blocks(msgpack: Any, data: bytes) -> int:
    """How many block hashes one event (``data``, either layout) lists, read from its
    headers alone (0 when it lists none, or not as an array)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    kind = _kind(data, 0)
    if kind == "array":
        if unpacker.read_array_header() < 2:
            return 0
        unpacker.skip()  # the tag; block_hashes comes first in both event types
        return int(unpacker.read_array_header()) if _kind(data, unpacker.tell()) == "array" else 0
    if kind == "map":
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "block_hashes" and _kind(data, unpacker.tell()) == "array":
                return int(unpacker.read_array_header())
            unpacker.skip()
    return 0


def _unpack_refusing(msgpack: Any, data: bytes, limit: int) -> object:
    """``msgpack.unpackb(data)``, but every event that lists more than ``limit`` block
    hashes left undecoded (``_Refused``): the batch and event headers are walked, each
    event skipped in C to find its end and decoded only when it is within the limit."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)

    def events() -> object:
        if _kind(data, unpacker.tell()) != "array":
            return unpacker.unpack()
        items: list[object] = []
        for _ in range(unpacker.read_array_header()):
            start = unpacker.tell()
            unpacker.skip()
            event = data[start : unpacker.tell()]
            blocks = _listed_blocks(msgpack, event)
            if blocks > limit:
                items.append(_Refused(blocks))
            else:
                items.append(msgpack.unpackb(event, raw=False, strict_map_key=False))
        return items

    kind = _kind(data, 0)
    if kind == "array":
        raw: list[object] = []
        for i in range(unpacker.read_array_header()):
            raw.append(events() if i == 1 else unpacker.unpack())
        value: object = raw
    elif kind == "map":
        fields: dict[object, object] = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            fields[key] = events() if key == "events" else unpacker.unpack()
        value = fields
    else:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    if unpacker.tell() != len(data):
        raise BadEvent(f"payload has {len(data) - unpacker.tell()} bytes after the batch")
    return value


def split_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """Check one published ZeroMQ message ``[topic, seq, payload]`` and split it into
    (topic, seq, payload) without decoding the payload; the seq frame is 8 bytes
    big-endian unsigned, counted per publisher."""
    given: object = frames  # checked at run time: callers hand over what a socket gave
    if isinstance(given, (bytes, bytearray, str)) or not isinstance(given, Sequence):
        raise BadEvent(f"frames must be a list of bytes, not {type(given).__name__}")
    if len(frames) != FRAME_COUNT:
        raise BadEvent(f"message has {len(frames)} frames; it needs [topic, seq, payload]")
    topic_raw, seq_raw, payload = frames
    for name, frame in (("topic", topic_raw), ("seq", seq_raw), ("payload", payload)):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise BadEvent(f"{name} frame must be bytes, not {type(frame).__name__}")
    try:
        topic = bytes(topic_raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadEvent(f"topic frame is not UTF-8 text: {exc}") from exc
    if len(seq_raw) != SEQ_BYTES:
        raise BadEvent(f"seq frame is {len(seq_raw)} bytes long; it must be {SEQ_BYTES}")
    return topic, int.from_bytes(bytes(seq_raw), "big", signed=False), bytes(payload)


REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The seq frame of a replay's end marker."""


def split_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One message from an engine's replay socket, as a DEALER receives it: (seq,
    payload), or None for the end marker. Both forms in use are accepted: vLLM up to
    0.25 sends ``[b"", seq, payload]`` and ends with ``[b"", END, b""]``; vLLM 0.26 and
    later send ``[b"", topic, seq, payload]`` and end with ``[b"", b"", END, b""]``.
    Anything else raises :class:`BadEvent` saying what came."""
    given: object = frames
    if isinstance(given, (bytes, bytearray, str)) or not isinstance(given, Sequence):
        raise BadEvent(f"replay reply must be a list of frames, not {type(given).__name__}")
    if not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        raise BadEvent("replay reply frames must be bytes")
    parts = [bytes(f) for f in frames]
    if len(parts) not in (3, 4) or parts[0] != b"":
        raise BadEvent(
            f"replay reply has {len(parts)} frames"
            + ("" if parts and parts[0] == b"" else " without the empty delimiter")
            + '; expected [b"", seq, payload] or [b"", topic, seq, payload]'
        )
    seq_raw, payload = parts[-2], parts[-1]
    if len(seq_raw) != SEQ_BYTES:
        raise BadEvent(f"replay reply's seq frame is {len(seq_raw)} bytes long, not {SEQ_BYTES}")
    if seq_raw == REPLAY_END:
        return None
    return int.from_bytes(seq_raw, "big", signed=False), payload


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, EventBatch]:
    """Decode one published ZeroMQ message ``[topic, seq, payload]`` into (topic, seq,
    batch); see :func:`split_frames`."""
    topic, seq, payload = split_frames(frames)
    return topic, seq, decode_batch(payload)
