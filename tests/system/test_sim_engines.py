"""The simulated vLLM engines (``pcr.bench.sim_engines``) over HTTP and ZeroMQ: the parts
of vLLM's API a router uses, the running-request limit, the counters, and events a
subscriber decodes with the project's bridge decoder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
aiohttp = pytest.importorskip("aiohttp")

import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from pcr.bench.sim_engines import EngineOptions, Fleet  # noqa: E402
from registry.bridge.bridge_events import BlockRemoved, BlockStored, decode_frames  # noqa: E402
from sim.engine_events import engine_chain  # noqa: E402

MODEL = "sim-engine"


def run(body: Callable[[Fleet, aiohttp.ClientSession], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        fleet = Fleet(1, EngineOptions(**options))
        await fleet.start()
        try:
            async with aiohttp.ClientSession() as session:
                await body(fleet, session)
        finally:
            await fleet.stop()

    asyncio.run(main())


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: Any, **extra: Any
) -> tuple[int, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        text = await reply.text()
        return reply.status, text if extra.get("stream") else json.loads(text)


def test_requests_beyond_the_running_limit_wait_in_order() -> None:
    """Two run at once; the third waits until one ends, then starts (and so does a
    fourth only when another ends); the counters count every request's tokens."""

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        engine = fleet.engines[0]

        def enter(n: int) -> asyncio.Task[Any]:
            tokens = list(range(n * 100, n * 100 + 40))
            hashes = engine_chain(tokens, 16, seed=engine.seed)
            return asyncio.create_task(engine._enter(hashes, tokens, 4))

        tickets = [enter(n) for n in range(4)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert [t.done() for t in tickets] == [True, True, False, False]
        assert (engine.running, len(engine.waiting)) == (2, 2)
        engine._leave(tickets[1].result())
        await asyncio.sleep(0)
        assert [t.done() for t in tickets] == [True, True, True, False]
        for n in (0, 2):
            engine._leave(tickets[n].result())
        await asyncio.sleep(0)
        engine._leave(tickets[3].result())
        assert (engine.running, len(engine.waiting)) == (0, 0)
        status, reply = await complete(session, engine.url, list(range(40)))
        assert status == 200
        assert reply["usage"]["prompt_tokens"] == 40
        async with session.get(f"{engine.url}/metrics") as answer:
            metrics = await answer.text()
        assert 'vllm:request_success_total{engine="0",finished_reason="length"' in metrics
        assert (
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 200.0' in metrics
        )

    run(body)


def test_a_resent_prompt_hits_and_the_stream_carries_usage() -> None:
    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        url = fleet.engines[0].url
        prompt = list(range(100, 150))  # three full blocks of 16 and 2 tokens
        await complete(session, url, prompt)
        status, text = await complete(
            session, url, prompt, stream=True, stream_options={"include_usage": True}
        )
        assert status == 200
        lines = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " x" * 4
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
        async with session.get(f"{url}/metrics") as reply:
            metrics = await reply.text()
        assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 48.0' in metrics

    run(body)


@pytest.mark.parametrize(
    ("prompt", "extra", "status", "says"),
    [
        ("a text prompt", {}, 400, "takes prompts as a non-empty list of token ids"),
        ([], {}, 400, "non-empty list of token ids"),
        ([1, True], {}, 400, "non-empty list of token ids"),
        ([1, 2], {"max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
        ([1, 2], {"model": "other"}, 404, "The model `other` does not exist."),
        (list(range(100)), {"max_tokens": 100}, 400, "more than the 8 blocks"),
    ],
)
def test_requests_it_cannot_serve_get_vllm_errors(
    prompt: Any, extra: dict[str, Any], status: int, says: str
) -> None:
    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        got, reply = await complete(session, fleet.engines[0].url, prompt, **extra)
        assert got == status
        assert says in reply["error"]["message"]
        assert reply["error"]["code"] == status

    run(body, kv_blocks=8)


def test_its_events_decode_into_its_cache_and_evictions() -> None:
    """Two prompts through a 6-block cache: the second evicts the first's blocks, and a
    subscriber sees the stores and the removals in order; the models list and the
    reset, refused while a request runs, behave as vLLM's."""

    async def body(fleet: Fleet, session: aiohttp.ClientSession) -> None:
        engine = fleet.engines[0]
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.connect(engine.publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            engine.publisher.wait_subscribed()
            await complete(session, engine.url, list(range(48)))  # 3 blocks + 1 generated
            await complete(session, engine.url, list(range(500, 548)))
            batches = [decode_frames(await sub.recv_multipart()) for _ in range(2)]
        finally:
            sub.close(0)
            context.term()
        assert [seq for _, seq, _ in batches] == [0, 1]
        first, second = (b.events for _, _, b in batches)
        assert [type(e) for e in first] == [BlockStored]
        stored = first[0]
        assert isinstance(stored, BlockStored)
        assert stored.token_ids == tuple(range(48))
        assert stored.group_idx == 0
        assert stored.medium == "GPU"
        # The first request freed its 4 blocks, its last first: the second takes the 2
        # never used, the first's output block, then its last prompt block (evicted).
        removed = [e for e in second if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [(stored.block_hashes[2],)]
        assert isinstance(second[-1], BlockStored)
        async with session.get(f"{engine.url}/v1/models") as reply:
            models = await reply.json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        slow = asyncio.create_task(complete(session, engine.url, list(range(900, 910))))
        while not engine.running:
            await asyncio.sleep(0)
        async with session.post(f"{engine.url}/reset_prefix_cache") as reply:
            assert reply.status == 400
        await slow
        async with session.post(f"{engine.url}/reset_prefix_cache") as reply:
            assert reply.status == 200
        assert engine.cache.cached() == set()

    run(body, kv_blocks=6, decode_ms=50)
