"""``pcr serve`` as a process of its own on a free port, for the tests that need the real
command (its HTTP layer, its signals, its exit); stopped in ``stop()`` by PID.

``start()`` waits for the service's own readiness line (``pcr serve: ready on URL``,
printed once it accepts connections) or for its exit, which fails at once with what it
printed: no fixed poll that a slow start on a busy machine outlasts."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import IO

import httpx

from registry import PrefixCacheRegistry
from registry.fleet.view import STALE_S
from tests.support import REPO_ROOT
from tests.support.servers import free_port
from tests.support.waiting import wait_until

START_DEADLINE = 600.0
"""Seconds a start may take before the test gives up: only a guard against a service that
hangs without exiting (the per-test timeout usually ends such a test first)."""


class PortTaken(AssertionError):
    """The service could not bind its port: another process took it first."""


class ServeProcess:
    """``python -m pcr serve --port <free> ARGS`` (or ``pcr gateway`` with
    ``command="gateway"``); ``start()`` waits until it says it is ready, then until
    ``path`` answers 200 (``path=None``: ready is enough)."""

    def __init__(self, *args: str, path: str | None = "/live", command: str = "serve") -> None:
        self.command = command
        self.port = free_port()
        self.args = [*args, "--port", str(self.port)]
        self.path = path
        self.process: subprocess.Popen[str] | None = None
        self.out = self.err = ""
        self._lines: dict[str, list[str]] = {"out": [], "err": []}
        self._readers: list[threading.Thread] = []
        self._ready = threading.Event()  # the readiness line came, or stdout ended

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ready_line(self) -> str:
        return f"pcr {self.command}: ready on {self.base}"

    def start(self, tries: int = 3) -> ServeProcess:
        """Start it and wait until it is ready. A port that another process took between
        ``free_port`` and the service's bind (``Address already in use``: parallel test
        workers pick ports at the same time) is not the service's fault: it starts again
        on a fresh port, up to ``tries`` times."""
        for attempt in range(tries):
            try:
                return self._start()
            except PortTaken:
                if attempt == tries - 1:
                    raise
                self.port = free_port()
                self.args = [*self.args[:-2], "--port", str(self.port)]
                self.out = self.err = ""
                self._lines = {"out": [], "err": []}
                self._readers = []
                self._ready = threading.Event()
        raise AssertionError("unreachable")

    def _start(self) -> ServeProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pcr", self.command, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        self._read(self.process.stdout, "out", self.ready_line)
        self._read(self.process.stderr, "err", None)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _read(self, pipe: IO[str], name: str, ready: str | None) -> None:
        """Collect ``pipe``'s lines in a thread (a full pipe would block the service);
        ``ready``: set ``_ready`` when that line comes, and when the pipe ends."""

        def run() -> None:
            try:
                for line in pipe:
                    self._lines[name].append(line)
                    if ready is not None and line.rstrip("\n") == ready:
                        self._ready.set()
            finally:
                pipe.close()
                if ready is not None:
                    self._ready.set()

        reader = threading.Thread(target=run, name=f"pcr-{self.command}-{name}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def _wait_ready(self) -> None:
        process = self.process
        assert process is not None
        if not self._ready.wait(START_DEADLINE):
            raise AssertionError(f"pcr {self.command} did not start in {START_DEADLINE:g} s")
        if self.ready_line + "\n" not in self._lines["out"]:  # stdout ended: it exited
            code = process.wait(30)
            self._collect()
            if f"cannot listen on 127.0.0.1:{self.port}: Address already in use" in self.err:
                raise PortTaken(self.err)
            raise AssertionError(f"pcr {self.command} exited ({code}) before ready:\n{self.err}")
        if self.path is None:
            return

        def answers() -> bool:
            if process.poll() is not None:
                self._collect()
                raise AssertionError(f"pcr {self.command} exited:\n{self.err}")
            try:
                return httpx.get(f"{self.base}{self.path}", timeout=30).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, timeout=60, what=f"pcr {self.command} to answer 200 on {self.path}")

    def _collect(self) -> None:
        for reader in self._readers:
            reader.join(30)
        self.out = "".join(self._lines["out"])
        self.err = "".join(self._lines["err"])

    def stop(self) -> int:
        """SIGTERM, then its exit code (its output in ``out`` and ``err``)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self._collect()
        return self.process.returncode


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples ``name`` with ``labels`` that the service at
    ``base`` exports on ``/metrics``."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.split("{")[0].split(" ")[0] == name and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def view_caught_up(base: str, registries: Iterable[PrefixCacheRegistry]) -> bool:
    """Whether the fleet view of the gateway at ``base`` is fresh, well inside
    ``STALE_S`` (``pcr_gateway_view_age_seconds``), and holds as many KV and Mamba
    entries of each of ``registries``' namespaces as Redis does
    (``pcr_gateway_view_entries``): its view follows the change records and may lag the
    last writes by the time a record takes to arrive and be applied."""
    if not metric(base, "pcr_gateway_view_age_seconds") < STALE_S / 2:
        return False
    for registry in registries:
        info = registry.info()
        for kind, count in (("kv", info.kv_entries), ("mamba", info.mamba_entries)):
            name = "pcr_gateway_view_entries"
            if metric(base, name, backend=registry.namespace, map=kind) != count:
                return False
    return True
