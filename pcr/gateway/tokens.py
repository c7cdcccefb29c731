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

Whatever cannot be tokenized here (an image part, a template error, no tokenizer given, a
text over ``MAX_PROMPT_CHARS``) gives ``None``: the request is still sent, routed by load.

No request stalls another:

- A prompt over the model's maximum length (``--max-model-len``, else the model's
  ``config.json`` in the tokenizer directory) is refused (``PromptTooLong``, answered 400)
  before it is tokenized, judged by its bytes: its text (a chat's rendered template) over
  ``max_len * longest_token`` UTF-8 bytes, where ``longest_token`` is the longest entry of
  the vocabulary in bytes (its byte-level spelling, which is never shorter than the bytes
  it stands for). Every token covers at most that many bytes of text, so such a prompt
  has more than ``max_len`` tokens and the engine would refuse it too (true of every
  lossless tokenizer; one whose normalizer deletes text, e.g. control characters, could
  be refused where the engine would not: give a larger ``--max-model-len`` then). A prompt
  of token ids is refused by its count.
- Texts up to ``IN_LOOP_CHARS`` are rendered and tokenized on the event loop (a thread
  hop costs more than they do). Longer ones run in worker threads, each with its own copy
  of the tokenizer (fast tokenizers are not safe to share across threads; the loop has its
  own copy too): no lock between requests. Texts up to
  ``LONG_PROMPT_CHARS`` go to a short lane of ``SHORT_WORKERS`` threads, longer ones to a
  long lane of one thread, so long prompts never starve short ones; while
  ``LONG_WAITING`` long prompts are in the long lane, more are routed by load untokenized.
- A text is encoded in its pieces between the tokenizer's added tokens (``<|im_start|>``
  and the like, which the tokenizer itself splits on before anything else), each piece's
  tokens remembered (``SEGMENTS`` of them, least recently used out): a chat's system
  prompt, shared by many requests, is encoded once. Only where a self-test at load shows
  the pieces' tokens joined equal to the whole text's (no added token strips its
  neighbours' spaces or is normalized, no pre-tokenizer treats a text's start apart);
  else, and with special tokens added, the whole text each time.
- Bodies are parsed by orjson where it is installed (``loads``; ``json`` for what it
  refuses). A body over ``PARSE_IN_LOOP`` bytes is parsed (and a prompt of token ids checked and
  hashed) in a helper process (``BodyParser``), not on the event loop: ``json.loads``
  holds the interpreter lock throughout, so a thread would not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import math
import multiprocessing
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

try:  # a quarter of json's time on a body of token ids (the gateway extra brings it)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - installed without it: json alone
    _fast_loads = None  # type: ignore[assignment]

from pcr.gateway.balance import prompt_root
from registry.core.hashing import (
    ChainKeys,
    block_hashes,
    body_token_ids,
    request_chain_keys,
    token_ids,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PROMPT_CHARS = 4_000_000
"""Longer text prompts are not tokenized for routing (they are still sent, by load)."""
LONG_PROMPT_CHARS = 32_768
"""Longer texts are tokenized in the long lane (one thread), shorter in the short lane."""
IN_LOOP_CHARS = 4_096
"""Texts up to this long (a completion's prompt; a chat's messages, rendered) are
tokenized on the event loop: handing them to a thread and back costs more (a 2 KB chat
renders and encodes in about 40 µs, the two thread hops took about 300 µs of wall time
and a sixth of a loaded gateway's samples)."""
SHORT_WORKERS = 4
"""Threads of the short lane, each with its own copy of the tokenizer."""
LONG_WAITING = 2
"""Long prompts the long lane takes at once (tokenizing or queued); more are routed by
load without their tokens."""
PARSE_IN_LOOP = 1 << 20
"""Bodies over this many bytes are parsed in the helper process, not on the event loop."""
SEGMENTS = 4_096
"""Pieces of text between added tokens whose tokens are remembered."""
SEGMENT_PROBES = (
    "Hello world",
    " leading space",
    "\n\nnewlines first",
    "  two spaces, tabs\tand\nlines  ",
    "caf\u00e9 \u4e2d\u6587 \U0001f642 123 4567",
    "system",
    "user\nWhat is 2+2?",
    "",
)
"""Texts the self-test joins around the added tokens (``_Segmenter.agrees``)."""
HASH_IN_LOOP = 4_096
"""Token lists longer than this are hashed in a worker thread."""
MAX_CONFIG_BYTES = 1 << 20
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "model_max_length",
)
"""The keys of a model's ``config.json`` that may give its length (vLLM's list)."""


class TokenizerError(Exception):
    """The tokenizer directory cannot be loaded (a one-line message for the CLI)."""


class BadBody(ValueError):
    """A body the gateway answers 400 (its message is the answer's)."""


class PromptTooLong(BadBody):
    """A prompt over the model's maximum length, refused before it is tokenized."""


@dataclass(frozen=True)
class PromptIds:
    """What routing needs of a prompt's tokens: their count, its first block (kin share
    it, ``prompt_root``) and its block hashes (None when the policy does not score)."""

    count: int
    root: Any
    hashes: list[int] | None


NO_KEYS = ChainKeys()
"""An unsalted request on a base model: the plain chain."""
TOKEN_LIMIT = 2**31
"""A token id is an int in ``[0, TOKEN_LIMIT)``: a prompt holding any other value is
not taken for token ids."""


def chain_keys(body: dict[str, Any], adapters: frozenset[str] = frozenset()) -> ChainKeys:
    """What the engine keys the request's block hashes by besides its tokens: its
    ``cache_salt`` and, when its ``model`` is one of the backends' LoRA ``adapters``,
    that adapter (``registry.core.hashing.request_chain_keys``); ``BadBody`` for a salt
    vLLM would refuse, so it is answered 400 before anything is routed."""
    salt = body.get("cache_salt")
    model = body.get("model")
    if salt is None and not (isinstance(model, str) and model in adapters):
        return NO_KEYS
    try:
        return request_chain_keys(salt, model=model, adapters=adapters)
    except (TypeError, ValueError) as exc:
        raise BadBody(str(exc)) from None


TENANT_SALT_DOMAIN = b"pcr-tenant-salt-v1\0"


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The ``cache_salt`` to send on for a tenant's request, so that no two tenants can
    share a salt, whatever they send (none included): ``t-`` and 64 hex digits of
    sha256 over the tenant and its own salt, a salt vLLM accepts. With API keys that
    name tenants (``pcr.web.auth``) and ``GatewayConfig.tenant_salts``, the gateway sets
    a tenant request's ``cache_salt`` to this before hashing (``parse_body``) and
    forwarding (``salted_body``)."""
    name = tenant.encode("utf-8", "surrogatepass")
    own = b"\0" if cache_salt is None else b"\1" + cache_salt.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(TENANT_SALT_DOMAIN + len(name).to_bytes(4, "big") + name + own)
    return "t-" + digest.hexdigest()


def salted_body(raw: bytes, salt: str) -> bytes:
    """``raw`` (a JSON object ``parse_body`` took) with ``"cache_salt": salt`` as its last
    member, the rest byte for byte (a large prompt is not serialized again): JSON
    parsers (Python's, and so vLLM's and SGLang's servers) keep a repeated name's last
    value, so a salt the tenant sent itself is overridden. ``BadBody`` for a body that
    is not UTF-8 (JSON between systems must be, RFC 8259)."""
    end = raw.rstrip(b" \t\r\n")
    if not (raw.lstrip(b" \t\r\n").startswith(b"{") and end.endswith(b"}")):
        raise BadBody("the body must be JSON in UTF-8")
    inner = end[:-1].rstrip(b" \t\r\n")
    comma = b"" if inner.endswith(b"{") else b","
    return b"".join((inner, comma, b'"cache_salt":', json.dumps(salt).encode(), b"}"))


def ids_of(
    tokens: Sequence[int], block_size: int, hashed: bool, keys: ChainKeys = NO_KEYS
) -> PromptIds:
    """The prompt's ids for routing, its hashes chained from ``keys`` as the engine's are
    (a salted or adapter prompt's kin are the prompts with the same keys too)."""
    hashes = block_hashes(tokens, block_size, salt=keys.salt, lora=keys.lora) if hashed else None
    root = prompt_root(tokens, block_size)
    if root is not None and keys is not NO_KEYS and keys != NO_KEYS:  # is: no __eq__ call
        root = (keys.salt, keys.lora, root)
    return PromptIds(len(tokens), root, hashes)


async def prompt_ids(
    tokens: list[int], block_size: int, hashed: bool, keys: ChainKeys = NO_KEYS
) -> PromptIds:
    """``ids_of``, hashed in a worker thread when the prompt is long."""
    if hashed and len(tokens) > HASH_IN_LOOP:
        return await asyncio.to_thread(ids_of, tokens, block_size, hashed, keys)
    return ids_of(tokens, block_size, hashed, keys)


def too_many(count: int, limit: int) -> PromptTooLong:
    return PromptTooLong(
        f"this model's maximum context length is {limit:,} tokens; the prompt has {count:,}"
    )


def loads(raw: bytes | str) -> Any:
    """``json.loads`` of a body, by orjson where it is installed and takes it; what orjson
    refuses and ``json`` reads (NaN, an int past 64 bits, UTF-16) goes to ``json``, so
    the bodies taken are the same. (orjson reads an int past 64 bits as a float: neither
    is a token id, and the body forwarded is the raw one.)"""
    if _fast_loads is not None:
        try:
            return _fast_loads(raw)
        except ValueError:
            pass
    return json.loads(raw)


def parse_body(
    raw: bytes,
    chat: bool,
    max_tokens: int | None,
    block_size: int | None,
    hashed: bool,
    adapters: frozenset[str] = frozenset(),
    tenant: str | None = None,
) -> tuple[dict[str, Any], PromptIds | None]:
    """The body as a JSON object, and for a completion with a prompt of token ids its
    ``PromptIds`` (``block_size`` None: not wanted), hashed under the request's
    ``chain_keys`` (``adapters``: the LoRA adapters the backends serve); ``BadBody`` for
    a body that is not a JSON object or has a ``cache_salt`` the engine would refuse,
    ``PromptTooLong`` for a prompt of token ids over ``max_tokens``.

    Also run in the helper process: a prompt of token ids is then left out of the body
    it answers (its ids say what routing needs; the raw body is what is forwarded)."""
    try:
        body = loads(raw)
    except (ValueError, RecursionError):
        raise BadBody("the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadBody("the body must be a JSON object")
    keys = _keyed(body, adapters, tenant)
    if chat:
        return body, None
    prompt = body.get("prompt")
    if max_tokens is not None and isinstance(prompt, list):
        for one in prompt if prompt and isinstance(prompt[0], list) else [prompt]:
            if isinstance(one, list) and len(one) > max_tokens:
                raise too_many(len(one), max_tokens)
    tokens = token_prompt(body)
    ids = None if tokens is None or block_size is None else ids_of(tokens, block_size, hashed, keys)
    return body, ids


def _keyed(body: dict[str, Any], adapters: frozenset[str], tenant: str | None) -> ChainKeys:
    """``chain_keys`` of the body, the request's own salt checked first; for a tenant,
    then the tenant's own salt set in its place (``salted_body``)."""
    keys = chain_keys(body, adapters)
    if tenant is not None:
        body["cache_salt"] = tenant_salt(tenant, body.get("cache_salt"))
        keys = chain_keys(body, adapters)
    return keys


def _token_body(
    raw: bytes,
    max_tokens: int | None,
    block_size: int | None,
    hashed: bool,
    adapters: frozenset[str],
    tenant: str | None,
) -> tuple[dict[str, Any], PromptIds | None] | None:
    """``_parse_apart``'s answer for a completion whose prompt is one list of token ids,
    with no Python int made per id: the ids read from the bytes in C
    (``body_token_ids``), the rest of the body parsed with the list left out. None
    where the body is not of that shape, or not JSON: ``parse_body`` then reads it all
    and answers as ever (the same body, ids and errors either way)."""
    found = body_token_ids(raw, TOKEN_LIMIT)
    if found is None:
        return None
    start, end, tokens = found
    try:
        body = loads(b"".join((raw[:start], b"0", raw[end:])))
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or "prompt" not in body:
        return None  # not so when the extension found it; the whole body parsed then
    del body["prompt"]
    keys = _keyed(body, adapters, tenant)
    if max_tokens is not None and len(tokens) > max_tokens:
        raise too_many(len(tokens), max_tokens)
    return body, None if block_size is None else ids_of(tokens, block_size, hashed, keys)


def _parse_apart(
    raw: bytes,
    chat: bool,
    max_tokens: int | None,
    block_size: int | None,
    hashed: bool,
    adapters: frozenset[str] = frozenset(),
    tenant: str | None = None,
) -> tuple[dict[str, Any], PromptIds | None]:
    """``parse_body``, a prompt that is not text left out of the body (its ids say what
    routing needs; the raw body is what is forwarded): in the helper process it stays
    there; on the loop, a list of hundreds of ids held by a request in flight is what the
    garbage collector would walk at every young collection."""
    if not chat:
        found = _token_body(raw, max_tokens, block_size, hashed, adapters, tenant)
        if found is not None:
            return found
    body, ids = parse_body(raw, chat, max_tokens, block_size, hashed, adapters, tenant)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not (prompt and isinstance(prompt[0], str)):
        body = {k: v for k, v in body.items() if k != "prompt"}
    return body, ids


class BodyParser:
    """Parses bodies over ``PARSE_IN_LOOP`` bytes in a helper process, started at the
    first such body (``json.loads`` of a large body holds the interpreter lock, so on
    the loop or in a thread it would stall every other request, ``/health`` included);
    smaller bodies on the loop."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(
        self,
        raw: bytes,
        chat: bool,
        max_tokens: int | None,
        block_size: int | None,
        hashed: bool,
        adapters: frozenset[str] = frozenset(),
        tenant: str | None = None,
    ) -> tuple[dict[str, Any], PromptIds | None]:
        args = (raw, chat, max_tokens, block_size, hashed, adapters, tenant)
        if len(raw) <= PARSE_IN_LOOP:
            return _parse_apart(*args)
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # the gateway runs threads
            self._pool = ProcessPoolExecutor(2, mp_context=context)
        try:
            future = self._pool.submit(_parse_apart, *args)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:  # the helper died (killed, out of memory): a new one
            self._pool = None
            log.warning("the gateway's body parser process died; starting another")
            return await asyncio.to_thread(_parse_apart, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class _Lane:
    """Worker threads that tokenize, and how many prompts they hold (running or queued)."""

    def __init__(self, name: str, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.held = 0
        self._lock = threading.Lock()

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        with self._lock:
            self.held += 1
        future = self.pool.submit(work, *args)
        future.add_done_callback(self._done)  # also when cancelled before it ran
        return await asyncio.wrap_future(future)

    def _done(self, _future: Future[Any]) -> None:
        with self._lock:
            self.held -= 1


def longest_token_bytes(tokenizer: Any) -> int:
    """The longest vocabulary entry (added tokens included) in UTF-8 bytes, at least 1."""
    return (
        max(
            (len(entry.encode("utf-8", "surrogatepass")) for entry in tokenizer.get_vocab()),
            default=1,
        )
        or 1
    )


def config_max_len(directory: Path) -> int | None:
    """The model's length from ``config.json`` beside the tokenizer: the largest of
    ``LENGTH_KEYS`` (vLLM takes the smallest), times a rope scaling factor over 1; None
    without one."""
    path = directory / "config.json"
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        config = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    best: int | None = None
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        lengths = [v for k in LENGTH_KEYS if type(v := part.get(k)) is int and 0 < v < 1 << 40]
        if not lengths:
            continue
        factor = 1.0
        for key in ("rope_scaling", "rope_parameters"):
            rope = part.get(key)
            found = rope.get("factor") if isinstance(rope, dict) else None
            if isinstance(found, (int, float)) and math.isfinite(found) and found > 1:
                factor = max(factor, float(found))
        length = math.ceil(max(lengths) * factor)
        best = length if best is None else max(best, length)
    return best


class _Segmenter:
    """Encodes a text as its pieces between the tokenizer's added tokens, each piece's
    tokens remembered (``SEGMENTS``, shared by the threads: ``lru_cache`` is safe to call
    from many threads and holds no lock while a piece is encoded)."""

    def __init__(self, added: dict[str, int], encode: Callable[[str], list[int]]) -> None:
        contents = sorted(added, key=len, reverse=True)  # the longest first, as the tokenizer
        self.pattern = re.compile("|".join(re.escape(c) for c in contents))
        self.added = added
        self.piece: Callable[[str], tuple[int, ...]] = lru_cache(maxsize=SEGMENTS)(
            lambda text: tuple(encode(text))
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        for found in self.pattern.finditer(text):
            if found.start() > at:
                ids += self.piece(text[at : found.start()])
            ids.append(self.added[found.group()])
            at = found.end()
        if at < len(text):
            ids += self.piece(text[at:])
        return ids

    def agrees(self, whole: Callable[[str], list[int]], texts: list[str]) -> bool:
        """Whether every text's pieces give the whole text's tokens."""
        return all(self.encode(text) == whole(text) for text in texts)


def _segmenter(tokenizer: Any, encode: Callable[[str], list[int]]) -> _Segmenter | None:
    """A ``_Segmenter`` for ``tokenizer`` where it tokenizes exactly so (the self-test:
    the probes joined around each added token, and a chat rendered by its template),
    else None."""
    try:
        found = tokenizer.added_tokens_decoder
    except AttributeError:
        return None
    added: dict[str, int] = {}
    for token_id, token in found.items():
        plain = not (token.lstrip or token.rstrip or token.single_word or token.normalized)
        if not plain or not token.content:
            return None
        added[token.content] = token_id
    if not added:
        return None
    texts = list(SEGMENT_PROBES)
    for content in list(added)[:64]:
        texts += [a + content + b for a in SEGMENT_PROBES for b in SEGMENT_PROBES[:4]]
    with contextlib.suppress(Exception):  # no template, or one that wants other messages
        messages = [
            {"role": "system", "content": SEGMENT_PROBES[3]},
            {"role": "user", "content": SEGMENT_PROBES[4]},
        ]
        texts.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    segmenter = _Segmenter(added, encode)
    try:
        agrees = segmenter.agrees(encode, texts)
    except Exception:  # a tokenizer that fails on a probe: the whole text each time
        return None
    if not agrees:
        return None
    segmenter.piece.cache_clear()  # type: ignore[attr-defined]
    return segmenter


TEMPLATE_PROBES = (
    ([{"role": "user", "content": SEGMENT_PROBES[0]}], True),
    ([{"role": "system", "content": SEGMENT_PROBES[3]},
      {"role": "user", "content": SEGMENT_PROBES[4]}], True),
    ([{"role": "system", "content": SEGMENT_PROBES[5]},
      {"role": "user", "content": SEGMENT_PROBES[6]},
      {"role": "assistant", "content": SEGMENT_PROBES[1]},
      {"role": "user", "content": SEGMENT_PROBES[2]}], False),
)  # fmt: skip
"""Chats the template's self-test renders both ways (``_chat_template``)."""


class _ChatTemplate:
    """The tokenizer's chat template compiled once and rendered straight: what
    ``apply_chat_template(tokenize=False)`` renders for a plain chat (no tools, no
    documents, no message continued, no template arguments), without its per-call
    work (choosing and looking up the template, the special tokens' map rebuilt, the
    checks for batches, tools and masks): 14 -> 9 us a chat in process. The same
    compiled template (transformers' own, from its cache), the same arguments."""

    __slots__ = ("compiled", "special")

    def __init__(self, compiled: Any, special: dict[str, Any]) -> None:
        self.compiled = compiled
        self.special = special

    def render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        text: str = self.compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=generation,
            **self.special,
        )
        return text


def _chat_template(tokenizer: Any) -> _ChatTemplate | None:
    """A ``_ChatTemplate`` for ``tokenizer`` where its chats render the same as through
    ``apply_chat_template`` (the self-test: ``TEMPLATE_PROBES``, each rendered both ways,
    or failing both ways alike), else None (no template, or this transformers does not
    compile them as this expects)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        source = tokenizer.get_chat_template()
        template = _ChatTemplate(
            _compile_jinja_template(source), dict(tokenizer.special_tokens_map)
        )
    except Exception:  # no template; a transformers without this helper
        return None
    rendered = 0
    for messages, generation in TEMPLATE_PROBES:
        through = _outcome(
            tokenizer.apply_chat_template,
            messages,
            tokenize=False,
            add_generation_prompt=generation,
        )
        if through != _outcome(template.render, messages, generation):
            return None
        rendered += through[0] == "text"
    return template if rendered else None


def _outcome(render: Callable[..., str], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """A render's text, or the type of what it raised."""
    try:
        return ("text", render(*args, **kwargs))
    except Exception as exc:  # a template that wants other messages
        return ("error", type(exc))


class PromptTokenizer:
    """The model's tokenizer and chat template, loaded once from ``directory``; copied
    into each worker thread that tokenizes. ``max_model_len``: the prompts' longest (else
    the model's ``config.json``'s, else none)."""

    def __init__(self, directory: str | Path, max_model_len: int | None = None) -> None:
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
        self.longest_token = longest_token_bytes(self.tokenizer)
        self.max_tokens = max_model_len or config_max_len(path)
        self.max_bytes = None if self.max_tokens is None else self.max_tokens * self.longest_token
        self._mine = threading.local()
        self._copying = threading.Lock()
        self.segmenter = _segmenter(self.tokenizer, self._plain)
        self.template = _chat_template(self.tokenizer)
        self.short = _Lane("pcr-tokenize", SHORT_WORKERS)
        self.long = _Lane("pcr-tokenize-long", 1)

    def _own(self) -> Any:
        """This thread's copy of the tokenizer (the loaded one is only ever copied)."""
        mine = getattr(self._mine, "tokenizer", None)
        if mine is None:
            with self._copying:
                mine = copy.deepcopy(self.tokenizer)
            self._mine.tokenizer = mine
        return mine

    def check_text(self, text: str) -> None:
        """``PromptTooLong`` for a text over ``max_bytes`` UTF-8 bytes."""
        limit = self.max_bytes
        if limit is None or len(text) * 4 <= limit:  # at most 4 bytes a character
            return
        size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            assert self.max_tokens is not None
            raise PromptTooLong(
                f"this model's maximum context length is {self.max_tokens:,} tokens; the "
                f"prompt's {size:,} bytes of text are more than that many tokens can hold "
                f"({self.longest_token} bytes a token at most)"
            )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens and self.segmenter is not None:
            return self.segmenter.encode(text)
        ids: list[int] = self._own().encode(text, add_special_tokens=add_special_tokens)
        return ids

    def _plain(self, text: str) -> list[int]:
        """``text``'s tokens without special tokens added, by this thread's copy."""
        ids: list[int] = self._own().encode(text, add_special_tokens=False)
        return ids

    def completion(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text(prompt)
        return self.encode(prompt, add_special_tokens)

    def render(self, body: dict[str, Any]) -> str | None:
        """The chat's text as the template writes it (None: not a chat of text)."""
        messages = _messages(body.get("messages"))
        if messages is None:
            return None
        continue_final = body.get("continue_final_message") is True
        generation = body.get("add_generation_prompt", True) is not False and not continue_final
        kwargs = body.get("chat_template_kwargs")
        options: dict[str, Any] = dict(kwargs) if isinstance(kwargs, dict) else {}
        tools = body.get("tools")
        if not (isinstance(tools, list) and tools):
            tools = None
        plain = not options and not continue_final and tools is None
        if plain and self.template is not None:  # the common chat: rendered straight
            return self.template.render(messages, generation)
        text: str = self._own().apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation,
            continue_final_message=continue_final,
            **options,
        )
        return text

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        text = self.render(body)
        if text is None:
            return None
        self.check_text(text)
        return self.encode(text, body.get("add_special_tokens") is True)

    async def tokens(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's tokens, on the loop for a short text, else in the lanes
        (``PromptTooLong`` before tokenizing; None for what is not tokenized here)."""
        if chat:
            size = _chat_chars(body)
            if size is not None and size <= IN_LOOP_CHARS:
                return self.chat(body)  # rendered and encoded here: cheaper than a hop
            text = await self.short.run(self.render, body)
            add_special = body.get("add_special_tokens") is True
        else:
            prompt = body.get("prompt")
            for one in prompt if isinstance(prompt, list) else [prompt]:
                if isinstance(one, str):
                    self.check_text(one)
            text = text_prompt(body)
            add_special = body.get("add_special_tokens", True) is not False
        if text is None:
            return None
        self.check_text(text)
        if len(text) > MAX_PROMPT_CHARS:
            return None
        if len(text) <= IN_LOOP_CHARS:
            return self.encode(text, add_special)
        if len(text) <= LONG_PROMPT_CHARS:
            return await self.short.run(self.encode, text, add_special)
        if self.long.held >= LONG_WAITING:
            return None
        return await self.long.run(self.encode, text, add_special)

    def close(self) -> None:
        for lane in (self.short, self.long):
            lane.pool.shutdown(wait=False, cancel_futures=True)


def _chat_chars(body: dict[str, Any]) -> int | None:
    """The characters of a chat's messages (their text contents, text parts included),
    or None where the chat carries more than text (tools, other parts, no list): what
    rendering and encoding it here would cost, before doing it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or body.get("tools"):
        return None
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    return None
                total += len(text)
        elif content is not None:
            return None
        if len(message) > 2:  # names, tool calls: the template writes them too
            total += sum(len(str(v)) for k, v in message.items() if k not in ("role", "content"))
    return total


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
    if isinstance(prompt, list) and prompt and _tokens(prompt):
        return prompt
    return None


def _tokens(values: list[Any]) -> bool:
    """Whether every value is a token id (``_token``): checked in one C pass
    (``registry.core.hashing.token_ids``), not value by value."""
    return token_ids(values, TOKEN_LIMIT)


def text_prompt(body: dict[str, Any]) -> str | None:
    """A completion's text prompt (the first of a list of them), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def _token(value: Any) -> bool:
    return type(value) is int and 0 <= value < TOKEN_LIMIT


async def prompt_tokens(
    tokenizer: PromptTokenizer | None, body: dict[str, Any], chat: bool
) -> list[int] | None:
    """The request's prompt as token ids, or None when it cannot be known here;
    ``PromptTooLong`` for a text over the model's length."""
    if not chat:
        tokens = token_prompt(body)
        if tokens is not None:
            return tokens
    if tokenizer is None:
        return None
    try:
        return await tokenizer.tokens(body, chat)
    except PromptTooLong:
        raise
    except Exception as exc:  # a template's own error, a bad argument: route by load
        log.debug("tokenizing for routing failed: %s", type(exc).__name__)
        return None
