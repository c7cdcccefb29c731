"""Parent-chained block hashes, the same numbers Megatron-Core's engines compute.

Only complete blocks get a hash. Tokens are packed as int64 little-endian; the chain
starts from 32 zero bytes; each block's digest is ``sha256(parent_digest + block)``,
and the whole 32-byte digest chains into the next block. The block's hash is the first
8 digest bytes read little-endian, mapped into [1, 2^63-1] (so the sentinels -1 and 0
never occur). A salt replaces the zero start with
``sha256(b"megatron-prefix-cache-salt-v1\\0" + salt)``, Megatron-Core's derivation,
so salted hashes also match the engines' and tenants cannot share or probe blocks.
A LoRA adapter's name starts the chain from
``sha256(b"prefix-cache-registry-lora-v1\\0" + len(name) + name + start)`` instead
(``start``: the salted or zero start, ``len`` 4 bytes big-endian), so blocks an engine
keys by adapter (vLLM) are listed apart from the base model's (:func:`chain_root`).
Torch is not imported: tensors are read through ``.tolist()``.

The chain runs in the C extension ``registry.core._blockhash`` where it was built
(SHA-256 on the CPU's SHA extensions where it has them, else portable C) and in pure
Python otherwise; both give the same numbers, :func:`implementation` says which runs.
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
import sys
from array import array
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from registry.core.types import MAX_HASH
from registry.core.validation import is_number

_blockhash: ModuleType | None
try:
    from registry.core import _blockhash
except ImportError:  # installed without its C extension: the same chain in Python
    _blockhash = None
if _blockhash is not None:  # a forked child must not wait on a lock its parent held
    os.register_at_fork(after_in_child=_blockhash.after_fork)

DIGEST_BYTES = 32
ZERO_PARENT = bytes(DIGEST_BYTES)
SALT_DOMAIN = b"megatron-prefix-cache-salt-v1\0"
LORA_DOMAIN = b"prefix-cache-registry-lora-v1\0"
HASH_MODULUS = MAX_HASH
MAX_SALT_BYTES = 4096
"""The longest salt (UTF-8 bytes) a chain takes: a cache salt is a tenant's tag, not data
(vLLM accepts 128 characters, ``pcr serve`` 1,024)."""
MAX_LORA_BYTES = 1024
"""The longest LoRA adapter name (UTF-8 bytes) a chain takes."""
MAX_REQUEST_SALT = 128
"""The longest ``cache_salt`` vLLM accepts on a request, in characters."""
FORBIDDEN_SALT_CHARS = frozenset("@/\\\0")
"""Characters vLLM refuses in a request's ``cache_salt``."""


def _int64_bytes(tokens: Any) -> bytes:
    """All of ``tokens`` as int64 little-endian bytes."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    kind = getattr(getattr(tokens, "dtype", None), "kind", None)
    if kind is not None and hasattr(tokens, "astype"):  # numpy: no Python loop
        if kind not in ("i", "u"):
            raise TypeError(f"tokens must hold integers, not dtype {tokens.dtype}")
        flat = tokens.reshape(-1)
        if kind == "u" and flat.size and int(flat.max()) >= 2**63:
            raise ValueError("a token id does not fit in int64")
        return bytes(flat.astype("<i8").tobytes())
    if hasattr(tokens, "tolist"):  # array.array, torch tensors, other array types
        tokens = tokens.tolist()
    if not isinstance(tokens, Iterable):
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    if isinstance(tokens, (list, tuple)) and set(map(type, tokens)) <= {int}:
        try:  # plain ints (no bools, no int subclasses): packed at C speed
            return struct.pack(f"<{len(tokens)}q", *tokens)
        except struct.error:  # the only one plain ints can raise: out of range
            raise ValueError("a token id does not fit in int64") from None
    packed = array("q")
    try:
        for token in tokens:
            if isinstance(token, bool):
                raise TypeError("a token is a bool")
            packed.append(operator.index(token))
    except TypeError as exc:
        raise TypeError(f"tokens must be integers: {exc}") from None
    except OverflowError:
        raise ValueError("a token id does not fit in int64") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True)
class ChainKeys:
    """What an engine's block hashes cover besides the tokens: a tenant's cache salt and
    the LoRA adapter a request runs on (both None: the base model, unsalted). Pass them
    to :func:`block_hashes` as ``salt=keys.salt, lora=keys.lora``."""

    salt: str | None = None
    lora: str | None = None


def _utf8(value: str, what: str, limit: int) -> bytes:
    """``value`` as UTF-8, at most ``limit`` bytes long, else ``ValueError``."""
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"{what} is not valid Unicode text: {exc.reason}") from None
    if len(data) > limit:
        raise ValueError(f"{what} is {len(data)} bytes long in UTF-8; at most {limit} are allowed")
    return data


def chain_root(salt: str | bytes | None = None, lora: str | None = None) -> bytes:
    """The 32-byte digest a prompt's first block chains from: zero bytes for the base
    model unsalted, Megatron-Core's salt derivation for a salt, and over that the LoRA
    adapter's name (length-prefixed, so no two (salt, lora) pairs share a start).
    ``TypeError``/``ValueError`` for a salt that is not str/bytes of at most
    ``MAX_SALT_BYTES``, or a LoRA name that is not a non-empty str of at most
    ``MAX_LORA_BYTES``."""
    if salt is None:
        root = ZERO_PARENT
    elif isinstance(salt, str):
        root = hashlib.sha256(SALT_DOMAIN + _utf8(salt, "salt", MAX_SALT_BYTES)).digest()
    elif isinstance(salt, bytes):
        if len(salt) > MAX_SALT_BYTES:
            raise ValueError(
                f"salt is {len(salt)} bytes long; at most {MAX_SALT_BYTES} are allowed"
            )
        root = hashlib.sha256(SALT_DOMAIN + salt).digest()
    else:
        raise TypeError(f"salt must be str, bytes or None, not {type(salt).__name__}")
    if lora is None:
        return root
    if not isinstance(lora, str):
        raise TypeError(f"lora must be an adapter name (str) or None, not {type(lora).__name__}")
    if not lora:
        raise ValueError("lora must be a non-empty adapter name")
    name = _utf8(lora, "lora", MAX_LORA_BYTES)
    return hashlib.sha256(LORA_DOMAIN + len(name).to_bytes(4, "big") + name + root).digest()


def block_hashes(
    tokens: Any,
    block_size: int,
    *,
    salt: str | bytes | None = None,
    lora: str | None = None,
) -> list[int]:
    """Hashes in [1, 2^63-1] of every complete ``block_size``-token block of ``tokens``,
    chained from :func:`chain_root` of ``salt`` (a tenant's cache salt) and ``lora``
    (the name of the LoRA adapter the request runs on); without either, the plain
    Megatron-Core chain."""
    if not is_number(block_size, integer=True):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    parent = chain_root(salt, lora)
    if _blockhash is not None:
        return _native_chain(parent, tokens, block_size, digests=False)
    digests = _python_digests(parent, tokens, block_size)
    # Every digest's first 8 bytes at once: one array over the joined digests.
    firsts = array("Q", b"".join(digests))
    if sys.byteorder == "big":
        firsts.byteswap()
    return [first % HASH_MODULUS + 1 for first in firsts[:: DIGEST_BYTES // 8]]


def request_chain_keys(
    cache_salt: object = None, *, model: object = None, adapters: Collection[str] = ()
) -> ChainKeys:
    """The keys an engine (vLLM) hashes a request's blocks under: its ``cache_salt``
    (checked as vLLM checks it: a non-empty string of at most 128 characters without
    ``@``, ``/``, ``\\`` or NUL; vLLM refuses any other) and, when the request's
    ``model`` is one of the LoRA ``adapters`` the engine serves, that adapter's name
    (a base model's name keys nothing). ``TypeError``/``ValueError`` for a salt the
    engine would refuse, before anything is hashed or sent."""
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, not {type(cache_salt).__name__}")
        if not cache_salt:
            raise ValueError("cache_salt must be a non-empty string if given")
        if len(cache_salt) > MAX_REQUEST_SALT:
            raise ValueError(f"cache_salt must be at most {MAX_REQUEST_SALT} characters")
        if not FORBIDDEN_SALT_CHARS.isdisjoint(cache_salt):
            raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")
        _utf8(cache_salt, "cache_salt", MAX_SALT_BYTES)
    if isinstance(adapters, (str, bytes)):
        raise TypeError("adapters must be a collection of adapter names, not one string")
    lora = model if isinstance(model, str) and model and model in adapters else None
    if lora is not None:
        _utf8(lora, "model", MAX_LORA_BYTES)
    return ChainKeys(cache_salt, lora)


def chain_digests(parent: bytes, tokens: Any, block_size: int) -> list[bytes]:
    """The 32-byte digest of every complete ``block_size``-token block of ``tokens``,
    chained from ``parent`` (``ZERO_PARENT`` at a prompt's start, or the digest of the
    block before): continuing a chain gives the same digests as hashing the whole prompt.
    """
    if _blockhash is not None and len(parent) == DIGEST_BYTES:
        return _native_chain(parent, tokens, block_size, digests=True)
    return _python_digests(parent, tokens, block_size)


def token_ids(values: list[Any], limit: int) -> bool:
    """Whether ``values`` is a non-empty list of ints (not bools, not floats), each in
    ``[0, limit)``: in one C pass where the extension is built, else by type set, min
    and max (the same answer)."""
    if _blockhash is not None:
        answer: bool = _blockhash.token_ids(values, limit)
        return answer
    return (
        bool(values)
        and set(map(type, values)) == {int}
        and min(values) >= 0
        and max(values) < limit
    )


def body_token_ids(raw: bytes, limit: int) -> tuple[int, int, memoryview] | None:
    """Where ``raw`` is a JSON object whose member ``"prompt"`` is a non-empty list of
    plain integers each in ``[0, limit)`` (``limit`` at most 2^59): the list's span in
    ``raw`` (``start``, ``end``) and its ids, read from the bytes in C with no Python int
    made per id (a sequence of ints over the packed int64s, which ``block_hashes``
    hashes as they are, uncopied). None for any other body (text, a list of lists, a
    sign, a fraction, a repeated or escaped member name), for a body that is not JSON,
    on a big-endian machine and where the C extension is not built: the caller parses
    the whole body then. The span lies between ``:`` and ``,`` or ``}``, so ``raw`` with
    another value in its place is JSON exactly when ``raw`` is, with the same other
    members."""
    if _blockhash is None or sys.byteorder != "little":
        return None
    found = _blockhash.prompt_ids(raw, limit)
    if found is None:
        return None
    start, end, packed = found
    return start, end, memoryview(packed).cast("q")  # int64 little-endian: native here


def remember_digests(on: bool | None) -> bool:
    """Whether the C extension remembers the digests of blocks it hashed, to give them
    again for the same block after the same parent (prompts share their first blocks:
    a system prompt, a conversation's earlier turns), byte for byte compared, so the
    same hashes either way: ``True`` (the default) or ``False`` from now on, ``None``
    to forget what it remembered. Answers whether it remembered before (False without
    the extension). For measuring the chain itself."""
    if _blockhash is None:
        return False
    was: bool = _blockhash.memo(on)
    return was


def implementation() -> str:
    """Which code computes the chain here: ``"c (sha-ni)"`` (the C extension on the
    CPU's SHA extensions), ``"c (portable)"`` or ``"python"`` (built without it)."""
    return "python" if _blockhash is None else f"c ({_blockhash.SHA256})"


def _native_chain(parent: bytes, tokens: Any, block_size: int, *, digests: bool) -> list[Any]:
    """The chain in the C extension: a list or tuple of plain ints packed there, the
    ids of ``body_token_ids`` (int64s over whole packed bytes) hashed as they are, any
    other input (or a list holding bools, int subclasses, numpy scalars) packed and
    checked by :func:`_int64_bytes` first, so both paths accept and refuse alike."""
    assert _blockhash is not None
    done: list[Any] | None
    if type(tokens) is memoryview and _whole_int64s(tokens):
        done = _blockhash.chain(parent, tokens.obj, block_size, digests, False)
        assert done is not None
        return done
    if type(tokens) is list or type(tokens) is tuple:
        done = _blockhash.chain(parent, tokens, block_size, digests, False)
        if done is not None:
            return done
    done = _blockhash.chain(parent, _int64_bytes(tokens), block_size, digests, False)
    assert done is not None  # only a list or tuple is handed back
    return done


def _whole_int64s(view: memoryview) -> bool:
    """Whether ``view`` is native int64s over the whole of a bytes object, in its order
    (a reversed view covers all of it too), on a little-endian machine: that object is
    then the chain's packed input as it is."""
    return (
        view.format == "q"
        and type(view.obj) is bytes
        and view.nbytes == len(view.obj)
        and view.c_contiguous
        and sys.byteorder == "little"
    )


def _python_digests(parent: bytes, tokens: Any, block_size: int) -> list[bytes]:
    """:func:`chain_digests` in pure Python."""
    data = _int64_bytes(tokens)
    step = 8 * block_size
    sha256 = hashlib.sha256
    digests: list[bytes] = []
    append = digests.append
    for offset in range(0, len(data) - step + 1, step):
        parent = sha256(parent + data[offset : offset + step]).digest()
        append(parent)
    return digests


def digest_hash(digest: bytes) -> int:
    """A block's hash from its digest: the first 8 bytes, little-endian, in [1, 2^63-1]."""
    return int.from_bytes(digest[:8], "little") % HASH_MODULUS + 1
