"""Concurrent histories of one namespace on a real server, under faults, checked for
linearizability against the sequential model (``tests/support/linearizability.py``).

Writer threads share the namespace's owner (one registry object per claim, so an
object's epoch never changes under a running call; a writer fenced with
``StaleEpochError`` claims again); reader threads read through registries of their own.
Owners and readers alike are made with the harness's options (``wait_replicas``): an
owner made without them had its writes acknowledged before any replica held them, and
a failover lost one now and then (issue 39).
Faults: the server stopped (SIGSTOP) for less and for more than the clients' read
timeout, a client process of its own killed (SIGKILL) with a write in flight, and an
empty restart of the server. Each fault is held until every client has met it (an
event, not a sleep), and a client that failed waits until the fault is over, so each
fault costs each client at most one call of unknown outcome.

On Sentinel (a primary, its replica, one sentinel), with ``wait_replicas=1``: the primary
stopped past its failover and resumed without a restart (a split brain: it says it is a
master until Sentinel converts it), and calls blocked on the stopped primary across its
kill and an empty restart at its address. Each is also run with redis-py's own Sentinel
client in place of the project's, which must be caught. Without ``wait_replicas`` a write
the old primary acknowledged and had not yet replicated is lost when the replica takes
over: such a history is rightly not linearizable, so the scenarios run with it on (it
confirms the registry's reads too: a read that saw a write the failover then lost is
just as wrong). Each history starts once the primary streams to its replica (``WAIT``
after a write answers 1), not merely once the replica says its link is up.

A deliberately broken owner, whose ``register_kv`` is one HSET per pair, must be
caught: a reader is let in between its HSETs (threading events), so its history is
not linearizable on every run; the same gate around the real, atomic script is the
control.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import redis
import redis.cluster
import redis.sentinel
from redis.backoff import ConstantBackoff
from redis.retry import Retry

from registry import PrefixCacheRegistry
from registry.core.validation import text
from tests.support import REPO_ROOT
from tests.support.backends import new_namespace
from tests.support.histories import (
    HistoryRecorder,
    random_read,
    random_write,
)
from tests.support.linearizability import (
    Call,
    Operation,
    OpName,
    PrefixMatch,
    Status,
    Verdict,
    assert_linearizable,
    check,
    explain,
)
from tests.support.servers import (
    RedisClusterServers,
    RedisServer,
    find_redis_server,
    free_port,
    replicas_streamed,
    require_redis_server,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.redis_server

READ_TIMEOUT = 0.5
"""The clients' socket timeouts: a long stop outlasts it, a short one does not."""
SHORT_STOP_NS = round(READ_TIMEOUT * 1e9 / 10)
"""A short stop lasts at least this long (a tenth of the timeout), and until every
client has a call out; what it costs is recorded, nothing depends on its length."""
PHASE_OPS = 60
"""Operations recorded between two faults (and before the first, after the last)."""
STEP_BUDGET = 200_000
"""Search steps each check may take (a few seconds; the histories here need a few
thousand); running out fails the test."""
DEADLINE = 60.0
"""Seconds any one wait may take: only reached when something is broken."""

Factory = Callable[..., PrefixCacheRegistry]
"""Makes an owner: ``(client, namespace, **options)``, options as ``PrefixCacheRegistry``'s."""


class Harness:
    """The clients of one history: writer threads sharing the owner, reader threads,
    the recorder, and the events that hold clients while a fault lasts."""

    def __init__(
        self,
        server: RedisServer,
        make_owner: Factory = PrefixCacheRegistry,
        *,
        url: str | None = None,
        timeout: float = READ_TIMEOUT,
        options: dict[str, Any] | None = None,
        plain: Callable[[], Any] | None = None,
        plain_roles: frozenset[str] = frozenset(),
    ) -> None:
        self.server = server
        self.url = url or server.url
        self.timeout = timeout
        self.options = options or {}
        self.plain = plain  # a client without the project's checks, for the controls
        self.plain_roles = plain_roles  # "writers", "readers": which use ``plain``
        self.reader_options: dict[str, Any] | None = None  # the readers' own, if any
        # The writers' owners get the options too (``wait_replicas``): a write counts as
        # done only once a failover cannot lose it. A control's plain writers get none.
        self.owner_options = {} if "writers" in plain_roles else dict(self.options)
        self.reader_pause = 0.0  # seconds each reader waits between its reads
        self.namespace = new_namespace()
        self.recorder = HistoryRecorder()
        self.make_owner = make_owner
        self.clears = True  # whether writers clear maps too
        self.healthy = threading.Event()  # cleared while a fault lasts
        self.claims_allowed = threading.Event()  # cleared while another process owns
        self.stop = threading.Event()
        self.healthy.set()
        self.claims_allowed.set()
        self.owner: PrefixCacheRegistry | None = None
        self.claims = 0
        self.troubled: set[str] = set()  # clients that failed since the fault began
        self.fenced: set[str] = set()  # writers waiting to claim again
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._claim_lock = threading.Lock()
        self._registries: list[PrefixCacheRegistry] = []
        self._threads: list[threading.Thread] = []
        self.owner_client = (
            self.plain_client() if "writers" in plain_roles else self.connect().client
        )

    # -- clients ----------------------------------------------------------------------

    def connect(self, options: dict[str, Any] | None = None) -> PrefixCacheRegistry:
        """A registry with a client of its own and short timeouts (from_url's retry),
        with ``options`` (default: the harness's)."""
        registry = PrefixCacheRegistry.from_url(
            self.url,
            self.namespace,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            **(self.options if options is None else options),
        )
        self._registries.append(registry)
        return registry

    def plain_client(self) -> Any:
        """A client of ``plain`` (a negative control's), closed at the end."""
        assert self.plain is not None
        registry = PrefixCacheRegistry(self.plain(), self.namespace)
        self._registries.append(registry)
        return registry.client

    def reclaim(self, process: str, stale: PrefixCacheRegistry | None) -> bool:
        """Claim the namespace with a new owner object, unless another writer already
        replaced ``stale``; False when the claim failed (its object is never used)."""
        with self._lock:
            self.fenced.add(process)
        self.claims_allowed.wait()
        with self._lock:
            self.fenced.discard(process)
        with self._claim_lock:
            if self.owner is not stale or self.stop.is_set():
                return True
            fresh = self.make_owner(self.owner_client, self.namespace, **self.owner_options)
            claimed = self.recorder.run(process, fresh, Call(OpName.CLAIM))
            if claimed is None or claimed.status is not Status.OK:
                return False
            self.owner = fresh
            self.claims += 1
            return True

    def _trouble(self, process: str) -> None:
        """A call failed: note it, and wait until the fault is over."""
        with self._lock:
            self.troubled.add(process)
        self.healthy.wait()

    def _write_loop(self, process: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            owner = self.owner
            if owner is None or owner.epoch is None:
                raise AssertionError("writers start after the first claim")
            op = self.recorder.run(
                process, owner, random_write(rng, owner.epoch, clears=self.clears)
            )
            failed = op is None or op.status is Status.UNKNOWN
            if not failed and op is not None and op.status is Status.STALE:
                failed = not self.reclaim(process, owner)  # fenced: claim again
            if failed:
                self._trouble(process)

    def _reader(self) -> PrefixCacheRegistry:
        """A reader's registry, connected (a cluster client connects when it is made)."""
        if "readers" in self.plain_roles:
            return PrefixCacheRegistry(self.plain_client(), self.namespace)
        return self.connect(self.reader_options)

    def _read_loop(self, process: str, seed: int, registry: PrefixCacheRegistry) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            if self.recorder.run(process, registry, random_read(rng)) is None:
                self._trouble(process)
            if self.reader_pause:
                self.stop.wait(self.reader_pause)

    def spawn(self, process: str, target: Callable[[], None]) -> None:
        """Run ``target`` in a thread whose error stops the history and fails the test."""

        def guarded() -> None:
            try:
                target()
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=guarded, name=process, daemon=True)
        self._threads.append(thread)
        thread.start()

    def start(self, writers: int, readers: int, seed: int) -> None:
        """Claim the namespace, then start the writer and reader threads."""
        # A claim whose WAIT timed out (a busy machine) is recorded as unknown: try again.
        wait_until(lambda: self.reclaim("owner", None), DEADLINE, "the first claim")
        for i in range(writers):
            self.spawn(f"writer-{i}", functools.partial(self._write_loop, f"writer-{i}", seed + i))
        # Readers connect here, before any fault: a cluster client made while the
        # slot's master is stopped fails to start on a busy machine, which is no history.
        made = [self._reader() for _ in range(readers)]
        for i, registry in enumerate(made):
            name = f"reader-{i}"
            self.spawn(name, functools.partial(self._read_loop, name, seed + 100 + i, registry))

    @property
    def clients(self) -> set[str]:
        return {thread.name for thread in self._threads}

    # -- waiting, faults ------------------------------------------------------------------

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        """Wait for ``condition``; a client thread's error ends the wait at once."""
        wait_until(lambda: bool(self.errors) or condition(), DEADLINE, what)
        if self.errors:
            raise self.errors[0]

    def run_on(self, more: int) -> None:
        """Let the clients record ``more`` operations."""
        target = self.recorder.completed() + more
        self.wait(lambda: self.recorder.completed() >= target, f"{target} operations")

    def each_reads(self, more: int) -> None:
        """Let every reader record ``more`` operations."""
        targets = {c: self.recorder.completed(c) + more for c in self.clients if "reader" in c}
        self.wait(
            lambda: all(self.recorder.completed(c) >= n for c, n in targets.items()),
            f"{more} operations of every reader",
        )

    @contextlib.contextmanager
    def fault(self) -> Iterator[None]:
        """While the block runs, a client that fails waits instead of retrying."""
        with self._lock:
            self.troubled.clear()
        self.healthy.clear()
        try:
            yield
        finally:
            self.healthy.set()

    def all_troubled(self) -> bool:
        with self._lock:
            return self.troubled >= self.clients

    def troubled_set(self) -> set[str]:
        """The clients that failed since the fault began."""
        with self._lock:
            return set(self.troubled)

    def all_waiting(self) -> bool:
        """Whether every client has a call out right now."""
        return {f.process for f in self.recorder.in_flight()} >= self.clients

    def failures(self) -> int:
        """Calls so far that failed: unknown outcomes and dropped calls."""
        return self.recorder.completed(status=Status.UNKNOWN) + self.recorder.dropped

    @contextlib.contextmanager
    def stopped(self) -> Iterator[int]:
        """The server SIGSTOPped for the block (always resumed). Yields a time by which it
        had stopped: a call sent after it cannot be answered before it resumes."""
        process = self.server.process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: process_state(process.pid) == "T", DEADLINE, "server stopped")
            yield time.monotonic_ns()
        finally:
            if process.poll() is None:  # not killed inside the block
                os.kill(process.pid, signal.SIGCONT)

    def finish(self) -> list[Operation]:
        """Stop every client thread, close every client; the history recorded."""
        self.stop.set()
        self.healthy.set()
        self.claims_allowed.set()
        for thread in self._threads:
            thread.join(DEADLINE)
        alive = [thread.name for thread in self._threads if thread.is_alive()]
        for registry in self._registries:
            registry.client.close()
        assert not alive, f"client threads did not stop: {alive}"
        if self.errors:
            raise self.errors[0]
        return self.recorder.history()


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc`` ("T": stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


@pytest.fixture
def harness(own_server: RedisServer) -> Iterator[Harness]:
    """A harness on a server of this test's own; every thread stopped at the end."""
    made = Harness(own_server)
    try:
        yield made
    finally:
        if own_server.process is not None and own_server.running:
            os.kill(own_server.process.pid, signal.SIGCONT)
        with contextlib.suppress(BaseException):
            made.finish()


# -- what a history saw -------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """Counts of one history, for the assertions and the log."""

    operations: int
    ok: int
    unknown: int
    stale: int
    claims: int
    restarts: int
    dropped: int
    processes: int

    @classmethod
    def of(cls, history: list[Operation], recorder: HistoryRecorder) -> Summary:
        statuses = [op.status for op in history]
        names = [op.call.name for op in history]
        return cls(
            operations=len(history),
            ok=statuses.count(Status.OK),
            unknown=statuses.count(Status.UNKNOWN),
            stale=statuses.count(Status.STALE),
            claims=names.count(OpName.CLAIM),
            restarts=names.count(OpName.RESTART),
            dropped=recorder.dropped,
            processes=len({op.process for op in history}),
        )


def checked(history: list[Operation], recorder: HistoryRecorder, what: str) -> Summary:
    """Check ``history`` (failing on a violation or an exhausted budget) and log it."""
    started = time.monotonic()
    result = assert_linearizable(history, budget=STEP_BUDGET)
    summary = Summary.of(history, recorder)
    took = time.monotonic() - started
    print(f"{what}: {summary}; linearizable in {result.steps} steps, {took:.2f} s")
    return summary


# -- (a) the server stopped, shorter and longer than the read timeout ---------------------


def test_histories_across_a_short_and_a_long_sigstop_are_linearizable(harness: Harness) -> None:
    """A short stop lasts a tenth of the timeout and until every client has a call out
    (those calls only take longer; on a stalled machine one may time out, which is
    recorded like any other); a long stop lasts until every client timed out: each writer leaves
    one write of unknown outcome, run or not once the server resumes."""
    harness.start(writers=3, readers=2, seed=10)
    harness.run_on(PHASE_OPS)
    failed = harness.failures()
    with harness.stopped() as since:
        harness.wait(
            lambda: harness.all_waiting() and time.monotonic_ns() - since >= SHORT_STOP_NS,
            "every client held by the stopped server",
        )
    held_ms = (time.monotonic_ns() - since) / 1e6
    print(f"short stop: {held_ms:.1f} ms, {harness.failures() - failed} calls failed")
    harness.run_on(PHASE_OPS)
    with harness.fault(), harness.stopped():
        harness.wait(harness.all_troubled, "every client timed out")
    harness.run_on(PHASE_OPS)
    summary = checked(harness.finish(), harness.recorder, "SIGSTOP short and long")
    assert summary.unknown >= 3  # every writer's timed-out write
    assert summary.dropped >= 2  # every reader's timed-out read


# -- (b) a client process killed with a write in flight -----------------------------------


@dataclass
class Child:
    """A client process of its own (``child_main``), its events fed to the recorder."""

    process: subprocess.Popen[str]
    ready: threading.Event
    reader: threading.Thread | None = None
    name: str = "child"

    def go(self) -> None:
        """Let it claim the namespace and start writing."""
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        """SIGKILL it, reap it, and take its last events (its stdout ends)."""
        self.process.kill()
        self.process.wait(DEADLINE)
        if self.reader is not None:
            self.reader.join(DEADLINE)


@contextlib.contextmanager
def child_client(harness: Harness, seed: int, log: Path) -> Iterator[Child]:
    """Start a child process (it waits for ``go`` to claim the namespace and write until
    killed); on leaving, it is dead and its calls still out are recorded as unknown
    (writes) or dropped (reads)."""
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.histories", harness.server.url,
             harness.namespace, str(seed), "--timeout", str(READ_TIMEOUT)],
            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True,
        )  # fmt: skip
    assert process.stdout is not None
    child = Child(process, threading.Event())
    child.reader = threading.Thread(
        target=absorb_lines, args=(process.stdout, harness.recorder, child.ready), daemon=True
    )
    child.reader.start()
    try:
        yield child
    finally:
        if process.poll() is None:
            child.kill()
        child.reader.join(DEADLINE)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        harness.recorder.abandon(child.name)


def absorb_lines(stdout: IO[str], recorder: HistoryRecorder, ready: threading.Event) -> None:
    """Feed a child's JSON lines to the recorder until its stdout ends."""
    for line in stdout:
        if not line.endswith("\n"):
            continue  # a line cut off by the kill is no event
        event = json.loads(line)
        if event["event"] == "ready":
            ready.set()
        else:
            recorder.absorb(event)


def test_a_client_process_killed_mid_write_leaves_a_linearizable_history(
    harness: Harness, tmp_path: Path
) -> None:
    """A second owner process takes the namespace over (the first owner's writers are
    fenced and wait), writes, and is killed while the server is stopped with a write it
    sent after the stop: unknown, then run or dropped when the server resumes. The
    first owner's writers claim the namespace back."""
    with child_client(harness, seed=29, log=tmp_path / "child.err") as child:
        harness.wait(child.ready.is_set, "the child process started")
        harness.start(writers=2, readers=2, seed=20)
        harness.run_on(PHASE_OPS)
        harness.claims_allowed.clear()
        child.go()
        harness.wait(
            lambda: (
                harness.recorder.completed(child.name) >= 40
                and harness.fenced >= {"writer-0", "writer-1"}
            ),
            "the child writing and every writer fenced",
        )
        with harness.fault(), harness.stopped() as since:
            # A write sent after the stop cannot be answered: the child's last write is of
            # unknown outcome, in flight at the kill (or timed out just before it).
            harness.wait(
                lambda: any(
                    f.process == child.name and f.invoked_ns >= since
                    for f in harness.recorder.in_flight()
                ),
                "a write of the child's held by the stopped server",
            )
            child.kill()
    harness.claims_allowed.set()
    harness.run_on(PHASE_OPS)
    history = harness.finish()
    summary = checked(history, harness.recorder, "client process killed")
    by_child = [op for op in history if op.process == "child"]
    assert by_child[0].call.name is OpName.CLAIM
    assert by_child[0].status is Status.OK
    assert by_child[-1].status is Status.UNKNOWN
    assert by_child[-1].invoked_ns >= since  # sent to the stopped server: never answered
    assert summary.stale >= 2  # both writers were fenced by the child's claim
    assert summary.claims >= 3  # the first owner, the child, the first owner again


# -- (c) an empty restart of the server ---------------------------------------------------


def test_a_history_across_an_empty_restart_is_linearizable_with_the_restart_in_it(
    harness: Harness,
) -> None:
    """The server is killed and a fresh, empty one started on the same port: the
    restart is an operation of the history; the owner's writes after it are fenced
    until a writer claims again."""
    harness.start(writers=3, readers=2, seed=30)
    harness.run_on(PHASE_OPS)
    with harness.fault(), harness.recorder.span("harness", Call(OpName.RESTART)):
        harness.server.kill()
        harness.wait(harness.all_troubled, "every client refused")
        harness.server.restart()
    harness.wait(lambda: harness.claims >= 2, "a claim on the new server")
    harness.run_on(PHASE_OPS)
    summary = checked(harness.finish(), harness.recorder, "empty restart")
    assert summary.restarts == 1
    assert summary.stale >= 1  # the old epoch was refused by the new server
    assert summary.claims >= 2


# -- a broken client must be caught -------------------------------------------------------

GATED = (201, 202)
"""Hashes only the gated write registers (no other operation touches them)."""
GATED_IDS = (901, 902)


@dataclass
class Gate:
    """Lets one reader in while the gated write is half done (or, atomic, under way)."""

    half: threading.Event
    looked: threading.Event

    def hold(self) -> None:
        self.half.set()
        if not self.looked.wait(DEADLINE):
            raise AssertionError("the gated reader never looked")


class SplitRegisterRegistry(PrefixCacheRegistry):
    """A broken owner: ``register_kv`` as one HSET per pair, yielding between them (not
    atomic, and not fenced); the gated write waits between its first two HSETs."""

    gate: Gate

    def _register_kv(self, entries: dict[int, int]) -> None:
        for i, (h, block_id) in enumerate(entries.items()):
            if i == 1 and GATED[0] in entries:
                self.gate.hold()
            elif i:
                time.sleep(0)  # a yield: other threads may see half a write
            self.client.hset(self.keys.kv, str(h), str(block_id))


class GatedAtomicRegistry(PrefixCacheRegistry):
    """The control: the real, atomic ``register_kv``; the gated write waits just before
    its one script runs."""

    gate: Gate

    def _register_kv(self, entries: dict[int, int]) -> None:
        if GATED[0] in entries:
            self.gate.hold()
        super()._register_kv(entries)


@pytest.mark.parametrize(
    ("owner_class", "verdict"),
    [
        pytest.param(SplitRegisterRegistry, Verdict.NOT_LINEARIZABLE, id="split-hsets"),
        pytest.param(GatedAtomicRegistry, Verdict.LINEARIZABLE, id="atomic-control"),
    ],
)
def test_a_register_kv_done_as_separate_hsets_is_caught(
    harness: Harness, owner_class: type[PrefixCacheRegistry], verdict: Verdict
) -> None:
    """Background writers and a reader run; one write of two dedicated hashes stops at
    its gate, a reader reads them and lets it go on. Split into HSETs, the reader sees
    the first hash only, which no order explains; atomic, it sees neither."""
    gate = Gate(threading.Event(), threading.Event())

    def make_owner(client: Any, namespace: str, **options: Any) -> PrefixCacheRegistry:
        owner = owner_class(client, namespace, **options)
        owner.gate = gate  # type: ignore[attr-defined]
        return owner

    def write() -> None:
        owner = harness.owner
        assert owner is not None
        call = Call(OpName.REGISTER_KV, GATED, GATED_IDS, epoch=owner.epoch)
        harness.recorder.run("gated-writer", owner, call)

    def read() -> None:
        if not gate.half.wait(DEADLINE):
            raise AssertionError("the gated write never reached its gate")
        reader = harness.connect()
        harness.recorder.run("gated-reader", reader, Call(OpName.MATCH_KV_PREFIX, GATED))
        gate.looked.set()

    harness.make_owner = make_owner
    harness.clears = False  # a clear between the HSETs would hide the half-written state
    harness.start(writers=2, readers=1, seed=40)
    harness.run_on(PHASE_OPS // 2)
    harness.spawn("gated-reader", read)
    harness.spawn("gated-writer", write)
    harness.wait(gate.looked.is_set, "the gated read")
    harness.run_on(PHASE_OPS // 2)
    history = harness.finish()
    seen = next(op for op in history if op.process == "gated-reader")
    half = PrefixMatch(GATED_IDS[:1], GATED[0])
    assert seen.value == (half if verdict is Verdict.NOT_LINEARIZABLE else PrefixMatch((), 0))
    result = check(history, budget=STEP_BUDGET)
    print(f"{owner_class.__name__}: {len(history)} operations, {result.verdict.value}")
    if result.verdict is not Verdict.LINEARIZABLE:
        print(explain(history, result))
    assert result.verdict is verdict, explain(history, result)
    # Without clears, only the gated pair touches its hashes: its own history (after the
    # first claim) is judged alike, and a rejection names the gated read.
    pair = [op for op in history if op.process in ("owner", "gated-writer", "gated-reader")]
    alone = check(pair, budget=STEP_BUDGET)
    assert alone.verdict is verdict, explain(pair, alone)
    if verdict is Verdict.NOT_LINEARIZABLE:
        assert "cannot place #2: " in explain(pair, alone)
        assert "gated-reader: match_kv_prefix(hashes=[201, 202])" in explain(pair, alone)


# -- Sentinel and Cluster failovers -------------------------------------------------------

WAIT_TIMEOUT = 0.2
"""``wait_timeout`` of the clients with ``wait_replicas=1`` (under ``READ_TIMEOUT``)."""
DURABLE = {"wait_replicas": 1, "wait_timeout": WAIT_TIMEOUT}
SENTINEL_TRIES = 3
"""Starts of the sentinel before giving up: its port can be taken between choosing and
binding it by another worker's server."""
BLOCKED_TIMEOUT = 20.0
"""Socket timeouts of the clients whose calls must still be blocked on a stopped server
when it is killed: longer than any failover here takes."""


class SentinelSet:
    """A primary, its replica and one Sentinel watching them as ``mymaster`` (quorum 1,
    ``down-after-milliseconds`` 500), each stopped by PID at the end."""

    def __init__(self) -> None:
        self.primary = RedisServer(["--repl-diskless-sync-delay", "0"])
        self.replica: RedisServer | None = None
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.directory = Path(tempfile.mkdtemp(prefix="pcr-lin-sentinel-"))
        self.port = 0  # chosen when it starts

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/mymaster"

    def __enter__(self) -> SentinelSet:
        try:
            return self._start()
        except BaseException:
            self.__exit__()  # what started stops: no server left running past the test
            raise

    def _start(self) -> SentinelSet:
        binary = find_redis_server()
        assert binary is not None
        self.primary.start()
        self.replica = RedisServer(["--replicaof", "127.0.0.1", str(self.primary.port)]).start()
        wait_until(lambda: self.link_up(self.replica), DEADLINE, "replica linked")
        # The replica's side says "up" once it loaded the RDB; the primary streams to it
        # only once its RDB child ended and it heard the replica's first ACK, seconds
        # later on a busy machine. A history started before then has its writes
        # unconfirmed and lost with the failover, though its readers saw them.
        wait_until(lambda: replicas_streamed(self.primary) >= 1, DEADLINE, "replica online")
        for _ in range(SENTINEL_TRIES):  # a port taken meanwhile: another one
            self.port = free_port()
            (self.directory / "sentinel.conf").write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor mymaster 127.0.0.1 {self.primary.port} 1\n"
                "sentinel down-after-milliseconds mymaster 500\n"
                "sentinel failover-timeout mymaster 2000\n"
            )
            self.sentinel = subprocess.Popen(
                [binary, str(self.directory / "sentinel.conf"), "--sentinel"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            wait_until(self._sentinel_up_or_gone, DEADLINE, "sentinel up")
            if self.sentinel.poll() is None:
                return self
            self.sentinel.wait(DEADLINE)
        raise AssertionError(f"the sentinel exited at its start {SENTINEL_TRIES} times")

    def _sentinel_up_or_gone(self) -> bool:
        """The sentinel answers as a sentinel (not another server that took its port),
        or it exited (its port taken)."""
        assert self.sentinel is not None
        return self.sentinel.poll() is not None or self.ask("SENTINEL", "MYID") is not None

    def __exit__(self, *_exc: object) -> None:
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait(DEADLINE)
        for server in (self.primary, self.replica):
            if server is not None and server.process is not None and server.running:
                os.kill(server.process.pid, signal.SIGCONT)
                server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def ask(self, *command: str) -> Any:
        """The sentinel's answer, or None when it does not answer."""
        client = redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)
        try:
            return client.execute_command(*command)
        except redis.RedisError:
            return None
        finally:
            client.close()

    def flags(self) -> set[str]:
        state = self.ask("SENTINEL MASTER", "mymaster")
        if not isinstance(state, dict):
            return set()
        flags = state.get("flags", "")
        return set(flags.split(",")) if isinstance(flags, str) else set(flags)

    def named_port(self) -> int | None:
        address = self.ask("SENTINEL GET-MASTER-ADDR-BY-NAME", "mymaster")
        return int(address[1]) if address else None

    def promoted(self) -> bool:
        """The replica is the master the sentinel names, says so, and the failover is
        over (no flag of one left)."""
        assert self.replica is not None
        return (
            self.named_port() == self.replica.port
            and role(self.replica) == "master"
            and not self.flags() & {"o_down", "failover_in_progress"}
        )

    @staticmethod
    def link_up(server: RedisServer | None) -> bool:
        assert server is not None
        client = server.client(socket_timeout=5)
        try:
            return bool(client.info("replication").get("master_link_status") == "up")
        except redis.RedisError:
            return False
        finally:
            client.close()

    def plain_master(self, timeout: float) -> Any:
        """redis-py's own Sentinel client: ``SENTINEL MASTERS`` discovery, no role check,
        its retry reconnecting to the old address (the negative control)."""
        sentinel = redis.sentinel.Sentinel([("127.0.0.1", self.port)], socket_timeout=5)
        retry = Retry(ConstantBackoff(0.05), 40)  # retries for about two seconds
        return sentinel.master_for(
            "mymaster", socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry
        )


SENTINEL_COMMANDS = frozenset(
    {"hello", "info", "ping", "publish", "subscribe", "role", "client", "config", "replicaof",
     "slaveof", "multi", "exec", "command", "auth", "select"}
)  # fmt: skip
"""What Sentinel and a client's handshake send a server: none of them reads or writes data."""


def data_calls(server: RedisServer) -> int:
    """Calls of commands other than ``SENTINEL_COMMANDS`` the server has answered: reads
    and writes of the registry's data."""
    client = server.client(socket_timeout=5)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(
        int(entry["calls"])
        for name, entry in stats.items()
        if name.removeprefix("cmdstat_").split("|")[0] not in SENTINEL_COMMANDS
    )


def role(server: RedisServer) -> str | None:
    """What ``ROLE`` says the server is, or None when it does not answer."""
    client = server.client(socket_timeout=5)
    try:
        return str(text(client.execute_command("ROLE")[0]))
    except redis.RedisError:
        return None
    finally:
        client.close()


@contextlib.contextmanager
def sentinel_harness(
    plain_roles: frozenset[str] = frozenset(), timeout: float = READ_TIMEOUT
) -> Iterator[tuple[SentinelSet, Harness]]:
    """A Sentinel set and a harness of durable clients on it (``plain_roles`` use redis-py's
    own Sentinel client instead); every thread and server stopped at the end."""
    require_redis_server()
    with SentinelSet() as servers:
        made = Harness(
            servers.primary,
            url=servers.url,
            timeout=timeout,
            options=DURABLE,
            plain=lambda: servers.plain_master(BLOCKED_TIMEOUT),
            plain_roles=plain_roles,
        )
        if "writers" in plain_roles:
            # The control's readers read the current primary only (the project's Sentinel
            # checks) but unconfirmed: confirmed reads wait for the new master's first
            # replica, which is the old primary only once Sentinel converted it, seconds
            # after the history has ended. What they must see is the plain writers' loss.
            made.reader_options = {}
        try:
            yield servers, made
        finally:
            for server in (servers.primary, servers.replica):
                if server is not None and server.process is not None and server.running:
                    os.kill(server.process.pid, signal.SIGCONT)
            with contextlib.suppress(BaseException):
                made.finish()


def judged(harness: Harness, what: str, controls: frozenset[str]) -> None:
    """Check the history: linearizable with the project's clients; with a control's
    plain clients, caught (not linearizable)."""
    history = harness.finish()
    if not controls:
        checked(history, harness.recorder, what)
        return
    result = check(history, budget=STEP_BUDGET)
    print(f"{what} with plain {sorted(controls)}: {len(history)} operations, "
          f"{result.verdict.value}")  # fmt: skip
    assert result.verdict is Verdict.NOT_LINEARIZABLE, explain(history, result)


PLAIN_WRITERS = frozenset({"writers"})
PLAIN_READERS = frozenset({"readers"})


@pytest.mark.parametrize(
    "controls",
    [
        pytest.param(frozenset(), id="project"),
        pytest.param(PLAIN_WRITERS, id="plain"),
    ],
)
def test_a_sentinel_split_brain_is_linearizable_with_wait_replicas(
    controls: frozenset[str],
) -> None:
    """The primary is stopped (SIGSTOP) past its failover: Sentinel promotes the replica
    while every client meets the stall; then the old primary resumes without a restart
    and says it is a master (until Sentinel converts it, seconds later) while the clients
    carry on. The project's clients (``wait_replicas=1``) never use it and lose no
    acknowledged write. The control's writers (redis-py's own Sentinel client, long
    timeouts, no WAIT) stay blocked on the stopped primary, then write to the resumed old
    primary and are acknowledged: caught."""
    with sentinel_harness(controls) as (servers, harness):
        harness.clears = False
        harness.start(writers=3, readers=2, seed=50)
        harness.run_on(PHASE_OPS)
        ours = {c for c in harness.clients if not c.startswith("writer") or not controls}
        with harness.fault(), harness.stopped():
            harness.wait(servers.promoted, "the replica promoted")
            harness.wait(
                lambda: ours <= harness.troubled_set(), "every project client met the stall"
            )
        harness.run_on(PHASE_OPS // 2)
        old_role = role(servers.primary)
        harness.run_on(PHASE_OPS // 2)
        print(f"old primary after the resume: {old_role}")
        judged(harness, "Sentinel split brain", controls)


@pytest.mark.parametrize(
    "controls", [pytest.param(frozenset(), id="project"), pytest.param(PLAIN_READERS, id="plain")]
)
def test_reads_blocked_across_a_kill_and_an_empty_restart_never_answer_empty(
    controls: frozenset[str],
) -> None:
    """Every client has a call blocked on the stopped primary; once Sentinel sees it down,
    it is killed and an empty server started at its address (a master, until Sentinel
    converts it). The blocked calls fail (their retry asks the sentinels, which name no
    master during the failover): none answers the empty server's nothing. The control's
    readers (redis-py's own Sentinel client) retry to the old address and read nothing."""
    with sentinel_harness(controls, BLOCKED_TIMEOUT) as (servers, harness):
        harness.clears = False
        harness.start(writers=2, readers=3, seed=60)
        harness.run_on(PHASE_OPS)
        port = servers.primary.port
        with harness.fault():
            with harness.stopped():
                harness.wait(harness.all_waiting, "every client blocked on the stopped primary")
                killed = time.monotonic_ns()
                # A failover under way, not just o_down: before it starts, an empty server
                # answering at the old address clears o_down, and Sentinel keeps naming it
                # (an empty restart, data lost for everyone, replica included).
                harness.wait(
                    lambda: "failover_in_progress" in servers.flags() or servers.promoted(),
                    "the failover under way",
                )
                servers.primary.kill()
            with RedisServer(port=port) as empty:
                harness.wait(
                    lambda: all(f.invoked_ns > killed for f in harness.recorder.in_flight()),
                    "every blocked call back",
                )
                harness.wait(servers.promoted, "the replica promoted")
                harness.healthy.set()
                harness.run_on(PHASE_OPS)
                print(f"the empty server at the old address: {role(empty)}")
                served = data_calls(empty)
        if controls and not served:
            # The control's readers retried only after Sentinel named the promoted
            # replica (a busy machine's timing): nothing reached the empty server, so
            # there is nothing for the checker to catch in this history.
            judged(harness, "reads blocked across a kill and an empty restart", frozenset())
            pytest.skip("the plain readers never reached the empty server in this run")
        judged(harness, "reads blocked across a kill and an empty restart", controls)


DEBUG_DIR = os.environ.get("PCR_LIN_DEBUG")
"""A folder where a failed Cluster failover history leaves its history, the round trips
of every client (which node answered what) and the nodes' state; unset: nothing kept."""


class WireTrace:
    """Every confirmed round trip (``_on_connection``) of this process, with the node it
    went to, its commands and replies, and its times: for ``DEBUG_DIR`` only."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self.marks: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def mark(self, what: str) -> None:
        with self._lock:
            self.marks.append((time.monotonic_ns(), what))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import registry.transport.scripts as scripts

        original = scripts._on_connection

        def traced(pool: Any, commands: Any) -> list[Any]:
            kwargs = getattr(pool, "connection_kwargs", {})
            node = f"{kwargs.get('host')}:{kwargs.get('port')}"
            names = [str(c[0]) + (f" {c[1]}" if c[0] != "EVALSHA" else "") for c in commands]
            started = time.monotonic_ns()
            try:
                replies = original(pool, commands)
            except BaseException as exc:
                line = f"{threading.current_thread().name} {node} {names} raised {exc!r}"
                with self._lock:
                    self.lines.append((started, f"{line} [{time.monotonic_ns() - started} ns]"))
                raise
            line = f"{threading.current_thread().name} {node} {names} -> {replies!r}"
            with self._lock:
                self.lines.append((started, f"{line} [{time.monotonic_ns() - started} ns]"))
            return replies

        scripts._on_connection = traced
        try:
            yield
        finally:
            scripts._on_connection = original

    def dump(self, folder: Path, origin: int, history: list[Operation], nodes: list[Any]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        events = sorted(self.lines + [(t, f"=== {m}") for t, m in self.marks])
        (folder / "wire.txt").write_text(
            "".join(f"{(t - origin) / 1e6:.3f} {line}\n" for t, line in events)
        )
        (folder / "history.txt").write_text("".join(op.describe(origin) + "\n" for op in history))
        states = []
        for node in nodes:
            client = node.client(socket_timeout=5)
            try:
                client.execute_command("READONLY")
                states.append(f"--- {node.port}: {client.execute_command('CLUSTER NODES')}")
                states.append(repr(client.info("replication")))
                for key in client.keys("*"):
                    kind = client.type(key)
                    value = client.hgetall(key) if kind in (b"hash", "hash") else kind
                    states.append(f"  {key!r}: {value!r}")
            except redis.RedisError as exc:
                states.append(f"--- {node.port}: {exc!r}")
            finally:
                client.close()
        (folder / "nodes.txt").write_text("\n".join(states) + "\n")


@pytest.mark.cluster
@pytest.mark.parametrize(
    "controls",
    [pytest.param(frozenset(), id="project"), pytest.param(PLAIN_READERS, id="stale-reader")],
)
def test_a_cluster_failover_with_replicas_is_linearizable_with_wait_replicas(
    controls: frozenset[str],
) -> None:
    """The master holding the namespace's slot (a 3-master cluster, one replica each) is
    stopped past the cluster's failover: its replica is elected while every client meets
    the stall; then the old master resumes, says it is a master until it hears of the
    newer epoch, and rejoins as a replica. With ``wait_replicas=1`` no acknowledged write
    is lost and no call is answered by the old master. The control's readers read a copy
    that followed the slot's master and stopped following before the fault (a replica
    lagging for good): caught."""
    require_redis_server()
    with (
        RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000) as cluster,
        contextlib.ExitStack() as stack,
    ):
        first = cluster.nodes[0]
        copies: list[RedisServer] = []
        harness = Harness(
            first,
            url=f"redis+cluster://{first.host}:{first.port}",
            options=DURABLE,
            plain=lambda: copies[0].client(socket_timeout=BLOCKED_TIMEOUT),
            plain_roles=controls,
        )
        probe = cluster.client()
        try:
            slot_master = probe.get_node_from_key(
                PrefixCacheRegistry(probe, harness.namespace).keys.kv
            )
            replication = probe.get_redis_connection(slot_master).info("replication")
            replica_port = int(replication["slave0"]["port"])
            harness.server = next(n for n in cluster.nodes if n.port == slot_master.port)
            replica = next(n for n in cluster.nodes if n.port == replica_port)
            if controls:
                # A copy never stalls: its readers pause between reads (outside the
                # recorded calls), so the history stays as short as the others.
                harness.reader_pause = 0.02
                copy = RedisServer(["--replicaof", slot_master.host, str(slot_master.port)])
                copies.append(stack.enter_context(copy))
                wait_until(lambda: SentinelSet.link_up(copy), DEADLINE, "the copy linked")
            probe_key = f"linearizability-probe:{{{harness.namespace}}}"
            wait_until(
                lambda: replicas_streamed(harness.server, probe_key) >= 1,
                DEADLINE,
                "replica online",
            )
            harness.clears = False
            trace = WireTrace()
            if DEBUG_DIR:
                stack.enter_context(trace.installed())
            harness.start(writers=3, readers=2, seed=70)
            harness.run_on(PHASE_OPS)
            for copy in copies:  # it stops following: from now on it lags for good
                copy.client().execute_command("REPLICAOF", "NO", "ONE")
            # Reads while confirmed writes go on: what catches the control (after the
            # fault no write is confirmed until the old master follows the new one).
            harness.each_reads(5)
            ours = {c for c in harness.clients if not c.startswith("reader") or not controls}
            with harness.fault(), harness.stopped():
                trace.mark(f"stopped {harness.server.port}")
                harness.wait(lambda: role(replica) == "master", "the replica elected")
                trace.mark(f"elected {replica.port}")
                harness.wait(lambda: ours <= harness.troubled_set(), "every client met the stall")
            trace.mark(f"resumed {harness.server.port}")
            # Until the new master streams to the old one, no call can be confirmed: a
            # client that fails meanwhile (its first call after the resume, to either
            # master) waits, so each writer leaves one unknown write here, not one per
            # WAIT timeout (each widens the checker's search).
            with harness.fault():
                harness.wait(lambda: role(harness.server) == "slave", "the old master a replica")
                harness.wait(
                    lambda: replicas_streamed(replica, probe_key) >= 1, "the new master streaming"
                )
            trace.mark(f"the old master {harness.server.port} a replica")
            harness.run_on(PHASE_OPS)
            try:
                judged(harness, "Cluster failover", controls)
            except AssertionError:
                if DEBUG_DIR:
                    history = harness.recorder.history()
                    origin = min(op.invoked_ns for op in history)
                    folder = Path(tempfile.mkdtemp(prefix="cluster-", dir=DEBUG_DIR))
                    trace.dump(folder, origin, history, cluster.nodes)
                    print(f"debug dump in {folder}")
                raise
        finally:
            probe.close()
            if harness.server.process is not None and harness.server.running:
                os.kill(harness.server.process.pid, signal.SIGCONT)
            with contextlib.suppress(BaseException):
                harness.finish()
