"""The prompt's tokens as the engine will see them, for ``pcr gateway`` to route by.

The engine hashes the tokens it computes, so the gateway must tokenize exactly as the
engine does, with the model's own tokenizer and chat template, from a local directory
(``transformers``' ``AutoTokenizer`` with ``local_files_only``: nothing is downloaded):

- ``/v1/completions``: a ``prompt`` of token ids is used as it is; a text prompt is
  encoded with the tokenizer's special tokens (vLLM's ``add_special_tokens`` default for
  completions is true); a list of prompts routes by its first.
- ``/v1/chat/completions``: the messages are rendered with the chat template (with the
  generation prompt unless ``add_generation_prompt`` is false, or
  ``continue_final_message`` is true), then encoded without adding special tokens (the
  template writes its own; vLLM's chat default), honouring the request's
  ``add_special_tokens``, ``chat_template_kwargs`` and ``tools``. A message's content is
  a string or a list of text parts (joined by newlines, as vLLM does for templates that
  take a string).

Whatever cannot be tokenized here (an image part, a template error, no tokenizer given)
gives ``None``: the request is still sent, routed by load. Tokenizing runs in a worker
thread (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 4_000_000
"""Longer text prompts are not tokenized for routing (they are still sent, by load)."""


class TokenizerError(Exception):
    """The tokenizer directory cannot be loaded (a one-line message for the CLI)."""


class PromptTokenizer:
    """The model's tokenizer and chat template, loaded once from ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory {str(path)!r} does not exist")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise TokenizerError(
                "--tokenizer needs transformers: pip install 'prefix-cache-registry[gateway]'"
            ) from exc
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # transformers raises many kinds here
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TokenizerError(f"cannot load a tokenizer from {str(path)!r}: {first}") from exc
        self.directory = path
        self._lock = threading.Lock()  # fast tokenizers are not safe to share across threads

    def completion(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return ids

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = _messages(body.get("messages"))
        if messages is None:
            return None
        continue_final = body.get("continue_final_message") is True
        generation = body.get("add_generation_prompt", True) is not False and not continue_final
        kwargs = body.get("chat_template_kwargs")
        options: dict[str, Any] = dict(kwargs) if isinstance(kwargs, dict) else {}
        tools = body.get("tools")
        with self._lock:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools if isinstance(tools, list) and tools else None,
                tokenize=False,
                add_generation_prompt=generation,
                continue_final_message=continue_final,
                **options,
            )
            add_special = body.get("add_special_tokens") is True
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special)
        return ids


def _messages(raw: Any) -> list[dict[str, Any]] | None:
    """Messages with text content as the template sees them, or None (not text)."""
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return None  # images, audio: the engine's own processing
                if not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            return None
        out.append({**message, "content": content})
    return out


def token_prompt(body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt of token ids (the first of a list of them), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(_token(t) for t in prompt):
        return prompt
    return None


def text_prompt(body: dict[str, Any]) -> str | None:
    """A completion's text prompt (the first of a list of them), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and len(prompt) <= MAX_PROMPT_CHARS:
        return prompt
    return None


def _token(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**31


async def prompt_tokens(
    tokenizer: PromptTokenizer | None, body: dict[str, Any], chat: bool
) -> list[int] | None:
    """The request's prompt as token ids, or None when it cannot be known here."""
    if not chat:
        tokens = token_prompt(body)
        if tokens is not None:
            return tokens
    if tokenizer is None:
        return None
    try:
        if chat:
            return await asyncio.to_thread(tokenizer.chat, body)
        text = text_prompt(body)
        if text is None:
            return None
        add_special = body.get("add_special_tokens", True) is not False
        return await asyncio.to_thread(tokenizer.completion, text, add_special)
    except Exception as exc:  # a template's own error, a bad argument: route by load
        log.debug("tokenizing for routing failed: %s", type(exc).__name__)
        return None
