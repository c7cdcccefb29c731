"""docker-compose.yml and the Dockerfile are secure by default (issue 43), checked without a
Docker engine: the files are parsed, and the parts that can run here do (the Redis command
line on a real redis-server, Grafana's start check in ``sh``, the image's healthcheck
against a local HTTP server, every ``pcr`` command line through the real parser, the
package the image installs as a wheel from exactly the files the Dockerfile copies).

Left out: the image's two ``pip install`` calls themselves (they fetch torch and every
extra from the network: minutes), and compose's own interpolation (no ``docker`` here:
the ``${VAR:?}`` forms are checked as text).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from pcr.cli.main import build_parser
from tests.support import REPO_ROOT
from tests.support.servers import HOST, free_port, refused_port, require_redis_server

ROOT = REPO_ROOT
PASSWORD = "compose-test-Pw-9f3a"
REQUIRED = re.compile(r"^\$\{REDIS_PASSWORD:\?[^}]+\}$")  # set and not empty, or compose stops


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:-default}`` and ``${NAME:?error}`` (``$$`` is a
    literal ``$``); a required variable that is unset or empty raises, as compose does."""

    def one(found: re.Match[str]) -> str:
        if found[0] == "$$":
            return "$"
        name, form, rest = found[1], found[2] or "", found[3] or ""
        got = env.get(name, "")
        if form == ":?" and not got:
            raise LookupError(f"required variable {name} is missing a value: {rest}")
        return got or (rest if form == ":-" else "")

    return re.sub(r"\$\$|\$\{([A-Z_]+)(:[-?])?([^}]*)\}", one, value)


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ")


def instructions(name: str) -> list[str]:
    """The Dockerfile's instructions of one kind, continuations joined, keyword dropped."""
    return [
        line.strip()[len(name) :].strip()
        for line in dockerfile().splitlines()
        if line.strip().upper().startswith(name + " ")
    ]


# -- the compose file -----------------------------------------------------------------------


def test_published_ports_are_bound_to_loopback() -> None:
    published = {}
    for name, service in services().items():
        assert service.get("network_mode") is None, name
        for port in service.get("ports", []):
            assert isinstance(port, str), f"{name}: long-form port {port!r}"
            host_ip, host_port, container_port = port.split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port!r} beyond loopback"
            assert host_port.isdigit(), port
            assert container_port.isdigit(), port
            assert host_port not in published, f"{name} and {published[host_port]} share it"
            published[host_port] = name
    assert {"redis", "serve", "gateway", "prometheus", "grafana"} <= set(published.values())
    assert "0.0.0.0:" not in (ROOT / "docker-compose.yml").read_text()


def test_no_published_port_is_an_engine_the_gateway_expects() -> None:
    """examples/gateway-backends.json names engines on the host's ports (through
    host.docker.internal): no service of the compose file may hold one of them."""
    backends = json.loads((ROOT / "examples" / "gateway-backends.json").read_text())
    engine_ports = {urlsplit(url).port for url in backends["backends"].values()}
    assert engine_ports == {8000, 8001}
    host_ports = {
        int(port.split(":")[1])
        for service in services().values()
        for port in service.get("ports", [])
    }
    assert host_ports.isdisjoint(engine_ports)


def test_every_service_is_on_the_compose_network() -> None:
    for name, service in services().items():
        assert service.get("networks") == ["registry"], name
    assert set(compose()["networks"]) == {"registry"}


def test_every_redis_server_requires_the_password() -> None:
    """Each redis-server is started with ``--requirepass ${REDIS_PASSWORD:?...}`` (cluster
    nodes also with ``--masterauth``), redis-cli in those containers logs in with it, and
    no default password is written anywhere."""
    servers = {
        name: s for name, s in services().items() if s.get("command", [""])[0] == "redis-server"
    }
    assert len(servers) == 7  # the standalone server and six cluster nodes
    for name, service in servers.items():
        command = service["command"]
        assert REQUIRED.match(command[command.index("--requirepass") + 1]), name
        if "--cluster-enabled" in command:
            assert REQUIRED.match(command[command.index("--masterauth") + 1]), name
        assert REQUIRED.match(service["environment"]["REDISCLI_AUTH"]), name
    assert REQUIRED.match(services()["redis-cluster-init"]["environment"]["REDISCLI_AUTH"])
    text = (ROOT / "docker-compose.yml").read_text()
    assert "${REDIS_PASSWORD}" not in text
    assert "${REDIS_PASSWORD:-" not in text
    example = (ROOT / ".env.example").read_text()
    assert re.search(r"^REDIS_PASSWORD=$", example, re.MULTILINE)  # nothing shipped
    with pytest.raises(LookupError, match="REDIS_PASSWORD"):
        interpolate(servers["redis"]["command"][2], {})


def test_the_redis_command_refuses_clients_without_the_password() -> None:
    """The compose file's redis command line, run on this machine's redis-server (on a
    free port instead of 6379): no password, NOAUTH; the password, PONG."""
    binary = require_redis_server()
    command = [interpolate(word, {"REDIS_PASSWORD": PASSWORD}) for word in
               services()["redis"]["command"]]  # fmt: skip
    assert command[0] == "redis-server"
    port = free_port()
    process = subprocess.Popen(
        [binary, *command[1:], "--port", str(port), "--bind", HOST],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        anonymous = redis.Redis(host=HOST, port=port, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                anonymous.ping()
                raise AssertionError("redis answered PING without the password")
            except redis.AuthenticationError:
                break  # NOAUTH: the server is up and wants the password
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        anonymous.close()
        with redis.Redis(host=HOST, port=port, password=PASSWORD, socket_timeout=5) as client:
            assert client.ping() is True
            assert client.config_get("appendonly") == {"appendonly": "no"}
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_every_pcr_command_parses_and_reads_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``pcr`` command line parses with the real CLI parser, its options as given;
    the services log in through ``$REDIS_URL`` (the password in it), which the parser
    takes as ``--redis-url``'s default; the HTTP services listen inside their container
    and are published on loopback only."""
    checked = []
    for name, service in services().items():
        command = service.get("command")
        if not isinstance(command, list) or command[:1] != ["pcr"]:
            continue
        url = interpolate(service["environment"]["REDIS_URL"], {"REDIS_PASSWORD": PASSWORD})
        parts = urlsplit(url.replace("redis+cluster://", "redis://"))
        assert parts.password == PASSWORD, name
        assert parts.hostname in services(), f"{name}: {parts.hostname} is not a service"
        monkeypatch.setenv("REDIS_URL", url)
        args = build_parser().parse_args(command[1:])  # SystemExit on an unknown option
        assert args.command == command[1]
        assert args.redis_url == url, name
        options = {word.lstrip("-").replace("-", "_") for word in command if word.startswith("--")}
        assert options <= set(vars(args)), name
        if service.get("depends_on", {}).get("redis"):  # the standalone server's services
            assert "setup" in service["depends_on"] or name == "setup", name
        if "--port" in command:
            assert args.host == "0.0.0.0"  # inside the container; the host sees loopback
            (published,) = service["ports"]
            assert published.endswith(f":{args.port}"), name
        checked.append(name)
    assert sorted(checked) == ["gateway", "serve", "setup", "simulate", "simulate-cluster"]


def test_grafana_asks_for_a_login() -> None:
    grafana = services()["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert re.search(r"^GRAFANA_ADMIN_PASSWORD=$", (ROOT / ".env.example").read_text(), re.M)
    for path in (ROOT / "grafana" / "provisioning").rglob("*.yml"):
        assert "anonymous" not in path.read_text().lower(), path


@pytest.mark.parametrize("password", ["", "grafana-Pw-1"])
def test_grafana_refuses_to_start_without_its_password(password: str, tmp_path: Path) -> None:
    """The entrypoint's check, run in ``sh`` with Grafana's start script replaced."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    entrypoint = services()["grafana"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"]
    script = interpolate(entrypoint[2], {})
    assert script.endswith("exec /run.sh")
    started = tmp_path / "started"
    done = subprocess.run(
        [sh, "-c", script.replace("exec /run.sh", f"exec touch {shlex.quote(str(started))}")],
        env={"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD": password},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if password:
        assert (done.returncode, started.exists()) == (0, True)
    else:
        assert (done.returncode, started.exists()) == (1, False)
        assert "GRAFANA_ADMIN_PASSWORD" in done.stderr


# -- the image ------------------------------------------------------------------------------


def test_the_image_runs_as_a_user_of_its_own() -> None:
    users = instructions("USER")
    assert users, "no USER: the image runs as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert re.search(rf"useradd .*--uid {re.escape(user)}\b", dockerfile()), "uid not created"


def test_the_base_image_is_pinned() -> None:
    (base,) = instructions("FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), base


def test_pip_uses_one_index_per_call_and_torch_only_from_its_own() -> None:
    text = dockerfile()
    assert "--extra-index-url" not in text
    assert "PIP_EXTRA_INDEX_URL" not in text
    calls = [c for c in re.split(r"&&|;", " ".join(instructions("RUN"))) if "pip install" in c]
    assert len(calls) == 2
    for call in calls:
        assert len(re.findall(r"--index-url\s+(\S+)", call)) == 1, call
    torch_call, package_call = calls
    assert re.findall(r"--index-url\s+(\S+)", torch_call) == [
        "https://download.pytorch.org/whl/cpu"
    ]
    assert '"torch==' in torch_call
    assert "torch" not in package_call.replace("-c constraints.txt", "")
    assert re.findall(r"--index-url\s+(\S+)", package_call) == ["https://pypi.org/simple"]
    pinned = re.search(r'"torch==([\d.]+)"', torch_call)
    assert pinned is not None
    assert f"torch=={pinned[1]}\n" in (ROOT / "constraints.txt").read_text()


class _Health(http.server.BaseHTTPRequestHandler):
    """200 on /live, 503 elsewhere."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/live" else 503)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((HOST, 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_healthcheck_asks_the_service(health_server: str) -> None:
    """The image's HEALTHCHECK (python, no curl) exits 0 on a 200 and fails on a 503 or
    a refused connection; the compose file points the gateway at its /health and turns
    the check off where nothing listens."""
    (check,) = instructions("HEALTHCHECK")
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[0] == "python"
    assert "curl" not in check
    assert "http://127.0.0.1:8000/live" in command[2]

    def run(url: str) -> int:
        env = {**os.environ, "PCR_HEALTH_URL": url}
        return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True,
                              timeout=30, check=False).returncode  # fmt: skip

    assert run(f"{health_server}/live") == 0
    assert run(f"{health_server}/health") != 0
    with refused_port() as port:
        assert run(f"http://{HOST}:{port}/live") != 0
    gateway = services()["gateway"]
    assert gateway["environment"]["PCR_HEALTH_URL"] == "http://127.0.0.1:8080/health"
    assert "--port" in gateway["command"]
    assert "8080" in gateway["command"]
    serve = services()["serve"]["command"]
    assert serve[serve.index("--port") + 1] == "8000"  # the image's default URL
    for name in ("simulate", "simulate-cluster"):
        assert services()[name]["healthcheck"] == {"disable": True}


def test_the_installed_package_runs_from_the_dockerfile_files(tmp_path: Path) -> None:
    """The wheel built from exactly the files the Dockerfile copies, installed (without
    its dependencies: those come from this checkout's environment) into a fresh venv and
    run from outside the source tree: every ``pcr`` command the compose file runs shows
    its help."""
    pytest.importorskip("build")
    from tests.system.test_packaging import dockerfile_copies

    context = tmp_path / "context"
    context.mkdir()
    for sources, destination in dockerfile_copies((ROOT / "Dockerfile").read_text()):
        for source in sources:
            origin = ROOT / source
            target = context / (source if destination.endswith("/") else destination)
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
         "--outdir", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(deps), "HOME": str(tmp_path)}
    where = subprocess.run(
        [str(python), "-c", "import pcr.cli.main, registry; print(pcr.cli.main.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.startswith(str(venv)), where.stdout
    for command in ("simulate", "serve", "gateway"):
        shown = subprocess.run(
            [str(venv / "bin" / "pcr"), command, "--help"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, f"pcr {command} --help: {shown.stderr[-2000:]}"
        assert "--redis-url" in shown.stdout
