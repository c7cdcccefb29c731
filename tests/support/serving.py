"""``pcr serve`` as a process of its own on a free port, for the tests that need the real
command (its HTTP layer, its signals, its exit); stopped in ``stop()`` by PID."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.support import REPO_ROOT
from tests.support.servers import free_port
from tests.support.waiting import wait_until


class ServeProcess:
    """``python -m pcr serve --port <free> ARGS`` (or ``pcr gateway`` with
    ``command="gateway"``); ``start()`` waits until ``path`` answers 200."""

    def __init__(self, *args: str, path: str = "/live", command: str = "serve") -> None:
        self.command = command
        self.port = free_port()
        self.args = [*args, "--port", str(self.port)]
        self.path = path
        self.process: subprocess.Popen[str] | None = None
        self.out = self.err = ""

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServeProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pcr", self.command, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        process = self.process

        def answers() -> bool:
            assert process.poll() is None, process.communicate()
            try:
                return httpx.get(f"{self.base}{self.path}", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(answers, timeout=60, what=f"pcr {self.command}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int:
        """SIGTERM, then its exit code (its output in ``out`` and ``err``)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.out, self.err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.out, self.err = self.process.communicate(timeout=30)
        return self.process.returncode
