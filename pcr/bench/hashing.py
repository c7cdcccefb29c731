"""Block hashing beside Dynamo's: ``block_hashes`` (Megatron-Core's SHA-256 chain, as
installed: the C extension or pure Python) against ``compute_block_hash_for_seq`` from
``ai-dynamo-runtime`` (an optional bench dependency, not in any extra: it pins an older
pydantic), and a plain chained SHA-256 in Python (hashlib, one object per block) as the
floor of a pure-Python chain.

The workload is what a router hashes per request: prompts of 512 complete blocks at 16
and 32 tokens per block, a list of Python ints (token ids uniform below 152,000, a
large vocabulary), 8 different prompts taken in turn. ``block_hashes`` is timed with
the digests it remembers turned off (``remember_digests``): each prompt hashed as if
for the first time, the headline; "remembered" is the same call with them on, where
all 8 prompts were hashed before (the best case: a prompt's shared prefix seen
before costs that per block). Every round times each hasher in
short batches, the hashers taking turns batch by batch (the order rotating), so a busy
machine slows all of them alike; a round's ratio is the medians' ratio, and the run
reports the median over rounds. Run it as ``python -m pcr.bench.hashing`` or
``make bench-hashing``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from registry.core.hashing import ZERO_PARENT, block_hashes, implementation, remember_digests

BLOCKS = 512
BLOCK_SIZES = (16, 32)
PROMPTS = 8
VOCABULARY = 152_000
BATCH = 10
"""Calls per timed batch: long enough to dwarf the clock, short enough to interleave."""

Hasher = Callable[[list[int], int], object]


def _dynamo() -> Hasher | None:
    """Dynamo's ``compute_block_hash_for_seq``, or None without ``ai-dynamo-runtime``."""
    try:
        core = importlib.import_module("dynamo._core")
    except ImportError:
        return None
    hasher: Hasher = core.compute_block_hash_for_seq
    return hasher


def plain_sha256_chain(tokens: list[int], block_size: int) -> list[int]:
    """The same chain written the plain way in Python (one hashlib object per block)."""
    data = struct.pack(f"<{len(tokens)}q", *tokens)
    step = 8 * block_size
    parent = ZERO_PARENT
    hashes = []
    for offset in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[offset : offset + step]).digest()
        hashes.append(int.from_bytes(parent[:8], "little") % (2**63 - 1) + 1)
    return hashes


def _cpu() -> str:
    """The processor's model name where Linux tells it (SHA extensions matter here)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _prompts(block_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCABULARY) for _ in range(BLOCKS * block_size)] for _ in range(PROMPTS)]


def _batch_us(hasher: Hasher, prompts: Sequence[list[int]], block_size: int, at: int) -> float:
    """Microseconds per call over one batch of ``BATCH`` calls on prompts in turn."""
    started = time.perf_counter_ns()
    for k in range(BATCH):
        hasher(prompts[(at + k) % len(prompts)], block_size)
    return (time.perf_counter_ns() - started) / BATCH / 1000


def measure(*, rounds: int, batches: int) -> dict[str, Any]:
    """Every hasher on every block size, interleaved batch by batch, ``rounds`` times."""
    hashers: dict[str, Hasher] = {"block_hashes": block_hashes, "remembered": block_hashes}
    dynamo = _dynamo()
    if dynamo is not None:
        hashers["dynamo"] = dynamo
    hashers["plain_python"] = plain_sha256_chain
    prompts = {size: _prompts(size, seed=size) for size in BLOCK_SIZES}
    for size in BLOCK_SIZES:  # the chain is Megatron-Core's, whichever code computes it
        if block_hashes(prompts[size][0], size) != plain_sha256_chain(prompts[size][0], size):
            raise RuntimeError("block_hashes differs from the plain SHA-256 chain")
    load_before = os.getloadavg()
    remembering = remember_digests(True)
    per_round: dict[int, list[dict[str, float]]] = {size: [] for size in BLOCK_SIZES}
    for r in range(rounds):
        for size in BLOCK_SIZES:
            samples: dict[str, list[float]] = {name: [] for name in hashers}
            names = list(hashers)
            for b in range(batches):
                turn = names[b % len(names) :] + names[: b % len(names)]
                for name in turn:
                    remember_digests(name == "remembered")  # the headline: never seen
                    samples[name].append(_batch_us(hashers[name], prompts[size], size, b + r))
            per_round[size].append({n: statistics.median(s) for n, s in samples.items()})
    remember_digests(remembering)
    rows = []
    for size in BLOCK_SIZES:
        medians = per_round[size]
        row: dict[str, Any] = {"block_size": size, "blocks": BLOCKS}
        for name in hashers:
            row[f"{name}_us"] = round(statistics.median(m[name] for m in medians), 1)
        if dynamo is not None:
            ratios = [m["block_hashes"] / m["dynamo"] for m in medians]
            row["ratio"] = round(statistics.median(ratios), 2)
            row["ratio_range"] = [round(min(ratios), 2), round(max(ratios), 2)]
            row["plain_python_ratio"] = round(
                statistics.median(m["plain_python"] / m["dynamo"] for m in medians), 2
            )
        rows.append(row)
    return {
        "workload": f"{PROMPTS} prompts of {BLOCKS} blocks, token ids below {VOCABULARY}, "
        "a list of Python ints",
        "implementation": implementation(),
        "dynamo": dynamo is not None,
        "rounds": rounds,
        "batches": batches,
        "batch_calls": BATCH,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "cpu": _cpu(),
        "target_ratio": 1.5,
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> list[str]:
    lines = [
        f"block hashing, {report['workload']} (median µs per prompt; "
        f"block_hashes runs {report['implementation']}):",
        f"{'block size':>10} {'block_hashes':>13} {'Dynamo':>8} {'ratio':>6} {'range':>12} "
        f"{'plain Python':>13} {'remembered':>11}",
    ]
    for r in report["rows"]:
        spread = "-" if "ratio_range" not in r else "{}-{}".format(*r["ratio_range"])
        lines.append(
            f"{r['block_size']:>10} {r['block_hashes_us']:>13} {r.get('dynamo_us', '-')!s:>8} "
            f"{r.get('ratio', '-')!s:>6} {spread:>12} {r['plain_python_us']:>13} "
            f"{r['remembered_us']:>11}"
        )
    lines.append(
        "block_hashes: each prompt as if never seen (digests not remembered); remembered: "
        "the same prompts hashed before, the best case"
    )
    if not report["dynamo"]:
        lines.append("(Dynamo's hashing not installed: pip install ai-dynamo-runtime)")
    lines.append(
        f"target: block_hashes <= {report['target_ratio']}x Dynamo; load average "
        f"{report['load_before'][0]} before, {report['load_after'][0]} after, "
        f"{report['cpus']} CPUs ({report['cpu']}); {report['rounds']} rounds x "
        f"{report['batches']} batches x {report['batch_calls']} calls per hasher"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr.bench.hashing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a few seconds")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    report = measure(rounds=3 if args.quick else 15, batches=10 if args.quick else 30)
    print("\n".join(format_report(report)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
