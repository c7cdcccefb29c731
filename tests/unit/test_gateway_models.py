"""What the gateway knows of the backends' models (``pcr.gateway.models``) and how it keys
a request's hashes by its salt and adapter (``pcr.gateway.tokens.chain_keys``): no I/O."""

from __future__ import annotations

import json
import re

import pytest

from pcr.gateway.models import MEMO_MODELS, ModelCatalog, served_of
from pcr.gateway.tokens import (
    BadBody,
    chain_keys,
    ids_of,
    parse_body,
    tenant_salt,
    token_prompt,
)
from registry import block_hashes, request_chain_keys

PROMPT = list(range(10, 43))


def listing(base: str, *adapters: str) -> dict[str, object]:
    data = [{"id": base, "object": "model", "parent": None}]
    data += [{"id": a, "object": "model", "parent": base} for a in adapters]
    return {"object": "list", "data": data}


def test_served_of_reads_adapters_by_their_parent() -> None:
    served = served_of(listing("tiny", "sql-lora", "chat-lora"))
    assert served is not None
    assert served.models == {"tiny", "sql-lora", "chat-lora"}
    assert served.adapters == {"sql-lora", "chat-lora"}
    shapes: tuple[object, ...] = (None, [], {"data": "x"}, "text", {"data": None})
    for shape in shapes:
        assert served_of(shape) is None
    odd = served_of({"data": [{"id": ""}, {"id": 5}, "x", {"id": "m", "parent": 3}, {"id": "m"}]})
    assert odd is not None
    assert (odd.models, odd.adapters, len(odd.entries)) == (frozenset({"m"}), frozenset(), 1)


def test_serving_leaves_out_only_backends_known_not_to_serve() -> None:
    catalog = ModelCatalog()
    catalog.learn("a", served_of(listing("tiny", "sql-lora")))
    catalog.learn("b", served_of(listing("tiny")))
    names = ["a", "b", "c"]  # c: not known
    assert catalog.serving("sql-lora", names) == {"a", "c"}
    assert catalog.serving("tiny", names) == {"a", "b", "c"}
    assert catalog.serving("nobody", names) == {"c"}
    assert catalog.serving("nobody", ["a", "b"]) == frozenset()
    assert catalog.serving(None, ["a", "b"]) == {"a", "b"}  # the engine's default model
    assert catalog.adapters == {"sql-lora"}
    catalog.keep_only(["b"])
    assert catalog.adapters == frozenset()
    assert [m["id"] for m in catalog.listing()] == ["tiny"]


def test_serving_answers_reused_only_while_the_lists_and_names_stand() -> None:
    catalog = ModelCatalog()
    catalog.learn("a", served_of(listing("tiny")))
    assert catalog.serving("tiny", ["a", "b"]) == {"a", "b"}
    assert catalog.serving("tiny", ["a", "b"]) == {"a", "b"}  # reused
    assert catalog.serving("tiny", ["a"]) == {"a"}  # other backends asked of: not reused
    catalog.learn("b", served_of(listing("other")))
    assert catalog.serving("tiny", ["a", "b"]) == {"a"}  # a list changed: forgotten
    for n in range(MEMO_MODELS * 3):  # models named by clients: remembered up to a bound
        assert catalog.serving(f"nobody-{n}", ["a", "b"]) == frozenset()
        assert len(catalog._memo) <= MEMO_MODELS
    assert catalog.serving("tiny", ["a", "b"]) == {"a"}


def test_listing_is_the_union_once_each() -> None:
    catalog = ModelCatalog()
    catalog.learn("b", served_of(listing("tiny", "y")))
    catalog.learn("a", served_of(listing("tiny", "x")))
    assert [m["id"] for m in catalog.listing()] == ["tiny", "x", "y"]
    assert [m["id"] for m in catalog.listing(["b"])] == ["tiny", "y"]
    catalog.learn("b", None)
    assert [m["id"] for m in catalog.listing()] == ["tiny", "x"]


def test_chain_keys_match_the_registry_and_refuse_bad_salts() -> None:
    adapters = frozenset({"sql-lora"})
    body = {"model": "sql-lora", "cache_salt": "t1", "prompt": PROMPT}
    keys = chain_keys(body, adapters)
    assert keys == request_chain_keys("t1", model="sql-lora", adapters=adapters)
    ids = ids_of(PROMPT, 4, True, keys)
    assert ids.hashes == block_hashes(PROMPT, 4, salt="t1", lora="sql-lora")
    assert ids.hashes != block_hashes(PROMPT, 4)
    assert ids.root != ids_of(PROMPT, 4, True).root  # kin: only the same keys
    assert chain_keys({"model": "tiny"}, adapters).lora is None
    assert chain_keys({"model": ["x"]}, adapters).lora is None  # unhashable: not an adapter
    bad: tuple[object, ...] = ("", "a/b", "@", "\\", "\0", "s" * 129, 5, [], {})
    for salt in bad:
        with pytest.raises(BadBody, match="cache_salt"):
            chain_keys({"cache_salt": salt}, adapters)


def test_parse_body_hashes_a_token_prompt_under_its_keys() -> None:
    raw = json.dumps({"model": "sql-lora", "cache_salt": "t1", "prompt": PROMPT}).encode()
    _body, ids = parse_body(raw, False, None, 4, True, frozenset({"sql-lora"}))
    assert ids is not None
    assert ids.hashes == block_hashes(PROMPT, 4, salt="t1", lora="sql-lora")
    _body, plain = parse_body(raw, False, None, 4, True)  # the adapter not known
    assert plain is not None
    assert plain.hashes == block_hashes(PROMPT, 4, salt="t1")
    with pytest.raises(BadBody, match="cache_salt"):
        parse_body(b'{"cache_salt": "a/b", "messages": []}', True, None, 4, True)


def test_tenant_salts_never_collide_and_are_salts_vllm_takes() -> None:
    salts = {
        tenant_salt(tenant, salt)
        for tenant in ("a", "b", "a\x01")
        for salt in (None, "", "x", "\x01x")
    }
    assert len(salts) == 12
    for salt in salts:
        assert re.fullmatch(r"t-[0-9a-f]{64}", salt)
        assert request_chain_keys(salt).salt == salt
    assert tenant_salt("a", "x") == tenant_salt("a", "x")


def test_a_salted_body_keeps_every_byte_and_its_last_salt_wins() -> None:
    from pcr.gateway.tokens import salted_body

    raw = b' {"prompt": [1, 2, 3], "cache_salt": "mine"}\n'
    out = salted_body(raw, "t-abc")
    assert out.startswith(b' {"prompt": [1, 2, 3], "cache_salt": "mine"')
    assert json.loads(out) == {"prompt": [1, 2, 3], "cache_salt": "t-abc"}
    assert json.loads(salted_body(b"{ }", "t-x")) == {"cache_salt": "t-x"}
    for not_utf8 in ('{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le")):
        with pytest.raises(BadBody):
            salted_body(not_utf8, "t-x")


def test_parse_body_hashes_a_tenant_request_under_its_tenant_salt() -> None:
    raw = json.dumps({"prompt": list(range(8)), "cache_salt": "mine"}).encode()
    body, ids = parse_body(raw, False, None, 4, True, tenant="tenant-c")
    salt = tenant_salt("tenant-c", "mine")
    assert body["cache_salt"] == salt
    assert ids is not None
    assert ids.hashes == block_hashes(list(range(8)), 4, salt=salt)
    with pytest.raises(BadBody):  # the tenant's own salt is still checked as vLLM would
        parse_body(b'{"cache_salt": "a/b", "prompt": [1]}', False, None, 4, True, tenant="t")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [1, 2, 3, 4, 5], "model": "m"}',
        b'{"prompt": [1, 2], "max_tokens": NaN}',  # json reads it, orjson does not
        b'{"prompt": [123456789012345678901234567890, 2]}',  # past 64 bits
        '{"prompt": [1, 2, 3, 4, 5]}'.encode("utf-16"),
        b'{"a": 1, "a": 2, "prompt": "text"}',  # a repeated name: the last value
        b'{"prompt": [1e400]}',
    ],
)
def test_a_body_parses_as_json_reads_it(raw: bytes) -> None:
    """orjson where installed, json for what it refuses: the same body and prompt ids."""
    body, ids = parse_body(raw, False, None, 4, True)
    want = json.loads(raw)
    assert body.keys() == want.keys()
    assert ids == ids_of(want["prompt"], 4, True) if token_prompt(want) else ids is None
    if isinstance(want["prompt"], str) or token_prompt(want):
        assert body["prompt"] == want["prompt"]


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'{"a": 1} x', b"\xff\xfe{", b"[" * 5000])
def test_a_body_that_is_no_json_object_is_refused_alike(raw: bytes) -> None:
    with pytest.raises(BadBody):
        parse_body(raw, False, None, 4, True)
