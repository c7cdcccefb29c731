"""The Grafana dashboard's ``pcr gateway`` row against a running gateway (a process, in
front of fake engines and a real redis-server): every metric and label its queries select
is in the gateway's ``/metrics``, the row shows every ``pcr_gateway_*`` family the gateway
exports, the queries parse (``promtool``, where installed), and every query returns data
from a real Prometheus scraping the gateway (where ``prometheus`` is installed: ``make
prometheus``; else that test skips, saying so)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from registry import PrefixCacheRegistry, block_hashes
from tests.support import REPO_ROOT
from tests.support.fake_engine import FakeEngine
from tests.support.servers import HOST, RedisServer, free_port
from tests.support.serving import ServeProcess
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

pytestmark = pytest.mark.timeout(240)

ROW = "pcr gateway"
BLOCK = 4
CACHED = list(range(10, 43))  # 33 tokens: 8 whole blocks, cached on backend b
REFUSED = list(range(50, 83))  # cached on backend c, which answers every request 500
RATE_WINDOW = "1m"
"""What ``$__rate_interval`` becomes outside Grafana (it holds every scrape of a test)."""
SELECTOR = re.compile(r"\b(pcr_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=|!=)\s*"([^"]*)"\s*')
BY = re.compile(r"\bby\s*\(([^)]*)\)")
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped sample (not in ``/metrics``)."""


def gateway_panels() -> list[dict[str, Any]]:
    """The panels under the dashboard's gateway row (up to the next row)."""
    panels = json.loads((REPO_ROOT / "grafana" / "dashboard.json").read_text())["panels"]
    start = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == ROW]
    assert len(start) == 1, f"one row titled {ROW!r}"
    row = []
    for panel in panels[start[0] + 1 :]:
        if panel["type"] == "row":
            break
        row.append(panel)
    return row


def gateway_queries() -> list[str]:
    return [target["expr"] for panel in gateway_panels() for target in panel["targets"]]


def runnable(expr: str) -> str:
    """A Grafana query as plain PromQL."""
    out = expr.replace("$__rate_interval", RATE_WINDOW)
    assert "$" not in out, f"a Grafana variable this test cannot fill in: {expr}"
    return out


@dataclass
class Running:
    """A gateway in front of engines a and b (answering) and c (answering 500), with the
    namespaces it knows them by."""

    gateway: ServeProcess
    names: dict[str, str]

    def traffic(self, rounds: int = 3) -> None:
        """Requests that exercise every series of the row: prompts cached on b (routed by
        prefix), on c (routed by prefix, answered 500), text prompts (routed by load)."""
        for n in range(rounds):
            assert self.complete({"prompt": CACHED}) == 200
            assert self.complete({"prompt": REFUSED}) == 500
            self.complete({"prompt": f"a prompt nobody cached {uuid.uuid4().hex} {n}"})
            self.complete({"prompt": CACHED, "stream": True})

    def complete(self, body: dict[str, Any]) -> int:
        reply = httpx.post(
            f"{self.gateway.base}/v1/completions", json={"model": "tiny", **body}, timeout=30
        )
        return reply.status_code

    def scrape(self) -> list[tuple[str, dict[str, str]]]:
        return [(name, labels) for name, labels, _value in self.samples()]

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        text = httpx.get(f"{self.gateway.base}/metrics", timeout=10).text
        return [
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def exchanges(self) -> float:
        """How many load exchanges (``gateway_load``) the gateway has timed: it runs them
        on its own tick, after the requests that changed its load have been answered."""
        return sum(
            value
            for name, labels, value in self.samples()
            if name == "pcr_operation_duration_seconds_count"
            and labels.get("operation") == "gateway_load"
        )


@pytest.fixture(scope="module")
def running(redis_server: RedisServer) -> Iterator[Running]:
    tag = uuid.uuid4().hex[:8]
    engines = {
        "a": FakeEngine("a").start(),
        "b": FakeEngine("b").start(),
        "c": FakeEngine("c", status=500).start(),
    }
    names = {key: f"dash-{key}-{tag}" for key in engines}
    client = redis_server.client()
    for key, prompt in (("b", CACHED), ("c", REFUSED)):
        registry = PrefixCacheRegistry(client, names[key])
        registry.claim(600)
        hashes = block_hashes(prompt, BLOCK)
        registry.register_kv(list(range(len(hashes))), hashes)
    args = ["--redis-url", redis_server.url, "--block-size", str(BLOCK)]
    for key, engine in engines.items():
        args += ["--backend", f"{names[key]}={engine.url}"]
    gateway = ServeProcess(*args, path="/health", command="gateway").start()
    try:
        here = Running(gateway, names)

        def every_backend_scraped() -> bool:
            up = [s for s in here.scrape() if s[0] == "pcr_gateway_backend_up"]
            return len(up) == len(engines)

        wait_until(every_backend_scraped, 60, "the gateway to read every engine's /metrics")
        here.traffic()
        yield here
    finally:
        gateway.stop()
        for engine in engines.values():
            engine.stop()
        client.close()


def test_the_gateway_row_queries_prometheus_and_keeps_the_grid() -> None:
    dashboard = json.loads((REPO_ROOT / "grafana" / "dashboard.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        assert grid["x"] + grid["w"] <= 24
        cells |= mine
    row = gateway_panels()
    assert len(row) >= 10
    for panel in row:
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus"
            assert SELECTOR.search(target["expr"]), target["expr"]


def test_every_gateway_query_selects_what_a_running_gateway_exports(running: Running) -> None:
    """Each metric a query names is exported with the labels its matchers ask for, and
    has the labels its ``by`` clauses group on; and every ``pcr_gateway_*`` family the
    gateway exports is on the row."""
    samples = running.scrape()
    for expr in gateway_queries():
        selected = SELECTOR.findall(expr)
        assert selected, expr
        for name, matchers in selected:
            wanted = [MATCHER.fullmatch(m) for m in matchers.strip("{}").split(",") if m]
            assert all(wanted), f"a label matcher this test cannot read: {expr}"
            found = [
                labels
                for sample_name, labels in samples
                if sample_name == name
                and all(
                    (labels.get(m[1], "") == m[3]) == (m[2] == "=") for m in wanted if m is not None
                )
            ]
            assert found, f"{name}{matchers} is not in the gateway's /metrics ({expr})"
            grouped = {
                label.strip() for clause in BY.findall(expr) for label in clause.split(",")
            } - TARGET_LABELS
            for label in grouped:
                assert any(label in labels for labels in found), f"{name} has no {label!r}"
    exported = {
        re.sub(r"(_total|_bucket|_count|_sum|_created)$", "", name)
        for name, _ in samples
        if name.startswith("pcr_gateway_")
    }
    shown = {
        re.sub(r"(_total|_bucket|_count|_sum)$", "", name)
        for expr in gateway_queries()
        for name, _ in SELECTOR.findall(expr)
    }
    assert len(exported) >= 12
    assert sorted(exported - shown) == []


def test_the_gateway_queries_parse_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: the gateway row's PromQL was not parsed (make prometheus)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:gateway_{i}", "expr": runnable(expr)}
                    for i, expr in enumerate(gateway_queries())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules['groups'][0]['rules'])} rules found" in checked.stdout


class Prometheus:
    """A ``prometheus`` process scraping the gateway every second, on a free port."""

    def __init__(self, binary: str, target: str, directory: Path) -> None:
        self.port = free_port()
        job = {"job_name": "pcr-gateway", "static_configs": [{"targets": [target]}]}
        config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [job]}
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (directory / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address={HOST}:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def ready(self) -> bool:
        assert self.process.poll() is None, "prometheus exited"
        try:
            return httpx.get(f"{self.base}/-/ready", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.base}/api/v1/query", params={"query": expr}, timeout=30)
        body = reply.json()
        assert reply.status_code == 200, (expr, body)
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scraped_since(self, moment: float) -> bool:
        """Whether a scrape of the gateway that began after ``moment`` (this machine's
        clock, as Prometheus stamps it) has landed, and found it up."""
        time.sleep(0.1)  # pace the polls: a scrape comes once a second
        up = 'up{job="pcr-gateway"}'
        scraped = self.query(f"timestamp({up})")  # of a bare selector: the sample's own time
        if not scraped or float(scraped[0]["value"][1]) <= moment:
            return False
        assert self.query(up)[0]["value"][1] == "1", "prometheus could not scrape the gateway"
        return True

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


def values(series_list: list[dict[str, Any]], **labels: str) -> list[float]:
    """The values of the series of a query's result that carry ``labels``."""
    return [
        float(series["value"][1])
        for series in series_list
        if all(series["metric"].get(k) == v for k, v in labels.items())
    ]


def test_every_gateway_query_returns_data_from_prometheus(running: Running, tmp_path: Path) -> None:
    """Prometheus scrapes the gateway once after one round of traffic and once after
    another (rates need two samples apart), then every query of the row is evaluated."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "prometheus not found: the gateway row's queries were not run against a real "
            "Prometheus (make prometheus installs Debian's package)"
        )
    prometheus = Prometheus(binary, f"{HOST}:{running.gateway.port}", tmp_path)
    try:
        wait_until(prometheus.ready, 60, "prometheus to be ready")
        before = time.time()
        wait_until(lambda: prometheus.scraped_since(before), 60, "a scrape of the gateway")
        exchanged = running.exchanges()  # at least what that scrape saw
        running.traffic()
        # the exchange that tells the traffic's load runs on the gateway's tick, up to a
        # second after the last reply: the next scrape must begin after it, or the
        # window holds no exchange and its quantiles are NaN
        wait_until(lambda: running.exchanges() > exchanged, 60, "an exchange after the traffic")
        after = time.time()
        wait_until(lambda: prometheus.scraped_since(after), 60, "a scrape after the traffic")
        results = {expr: prometheus.query(runnable(expr)) for expr in gateway_queries()}
    finally:
        prometheus.stop()
    empty = [expr for expr, result in results.items() if not result]
    assert empty == [], "queries that returned no data"
    names = running.names

    def one(fragment: str, nth: int = 0) -> list[dict[str, Any]]:
        matching = [result for expr, result in results.items() if fragment in expr]
        assert matching, fragment
        return matching[nth]

    assert values(one("pcr_gateway_requests_total"), backend=names["b"], result="ok")[0] > 0
    assert values(one("pcr_gateway_requests_total"), backend=names["c"], result="error")[0] > 0
    errors = one("rate(pcr_gateway_errors_total")
    assert values(errors, backend=names["c"], kind="status")[0] > 0
    assert values(errors, backend=names["b"], kind="status") == [0]
    routed = one("pcr_gateway_routing_decisions_total")
    assert values(routed, outcome="prefix")[0] > 0
    assert values(routed, outcome="load")[0] > 0
    assert values(routed, outcome="registry_away") == [0]
    predicted = one("sum by (backend) (rate(pcr_gateway_predicted_cached_tokens_total")
    assert values(predicted, backend=names["b"])[0] > 0
    share = values(one(") / sum(rate(pcr_gateway_prompt_tokens_total"))
    assert len(share) == 1
    assert 0 < share[0] < 1  # 32 of every 33 prompt tokens were cached
    for fragment in ("time_to_first_byte", "request_duration"):
        for nth in (0, 1):  # p50, p99
            quantile = values(one(fragment, nth), backend=names["b"])
            assert len(quantile) == 1, fragment
            assert 0 < quantile[0] < 30, fragment
    for nth in (0, 1):
        for fragment in ("pcr_gateway_overhead_seconds", 'operation="gateway_load"'):
            quantile = values(one(fragment, nth))
            assert len(quantile) == 1, fragment
            assert 0 < quantile[0] < 30, fragment  # not NaN: the window saw some
    assert values(one("sum by (instance) (pcr_gateway_backend_up)")) == [3]
    assert values(one("count by (instance) (pcr_gateway_backend_up)")) == [3]
    assert values(one("pcr_gateway_registry_up")) == [1]
    assert sorted(values(one("pcr_gateway_in_flight"))) == [0, 0, 0]
