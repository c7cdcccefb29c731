"""The gateway's body parsing on the loop (``pcr.gateway.tokens.BodyParser``): a prompt
of token ids is read into its ids and left out of the body, as the helper process does
for a large body, so no request in flight holds a list of hundreds of ints for the
garbage collector to walk; everything else of the body, and a text prompt, stays."""

from __future__ import annotations

import asyncio
import gc
import json

from pcr.gateway.tokens import BodyParser, ids_of
from pcr.serve.state import YOUNG_COLLECTION, settle_heap


def _parse(body: dict[str, object], chat: bool = False) -> tuple[dict[str, object], object]:
    parser = BodyParser()
    try:
        raw = json.dumps(body).encode()
        return asyncio.run(parser.parse(raw, chat, None, 16, True))
    finally:
        parser.close()


def test_token_ids_become_ids_and_leave_the_body() -> None:
    prompt = list(range(100, 164))
    body, ids = _parse({"model": "m", "prompt": prompt, "stream": True, "max_tokens": 3})
    assert body == {"model": "m", "stream": True, "max_tokens": 3}
    assert ids == ids_of(prompt, 16, True)


def test_a_batch_of_id_prompts_leaves_too_and_a_text_prompt_stays() -> None:
    body, ids = _parse({"prompt": [[1, 2], [3, 4]]})
    assert "prompt" not in body
    assert ids == ids_of([1, 2], 16, True)  # a batch is routed by its first prompt
    body, ids = _parse({"prompt": "hello there"})
    assert body["prompt"] == "hello there"
    assert ids is None  # tokenized later, by the tokenizer
    body, _ = _parse({"prompt": ["a", "b"]})
    assert body["prompt"] == ["a", "b"]


def test_chat_bodies_are_left_whole() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body, ids = _parse({"model": "m", "messages": messages}, chat=True)
    assert body == {"model": "m", "messages": messages}
    assert ids is None


def test_settling_the_heap_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_threshold() == (YOUNG_COLLECTION, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
