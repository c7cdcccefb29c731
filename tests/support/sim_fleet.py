"""Simulated vLLM engines as a process, ``pcr bridge`` following them, and an open-loop
client replaying a trace: what ``tests/engines/bench_trace.py`` and the trace system test
share.

``FleetProcess`` runs ``python -m pcr.bench.sim_engines`` (N engines in one process) in
a session of its own and reads the ready file it writes; ``BridgeProcess`` follows every
engine's events (``--endpoint``, ``--replay-endpoint``) into one namespace each;
``replay`` sends token-id completions at their arrival times (each its own task, so a
slow reply never delays the next arrival) and measures the time to the first SSE chunk.
Every process is stopped by PID (its process group).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import redis

from pcr.bench.sim_engines import EngineAddress, EngineOptions
from registry import PrefixCacheRegistry
from tests.support.process_groups import kill_group, stop_group

START_TIMEOUT = 120.0
"""Only a fleet that cannot start reaches it (it starts in about a second)."""
COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
}


class FleetProcess:
    """``count`` simulated engines in a process of their own."""

    def __init__(self, count: int, options: EngineOptions, log_dir: Path, name: str = "fleet"):
        self.count = count
        self.options = options
        self.log = log_dir / f"{name}.log"
        self.ready = log_dir / f"{name}.ready.json"
        self.process: subprocess.Popen[bytes] | None = None
        self.engines: list[EngineAddress] = []

    def start(self) -> list[EngineAddress]:
        self.ready.unlink(missing_ok=True)
        o = self.options
        command = [
            sys.executable, "-m", "pcr.bench.sim_engines",
            "--engines", str(self.count),
            "--kv-blocks", str(o.kv_blocks),
            "--block-size", str(o.block_size),
            "--max-running", str(o.max_running),
            "--prefill-ms", str(o.prefill_ms),
            "--decode-ms", str(o.decode_ms),
            "--model", o.model,
            "--ready-file", str(self.ready),
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"the simulated engines did not start: {tail}")
            time.sleep(0.02)  # another process's file: nothing to wait on but its existence
        document = json.loads(self.ready.read_text())
        self.engines = [EngineAddress(**e) for e in document["engines"]]
        return self.engines

    def stop(self) -> None:
        stop_group(self.process, 10)
        self.process = None


class BridgeProcess:
    """``pcr bridge`` following the fleet's engines, one namespace each."""

    def __init__(self, redis_url: str, log: Path) -> None:
        self.redis_url = redis_url
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(
        self,
        engines: Sequence[EngineAddress],
        namespaces: Sequence[str],
        block_size: int,
        env: dict[str, str] | None = None,
    ) -> BridgeProcess:
        command = [sys.executable, "-m", "pcr", "bridge", "--redis-url", self.redis_url]
        for engine, namespace in zip(engines, namespaces, strict=True):
            command += ["--endpoint", engine.endpoint, "--namespace", namespace]
            command += ["--replay-endpoint", engine.replay_endpoint]
        command += ["--block-size", str(block_size)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                # python -m puts the working directory first on the path: a source tree
                # named by PYTHONPATH must be where it runs too.
                cwd=(env or {}).get("PYTHONPATH"),
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        stop_group(self.process, 20)
        self.process = None

    def kill(self) -> None:
        kill_group(self.process)
        self.process = None


def kv_entries(client: redis.Redis, namespaces: Sequence[str]) -> list[int]:
    """How many KV entries each namespace lists."""
    return [int(client.hlen(PrefixCacheRegistry(client, ns).keys.kv)) for ns in namespaces]


def engine_counters(url: str) -> dict[str, float]:
    """The engine's counters from its ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = dict.fromkeys(COUNTERS, 0.0)
    names = {metric: key for key, metric in COUNTERS.items()}
    for line in text.splitlines():
        key = names.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            values[key] += float(line.rsplit(" ", 1)[1])
    return values


def reset_caches(engines: Sequence[EngineAddress]) -> None:
    """Empty every engine's prefix cache (each publishes ``AllBlocksCleared``)."""
    for engine in engines:
        httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30).raise_for_status()


@dataclass(frozen=True)
class Send:
    """One request to replay: its prompt, its output length, its arrival (seconds)."""

    tokens: tuple[int, ...]
    max_tokens: int
    at: float


@dataclass
class Outcome:
    ok: bool
    ttft: float
    """Seconds from sending to the first SSE data chunk (to the failure, if none)."""
    total: float
    late: float
    """Seconds it was sent after its arrival time (the client's own lag)."""
    error: str = ""


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, send: Send, start: float
) -> Outcome:
    loop = asyncio.get_running_loop()
    delay = start + send.at - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    late = max(0.0, loop.time() - start - send.at)
    began = time.perf_counter()
    first: float | None = None
    error = ""
    done = False
    try:
        async with session.post(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as reply:
            if reply.status != 200:
                text = await reply.text()
                elapsed = time.perf_counter() - began
                return Outcome(False, elapsed, elapsed, late, f"HTTP {reply.status}: {text[:160]}")
            async for line in reply.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - began
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b'{"error"') or b'"object":"error"' in data:
                    error = data[:160].decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:160]
    total = time.perf_counter() - began
    if not error and not done:
        error = "the stream ended without [DONE]"
    return Outcome(not error, total if first is None else first, total, late, error)


async def _replay(url: str, sends: Sequence[Send], model: str, timeout: float) -> list[Outcome]:
    bodies = [
        json.dumps(
            {
                "model": model,
                "prompt": list(s.tokens),
                "max_tokens": s.max_tokens,
                "temperature": 0.0,
                "stream": True,
            }
        ).encode()
        for s in sends
    ]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        start = asyncio.get_running_loop().time() + 0.05
        return list(
            await asyncio.gather(
                *(_one(session, url, body, s, start) for body, s in zip(bodies, sends, strict=True))
            )
        )


def replay(url: str, sends: Sequence[Send], model: str, timeout: float = 300.0) -> list[Outcome]:
    """Send ``sends`` to ``url`` at their arrival times (open loop, streamed); the
    outcomes in the same order."""
    return asyncio.run(_replay(url, sends, model, timeout))


def options_dict(options: EngineOptions) -> dict[str, Any]:
    return asdict(options)
