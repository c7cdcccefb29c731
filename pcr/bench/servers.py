"""Real ``redis-server`` processes: one standalone server, or a small Redis Cluster.

Shared by ``pcr bench`` (which measures a server of its own) and the tests.

Why a helper and not only fakeredis: the registry's Lua scripts, hash-tag key layout and
failure handling must be checked against the real server and a real cluster. Every server
runs on a free loopback port in its own temporary directory, without persistence, and never
touches a Redis the developer already runs (for example on 6379).

No process is left behind: ``stop()`` is idempotent, a failed ``start()`` stops whatever it
started, an ``atexit`` handler stops every server still running, and on Linux each
``redis-server`` started from the main thread gets ``PR_SET_PDEATHSIG`` so it dies with the
test process even when that is killed hard.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import redis
import redis.cluster

from registry.core.validation import text

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
_CLUSTER_BUS_OFFSET = 10000
_PORT_ATTEMPTS = 5
_BIND_ERRORS = ("Address already in use", "Could not create server TCP listening socket")

# Every server that has a live process; the atexit handler stops what is still here.
_LIVE: set[RedisServer] = set()
_LIVE_LOCK = threading.Lock()


def find_redis_server() -> str | None:
    """Return the path of the ``redis-server`` binary on PATH, or None."""
    return shutil.which("redis-server")


def _require_redis_cli() -> str:
    """Return the ``redis-cli`` path (needed to form a cluster), or raise RuntimeError."""
    path = shutil.which("redis-cli")
    if path is None:
        raise RuntimeError("redis-cli not found on PATH: it is needed to create a Redis Cluster")
    return path


def _port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on the loopback address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port(with_cluster_bus: bool) -> int:
    """Pick a free loopback port (and a free cluster bus port ``port + 10000`` if asked).

    The port is only free when checked: another process can take it before redis-server
    binds it, so callers retry with a new port when the server fails to bind.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if not with_cluster_bus:
            return port
        bus = port + _CLUSTER_BUS_OFFSET
        if bus <= 65535 and _port_is_free(bus):
            return port
    raise RuntimeError("could not find a free loopback port (with a free cluster bus port)")


def free_port() -> int:
    """A loopback TCP port that is free right now (the one free-port helper: tests use it
    for servers of their own and for ports where nothing listens)."""
    return _free_port(with_cluster_bus=False)


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this thread dies (Linux only).

    The signal follows the *thread* that forked, so it is used only from the main thread: a
    server started from a worker thread would otherwise die when that thread ends.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    sigkill = 9

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)

    return preexec


class RedisServer:
    """One ``redis-server`` process on a free loopback port, without persistence.

    ``extra_args`` are appended to the command line; the text ``{dir}`` in any of them is
    replaced by this server's temporary directory (e.g. ``--cluster-config-file
    {dir}/nodes.conf``). ``restart()`` keeps the port and the directory, so a cluster node
    comes back with its identity (nodes.conf); ``stop()`` removes the directory.
    """

    host: str = HOST

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self._extra_args = list(extra_args)
        self._fixed_port = port
        self._port: int | None = port
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._dir: str | None = None
        self.process: subprocess.Popen[bytes] | None = None

    # -- attributes -------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port (known once started, or when given to the constructor)."""
        if self._port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """A redis-py URL to database 0 of this server."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def dir(self) -> str:
        """The server's temporary working directory (log, nodes.conf)."""
        if self._dir is None:
            raise RuntimeError("RedisServer has no directory: it is not started")
        return self._dir

    @property
    def logfile(self) -> str:
        """Path of the server's log file."""
        return os.path.join(self.dir, "redis.log")

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self.process is not None and self.process.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A new ``redis.Redis`` connected to this server; the caller closes it."""
        return redis.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; retry on a taken port.

        On failure everything started is stopped and RuntimeError (with the log tail) is
        raised. Returns ``self`` so ``server = RedisServer().start()`` works.
        """
        if self.running:
            return self
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("redis-server not found on PATH")
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="pcr-redis-")
        try:
            attempts = 1 if self._fixed_port is not None else _PORT_ATTEMPTS
            for attempt in range(1, attempts + 1):
                if self._fixed_port is None:
                    self._port = _free_port(self._is_cluster_node())
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.logfile)  # judge each attempt by its own log only
                error = self._spawn_and_wait(binary)
                if error is None:
                    return self
                log = self._log_tail()
                bind_failure = any(marker in log for marker in _BIND_ERRORS)
                if attempt < attempts and bind_failure:
                    continue
                raise RuntimeError(
                    f"redis-server on port {self._port} did not start: {error}\n"
                    f"in {self._dir}:\n{log}"
                )
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove the directory; idempotent."""
        self._stop_process()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """Stop the process only, keeping port and directory: ``restart()`` brings it back."""
        self._stop_process()

    def restart(self) -> RedisServer:
        """Stop the process and start it again on the same port, keeping the directory.

        Data is gone (no persistence) but a cluster node keeps its nodes.conf, so it rejoins
        the cluster with the same node id and slots.
        """
        if self._port is None:
            return self.start()
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("redis-server not found on PATH")
        self._stop_process()
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="pcr-redis-")
        try:
            error = self._spawn_and_wait(binary)
            if error is not None:
                raise RuntimeError(
                    f"redis-server did not restart on port {self._port}: {error}\n"
                    f"in {self._dir}:\n{self._log_tail()}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.host}:{self._port}, {state})"

    # -- internals --------------------------------------------------------------------

    def _is_cluster_node(self) -> bool:
        """Whether the extra args enable cluster mode (then the bus port must be free too)."""
        args = [a.lower() for a in self._extra_args]
        return any(
            a == "--cluster-enabled" and i + 1 < len(args) and args[i + 1] == "yes"
            for i, a in enumerate(args)
        )

    def _command(self, binary: str) -> list[str]:
        """The full redis-server command line for the current port and directory."""
        directory = self.dir
        extra = [arg.replace("{dir}", directory) for arg in self._extra_args]
        return [
            binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", directory,
            "--daemonize", "no",
            "--logfile", os.path.join(directory, "redis.log"),
            *extra,
        ]  # fmt: skip

    def _spawn_and_wait(self, binary: str) -> str | None:
        """Spawn the process and poll PING until the deadline; return an error text or None.

        stdout/stderr go to ``redis.out`` in the directory: errors before the log file is
        open (bad arguments) only appear there. On error the process is already stopped
        (the directory is kept for the log).
        """
        with open(os.path.join(self.dir, "redis.out"), "wb") as out:
            self.process = subprocess.Popen(
                self._command(binary),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                preexec_fn=_pdeathsig_preexec(),
            )
        with _LIVE_LOCK:
            _LIVE.add(self)
        deadline = time.monotonic() + self._start_timeout
        delay = 0.005
        while True:
            code = self.process.poll()
            if code is not None:
                self._stop_process()
                return f"the process exited with code {code}"
            ping_error = self._ping_once(self.process.pid)
            if ping_error is None:
                return None
            if time.monotonic() >= deadline:
                self._stop_process()
                return f"no PONG within {self._start_timeout:.0f} s (last error: {ping_error})"
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _ping_once(self, pid: int) -> str | None:
        """PING once with short timeouts; None when *our* process (``pid``) answered.

        The pid check matters: if the port was taken meanwhile, another Redis (say, the
        developer's) would answer the PING while our server fails to bind.
        """
        client = redis.Redis(
            host=self.host,
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
        )
        try:
            client.ping()
            answered_by = int(client.info("server")["process_id"])
        except redis.RedisError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        if answered_by != pid:
            return f"port {self.port} is answered by another redis-server (pid {answered_by})"
        return None

    def _stop_process(self) -> None:
        """Terminate the process and reap it (SIGKILL after ``stop_timeout``); keep the dir."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=self._stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait(timeout=self._stop_timeout)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def _log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's stdout/stderr and log file ('' when none)."""
        if self._dir is None:
            return ""
        parts = []
        for name in ("redis.out", "redis.log"):
            try:
                with open(os.path.join(self._dir, name), encoding="utf-8", errors="replace") as f:
                    tail = "".join(f.readlines()[-lines:])
            except OSError:
                continue
            if tail.strip():
                parts.append(f"--- {name} ---\n{tail}")
        return "".join(parts) or "(no output)"


class RedisClusterServers:
    """A real Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each.

    Each node is a :class:`RedisServer` in its own directory; ``redis-cli --cluster create``
    assigns the slots, then ``start()`` waits until every node reports ``cluster_state:ok``
    with all 16384 slots assigned and, with replicas, every master has its replicas attached.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = 5000,
        ready_timeout: float = 20.0,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.masters = masters
        self.replicas = replicas
        self.ready_timeout = ready_timeout
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "{dir}/nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            # Replicas sync at once instead of after the default 5 s diskless-sync delay.
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        self.nodes: list[RedisServer] = [RedisServer(args) for _ in range(masters * (1 + replicas))]
        self.create_output = ""

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node, in start order."""
        return [(node.host, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        """A redis-py cluster URL pointing at the first node."""
        first = self.nodes[0]
        return f"redis://{first.host}:{first.port}"

    def client(self, **kwargs: object) -> redis.cluster.RedisCluster:
        """A new ``RedisCluster`` bootstrapped from the first node; the caller closes it."""
        first = self.nodes[0]
        return redis.cluster.RedisCluster(
            host=first.host,
            port=first.port,
            **kwargs,  # type: ignore[arg-type]
        )

    def start(self) -> RedisClusterServers:
        """Start all nodes, create the cluster and wait until it is ready.

        On any failure every node is stopped before the error is raised.
        """
        try:
            cli = _require_redis_cli()
            for node in self.nodes:
                node.start()
            command = [
                cli,
                "--cluster", "create",
                *(f"{node.host}:{node.port}" for node in self.nodes),
                "--cluster-replicas", str(self.replicas),
                "--cluster-yes",
            ]  # fmt: skip
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            self.create_output = result.stdout + result.stderr
            if result.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create failed (exit {result.returncode}):\n"
                    f"{self.create_output}"
                )
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll every node until the cluster is fully formed; RuntimeError at the deadline.

        Also useful after restarting a node in a fault test.
        """
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = 0.02
        while True:
            problem = self._not_ready_reason()
            if problem is None:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"Redis Cluster not ready within {limit:.0f} s: {problem}")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def stop(self) -> None:
        """Stop every node (replicas first, so no master waits for them); idempotent."""
        for node in reversed(self.nodes):
            node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _not_ready_reason(self) -> str | None:
        """Why the cluster is not ready yet, or None when every check passes."""
        total = len(self.nodes)
        for node in self.nodes:
            client = node.client(decode_responses=True, socket_timeout=2.0)
            try:
                info = _cluster_info(client.cluster("INFO"))
                expected = {
                    "cluster_state": "ok",
                    "cluster_slots_assigned": str(CLUSTER_SLOTS),
                    "cluster_known_nodes": str(total),
                    "cluster_size": str(self.masters),
                }
                for key, want in expected.items():
                    if info.get(key) != want:
                        return f"{node.port}: {key}={info.get(key)} (want {want})"
                if self.replicas > 0:
                    problem = self._replication_problem(node, client)
                    if problem is not None:
                        return problem
            except redis.RedisError as exc:
                return f"{node.port}: {type(exc).__name__}: {exc}"
            finally:
                client.close()
        return None

    def _replication_problem(self, node: RedisServer, client: redis.Redis) -> str | None:
        """Check from ``node``'s view that each master has its replicas, all links up."""
        replica_counts: dict[str, int] = {}
        replicas_of: list[str] = []
        for node_id, flags, master_id, connected in _cluster_nodes(client.cluster("NODES")):
            if "fail" in flags or "fail?" in flags or not connected:
                return f"{node.port}: node {node_id[:8]} flags={','.join(flags)}"
            if "master" in flags:
                replica_counts.setdefault(node_id, 0)
            elif "slave" in flags:
                replicas_of.append(master_id)
        for master_id in replicas_of:
            if master_id in replica_counts:
                replica_counts[master_id] += 1
        wrong = {m[:8]: n for m, n in replica_counts.items() if n != self.replicas}
        if len(replica_counts) != self.masters or wrong:
            return f"{node.port}: {len(replica_counts)} masters, replica counts {wrong}"
        replication = client.info("replication")
        if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
            return f"{node.port}: replica link {replication.get('master_link_status')}"
        return None


def _cluster_info(raw: object) -> dict[str, str]:
    """``CLUSTER INFO`` as a dict, whether redis-py parsed it already or returned text."""
    if isinstance(raw, dict):
        return {text(k): text(v) for k, v in raw.items()}
    info: dict[str, str] = {}
    for line in text(raw).splitlines():
        key, sep, value = line.strip().partition(":")
        if sep:
            info[key] = value
    return info


def _cluster_nodes(raw: object) -> list[tuple[str, set[str], str, bool]]:
    """``CLUSTER NODES`` as ``(node_id, flags, master_id, link connected)`` rows.

    Accepts both the dict redis-py's response callback builds and the raw text.
    """
    rows: list[tuple[str, set[str], str, bool]] = []
    if isinstance(raw, dict):
        for entry in raw.values():
            rows.append(
                (
                    text(entry["node_id"]),
                    set(text(entry["flags"]).split(",")),
                    text(entry["master_id"]),
                    bool(entry["connected"]),
                )
            )
        return rows
    for line in text(raw).splitlines():
        fields = line.split()
        if len(fields) >= 8:
            rows.append((fields[0], set(fields[2].split(",")), fields[3], fields[7] == "connected"))
    return rows


@atexit.register
def _stop_all_servers() -> None:
    """Stop every server still running when the interpreter exits (e.g. after Ctrl-C)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()
