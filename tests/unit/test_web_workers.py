"""The supervisor of ``--workers N`` (``pcr.web.server.serve_workers``), with workers
that only write their pid and wait: a worker killed after it ran a while is replaced (the
others untouched), one that fails as it starts stops them all with its status, a signal
to the parent stops every worker (status 0), and nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.waiting import wait_until

SUPERVISED = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from pcr.web.server import serve_workers

    where, fail = Path(sys.argv[1]), sys.argv[2]

    def serve(index):
        if fail == str(index):
            return 3  # a start that fails
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        (where / f"{index}-{os.getpid()}").write_text("")
        while True:
            time.sleep(0.05)

    code = serve_workers(2, serve, respawn_after=float(sys.argv[3]))
    if code is None:
        raise SystemExit(0)
    os._exit(code)
    """
)


def _start(tmp_path: Path, fail: str, respawn_after: float) -> subprocess.Popen[bytes]:
    script = tmp_path / "supervised.py"
    script.write_text(SUPERVISED)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), fail, str(respawn_after)],
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,
    )


def _workers(tmp_path: Path) -> dict[int, int]:
    """pid -> index of every worker that started."""
    out = {}
    for entry in tmp_path.iterdir():
        index, _, pid = entry.name.partition("-")
        if pid.isdigit():
            out[int(pid)] = int(index)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def test_a_worker_killed_after_its_start_is_replaced_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    process = _start(tmp_path, fail="", respawn_after=0.2)
    try:
        wait_until(lambda: len(_workers(tmp_path)) == 2, 30, "two workers")
        first = _workers(tmp_path)
        time.sleep(0.3)  # past respawn_after
        victim = next(pid for pid, index in first.items() if index == 1)
        other = next(pid for pid in first if pid != victim)
        os.kill(victim, signal.SIGKILL)  # as the kernel's out-of-memory killer does
        wait_until(lambda: len(_workers(tmp_path)) == 3, 30, "a new worker")
        new = next(pid for pid in _workers(tmp_path) if pid not in first)
        assert _workers(tmp_path)[new] == 1  # the same index: its socket, its replica id
        assert _alive(other)  # untouched meanwhile
        assert process.poll() is None
        time.sleep(0.3)
        os.kill(new, signal.SIGKILL)  # and again
        wait_until(lambda: len(_workers(tmp_path)) == 4, 30, "another new worker")
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(30) == 0
        assert not any(_alive(pid) for pid in _workers(tmp_path))
    finally:
        _stop(process)


def test_a_worker_that_fails_as_it_starts_stops_the_others_with_its_status(
    tmp_path: Path,
) -> None:
    process = _start(tmp_path, fail="1", respawn_after=60.0)
    try:
        assert process.wait(30) == 3
        assert not any(_alive(pid) for pid in _workers(tmp_path))
    finally:
        _stop(process)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_worker_gone_before_its_time_is_not_replaced(tmp_path: Path, how: int) -> None:
    """A worker that ends before ``respawn_after`` (killed or failing, the start is in
    doubt) is not replaced: every worker stops and the parent says it failed."""
    process = _start(tmp_path, fail="", respawn_after=60.0)
    try:
        wait_until(lambda: len(_workers(tmp_path)) == 2, 30, "two workers")
        victim = next(iter(_workers(tmp_path)))
        os.kill(victim, how)
        code = process.wait(30)
        # SIGTERM: the worker's own handler exits 0, so the parent's status is 0
        assert code == (0 if how == signal.SIGTERM else 1)
        assert len(_workers(tmp_path)) == 2  # none started in its place
        assert not any(_alive(pid) for pid in _workers(tmp_path))
    finally:
        _stop(process)
