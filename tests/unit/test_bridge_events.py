"""Decoding engine KV-cache event batches: vLLM's two layouts, SGLang's signed hashes,
the ZeroMQ framing, and that malformed input only ever raises ``BadEvent``."""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.bridge.bridge_events import (
    AllBlocksCleared,
    BadEvent,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
    decode_batch,
    decode_frames,
    engine_hash,
    split_replay_reply,
)

msgpack = pytest.importorskip("msgpack")

U64 = 2**64

# --- encoders: the documented wire format, written out by hand ----------------------------


def pack(value: object) -> bytes:
    """msgpack with str as str and bytes as bin, as the engines send them."""
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def stored_array(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    *rest: Any,
) -> list[Any]:
    """A ``BlockStored`` in the array layout; ``rest`` are the later fields in order
    (block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...)."""
    return ["BlockStored", hashes, parent, tokens, *rest]


def removed_array(hashes: list[Any], *rest: Any) -> list[Any]:
    """A ``BlockRemoved`` in the array layout; ``rest``: medium, group_idx."""
    return ["BlockRemoved", hashes, *rest]


def event_map(tag: str, **fields: Any) -> dict[str, Any]:
    """An event in the map layout: ``type`` plus the non-default fields."""
    return {"type": tag, **fields}


def vllm_array_batch(ts: float, events: list[Any], rank: int | None = None) -> bytes:
    return pack([ts, events, rank])


def vllm_map_batch(ts: float, events: list[Any], rank: int | None = None) -> bytes:
    batch: dict[str, Any] = {"ts": ts, "events": events}
    if rank is not None:
        batch["data_parallel_rank"] = rank
    return pack(batch)


def sglang_batch(ts: float, events: list[Any]) -> bytes:
    return pack([ts, events])


def frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big", signed=False), payload]


def h(value: int) -> EngineHash:
    return EngineHash(value)


# --- vLLM, both layouts ---------------------------------------------------------------------

FULL_STORED = BlockStored(
    block_hashes=(h(11), h(2**64 - 1)),
    parent_block_hash=h(7),
    token_ids=tuple(range(8)),
    block_size=4,
    lora_id=3,
    medium="GPU",
    group_idx=1,
    kv_cache_spec_kind="mamba",
    lora_name="lora-a",
)


def test_vllm_array_layout_full_batch() -> None:
    events = [
        stored_array(
            [11, 2**64 - 1], 7, list(range(8)), 4, 3, "GPU", "lora-a", [None, None], 1, "mamba", 0
        ),
        removed_array([11], "CPU", 2),
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(vllm_array_batch(12.5, events, rank=3))
    assert batch == EventBatch(
        ts=12.5,
        events=(
            FULL_STORED,
            BlockRemoved(block_hashes=(h(11),), medium="CPU", group_idx=2),
            AllBlocksCleared(),
        ),
        data_parallel_rank=3,
        unknown=0,
    )


def test_vllm_map_layout_full_batch() -> None:
    events = [
        event_map(
            "BlockStored",
            block_hashes=[11, 2**64 - 1],
            parent_block_hash=7,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=3,
            medium="GPU",
            lora_name="lora-a",
            extra_keys=[None, None],
            group_idx=1,
            kv_cache_spec_kind="mamba",
            kv_cache_spec_sliding_window=0,
        ),
        event_map("BlockRemoved", block_hashes=[11], medium="CPU", group_idx=2),
        event_map("AllBlocksCleared"),
    ]
    batch = decode_batch(vllm_map_batch(12.5, events, rank=3))
    assert batch.events == (
        FULL_STORED,
        BlockRemoved(block_hashes=(h(11),), medium="CPU", group_idx=2),
        AllBlocksCleared(),
    )
    assert (batch.ts, batch.data_parallel_rank, batch.unknown) == (12.5, 3, 0)


def test_both_layouts_decode_to_the_same_batch() -> None:
    array = decode_batch(
        vllm_array_batch(1.0, [stored_array([5, 6], None, [1, 2, 3, 4], 2), removed_array([5])])
    )
    mapped = decode_batch(
        vllm_map_batch(
            1.0,
            [
                event_map(
                    "BlockStored",
                    block_hashes=[5, 6],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4],
                    block_size=2,
                ),
                event_map("BlockRemoved", block_hashes=[5]),
            ],
        )
    )
    assert array == mapped


def test_map_layout_omits_defaults() -> None:
    batch = decode_batch(
        vllm_map_batch(2, [event_map("BlockStored", block_hashes=[1], token_ids=[9])])
    )
    assert batch.ts == 2.0
    assert isinstance(batch.ts, float)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored(
            block_hashes=(h(1),),
            parent_block_hash=None,
            token_ids=(9,),
            block_size=None,
            lora_id=None,
            medium=None,
            group_idx=None,
            kv_cache_spec_kind=None,
        ),
    )


@pytest.mark.parametrize("extra", [0, 1, 2, 3, 4, 5, 6, 7, 8])
def test_array_layout_trailing_fields_missing(extra: int) -> None:
    later: list[Any] = [4, 3, "GPU", "lora-a", None, 1, "mamba", 0][:extra]
    batch = decode_batch(vllm_array_batch(0.0, [stored_array([1, 2], 0, list(range(8)), *later)]))
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_size == (4 if extra >= 1 else None)
    assert event.lora_id == (3 if extra >= 2 else None)
    assert event.medium == ("GPU" if extra >= 3 else None)
    assert event.group_idx == (1 if extra >= 6 else None)
    assert event.kv_cache_spec_kind == ("mamba" if extra >= 7 else None)


def test_removed_trailing_fields_missing() -> None:
    batch = decode_batch(vllm_array_batch(0.0, [removed_array([3]), removed_array([4], "GPU")]))
    assert batch.events == (
        BlockRemoved(block_hashes=(h(3),), medium=None, group_idx=None),
        BlockRemoved(block_hashes=(h(4),), medium="GPU", group_idx=None),
    )


def test_unknown_fields_are_ignored() -> None:
    batch = decode_batch(
        vllm_map_batch(
            0.0,
            [
                event_map(
                    "BlockStored", block_hashes=[1], token_ids=[], future=[1, 2], **{"x": {}}
                ),
                event_map("BlockRemoved", block_hashes=[1], another="field"),
                event_map("AllBlocksCleared", reason="reset"),
            ],
        )
    )
    assert len(batch.events) == 3
    # Array layout: elements past the known fields (appended by a later release).
    array = decode_batch(
        vllm_array_batch(
            0.0,
            [
                stored_array([1], None, [], None, None, None, None, None, None, None, 0, "new", 9),
                removed_array([1], None, None, "new"),
                ["AllBlocksCleared", "new"],
            ],
        )
    )
    assert len(array.events) == 3


def test_array_batch_longer_than_known_is_accepted() -> None:
    batch = decode_batch(pack([1.0, [], 2, "future"]))
    assert batch.data_parallel_rank == 2


def test_unknown_event_types_are_skipped_and_counted() -> None:
    events = [
        ["BlockUpdated", [1]],
        stored_array([1], None, [5]),
        event_map("SomethingNew", block_hashes=[1]),
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(vllm_array_batch(0.0, events))
    assert batch.unknown == 2
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]


# --- SGLang ---------------------------------------------------------------------------------


def test_sglang_array_layout_with_signed_hashes() -> None:
    events = [
        ["BlockStored", [-1, -(2**63), 2**63 - 1, 42], -5, list(range(16)), 4, None],
        ["BlockRemoved", [-1]],
        ["AllBlocksCleared"],
    ]
    batch = decode_batch(sglang_batch(3.25, events))
    assert batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (h(U64 - 1), h(2**63), h(2**63 - 1), h(42))
    assert stored.parent_block_hash == h(U64 - 5)
    assert stored.block_size == 4
    assert stored.lora_id is None
    assert removed == BlockRemoved(block_hashes=(h(U64 - 1),), medium=None, group_idx=None)
    assert cleared == AllBlocksCleared()


def test_signed_and_unsigned_forms_of_one_hash_agree() -> None:
    signed = decode_batch(sglang_batch(0.0, [["BlockRemoved", [-2]]]))
    unsigned = decode_batch(sglang_batch(0.0, [["BlockRemoved", [U64 - 2]]]))
    digest = decode_batch(
        sglang_batch(0.0, [["BlockRemoved", [b"\x00" * 24 + b"\xff" * 7 + b"\xfe"]]])
    )
    assert signed.events == unsigned.events == digest.events


# --- hashes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (1, 1),
        (-1, U64 - 1),
        (-(2**63), 2**63),
        (2**63 - 1, 2**63 - 1),
        (2**64 - 1, 2**64 - 1),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
        (b"\x01" * 8, int.from_bytes(b"\x01" * 8, "big")),
        (bytearray(b"\xff" * 8), U64 - 1),
    ],
)
def test_engine_hash_normalises(value: int | bytes, expected: int) -> None:
    assert engine_hash(value) == expected


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, b"\x01" * 7, b"", True, 1.0, "12", None])
def test_engine_hash_rejects(value: object) -> None:
    with pytest.raises(BadEvent, match="parent_block_hash"):
        engine_hash(value, "parent_block_hash")


def test_bytes_hashes_in_a_batch() -> None:
    digest = bytes(range(32))
    batch = decode_batch(
        vllm_map_batch(
            0.0,
            [
                event_map(
                    "BlockStored",
                    block_hashes=[digest],
                    parent_block_hash=digest[::-1],
                    token_ids=[1],
                )
            ],
        )
    )
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (h(int.from_bytes(digest[-8:], "big")),)
    assert event.parent_block_hash == h(int.from_bytes(digest[::-1][-8:], "big"))


# --- malformed input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),  # a never-used msgpack byte
        (pack(1.0) + b"\x00", "msgpack"),  # extra data after the value
        (pack(5), "batch"),
        (pack([1.0]), "batch"),
        (pack({"events": []}), "ts"),
        (pack({"ts": 1.0}), "events"),
        (pack(["1.0", []]), "ts"),
        (pack([True, []]), "ts"),
        (pack([math.nan, []]), "ts"),
        (pack([1.0, {}]), "events"),
        (pack([1.0, [], True]), "data_parallel_rank"),
        (pack([1.0, [], -1]), "data_parallel_rank"),
        (pack([1.0, [[]]]), "events[0]"),
        (pack([1.0, [7]]), "events[0]"),
        (pack([1.0, [[7, [1]]]]), "events[0] tag"),
        (pack([1.0, [{"block_hashes": [1]}]]), "type"),
        (pack([1.0, [{"type": b"BlockStored"}]]), "type"),
        (pack([1.0, [["BlockStored"]]]), "block_hashes"),
        (pack([1.0, [["BlockStored", [1], None]]]), "token_ids"),
        (pack([1.0, [["BlockRemoved"]]]), "block_hashes"),
        (pack([1.0, [["BlockStored", 1, None, []]]]), "block_hashes"),
        (pack([1.0, [["BlockStored", [1], None, [1, 2, 3], 2]]]), "block_size"),
        (pack([1.0, [["BlockStored", [1], None, [1, 2], 0]]]), "block_size"),
        (pack([1.0, [["BlockStored", [1], None, [1, 2], True]]]), "block_size"),
        (pack([1.0, [["BlockStored", [1], None, [1, True]]]]), "token_ids[1]"),
        (pack([1.0, [["BlockStored", [1], None, [1, "2"]]]]), "token_ids[1]"),
        (pack([1.0, [["BlockStored", [1], None, "12"]]]), "token_ids"),
        (pack([1.0, [["BlockStored", [True], None, []]]]), "block_hashes[0]"),
        (pack([1.0, [["BlockStored", [b"short"], None, []]]]), "block_hashes[0]"),
        (pack([1.0, [["BlockStored", ["1"], None, []]]]), "block_hashes[0]"),
        (pack([1.0, [["BlockStored", [1], 2.5, []]]]), "parent_block_hash"),
        (pack([1.0, [["BlockStored", [1], b"1234567", []]]]), "parent_block_hash"),
        (pack([1.0, [["BlockStored", [1], None, [], None, False]]]), "lora_id"),
        (pack([1.0, [["BlockStored", [1], None, [], None, None, 5]]]), "medium"),
        (
            pack([1.0, [["BlockStored", [1], None, [], None, None, None, None, None, -1]]]),
            "group_idx",
        ),
        (
            pack([1.0, [["BlockStored", [1], None, [], None, None, None, None, None, 0, 3]]]),
            "kv_cache_spec_kind",
        ),
        (pack([1.0, [["BlockRemoved", [1], b"GPU"]]]), "medium"),
        (pack([1.0, [["BlockRemoved", [1], None, 1.0]]]), "group_idx"),
        (
            pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}]]),
            "group_idx",
        ),
    ],
)
def test_malformed_payloads_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(BadEvent, match=field.replace("[", r"\[").replace("]", r"\]")):
        decode_batch(payload)


def test_out_of_range_hash_in_a_payload() -> None:
    # msgpack cannot carry ints outside [-2**63, 2**64-1]; a float is the nearest bad value.
    with pytest.raises(BadEvent, match="block_hashes"):
        decode_batch(pack([1.0, [["BlockRemoved", [1.8e19]]]]))


def test_unhashable_map_key_is_a_bad_event() -> None:
    # An array used as a map key: msgpack refuses it while decoding.
    raw = pack([1.0, []])[:-1] + b"\x91\x81\x91\x01\x01"  # events: [{[1]: 1}]
    with pytest.raises(BadEvent):
        decode_batch(raw)


def test_not_bytes_payload() -> None:
    with pytest.raises(BadEvent, match="payload"):
        decode_batch("text")  # type: ignore[arg-type]


def test_missing_msgpack_is_a_bad_event(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        if name == "msgpack":
            raise ImportError("no msgpack")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(BadEvent, match="msgpack"):
        decode_batch(pack([1.0, []]))


# --- frames ---------------------------------------------------------------------------------


def test_decode_frames() -> None:
    payload = vllm_array_batch(1.5, [removed_array([-1 + U64])])
    topic, seq, batch = decode_frames(frames(b"kv-events", 2**64 - 1, payload))
    assert (topic, seq) == ("kv-events", 2**64 - 1)
    assert batch.events == (BlockRemoved(block_hashes=(h(U64 - 1),), medium=None, group_idx=None),)
    assert decode_frames(frames(b"", 0, payload))[:2] == ("", 0)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ([], "frames"),
        ([b"", b"\x00" * 8], "frames"),
        ([b"", b"\x00" * 8, pack([1.0, []]), b""], "frames"),
        ([b"", b"\x00" * 7, pack([1.0, []])], "seq"),
        ([b"", b"\x00" * 9, pack([1.0, []])], "seq"),
        ([b"\xff", b"\x00" * 8, pack([1.0, []])], "topic"),
        (["t", b"\x00" * 8, pack([1.0, []])], "topic"),
        ([b"", 0, pack([1.0, []])], "seq"),
        ([b"", b"\x00" * 8, b"\xc1"], "msgpack"),
        (b"abc", "frames"),
    ],
)
def test_bad_frames(message: Any, field: str) -> None:
    with pytest.raises(BadEvent, match=field):
        decode_frames(message)


# --- fuzz: only BadEvent (or a batch) ever comes out ----------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "ts", "events"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.one_of(
                st.sampled_from(
                    [
                        "type",
                        "ts",
                        "events",
                        "block_hashes",
                        "token_ids",
                        "block_size",
                        "parent_block_hash",
                        "data_parallel_rank",
                    ]
                ),
                st.text(max_size=6),
                st.integers(-5, 5),
            ),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=40,
)
_tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
# Near-valid field values (hash lists, token lists, small ints, names, nil) mixed with
# arbitrary ones, so that the fuzz reaches every field check, not only the batch's.
_hash_values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(max_size=34), _scalars
)
_fields = st.one_of(
    st.lists(_hash_values, max_size=4),
    st.lists(st.integers(-3, 100), max_size=12),
    st.integers(-2, 8),
    st.sampled_from(["GPU", "CPU", "full_attention", "mamba"]),
    st.none(),
    _values,
)
_field_names = st.sampled_from(
    [
        "block_hashes",
        "token_ids",
        "block_size",
        "parent_block_hash",
        "medium",
        "group_idx",
        "lora_id",
        "kv_cache_spec_kind",
        "extra_keys",
    ]
)
_events = st.one_of(
    st.builds(lambda tag, fields: [tag, *fields], _tags, st.lists(_fields, max_size=12)),
    st.builds(
        lambda tag, fields: {"type": tag, **fields}, _tags, st.dictionaries(_field_names, _fields)
    ),
    _values,
)
_ts = st.one_of(st.floats(), st.integers(-(2**63), 2**63), _values)
_ranks = st.one_of(st.none(), st.integers(-2, 8), _values)
_batches = st.one_of(
    st.builds(
        lambda ts, events, rest: [ts, events, *rest],
        _ts,
        st.lists(_events, max_size=5),
        st.lists(_ranks, max_size=2),
    ),
    st.builds(
        lambda ts, events, rank: {"ts": ts, "events": events, "data_parallel_rank": rank},
        _ts,
        st.lists(_events, max_size=5),
        _ranks,
    ),
    _values,
)


def _only_bad_event(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except BadEvent:
        return
    assert isinstance(batch, EventBatch)
    assert batch.unknown >= 0
    for event in batch.events:
        assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
        if isinstance(event, (BlockStored, BlockRemoved)):
            assert all(0 <= value < U64 for value in event.block_hashes)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(payload: bytes) -> None:
    _only_bad_event(payload)


@settings(max_examples=100, deadline=None)  # structures are slow to generate
@given(_batches)
def test_fuzz_random_msgpack_structures(value: object) -> None:
    _only_bad_event(pack(value))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=20), max_size=4))
def test_fuzz_random_frames(message: list[bytes]) -> None:
    with contextlib.suppress(BadEvent):
        decode_frames(message)


@pytest.mark.parametrize(
    ("tokens", "says"),
    [
        ([1, 2, 3, 2**63], "token_ids[3] = 9223372036854775808 does not fit in int64"),
        ([2**64 - 1, 2, 3, 4], "token_ids[0] = 18446744073709551615 does not fit in int64"),
        ([1, True, 3, 4], "token_ids[1] must be an int, not bool"),
        ([1, 2, 3.0, 4], "token_ids[2] must be an int, not float"),
    ],
)
def test_token_ids_must_be_int64(tokens: list[Any], says: str) -> None:
    payload = vllm_map_batch(
        1.0, [event_map("BlockStored", block_hashes=[1], token_ids=tokens, block_size=4)]
    )
    with pytest.raises(BadEvent) as raised:
        decode_batch(payload)
    assert says in str(raised.value)


# --- the replay socket's replies: both forms in use -----------------------------------------

END = (-1).to_bytes(8, "big", signed=True)


def test_replay_replies_in_both_forms() -> None:
    seq = (7).to_bytes(8, "big")
    assert split_replay_reply([b"", seq, b"payload"]) == (7, b"payload")  # vLLM <= 0.25
    assert split_replay_reply([b"", b"kv", seq, b"payload"]) == (7, b"payload")  # >= 0.26
    assert split_replay_reply([b"", b"", seq, b"p"]) == (7, b"p")  # an empty topic
    assert split_replay_reply([b"", END, b""]) is None
    assert split_replay_reply([b"", b"", END, b""]) is None
    big = (2**64 - 2).to_bytes(8, "big")
    assert split_replay_reply([b"", b"", big, b""]) == (2**64 - 2, b"")
    assert split_replay_reply([memoryview(b""), bytearray(seq), b"x"]) == (7, b"x")


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([], "0 frames"),
        ([b""], "1 frames"),
        ([b"", b"x"], "2 frames"),
        ([b"", b"t", b"x", (1).to_bytes(8, "big"), b"p"], "5 frames"),
        ([b"x", (1).to_bytes(8, "big"), b"p"], "without the empty delimiter"),
        ([b"", b"1234", b"p"], "4 bytes long"),
        ([b"", b"t", b"123456789", b"p"], "9 bytes long"),
        ([b"", "text", b"p"], "must be bytes"),
        (b"not frames", "list of frames"),
        (None, "list of frames"),
    ],
)
def test_replay_replies_out_of_protocol_say_what_came(frames: Any, says: str) -> None:
    with pytest.raises(BadEvent, match=says):
        split_replay_reply(frames)


@given(st.lists(st.binary(max_size=12), max_size=6))
def test_any_replay_reply_is_parsed_or_refused_with_bad_event(frames: list[bytes]) -> None:
    with contextlib.suppress(BadEvent):
        reply = split_replay_reply(frames)
        assert reply is None or (0 <= reply[0] < 2**64 and reply[1] == frames[-1])
