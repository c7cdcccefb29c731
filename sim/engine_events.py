"""A stand-in for a vLLM / SGLang engine's KV-event publisher, written from the wire
format (vLLM's ``kv_events`` publisher, SGLang's copy of it): an XPUB socket sending
``[topic, seq, payload]`` and a ROUTER replay socket answering ``[b"", start_seq]`` with
every buffered batch from ``start_seq`` on, then the end marker, in either form in use
(``replay_frames``: 4 as vLLM 0.26 and later, ``[b"", topic, seq, payload]`` ending with
``[b"", b"", END, b""]``; 3 as vLLM up to 0.25, ``[b"", seq, payload]`` ending with
``[b"", END, b""]``). XPUB behaves as the
engines' PUB and also lets a caller wait until the bridge has subscribed. The simulation's
bridged mode, ``pcr bench``'s bridge rows and the bridge tests publish through it.

Needs the ``bridge`` extra (pyzmq, msgpack).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from registry.bridge.bridge_events import STORED_FIELDS

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int,
    *,
    layout: str = "map",
    medium: str | None = "GPU",
    group_idx: int | None = None,
    kind: str | None = None,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
) -> Any:
    """A BlockStored event in the map or array layout (SGLang: ``layout="sglang"``)."""
    if layout == "sglang":
        return ["BlockStored", hashes, parent, tokens, block_size, None]
    fields = [hashes, parent, tokens, block_size, None, medium, lora_name, extra_keys]
    fields += [group_idx, kind, None]
    if layout == "array":
        return ["BlockStored", *fields]
    event = {"type": "BlockStored"}
    event.update({n: v for n, v in zip(STORED_FIELDS, fields, strict=True) if v is not None})
    return event


def removed(
    hashes: list[Any],
    *,
    layout: str = "map",
    medium: str | None = "GPU",
    group_idx: int | None = None,
) -> Any:
    if layout == "sglang":
        return ["BlockRemoved", hashes]
    if layout == "array":
        return ["BlockRemoved", hashes, medium, group_idx]
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
    if medium is not None:
        event["medium"] = medium
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def cleared(layout: str = "map") -> Any:
    return ["AllBlocksCleared"] if layout in ("array", "sglang") else {"type": "AllBlocksCleared"}


def batch(events: list[Any], layout: str = "map") -> bytes:
    if layout == "sglang":
        return bytes(msgpack.packb([time.time(), events]))
    if layout == "array":
        return bytes(msgpack.packb([time.time(), events, None]))
    return bytes(msgpack.packb({"ts": time.time(), "events": events, "data_parallel_rank": None}))


def shared_context() -> zmq.Context[Any]:
    """One ZeroMQ context for many publishers of one process (``EnginePublisher(context=
    ...)``); its caller ends it (``term()``) after every publisher closed."""
    return zmq.Context()


class EnginePublisher:
    """Publishes event batches with per-process sequence numbers and serves replays."""

    def __init__(
        self,
        *,
        replay: bool = True,
        buffer_steps: int = 10_000,
        topic: bytes = b"",
        context: Any = None,
        replay_frames: int = 4,
    ) -> None:
        if replay_frames not in (3, 4):
            raise ValueError(f"replay_frames must be 3 or 4, not {replay_frames!r}")
        self.replay_frames = replay_frames
        # A shared ``context`` (many engines in one process) is the caller's to end.
        self._own_context = context is None
        self.context = zmq.Context() if context is None else context
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.lock = threading.Lock()
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self.answer_replays = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_port = router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._thread.start()

    # -- publishing --------------------------------------------------------------------------

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Block until a subscriber's subscription reached the XPUB socket."""
        if not self.pub.poll(round(timeout * 1000), zmq.POLLIN):
            raise TimeoutError("no subscriber connected")
        self.pub.recv()

    def publish(self, events: list[Any], layout: str = "map", *, send: bool = True) -> int:
        """Publish one batch (``send=False``: buffer it for replay only, as if the
        subscriber lost it); returns its seq."""
        return self.publish_raw(batch(events, layout), send=send)

    def publish_raw(self, payload: bytes, *, send: bool = True) -> int:
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send anything, bypassing sequence numbers (garbage tests)."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine process restarted: sequence numbers and the buffer start afresh."""
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    # -- replay --------------------------------------------------------------------------------

    def _serve_replay(self, sock: Any) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(50, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                self.replay_requests.append(start)
                if not self.answer_replays:
                    continue
                with self.lock:
                    found = [(s, p) for s, p in self.buffer if s >= start]
                head = [client, b""] if self.replay_frames == 3 else [client, b"", self.topic]
                for s, p in found:
                    sock.send_multipart([*head, s.to_bytes(8, "big"), p])
                end = [b""] if self.replay_frames == 3 else [b"", b""]
                sock.send_multipart([client, *end, END_SEQ, b""])
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(0)
        if self._own_context:
            self.context.term()

    def __enter__(self) -> EnginePublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def prompt(seed: int, blocks: int, block_size: int) -> list[int]:
    """Deterministic token ids for a prompt of ``blocks`` full blocks."""
    return [(seed * 7919 + i * 31) % 50_000 for i in range(blocks * block_size)]


def engine_chain(tokens: list[int], block_size: int, seed: bytes = b"engine-1") -> list[int]:
    """Engine-side block hashes as an engine makes them: chained over the prefix and
    seeded per process (a restarted engine passes another seed), unsigned 64-bit."""
    hashes, parent = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(tokens[start : start + block_size]).encode()).digest()
        hashes.append(int.from_bytes(parent[-8:], "big"))
    return hashes


__all__ = [
    "EnginePublisher",
    "batch",
    "cleared",
    "engine_chain",
    "prompt",
    "removed",
    "stored",
]
