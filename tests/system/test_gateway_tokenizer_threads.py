"""``PromptTokenizer`` without a lock between requests: each worker thread tokenizes with
its own copy, and every prompt gets the same tokens from many threads at once as from one
thread alone (fast tokenizers release the GIL, so the copies really run together)."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.tiny_tokenizer import words

pytest.importorskip("transformers")


def _bodies(count: int) -> list[dict[str, object]]:
    rng = random.Random(5)
    bodies: list[dict[str, object]] = []
    for n in range(count):
        system = words([rng.randrange(4, 512) for _ in range(rng.randrange(50, 400))])
        user = words([rng.randrange(4, 512) for _ in range(rng.randrange(1, 40))])
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        bodies.append({"messages": messages, "add_special_tokens": n % 3 == 0})
    return bodies


def test_many_threads_tokenize_as_one_does(tokenizer_dir: Path) -> None:
    from pcr.gateway.tokens import SHORT_WORKERS, PromptTokenizer

    bodies = _bodies(200)
    alone = PromptTokenizer(tokenizer_dir)
    expected = [alone.chat(body) for body in bodies]
    assert all(expected)
    shared = PromptTokenizer(tokenizer_dir)
    with ThreadPoolExecutor(16) as pool:  # one PromptTokenizer, 16 threads at once
        got = list(pool.map(shared.chat, bodies * 4))
    assert got == expected * 4

    async def lanes() -> list[list[int] | None]:
        return await asyncio.gather(*(shared.tokens(body, chat=True) for body in bodies))

    assert asyncio.run(lanes()) == expected  # through the short lane's threads
    assert SHORT_WORKERS > 1
    assert shared.short.held == 0
    shared.close()
    alone.close()


def test_a_chat_encoded_in_pieces_between_added_tokens_gets_the_whole_texts_tokens(
    tokenizer_dir: Path,
) -> None:
    """The pieces between added tokens (``<s>``...) are encoded once each and remembered:
    every chat's tokens equal its whole rendered text's, the second time too."""
    from pcr.gateway.tokens import PromptTokenizer

    tokenizer = PromptTokenizer(tokenizer_dir)
    assert tokenizer.segmenter is not None
    whole = tokenizer.tokenizer
    for body in _bodies(50) * 2:
        text = tokenizer.render(body)
        assert text is not None
        special = body["add_special_tokens"] is True
        assert tokenizer.chat(body) == whole.encode(text, add_special_tokens=special)
    tokenizer.close()


def test_a_tokenizer_that_treats_a_texts_start_apart_is_encoded_whole(tmp_path: Path) -> None:
    """A Metaspace pre-tokenizer that marks only the text's first word (Llama's
    ``prepend_scheme="first"``) tokenizes a piece after an added token unlike the piece
    alone: the self-test finds it, and texts are encoded whole; so too where an added
    token strips its neighbours' spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pcr.gateway.tokens import PromptTokenizer

    vocab = {"<s>": 0, "<unk>": 1, "\u2581Hello": 2, "Hello": 3, "\u2581world": 4}
    for n, (scheme, strip) in enumerate((("first", False), ("always", True))):
        words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
        fast.add_special_tokens({"bos_token": AddedToken("<s>", lstrip=strip)})
        fast.save_pretrained(tmp_path / str(n))
        tokenizer = PromptTokenizer(tmp_path / str(n))
        assert tokenizer.segmenter is None
        assert tokenizer.encode("<s>Hello world", False) == fast.encode(
            "<s>Hello world", add_special_tokens=False
        )
        tokenizer.close()


def test_short_texts_on_the_loop_and_long_ones_in_the_lanes_get_the_same_tokens(
    tokenizer_dir: Path,
) -> None:
    """A chat or a text prompt up to ``IN_LOOP_CHARS`` is tokenized on the event loop (no
    thread hop), a longer one in a lane: both give what one thread alone gives; a chat
    with tools, parts that are not text or another shape goes to a lane whatever its
    size."""
    from pcr.gateway.tokens import IN_LOOP_CHARS, PromptTokenizer, _chat_chars

    rng = random.Random(8)
    tokenizer = PromptTokenizer(tokenizer_dir)
    alone = PromptTokenizer(tokenizer_dir)
    short = _bodies(20)
    assert all(0 < (_chat_chars(b) or 0) <= IN_LOOP_CHARS for b in short[:5])
    long_text = words([rng.randrange(4, 512) for _ in range(IN_LOOP_CHARS // 2)])
    assert len(long_text) > IN_LOOP_CHARS
    long_chat = {"messages": [{"role": "user", "content": long_text}]}
    assert (_chat_chars(long_chat) or 0) > IN_LOOP_CHARS
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}]}
    assert _chat_chars(parts) == len("w5 w6")
    assert _chat_chars({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}) is None
    assert _chat_chars({"messages": "not a list"}) is None
    assert _chat_chars({"messages": [{"role": "user", "content": [{"type": "image"}]}]}) is None
    handed: list[str] = []  # what went to a lane's threads
    hop = tokenizer.short.run

    async def counted(work: Any, *args: Any) -> Any:
        handed.append(work.__name__)
        return await hop(work, *args)

    tokenizer.short.run = counted  # type: ignore[method-assign]

    async def run() -> list[list[int] | None]:
        out = [await tokenizer.tokens(b, chat=True) for b in [*short, long_chat, parts]]
        out.append(await tokenizer.tokens({"prompt": long_text}, chat=False))
        out.append(await tokenizer.tokens({"prompt": "w7 w8 w9"}, chat=False))
        return out

    got = asyncio.run(run())
    want = [alone.chat(b) for b in [*short, long_chat, parts]]
    want += [alone.completion(long_text), alone.completion("w7 w8 w9")]
    assert got == want
    assert all(got)
    # Only the long chat (rendered, then encoded) and the long prompt reached a thread.
    assert handed == ["render", "encode", "encode"]
    tokenizer.close()
    alone.close()


LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    "{% if tools %}tools: {{ tools | length }}{% endif %}"
    "{% if think is defined %}think={{ think }}{% endif %}"
)


def test_a_plain_chat_is_rendered_straight_as_apply_chat_template_renders_it(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The template compiled once and rendered straight (``_ChatTemplate``) writes what
    ``apply_chat_template`` writes, for the test tokenizer's template and one that uses
    its special tokens, trims and refuses a role: random chats with and without the
    generation prompt; a refused role fails alike (routed by load), and a chat with
    tools, template arguments or its last message continued goes through
    ``apply_chat_template`` (what the straight render does not take)."""
    from transformers import AutoTokenizer

    from pcr.gateway.tokens import PromptTokenizer

    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(tmp_path)
    fast = AutoTokenizer.from_pretrained(str(tmp_path))
    fast.chat_template = LLAMA_LIKE
    fast.save_pretrained(tmp_path)
    rng = random.Random(12)
    for directory in (tokenizer_dir, tmp_path):
        tokenizer = PromptTokenizer(directory)
        assert tokenizer.template is not None
        whole = tokenizer.tokenizer
        for body in _bodies(40):
            messages = body["messages"]
            assert isinstance(messages, list)
            if rng.random() < 0.5:
                messages.append({"role": "assistant", "content": " w9 w10 "})
                messages.append({"role": "user", "content": "w11"})
            generation = rng.random() < 0.7
            body["add_generation_prompt"] = generation
            assert tokenizer.render(body) == whole.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
        odd = {"messages": [{"role": "tool", "content": "w5"}]}
        if directory == tmp_path:
            with pytest.raises(Exception, match="roles are"):
                tokenizer.render(odd)
        plain = [{"role": "user", "content": "w5 w6"}]
        asked = {
            "tools": {"messages": plain, "tools": [{"type": "function"}]},
            "kwargs": {"messages": plain, "chat_template_kwargs": {"think": "yes"}},
        }
        for name, body in asked.items():
            options = {"tools": body["tools"]} if name == "tools" else {"think": "yes"}
            assert tokenizer.render(body) == whole.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=True, **options
            )
        if directory == tmp_path:
            assert "tools: 1" in (tokenizer.render(asked["tools"]) or "")
            assert "think=yes" in (tokenizer.render(asked["kwargs"]) or "")
        tokenizer.close()


def test_a_template_that_renders_otherwise_straight_goes_through_transformers(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The self-test renders its probes both ways: where the straight render differs
    (here: a transformers whose ``apply_chat_template`` writes something more than its
    template), no ``_ChatTemplate`` is kept and every chat goes through it."""
    from transformers import PreTrainedTokenizerBase

    from pcr.gateway.tokens import PromptTokenizer

    through = PreTrainedTokenizerBase.apply_chat_template

    def more(self: Any, *args: Any, **kwargs: Any) -> Any:
        return through(self, *args, **kwargs) + " w7"

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", more)
    tokenizer = PromptTokenizer(tokenizer_dir)
    assert tokenizer.template is None
    body = {"messages": [{"role": "user", "content": "w5"}]}
    rendered = tokenizer.render(body)
    assert rendered is not None
    assert rendered.endswith(" w7")
    tokenizer.close()
