"""``pcr bench``'s serve rows: ``pcr serve`` over HTTP, and the asyncio router.

The data is the routing rows' (``score over 16 namespaces``): 16 live namespaces under
a key prefix of their own, each holding 4,096 other blocks, namespace i the first
512 * (i + 1) / 16 blocks of one 512-block prompt, with a Mamba checkpoint every 8 blocks.

- **Routers.** ``PrefixRouter.score`` and ``AsyncPrefixRouter.score`` (awaited on one
  event loop, one call at a time) of the prompt, in interleaved rounds on one
  connection each; p50 is the median of the per-round medians. Their ratio is a target.
- **HTTP.** ``pcr serve`` runs in a process of its own (one uvicorn worker); this process
  offers ``POST /v1/score`` (the prompt as ``block_hashes``, the body encoded once) at a
  fixed rate, open loop: request i is sent at start + i / rate whatever the replies
  before it, over up to 16 keep-alive connections (httpx). Latency runs from sending to
  the whole reply, client included; requests/s is the replies over the time from the
  first send to the last reply. Then ``SATURATING`` clients send back to back for half
  as long: the most requests/s the service gives on this machine.

Needs the ``serve`` extra and httpx; without them the rows are ``skipped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import redis

from pcr.bench.servers import free_port
from registry import PrefixCacheRegistry, PrefixRouter

KEY_PREFIX = "pcr-bench-serve"
NAMESPACES = 16
BLOCKS = 512
FILLER = 4096
START_TIMEOUT = 60.0
CONNECTIONS = 16
SKIP_REASON = "needs the serve extra and httpx: pip install 'prefix-cache-registry[serve]' httpx"


@dataclass(frozen=True)
class ServeEffort:
    """How hard to measure."""

    rounds: int
    calls: int  # router calls per round
    rate: float  # offered requests per second
    seconds: float  # of offered load


QUICK = ServeEffort(rounds=3, calls=30, rate=50.0, seconds=2.0)
FULL = ServeEffort(rounds=7, calls=100, rate=50.0, seconds=10.0)
SATURATING = 8
"""Clients sending back to back for the saturated figure."""


def missing_dependency() -> str | None:
    """Why the serve rows cannot run here, or None when they can."""
    for module in ("fastapi", "uvicorn", "httpx"):
        try:
            importlib.import_module(module)
        except ImportError:
            return SKIP_REASON
    return None


def _fill(client: Any) -> list[int]:
    prompt = [2**60 + 7_000_000 + i for i in range(BLOCKS)]
    for i in range(NAMESPACES):
        reg = PrefixCacheRegistry(client, f"bench-serve-{i}", key_prefix=KEY_PREFIX)
        reg.claim(lease_ttl=3600)
        client.hset(reg.keys.kv, mapping={2**59 + i * 10_000 + j: j for j in range(FILLER)})
        cached = BLOCKS * (i + 1) // NAMESPACES
        reg.register_kv(range(cached), prompt[:cached])
        reg.register_mamba(range(0, cached, 8), prompt[:cached:8])
    return prompt


async def _routers(url: str, prompt: list[int], effort: ServeEffort) -> dict[str, Any]:
    from registry.routing.aio_routing import AsyncPrefixRouter
    from registry.transport.client import async_client_from_url

    sync_client = redis.Redis.from_url(url)
    async_client = async_client_from_url(url)
    try:
        sync_router = PrefixRouter(sync_client, KEY_PREFIX)
        async_router = AsyncPrefixRouter(async_client, KEY_PREFIX)
        expected = sync_router.score(prompt)
        if await async_router.score(prompt) != expected or len(expected) != NAMESPACES:
            raise RuntimeError("the asyncio router's scores differ from the sync router's")
        medians: dict[str, list[float]] = {"sync": [], "asyncio": []}
        for _ in range(effort.rounds):
            for name in medians:
                samples = []
                for _ in range(effort.calls):
                    start = time.perf_counter()
                    if name == "sync":
                        sync_router.score(prompt)
                    else:
                        await async_router.score(prompt)
                    samples.append((time.perf_counter() - start) * 1000)
                medians[name].append(statistics.median(samples))
    finally:
        sync_client.close()
        await async_client.aclose()
    sync_ms = statistics.median(medians["sync"])
    async_ms = statistics.median(medians["asyncio"])
    return {
        "sync_router_p50_ms": round(sync_ms, 4),
        "async_router_p50_ms": round(async_ms, 4),
        "async_over_sync": round(async_ms / sync_ms, 3),
    }


async def _offered_load(port: int, body: bytes, effort: ServeEffort) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30
    ) as http:
        for _ in range(20):  # warm up: connections, scripts, the live-node cache
            reply = await http.post("/v1/score", content=body, headers=headers)
            if reply.status_code != 200:
                raise RuntimeError(
                    f"POST /v1/score answered {reply.status_code}: {reply.text:.200}"
                )
        count = int(effort.rate * effort.seconds)
        latencies: list[float] = []
        failures = 0
        last = 0.0
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05

        async def one(i: int) -> None:
            nonlocal failures, last
            await asyncio.sleep(max(0.0, start + i / effort.rate - loop.time()))
            sent = time.perf_counter()
            try:
                reply = await http.post("/v1/score", content=body, headers=headers)
                ok = reply.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - sent) * 1000)
            else:
                failures += 1
            last = max(last, loop.time())

        await asyncio.gather(*(one(i) for i in range(count)))
        saturated = await _saturated(http, body, effort.seconds / 2)
    latencies.sort()
    return {
        "offered_per_s": effort.rate,
        "requests": count,
        "failed": failures,
        "requests_per_s": round(len(latencies) / (last - start), 1),
        "p50_ms": round(statistics.median(latencies), 3) if latencies else None,
        "p99_ms": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
        "saturated_per_s": saturated,
    }


async def _saturated(http: Any, body: bytes, seconds: float) -> float:
    """Replies per second with ``SATURATING`` clients sending back to back."""
    headers = {"content-type": "application/json"}
    done = 0
    end = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < end:
            reply = await http.post("/v1/score", content=body, headers=headers)
            done += reply.status_code == 200

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(SATURATING)))
    return round(done / (time.perf_counter() - start), 1)


@contextlib.contextmanager
def _served(url: str) -> Any:
    import httpx

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pcr", "serve", "--redis-url", url, "--key-prefix", KEY_PREFIX,
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pcr serve exited: {process.communicate()[1][-300:]!r}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/live", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"pcr serve did not answer in {START_TIMEOUT:.0f} s")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def measure(url: str, *, quick: bool = False) -> dict[str, Any]:
    """The serve rows, or ``{"skipped": why}`` / ``{"error": what}``."""
    why = missing_dependency()
    if why is not None:
        return {"skipped": why}
    effort = QUICK if quick else FULL
    client = redis.Redis.from_url(url)
    try:
        prompt = _fill(client)
        rows: dict[str, Any] = {"namespaces": NAMESPACES, "blocks": BLOCKS}
        rows.update(asyncio.run(_routers(url, prompt, effort)))
        body = json.dumps({"block_hashes": prompt}).encode()
        with _served(url) as port:
            rows["http"] = asyncio.run(_offered_load(port, body, effort))
        return rows
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        client.close()


def format_rows(rows: dict[str, Any] | None) -> list[str]:
    """The serve rows as report lines."""
    if rows is None:
        return []
    if "skipped" in rows:
        return [f"serve: skipped ({rows['skipped']})"]
    if "error" in rows:
        return [f"serve: FAILED: {rows['error']}"]
    http = rows["http"]
    where = f"{rows['blocks']} hashes, {rows['namespaces']} live nodes"
    return [
        f"score, {where}: PrefixRouter p50 {rows['sync_router_p50_ms']:.3f} ms, "
        f"AsyncPrefixRouter p50 {rows['async_router_p50_ms']:.3f} ms "
        f"({rows['async_over_sync']:.2f}x)",
        f"pcr serve POST /v1/score, {where}, offered {http['offered_per_s']:.0f}/s: "
        f"{http['requests_per_s']:,.1f} requests/s, p50 {http['p50_ms']} ms, "
        f"p99 {http['p99_ms']} ms ({http['failed']} failed of {http['requests']}); "
        f"saturated ({SATURATING} clients back to back) {http['saturated_per_s']:,.1f} requests/s",
    ]
