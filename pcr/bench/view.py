"""``pcr bench --fleet``'s in-process rows: one routing decision from the fleet view
(``registry/fleet/view.py``) beside Dynamo's ``RadixTree``, fed the same fleet, with
equal answers checked; and the view's memory per (node, block) pair. Then, on Redis, a
write's way to a view, a view's cold start and what an owner's write costs. The same
fleets through Redis, from the view and exactly, are ``pcr.bench.fleet``'s.

Two fleets at each size (``--best-case`` adds a third, labelled). The headline, long
prompts (``long_prompts``): conversations of 352 to 512 blocks on 16 Zipf system
prompts, each held by 3 workers at different lengths, about 4,000 blocks per worker;
each prompt routed is one of them whole and new blocks after it (512 blocks), so a
decision matches hundreds of blocks. The realistic fleet, short prefixes: each
of W workers holds 16 conversations. A conversation is one of 8 system prompts of 128
blocks, chosen by Zipf popularity (s = 1.1), followed by its own turns (64 to 192
blocks: about 4,000 blocks per worker). Evictions left each worker a prefix of each
conversation: a quarter of them cut inside the system prompt, the rest inside the
turns. The prompts routed: 64 of 512 blocks, each a system prompt by the same
popularity followed by, in turn, the blocks of a conversation some worker holds and
new ones (a conversation going on), or only new blocks (a one-off prompt).

Both sides receive the fleet as events: the view as change records (``k+`` with the
blocks of each conversation, the same text its scripts publish), the tree as Dynamo's
``stored`` events (each conversation from its root, parent by parent). A decision is
``FleetView.match(hashes)`` (the workers that match, each with its usable prefix) against
``RadixTree.find_matches(hashes)`` (the workers that match, each with its matched
blocks); both in this process, on the same prompts, alternating. Every fleet is built
first and the fleets take turns round by round, so that the growth from the smallest to
the largest is measured under one machine's load, not two.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from registry.core.errors import RegistryUnavailable
from registry.fleet.view import FleetView
from registry.routing.plan import least_loaded
from registry.routing.routing import PrefixRouter
from registry.transport import lua

SYSTEM_PROMPTS = 8
SYSTEM_BLOCKS = 128
CONVERSATIONS = 16
TURN_BLOCKS = (64, 192)
PROMPTS = 64
PROMPT_BLOCKS = 512
ZIPF_S = 1.1


@dataclass
class Fleet:
    """Who holds what: per worker, the chains it holds (each a list of hashes)."""

    held: dict[str, list[list[int]]]
    prompts: list[list[int]]
    label: str

    @property
    def pairs(self) -> int:
        return sum(len({h for chain in chains for h in chain}) for chains in self.held.values())


def _zipf(rng: random.Random, n: int) -> int:
    weights = [1 / (k + 1) ** ZIPF_S for k in range(n)]
    return rng.choices(range(n), weights)[0]


def realistic(workers: int, seed: int = 27) -> Fleet:
    """The realistic fleet above."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 2**63) for _ in range(n)]

    systems = [fresh(SYSTEM_BLOCKS) for _ in range(SYSTEM_PROMPTS)]
    held: dict[str, list[list[int]]] = {}
    conversations: list[list[int]] = []
    for w in range(workers):
        chains = []
        for _ in range(CONVERSATIONS):
            system = systems[_zipf(rng, SYSTEM_PROMPTS)]
            chain = system + fresh(rng.randint(*TURN_BLOCKS))
            conversations.append(chain)
            if rng.random() < 0.25:
                cut = rng.randint(1, SYSTEM_BLOCKS)  # evicted into the system prompt
            else:
                cut = rng.randint(SYSTEM_BLOCKS + 1, len(chain))
            chains.append(chain[:cut])
        held[f"worker-{w:04d}"] = chains
    prompts = []
    for i in range(PROMPTS):
        # A conversation going on, or a one-off prompt.
        base = rng.choice(conversations) if i % 2 == 0 else systems[_zipf(rng, SYSTEM_PROMPTS)]
        prompts.append((base + fresh(PROMPT_BLOCKS))[:PROMPT_BLOCKS])
    return Fleet(held, prompts, "realistic")


HEADLINE = "long prompts (headline)"
LONG_SYSTEMS = 16
LONG_SYSTEM_BLOCKS = 32
LONG_BODY_BLOCKS = (320, 480)
LONG_COPIES = 3


def long_prompts(workers: int, seed: int = 45) -> Fleet:
    """The headline shape: long prompts, each held by a few workers at different
    lengths. A conversation is one of 16 system prompts of 32 blocks (Zipf, s = 1.1)
    followed by its own body of 320 to 480 blocks; each is held by 3 workers, each
    holding a different prefix of it (cut past the system prompt, evictions having
    taken the rest), 16 conversations per worker (about 4,000 blocks each). The 64
    prompts routed are 512 blocks: a conversation held somewhere, whole, followed by
    new blocks (it goes on), so a decision matches hundreds of blocks on about three
    workers at different lengths, and the system prompt on many."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 2**63) for _ in range(n)]

    systems = [fresh(LONG_SYSTEM_BLOCKS) for _ in range(LONG_SYSTEMS)]
    names = [f"worker-{w:04d}" for w in range(workers)]
    held: dict[str, list[list[int]]] = {n: [] for n in names}
    conversations: list[list[int]] = []
    for _ in range(CONVERSATIONS):  # each round gives every worker one more
        order = rng.sample(names, len(names))
        for at in range(0, len(order), LONG_COPIES):
            chain = systems[_zipf(rng, LONG_SYSTEMS)] + fresh(rng.randint(*LONG_BODY_BLOCKS))
            conversations.append(chain)
            for name in order[at : at + LONG_COPIES]:
                held[name].append(chain[: rng.randint(LONG_SYSTEM_BLOCKS + 1, len(chain))])
    prompts = [
        (chain + fresh(PROMPT_BLOCKS))[:PROMPT_BLOCKS]
        for chain in rng.sample(conversations, min(PROMPTS, len(conversations)))
    ]
    return Fleet(held, prompts, HEADLINE)


def best_case(workers: int, seed: int = 27) -> Fleet:
    """Every worker holds the same 4,096-block chain; the prompts are its prefix and
    new blocks (labelled best case: one holder set along the whole chain)."""
    rng = random.Random(seed)
    chain = [rng.randrange(1, 2**63) for _ in range(4096)]
    held = {f"worker-{w:04d}": [chain] for w in range(workers)}
    prompts = [chain[: rng.randint(1, PROMPT_BLOCKS)] for _ in range(PROMPTS)]
    prompts = [(p + [rng.randrange(1, 2**63) for _ in range(PROMPT_BLOCKS)])[:PROMPT_BLOCKS]
               for p in prompts]  # fmt: skip
    return Fleet(held, prompts, "best case: one chain held by all")


def records(fleet: Fleet) -> list[bytes]:
    """The fleet as change records, one per conversation."""
    out = []
    for name, chains in fleet.held.items():
        for seq, chain in enumerate(chains, start=1):
            out.append(f"{name} 0 {seq} k+ {' '.join(map(str, chain))}".encode())
    return out


def dynamo_events(fleet: Fleet) -> list[tuple[int, bytes]]:
    """The fleet as Dynamo ``stored`` events, one per conversation, from its root."""
    out = []
    event_id = 0
    for worker, chains in enumerate(fleet.held.values()):
        for chain in chains:
            event_id += 1
            blocks = [{"block_hash": h, "tokens_hash": h} for h in chain]
            data = {"stored": {"parent_hash": None, "blocks": blocks}}
            out.append((worker, json.dumps({"event_id": event_id, "data": data}).encode()))
    return out


def _radix_tree() -> Any:
    """A new Dynamo ``RadixTree``, or None without ``ai-dynamo-runtime`` (an optional
    bench dependency: not in any extra, it pins an older pydantic)."""
    try:
        core = importlib.import_module("dynamo._core")
    except ImportError:
        return None
    return core.RadixTree()


STEPS = ("decision", "answer", "choice")
"""What the in-process rows time, on both sides, call by call on the same prompts:
``decision`` the lookup in its native answer (``FleetView.match`` -> ``Matches``,
``RadixTree.find_matches`` -> ``OverlapScores``, neither naming every worker yet);
``answer`` that answer as a Python dict worker -> prefix (``.usable``, ``.scores``);
``choice`` one node chosen: the longest prefix, ties to the lowest load
(``PrefixRouter(view=...).best(prompt, load)``; the tree's scores, then the same rule)."""


@dataclass
class Built:
    """One fleet built into both sides, with its row so far and each side's steps."""

    fleet: Fleet
    row: dict[str, Any]
    steps: dict[str, dict[str, Any]]


def build(fleet: Fleet) -> Built:
    """One fleet into a detached view and, when installed, Dynamo's tree; the answers
    and the choices checked equal, the view's bytes per (node, block) measured."""
    names = list(fleet.held)
    gc.collect()
    tracemalloc.start()
    view = FleetView.detached(names)
    started = time.perf_counter()
    for record in records(fleet):
        view.apply(record)
    applied_s = time.perf_counter() - started
    view_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    pairs = fleet.pairs
    row: dict[str, Any] = {
        "workload": fleet.label,
        "nodes": len(names),
        "pairs": pairs,
        "view_bytes_per_pair": round(view_bytes / pairs, 1),
        "view_records_per_s": round(len(names) * CONVERSATIONS / applied_s),
    }
    rng = random.Random(len(names))
    load = {n: rng.random() for n in names}  # distinct: no tie left to the name order
    steps = {"view": _our_steps(view, load)}
    tree = _radix_tree()
    if tree is not None:
        for worker, event in dynamo_events(fleet):
            tree.apply_event(worker, event)
        steps["radix"] = _their_steps(tree, names, load)
        row["answers_equal"] = _compare(
            view, tree, fleet, names, steps["view"]["choice"], steps["radix"]["choice"]
        )
    return Built(fleet, row, steps)


def time_steps(built: list[Built], rounds: int) -> None:
    """Time every step of every fleet, filling each row: in rounds (the first warms up,
    untimed), each round going through every fleet in turn, and within one fleet each
    step of both sides call by call on the same prompts. The fleets take turns so that
    their figures, and the growth from one to the next, are taken under the same
    conditions (a machine's load drifts over a run)."""
    timed: list[dict[str, list[int]]] = [
        {f"{side}_{step}": [] for side in b.steps for step in STEPS} for b in built
    ]
    for turn in range(rounds + 1):
        for b, out in zip(built, timed, strict=True):
            for step in STEPS:
                for prompt in b.fleet.prompts:
                    for side, steps in b.steps.items():
                        call = steps[step]
                        t0 = time.perf_counter_ns()
                        call(prompt)
                        if turn:
                            out[f"{side}_{step}"].append(time.perf_counter_ns() - t0)
    for b, out in zip(built, timed, strict=True):
        row = b.row
        for step in STEPS:
            prefix = "" if step == "decision" else f"{step}_"
            for side in b.steps:
                values = out[f"{side}_{step}"]
                row[f"{side}_{prefix}p50_us"] = round(statistics.median(values) / 1000, 1)
                row[f"{side}_{prefix}p99_us"] = round(_p99(values) / 1000, 1)
            if f"radix_{prefix}p50_us" in row:
                row[f"ratio_{prefix}p50"] = round(
                    row[f"view_{prefix}p50_us"] / row[f"radix_{prefix}p50_us"], 2
                )


def _our_steps(view: FleetView, load: dict[str, float]) -> dict[str, Any]:
    router = PrefixRouter(None, view=view)
    return {
        "decision": view.match,
        "answer": lambda prompt: view.match(prompt).usable,
        "choice": lambda prompt: router.best(prompt, load),
    }


def _their_steps(tree: Any, names: list[str], load: dict[str, float]) -> dict[str, Any]:
    def choice(prompt: list[int]) -> str | None:
        scores: dict[tuple[int, int], int] = tree.find_matches(prompt).scores
        best = max(scores.values(), default=0)
        if not best:
            return least_loaded(names, load)
        return least_loaded([names[w] for (w, _rank), n in scores.items() if n == best], load)

    return {
        "decision": tree.find_matches,
        "answer": lambda prompt: tree.find_matches(prompt).scores,
        "choice": choice,
    }


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _compare(
    view: FleetView, tree: Any, fleet: Fleet, names: list[str], ours: Any, theirs: Any
) -> bool:
    """Whether both answer every prompt with the same workers and prefixes, and choose
    the same node."""
    for prompt in fleet.prompts:
        found = view.match(prompt)
        if found != {n: s.kv_prefix for n, s in view.score(prompt).items()}:
            return False
        scores = tree.find_matches(prompt).scores
        if found.usable != {names[w]: blocks for (w, _rank), blocks in scores.items() if blocks}:
            return False
        if ours(prompt) != theirs(prompt):
            return False
    return True


def run(nodes: tuple[int, ...], *, rounds: int, best: bool) -> dict[str, Any]:
    built = []
    for n in nodes:
        built.append(build(long_prompts(n)))
        built.append(build(realistic(n)))
        if best:
            built.append(build(best_case(n)))
    time_steps(built, rounds)
    rows = [b.row for b in built]
    del built
    growth: dict[str, dict[str, float]] = {}
    for workload in (HEADLINE, "realistic"):
        sized = [r for r in rows if r["workload"] == workload]
        if len(sized) > 1:
            first, last = sized[0], sized[-1]
            growth[workload] = {
                key: round(last[key] / first[key], 2)
                for key in GROWTH_KEYS
                if key in first and key in last
            }
    return {
        "python": sys.version.split()[0],
        "radix_tree": _radix_tree() is not None,
        "native_walk": native_walk(),
        "rows": rows,
        "view_growth_p50": growth.get(HEADLINE, {}).get("view_p50_us"),
        "growth_p50": growth,
    }


def native_walk() -> bool:
    """Whether the view walks in its C extension (``registry/fleet/_holders.c``)."""
    from registry.fleet.matches import NATIVE

    return NATIVE is not None


GROWTH_KEYS = (
    "view_p50_us",
    "radix_p50_us",
    "view_answer_p50_us",
    "radix_answer_p50_us",
    "view_choice_p50_us",
    "radix_choice_p50_us",
)


def format_report(report: dict[str, Any]) -> list[str]:
    lines = [
        "one routing decision, in process, the view beside Dynamo's RadixTree (p50 / p99, µs):",
        "  decision: FleetView.match / RadixTree.find_matches (each its native answer);",
        "  answer: that answer as a dict (.usable / .scores); choice: the node chosen",
        f"{'workload':<34} {'nodes':>6} {'step':>9} {'view':>15} {'RadixTree':>15} {'ratio':>6}",
    ]
    for r in report["rows"]:
        for step in STEPS:
            key = "" if step == "decision" else f"{step}_"
            ours = f"{r[f'view_{key}p50_us']} / {r[f'view_{key}p99_us']}"
            theirs = (
                f"{r[f'radix_{key}p50_us']} / {r[f'radix_{key}p99_us']}"
                if f"radix_{key}p50_us" in r
                else "-"
            )
            lines.append(
                f"{r['workload']:<34} {r['nodes']:>6} {step:>9} {ours:>15} {theirs:>15} "
                f"{r.get(f'ratio_{key}p50', '-')!s:>6}"
            )
        lines.append(
            f"{'':<34} {'':>6} answers and choices equal: {r.get('answers_equal', '-')}; "
            f"view bytes per (node, block): {r['view_bytes_per_pair']}"
        )
    if not report["radix_tree"]:
        lines.append("(Dynamo's RadixTree not installed: pip install ai-dynamo-runtime)")
    if not report.get("native_walk", True):
        lines.append("(the view's C extension is not built: the pure-Python walk was timed)")
    for workload, growth in (report.get("growth_p50") or {}).items():
        lines.append(
            f"p50 growth from the smallest to the largest fleet, {workload}: "
            + ", ".join(f"{k.removesuffix('_p50_us')} {v}x" for k, v in growth.items())
        )
    return lines


# -- against a redis-server: a write seen by a view, a cold start, a write's cost ------------


def measure_redis(url: str, *, quick: bool) -> dict[str, Any]:
    """On the server (or cluster) at ``url`` (flushed): how long an owner's write takes
    to reach a view following it in another process (from the write's call to that view
    holding it); a view's cold start over 256 namespaces x 4,096
    blocks (64 x 1,024 with ``quick``); and what an owner's ``register_kv`` /
    ``evict_kv`` of 32 blocks costs (its change record included)."""
    from registry.transport.client import client_from_url

    client = client_from_url(url)
    client.flushall()
    rng = random.Random(3)  # one sequence through the three, in this order
    out = _write_to_view(client, url, rng, quick)
    out.update(_cold_start(client, url, rng, quick))
    out.update(_owner_write_cost(client, rng, quick))
    client.close()
    return out


def _write_to_view(client: Any, url: str, rng: random.Random, quick: bool) -> dict[str, Any]:
    """From an owner's ``register_kv`` call to a view in another process holding the
    block. Both ends stamp ``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux, one clock
    for every process); the watcher sends back when it saw each write, and the owner
    writes the next one only then, so one write is in flight at a time."""
    import multiprocessing

    from registry import PrefixCacheRegistry

    samples = 100 if quick else 1000
    hashes = [rng.randrange(1, 2**63) for _ in range(samples)]
    owner = PrefixCacheRegistry(client, "writer")
    owner.claim(lease_ttl=600)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    watcher = ctx.Process(target=_watch_writes, args=(url, hashes, theirs), daemon=True)
    watcher.start()

    def heard(wait: float, what: str) -> Any:
        if not ours.poll(wait):
            raise RegistryUnavailable(f"the view in the watching process {what} in {wait:g} s")
        kind, value = ours.recv()
        if kind == "error":
            raise RegistryUnavailable(f"the view in the watching process failed: {value}")
        return value

    try:
        heard(150, "did not load")  # its own start gives up at 120 s, and says why
        seen = []
        for i, h in enumerate(hashes):
            t0 = time.perf_counter()
            owner.register_kv([i], [h])
            seen.append(heard(60, "did not see a write") - t0)
    finally:
        watcher.kill()
        watcher.join()
    return {
        "write_to_view_p50_ms": round(statistics.median(seen) * 1000, 3),
        "write_to_view_p99_ms": round(_p99(seen) * 1000, 3),
    }


def _watch_writes(url: str, hashes: list[int], conn: Any) -> None:
    """In the watching process: follow ``url`` and send the time each hash arrived
    (``("seen", t)``), after ``("ready", None)``, or ``("error", message)``."""
    from registry.transport.client import client_from_url

    try:
        view = FleetView(client_from_url(url)).start(timeout=120)
    except Exception as exc:  # said by the measuring process, in one line
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    blocks = view.blocks
    for h in hashes:
        while h not in blocks:
            time.sleep(0)
        conn.send(("seen", time.perf_counter()))
    view.close()


def _cold_start(client: Any, url: str, rng: random.Random, quick: bool) -> dict[str, Any]:
    """A view's start over namespaces sharing half their chain or more."""
    from registry import PrefixCacheRegistry
    from registry.transport.client import client_from_url

    namespaces, blocks = (64, 1024) if quick else (256, 4096)
    chain = [rng.randrange(1, 2**63) for _ in range(blocks)]
    for n in range(namespaces):
        reg = PrefixCacheRegistry(client, f"cold-{n:04d}")
        reg.claim(lease_ttl=600)
        cut = rng.randint(blocks // 2, blocks)
        own = [rng.randrange(1, 2**63) for _ in range(blocks - cut)]
        reg.register_kv(range(blocks), chain[:cut] + own)
    t0 = time.perf_counter()
    cold = FleetView(client_from_url(url)).start(timeout=120)
    out = {
        "cold_start_s": round(time.perf_counter() - t0, 2),
        "cold_start_fleet": f"{namespaces} x {blocks}",
    }
    cold.close()
    return out


def _owner_write_cost(client: Any, rng: random.Random, quick: bool) -> dict[str, Any]:
    """An owner's ``register_kv`` / ``evict_kv`` of 32 blocks, with and without the
    change record, and their ratios."""
    from registry import PrefixCacheRegistry

    writer = PrefixCacheRegistry(client, "cost")
    writer.claim(lease_ttl=600)
    costs: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for _ in range(4 if quick else 12):  # the two in turn, in blocks (the machine drifts)
        for recorded in (True, False):
            with _change_records(recorded):
                registers, evicts = costs[recorded]
                for _ in range(25 if quick else 50):
                    hashes = [rng.randrange(1, 2**63) for _ in range(32)]
                    t0 = time.perf_counter()
                    writer.register_kv(range(32), hashes)
                    t1 = time.perf_counter()
                    writer.evict_kv(hashes)
                    t2 = time.perf_counter()
                    registers.append(t1 - t0)
                    evicts.append(t2 - t1)
    out: dict[str, Any] = {}
    for recorded, tag in ((True, ""), (False, "_unrecorded")):
        registers, evicts = costs[recorded]
        out[f"register_kv{tag}_us"] = round(statistics.median(registers) * 1e6, 1)
        out[f"evict_kv{tag}_us"] = round(statistics.median(evicts) * 1e6, 1)
    for op in ("register_kv", "evict_kv"):
        out[f"{op}_record_ratio"] = round(out[f"{op}_us"] / out[f"{op}_unrecorded_us"], 3)
    return out


@contextlib.contextmanager
def _change_records(on: bool) -> Iterator[None]:
    """The write scripts as shipped (``on``), or with their change records left out (the
    prelude's ``record_changes`` and ``add_part`` returning at once): what the fleet view
    costs a write, measured side by side. Scripts are sent by their SHA (and a Functions
    library is named by its hash), so the two variants live side by side in Redis; the
    caches of sources, SHAs and the library are cleared at each switch."""
    if on:
        yield
        return
    read = lua.read_script

    def without(name: str) -> str:
        text = read(name)
        if name != lua.PRELUDE:
            return text
        for head in (
            "local function record_changes(meta_key, parts)\n",
            "local function add_part(parts, op, list, from, to, step)\n",
        ):
            assert head in text, head
            text = text.replace(head, head + "  do return end\n", 1)
        return text

    lua.clear_caches()
    lua.read_script = without
    try:
        yield
    finally:
        lua.read_script = read
        lua.clear_caches()


def format_redis(row: dict[str, Any]) -> list[str]:
    return [
        "",
        "against Redis (the write seen by a view in another process):",
        f"  an owner's write seen by a view: p50 {row['write_to_view_p50_ms']} ms, "
        f"p99 {row['write_to_view_p99_ms']} ms",
        f"  a view's cold start over {row['cold_start_fleet']} blocks: {row['cold_start_s']} s",
        f"  an owner's register_kv of 32 blocks: p50 {row['register_kv_us']} µs, "
        f"{row['register_kv_unrecorded_us']} µs without its change record "
        f"({row['register_kv_record_ratio']}x); its evict_kv: p50 {row['evict_kv_us']} µs, "
        f"{row['evict_kv_unrecorded_us']} µs without ({row['evict_kv_record_ratio']}x)",
    ]
