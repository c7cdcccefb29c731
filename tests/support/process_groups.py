"""Stopping a child started with ``start_new_session=True`` together with everything it
started (an engine leaves its workers behind otherwise): the whole process group, by the
leader's PID, which is the group's id."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_group(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL the group of ``process`` (if it still runs) and reap the leader."""
    if process is None:
        return
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)


def stop_group(process: subprocess.Popen[bytes] | None, grace: float) -> None:
    """SIGTERM the group of ``process``, then SIGKILL it after ``grace`` seconds."""
    if process is None:
        return
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    kill_group(process)
