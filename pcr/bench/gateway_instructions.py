"""The gateway's instructions per proxied request, counted by valgrind's callgrind: a
figure that stays put on a busy machine, where CPU time per request moves by 10-40%
from one minute to the next (issue 45), so a change of a few percent can be told from
noise.

The same fleet as ``pcr.bench.gateway_load`` (4 instant stub engines, a Redis with each
engine's namespace claimed and the system prompts' blocks registered, the gateway's
fleet view filled), one gateway at a time started under ``valgrind --tool=callgrind``
with counting off; ``--warmup`` requests, then counting on for ``--requests`` requests
sent one after another on one kept-alive connection, then off. Every thread of the
gateway is counted (its view's follower and its background loops too, a small share).
One connection means a wake-up of the event loop per request: the figure is higher than
under load, where one wake-up serves several; compare checkouts with it, not routers.
Valgrind hides the CPU's SHA extensions, so the blocks hashed are counted on the C
extension's portable SHA-256, about 5x their cost on a CPU with SHA-NI: a token-id
request's 25 blocks were about 28% of its figure, where they cost a few percent of the
CPU, until the chain remembered the digests of blocks hashed before (a shared system
prompt's blocks are then looked up, not hashed: only a prompt's own blocks count). A
change to how much is hashed reads here 5x larger than on the CPU. Cache misses and the
kernel's time are not counted.

``python -m pcr.bench.gateway_instructions --baseline DIR`` counts this checkout's gateway
and DIR's (another checkout, its C extensions built in place) in turns, ``--rounds``
times each, and prints thousands of instructions per request and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcr.bench import gateway_load as load
from pcr.bench.servers import RedisServer, free_port
from pcr.tables import format_table

PATHS = load.PATHS
START_S = 600.0
"""Seconds a gateway under valgrind may take to say it is ready (its imports run ~10x
slower there)."""


def count(
    checkout: Path | None, url: str, backends: dict[str, str], tokenizer: Path,
    bodies: list[bytes], path: str, requests: int, warmup: int, out_dir: Path,
) -> float:  # fmt: skip
    """Instructions per request of ``checkout``'s gateway (None: this one's)."""
    port = free_port()
    out = out_dir / f"callgrind-{port}.out"
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        *load._gateway_command(url, backends, port, f"i{port}", tokenizer),
    ]  # fmt: skip
    env = dict(os.environ)
    where = None
    if checkout is not None:
        where = checkout.resolve()
        env["PYTHONPATH"] = str(where)
    log = (out_dir / f"gateway-{port}.log").open("w")
    process = subprocess.Popen(
        command, cwd=where, env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        _wait_ready(process)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=START_S)
        _send(connection, path, bodies, warmup)
        _callgrind(process.pid, "-i", "on")
        _send(connection, path, bodies, requests)
        _callgrind(process.pid, "-i", "off")
        _callgrind(process.pid, "-d")
        connection.close()
    finally:
        process.terminate()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    total = sum(_totals(dump) for dump in out_dir.glob(out.name + ".*"))
    if total <= 0:
        raise RuntimeError(f"callgrind counted nothing (see {out_dir})")
    return total / requests


def _wait_ready(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:  # the gateway's lines until its ready line
        if "ready on" in line:
            return
    raise RuntimeError("the gateway under valgrind exited before it was ready")


def _send(connection: http.client.HTTPConnection, path: str, bodies: list[bytes], n: int) -> None:
    headers = {"content-type": "application/json"}
    for i in range(n):
        connection.request("POST", path, bodies[i % len(bodies)], headers)
        reply = connection.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"the gateway answered {reply.status}")


def _callgrind(pid: int, *what: str) -> None:
    subprocess.run(["callgrind_control", *what, str(pid)], check=True, capture_output=True)


def _totals(dump: Path) -> int:
    with dump.open(errors="replace") as lines:
        for line in lines:
            if line.startswith("totals:"):
                return int(line.split()[1])
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(tempfile.mkdtemp(prefix="pcr-gateway-instructions-"))
    server = RedisServer().start()
    context = multiprocessing.get_context("spawn")
    ports = [free_port() for _ in range(load.ENGINES)]
    ready = context.Event()
    stubs = context.Process(target=load._serve_stubs, args=(ports, ready), daemon=True)
    stubs.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the stub engines did not start")
        tokenizer = out_dir / "tokenizer"
        workload = load.build_workload(load.build_tokenizer(tokenizer))
        names = [f"stub-{n}" for n in range(load.ENGINES)]
        backends = {ns: f"http://127.0.0.1:{p}" for ns, p in zip(names, ports, strict=True)}
        load.fill(server.url, names, workload)
        checkouts: list[tuple[str, Path | None]] = [("gateway", None)]
        if args.baseline is not None:
            checkouts.append((f"gateway at {args.baseline.name}", args.baseline))
        rows = []
        for shape in args.shapes.split(","):
            bodies = workload.bodies(shape)
            counted: dict[str, list[float]] = {label: [] for label, _ in checkouts}
            for turn in range(args.rounds):
                for label, checkout in checkouts if turn % 2 == 0 else checkouts[::-1]:
                    per = count(checkout, server.url, backends, tokenizer, bodies, PATHS[shape],
                                args.requests, args.warmup, out_dir)  # fmt: skip
                    counted[label].append(per)
                    load.say(f"{shape} {label}: {per / 1e3:.1f} k instructions a request")
            first = statistics.median(counted["gateway"])
            for label, values in counted.items():
                middle = statistics.median(values)
                rows.append({"shape": shape, "router": label, "k_instructions": middle / 1e3,
                             "vs_gateway": middle / first})  # fmt: skip
        return {"rows": rows}
    finally:
        stubs.kill()
        server.stop()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr.bench.gateway_instructions",
        description="The gateway's instructions per proxied request, under callgrind.",
    )
    parser.add_argument("--baseline", type=Path, help="another checkout, counted in turns")
    parser.add_argument("--shapes", default="ids,chat", type=_shapes)
    parser.add_argument("--requests", type=_positive, default=1_000)
    parser.add_argument("--warmup", type=_positive, default=300)
    parser.add_argument("--rounds", type=_positive, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind (with callgrind_control) is not installed")
    if args.baseline is not None and not (args.baseline / "pcr").is_dir():
        parser.error(f"--baseline {args.baseline}: not a checkout of this project")
    result = run(args)
    table = [[r["shape"], r["router"], f"{r['k_instructions']:.1f}", f"{r['vs_gateway']:.3f}x"]
             for r in result["rows"]]  # fmt: skip
    print(format_table(["shape", "router", "k instr/request", "vs gateway"], table))
    return 0


def _shapes(text: str) -> str:
    shapes = text.split(",")
    if not shapes or any(s not in PATHS for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are {', '.join(PATHS)}, comma-separated")
    return text


def _positive(text: str) -> int:
    with contextlib.suppress(ValueError):
        if int(text) > 0:
            return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")


if __name__ == "__main__":
    sys.exit(main())
