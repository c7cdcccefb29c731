"""Simulated vLLM engines for the routing benchmarks: N engines in one asyncio process,
each on its own loopback HTTP port, each publishing vLLM's own KV events.

Each engine speaks the part of vLLM 0.32's OpenAI server a router uses:
``POST /v1/completions`` with a token-id prompt (streamed as SSE or not), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``, ``vllm:request_success_total``,
``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``) and ``POST
/reset_prefix_cache``; and, for tests, ``GET /sim/cache`` (not vLLM's): every block it
caches, as the registry's hash of its prefix and its position, so that a test can compare
it with what ``pcr bridge`` lists. Its cache is a ``sim.engine_cache.EngineCache``
(vLLM's block pool: LRU free queue, hits up to the prompt's last token, second copies),
its block hashes a chain seeded per engine process as vLLM's are
(``sim.engine_events.engine_chain``), and its events go out as vLLM 0.32 publishes them
(``sim.engine_events.EnginePublisher``: a PUB socket ``[topic, seq, payload]`` and a
ROUTER replay socket answering in vLLM 0.26+'s four frames), each payload encoded as
vLLM's msgspec structs encode it (:func:`encode_batch`).

Service time: at most ``max_running`` requests run at once, the rest wait in arrival
order (a request also waits until its blocks fit). A running request's prefill takes
``prefill_ms`` per block it computes and ends no sooner than the prefills computing the
blocks it hits; then its first token is out and the engine's events of that step are
published; each further token takes ``decode_ms``. Streamed
replies carry the first token alone, then the rest in chunks of up to
``CHUNK_TOKENS``.

``python -m pcr.bench.sim_engines --engines 8 --kv-blocks 1200 ...`` runs a fleet until
SIGTERM or SIGINT, after printing one JSON line naming each engine's URL and event
endpoints (``--ready-file`` writes it to a file too). Needs aiohttp (the gateway extra)
and the bridge extra (pyzmq, msgpack).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
from aiohttp import web

from registry.core.hashing import block_hashes
from sim.engine_cache import Admission, CacheEvent, Cleared, EngineCache, Removed, Stored
from sim.engine_events import EnginePublisher, engine_chain, shared_context

CHUNK_TOKENS = 16
MODEL = "sim-engine"
MAX_TOKENS_DEFAULT = 16


@dataclass(frozen=True)
class EngineOptions:
    """One engine's sizes and service times."""

    kv_blocks: int = 1200
    block_size: int = 16
    max_running: int = 2
    prefill_ms: float = 6.0
    """Per block a prefill computes (the blocks past the hit, a partial last one too)."""
    decode_ms: float = 4.0
    """Per generated token after the first."""
    model: str = MODEL


class BadRequest(ValueError):
    """A request the engine refuses (400, vLLM's error shape)."""


def error_reply(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """vLLM's error body."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


@dataclass
class _Waiting:
    hashes: list[int]
    tokens: list[int]
    generated: int
    admitted: asyncio.Future[Admission]


class SimulatedEngine:
    """One engine: its cache, its queue, its counters, its publisher and its app."""

    def __init__(self, name: str, options: EngineOptions, publisher: EnginePublisher) -> None:
        self.name = name
        self.options = options
        self.publisher = publisher
        self.cache = EngineCache(options.kv_blocks, options.block_size)
        self.seed = f"{name}-{os.getpid()}-{time.time_ns()}".encode()
        self.waiting: deque[_Waiting] = deque()
        self.running = 0
        self.succeeded = 0
        self.url = ""
        self.ready: dict[int, float] = {}
        """Block id -> when (the loop's clock) the prefill computing it ends."""
        self.listed: dict[int, tuple[int, int]] = {}
        """Engine hash -> (the registry's hash of its prefix, position), cached blocks."""

    # -- scheduling ------------------------------------------------------------------------

    async def _enter(self, hashes: list[int], tokens: list[int], generated: int) -> Admission:
        loop = asyncio.get_running_loop()
        ticket = _Waiting(hashes, tokens, generated, loop.create_future())
        self.waiting.append(ticket)
        self._schedule()
        try:
            return await ticket.admitted
        except asyncio.CancelledError:
            if ticket.admitted.done() and not ticket.admitted.cancelled():
                self._leave(ticket.admitted.result())
            else:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(ticket)
            raise

    def _schedule(self) -> None:
        """Start waiting requests in arrival order while a slot is free and the first
        one's blocks fit."""
        while self.waiting and self.running < self.options.max_running:
            head = self.waiting[0]
            if head.admitted.done():  # its client left
                self.waiting.popleft()
                continue
            if not self.cache.fits(head.hashes, len(head.tokens), head.generated):
                return
            self.waiting.popleft()
            self.running += 1
            head.admitted.set_result(self.cache.admit(head.hashes, head.tokens, head.generated))
            own = block_hashes(head.tokens, self.options.block_size)
            for position, (engine, mine) in enumerate(zip(head.hashes, own, strict=True)):
                self.listed.setdefault(engine, (mine, position))

    def _leave(self, admission: Admission) -> None:
        self.cache.release(admission)
        self.running -= 1
        self._schedule()

    def publish(self) -> None:
        """The step ended: send the cache's events since the last step, in order."""
        events = self.cache.take_events()
        if events:
            self.publisher.publish_raw(encode_batch(events, self.options.block_size))
            if any(not isinstance(e, Stored) for e in events):
                cached = self.cache.copies
                self.listed = {h: v for h, v in self.listed.items() if h in cached}

    # -- HTTP ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_get("/sim/cache", self.cached)
        return app

    def _parse(self, body: Any) -> tuple[list[int], int, bool, bool]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model", self.options.model)
        if model != self.options.model:
            raise LookupError(f"The model `{model}` does not exist.")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(type(t) is int and t >= 0 for t in prompt)
        ):
            raise BadRequest("this engine takes prompts as a non-empty list of token ids")
        max_tokens = body.get("max_tokens", MAX_TOKENS_DEFAULT)
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest("max_tokens must be an integer >= 1")
        if self.cache.blocks_needed(len(prompt), max_tokens) > self.options.kv_blocks:
            raise BadRequest(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) need more "
                f"than the {self.options.kv_blocks} blocks of the KV cache"
            )
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return prompt, max_tokens, bool(body.get("stream", False)), usage

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return error_reply(400, "the body is not JSON")
        try:
            prompt, max_tokens, stream, usage = self._parse(body)
        except BadRequest as exc:
            return error_reply(400, str(exc))
        except LookupError as exc:
            return error_reply(404, str(exc), "NotFoundError")
        hashes = engine_chain(prompt, self.options.block_size, seed=self.seed)
        admission = await self._enter(hashes, prompt, max_tokens)
        finished = False
        try:
            await asyncio.sleep(self._prefill_time(admission))
            self.publish()
            reply = await self._reply(request, admission, max_tokens, stream, usage)
            finished = True
            return reply
        finally:
            self._leave(admission)
            self.succeeded += finished

    def _prefill_time(self, admission: Admission) -> float:
        """Seconds until the prefill ends: its own blocks' time, or later if a block it
        hits is still being computed; its fresh blocks are ready then."""
        now = asyncio.get_running_loop().time()
        hits = admission.blocks[: admission.hit_blocks]
        end = max(
            now + admission.computed_blocks * self.options.prefill_ms / 1000,
            max((self.ready.get(b, 0.0) for b in hits), default=0.0),
        )
        for block in admission.blocks[admission.hit_blocks :]:
            self.ready[block] = end
        return end - now

    async def _reply(
        self,
        request: web.Request,
        admission: Admission,
        max_tokens: int,
        stream: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        ident = f"cmpl-{self.name}-{time.monotonic_ns()}"
        decode = self.options.decode_ms / 1000
        usage = {
            "prompt_tokens": admission.prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": admission.prompt_tokens + max_tokens,
            "prompt_tokens_details": {
                "cached_tokens": admission.hit_blocks * self.cache.block_size
            },
        }
        if not stream:
            await asyncio.sleep((max_tokens - 1) * decode)
            return web.json_response(
                {
                    "id": ident,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": self.options.model,
                    "choices": [_choice(" x" * max_tokens, "length")],
                    "usage": usage,
                }
            )
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)

        async def send(data: dict[str, Any] | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await reply.write(f"data: {text}\n\n".encode())

        def chunk(tokens: int, reason: str | None) -> dict[str, Any]:
            return {
                "id": ident,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.options.model,
                "choices": [_choice(" x" * tokens, reason)],
            }

        await send(chunk(1, "length" if max_tokens == 1 else None))
        left = max_tokens - 1
        while left:
            step = min(CHUNK_TOKENS, left)
            await asyncio.sleep(step * decode)
            left -= step
            await send(chunk(step, None if left else "length"))
        if include_usage:
            await send({**chunk(0, None), "choices": [], "usage": usage})
        await send("[DONE]")
        await reply.write_eof()
        return reply

    async def models(self, request: web.Request) -> web.Response:
        model = self.options.model
        entry = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.options.kv_blocks * self.options.block_size,
        }
        return web.json_response({"object": "list", "data": [entry]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def reset(self, request: web.Request) -> web.Response:
        if not self.cache.clear():
            return error_reply(400, "requests are running: the prefix cache was not reset")
        self.publish()
        return web.Response(status=200)

    async def cached(self, request: web.Request) -> web.Response:
        blocks = {str(self.listed[h][0]): self.listed[h][1] for h in self.cache.copies}
        return web.json_response({"blocks": blocks})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{self.options.model}"}}'
        lines = []
        for name, kind, value in (
            ("vllm:prefix_cache_queries_total", "counter", self.cache.queries),
            ("vllm:prefix_cache_hits_total", "counter", self.cache.hits),
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", len(self.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", self.cache.in_use() / self.cache.capacity),
        ):
            lines += [f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
        success = f'{{engine="0",finished_reason="length",model_name="{self.options.model}"}}'
        lines += [
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{success} {float(self.succeeded)}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _choice(text: str, reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


def wire_event(event: CacheEvent, block_size: int) -> dict[str, Any]:
    """A cache event as vLLM 0.32's ``KVCacheEvent`` structs encode: a tagged map with
    the fields that have no default always (``None`` included) and the others only when
    set (a plain model's one KV cache group is ``group_idx`` 0)."""
    if isinstance(event, Stored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.hashes),
            "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids),
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
        }
    if isinstance(event, Removed):
        hashes = list(event.hashes)
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}
    assert isinstance(event, Cleared)
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[CacheEvent], block_size: int, rank: int = 0) -> bytes:
    """One step's events as vLLM 0.32 publishes them: its ``KVEventBatch`` is an
    array-like struct, ``[ts, events, data_parallel_rank]``, each event a tagged map."""
    body = [time.time(), [wire_event(e, block_size) for e in events], rank]
    return bytes(msgpack.packb(body))


@dataclass(frozen=True)
class EngineAddress:
    """Where a running engine answers and publishes."""

    name: str
    url: str
    endpoint: str
    replay_endpoint: str


class Fleet:
    """``count`` engines in this process's event loop (``start``, then ``stop``)."""

    def __init__(self, count: int, options: EngineOptions, host: str = "127.0.0.1") -> None:
        self.count = count
        self.options = options
        self.host = host
        self.engines: list[SimulatedEngine] = []
        self._runners: list[web.AppRunner] = []
        self._context: Any = None

    async def start(self) -> list[EngineAddress]:
        self._context = shared_context()
        try:
            for n in range(self.count):
                publisher = EnginePublisher(context=self._context)
                engine = SimulatedEngine(f"engine-{n}", self.options, publisher)
                self.engines.append(engine)
                runner = web.AppRunner(engine.app(), access_log=None, handle_signals=False)
                await runner.setup()
                self._runners.append(runner)
                site = web.TCPSite(runner, self.host, 0)
                await site.start()
                port = runner.addresses[0][1]
                engine.url = f"http://{self.host}:{port}"
        except BaseException:
            await self.stop()
            raise
        return self.addresses()

    def addresses(self) -> list[EngineAddress]:
        return [
            EngineAddress(e.name, e.url, e.publisher.endpoint, e.publisher.replay_endpoint or "")
            for e in self.engines
        ]

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        for engine in self.engines:
            engine.publisher.close()
        if self._context is not None:
            self._context.term()
            self._context = None


async def serve(count: int, options: EngineOptions, ready_file: str | None) -> None:
    """Run a fleet until SIGTERM or SIGINT; announce it on stdout (and ``ready_file``)."""
    fleet = Fleet(count, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    addresses = await fleet.start()
    try:
        line = json.dumps({"engines": [asdict(a) for a in addresses], "options": asdict(options)})
        if ready_file:
            with open(ready_file + ".part", "w", encoding="utf-8") as out:
                out.write(line + "\n")
            os.replace(ready_file + ".part", ready_file)
        print(line, flush=True)
        await stop.wait()
    finally:
        await fleet.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pcr.bench.sim_engines", description=__doc__)
    defaults = EngineOptions()
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=defaults.kv_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--max-running", type=int, default=defaults.max_running)
    parser.add_argument("--prefill-ms", type=float, default=defaults.prefill_ms)
    parser.add_argument("--decode-ms", type=float, default=defaults.decode_ms)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--ready-file")
    args = parser.parse_args(argv)
    for name in ("engines", "kv_blocks", "block_size", "max_running"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("prefill_ms", "decode_ms"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            parser.error(f"--{name.replace('_', '-')} must be a number >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = EngineOptions(
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_running=args.max_running,
        prefill_ms=args.prefill_ms,
        decode_ms=args.decode_ms,
        model=args.model,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.engines, options, args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
