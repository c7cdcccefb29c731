"""A completion's prompt of token ids read straight from the body's bytes
(``registry.core.hashing.body_token_ids``, ``pcr.gateway.tokens._token_body``) against
the whole body parsed: the same body, the same ids and hashes, the same refusals, for
every body, whitespace, member order, repeated or escaped name, number form, salt and
broken byte. Where the bytes are not of the plain shape the whole body is parsed, so
the answers can only differ by a defect of the scan."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcr.gateway import tokens as gateway_tokens
from pcr.gateway.tokens import PromptIds, _parse_apart, _token_body, ids_of
from registry.core.hashing import block_hashes, body_token_ids
from tests.support.chains import NATIVE

needs_extension = pytest.mark.skipif(NATIVE is None, reason="C extension not built")
LIMIT = gateway_tokens.TOKEN_LIMIT


def outcome(raw: bytes, fast: bool, **options: Any) -> tuple[Any, ...]:
    """``_parse_apart``'s answer (or its refusal) with the scan on or off."""
    args = (
        raw,
        False,
        options.get("max_tokens"),
        options.get("block_size", 4),
        options.get("hashed", True),
        options.get("adapters", frozenset()),
        options.get("tenant"),
    )
    saved = gateway_tokens.body_token_ids
    if not fast:
        gateway_tokens.body_token_ids = lambda raw, limit: None  # type: ignore[assignment]
    try:
        body, ids = _parse_apart(*args)
    except ValueError as refused:  # BadBody, PromptTooLong
        return ("refused", type(refused), str(refused))
    finally:
        gateway_tokens.body_token_ids = saved
    return ("taken", body, list(body), ids)


def same_either_way(raw: bytes, **options: Any) -> tuple[Any, ...]:
    fast = outcome(raw, True, **options)
    assert fast == outcome(raw, False, **options), raw
    return fast


@needs_extension
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":1}',
        b'{"prompt":[0,10,2147483647,5,6]}',
        b' \t\r\n{ "prompt" \n: [ 1 ,2,\t3 ,4 ,5 ] , "stream" : false }\n ',
        b'{"a":{"prompt":[9,9]},"b":["\\"prompt\\":[7]"],"prompt":[1,2,3,4,5],"c":null}',
        b'{"x":"}{][,:","prompt":[5,4,3,2,1],"y":[[{"z":"\\\\"}]],"n":-1.5e3}',
    ],
)
def test_a_plain_prompt_of_ids_is_read_from_the_bytes_with_the_same_answer(raw: bytes) -> None:
    taken = same_either_way(raw)
    want = json.loads(raw)
    assert taken[0] == "taken"
    assert "prompt" not in taken[1]
    assert taken[1] == {k: v for k, v in want.items() if k != "prompt"}
    assert taken[3] == ids_of(want["prompt"], 4, True)
    assert _token_body(raw, None, 4, True, frozenset(), None) is not None  # the scan took it
    start, end, ids = body_token_ids(raw, LIMIT) or (0, 0, [])
    assert json.loads(raw[start:end]) == want["prompt"] == list(ids)


@needs_extension
@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt":[1,2],"prompt":[3,4,5,6,7]}',  # repeated: the last one counts
        b'{"pr\\u006fmpt":[1,2,3,4,5],"prompt":[9,9,9,9,9]}',  # an escaped name
        b'{"prompt":[1,2,3,4,5],"pr\\u006fmpt":"text"}',
        b'{"prompt":[-1,2,3,4,5]}',
        b'{"prompt":[1.0,2,3,4,5]}',
        b'{"prompt":[1e2,2,3,4,5]}',
        b'{"prompt":[01,2,3,4,5]}',
        b'{"prompt":[2147483648,2,3,4,5]}',  # past a token id
        b'{"prompt":[123456789012345678901234567890,2]}',
        b'{"prompt":[true,2,3,4,5]}',
        b'{"prompt":[[1,2,3,4,5],[6]]}',
        b'{"prompt":[]}',
        b'{"prompt":"text"}',
        b'{"prompt":[1,2,3,4,5].5}',  # a fraction after the list
        b'{"prompt":[1,2,3,4,5]e3}',
        b'{"prompt":[1,2,3,4,5]} x',
        b'{"prompt":[1,2,3,4,5]',
        b'{"prompt":[1,2,3,4,5,]}',
        b'{"prompt":[1,,2]}',
        b'{"prompt"[1,2]}',
        b'{"prompt":[1,2],}',
        b'{"prompt":[1,2,3,4,5],"max_tokens":NaN}',  # json reads it, orjson does not
        b'{"prompt":[1,2,3,4,5],"s":"\xff"}',  # not UTF-8
        b'{"prompt":[1,2,3,4,5],"a":[}',
        b'{"prompt":[1,2,3,4,5],"a":' + b"[" * 600 + b"]" * 600 + b"}",
        b'\xef\xbb\xbf{"prompt":[1,2,3,4,5]}',
        '{"prompt": [1, 2, 3, 4, 5]}'.encode("utf-16"),
        b'[{"prompt":[1,2,3,4,5]}]',
        b"{}",
        b"",
    ],
)
def test_any_other_body_gets_the_whole_parse_answer(raw: bytes) -> None:
    same_either_way(raw)


@needs_extension
def test_salts_adapters_limits_and_policies_are_applied_alike() -> None:
    raw = b'{"model":"sql-lora","cache_salt":"s1","prompt":[1,2,3,4,5,6,7,8,9]}'
    adapters = frozenset({"sql-lora"})
    salted = same_either_way(raw, adapters=adapters)
    plain = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert salted[3].hashes == block_hashes(
        [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, salt="s1", lora="sql-lora"
    )
    assert salted[3].hashes != plain
    assert salted[3].root == ("s1", "sql-lora", (1, 2, 3, 4))
    tenant = same_either_way(raw, tenant="tenant-a")
    assert tenant[1]["cache_salt"].startswith("t-")
    assert same_either_way(raw, max_tokens=8)[0:2] == ("refused", gateway_tokens.PromptTooLong)
    assert same_either_way(raw, max_tokens=9)[0] == "taken"
    assert same_either_way(raw, block_size=None)[3] is None
    assert same_either_way(raw, hashed=False)[3] == PromptIds(9, ("s1", None, (1, 2, 3, 4)), None)
    assert same_either_way(raw, block_size=10)[3] == PromptIds(9, None, [])
    bad = b'{"cache_salt":"a/b","prompt":[1,2,3,4,5]}'  # a salt vLLM refuses
    assert same_either_way(bad)[0:2] == ("refused", gateway_tokens.BadBody)
    assert same_either_way(bad, max_tokens=1)[0:2] == ("refused", gateway_tokens.BadBody)


SPACE = st.sampled_from(["", "", " ", "\n", "\t", "\r\n  "])
NAMES = st.sampled_from(
    ["prompt", "model", "stream", "promp", "prompts", "Prompt", "pr\\u006fmpt", "a\\"]
)
SCALARS = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.sampled_from(["true", "false", "null", "1.5", "-0", "1e9", '"a,b]}"', '"\\"["', '""']),
)
IDS = st.lists(
    st.one_of(
        st.integers(0, 2**31 - 1).map(str),
        st.sampled_from(["0", "2147483648", "-3", "1.0", "07", "1E2", '"7"', "null"]),
    ),
    max_size=40,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A JSON-like object, whitespace anywhere a JSON text allows it, a prompt of ids
    (or something like one) among members that may hide its name."""

    def ws() -> str:
        return draw(SPACE)

    def value(depth: int) -> str:
        kind = draw(st.integers(0, 3 if depth < 3 else 0))
        if kind == 0:
            return draw(SCALARS)
        if kind == 1:
            items = [value(depth + 1) for _ in range(draw(st.integers(0, 3)))]
            return "[" + ",".join(ws() + item + ws() for item in items) + "]"
        if kind == 2:
            keys = [draw(NAMES) for _ in range(draw(st.integers(0, 3)))]
            inner = ",".join(f'{ws()}"{k}"{ws()}:{ws()}{value(depth + 1)}{ws()}' for k in keys)
            return "{" + inner + "}"
        ids = draw(IDS)
        return "[" + ",".join(ws() + i + ws() for i in ids) + "]"

    members = [(draw(NAMES), value(0)) for _ in range(draw(st.integers(0, 4)))]
    members.insert(draw(st.integers(0, len(members))), ("prompt", value(3)))
    inner = ",".join(f'{ws()}"{k}"{ws()}:{ws()}{v}{ws()}' for k, v in members)
    return (ws() + "{" + inner + "}" + ws()).encode()


@needs_extension
@settings(max_examples=400, deadline=None)
@given(bodies(), st.randoms(use_true_random=False))
def test_generated_and_broken_bodies_get_the_same_answer(raw: bytes, rng: random.Random) -> None:
    same_either_way(raw)
    same_either_way(raw, max_tokens=3, block_size=2, tenant="t")
    broken = bytearray(raw)
    for _ in range(rng.randint(1, 3)):  # a byte changed, dropped or added
        at = rng.randrange(len(broken) + 1)
        byte = rng.choice(b'{}[],:" \\0123456789-.eE\xff')
        edit = rng.randrange(3)
        if edit == 0 and at < len(broken):
            broken[at] = byte
        elif edit == 1 and at < len(broken):
            del broken[at]
        else:
            broken.insert(at, byte)
    same_either_way(bytes(broken))


@needs_extension
def test_a_long_prompt_and_a_large_body_are_read_whole() -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(LIMIT) for _ in range(20_000)]
    raw = json.dumps({"model": "m", "prompt": prompt, "pad": "x" * 100_000}).encode()
    taken = same_either_way(raw, block_size=16)
    assert taken[3].count == 20_000
    assert len(taken[3].hashes) == 1_250


@needs_extension
def test_the_ids_read_hash_as_they_are_and_any_view_of_them_alike() -> None:
    """The scan's ids (int64s over the packed bytes) are hashed without a copy; a view
    over part of them, reversed, strided or of another format, goes the general way:
    the same hashes."""
    ids = list(range(1, 70))
    raw = json.dumps({"prompt": ids}).encode()
    found = body_token_ids(raw, LIMIT)
    assert found is not None
    whole = found[2]
    assert list(whole) == ids
    assert block_hashes(whole, 16) == block_hashes(ids, 16)
    assert block_hashes(whole[16:], 16) == block_hashes(ids[16:], 16)
    assert block_hashes(memoryview(bytearray(whole.obj)).cast("q"), 16) == block_hashes(ids, 16)
    assert block_hashes(whole[::-1], 16) == block_hashes(ids[::-1], 16)  # all of it, reversed
    assert block_hashes(whole[::2], 16) == block_hashes(ids[::2], 16)
