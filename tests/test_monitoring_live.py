"""Monitoring against the live stack: `python -m x1_pretrain.stack up`, as `make demo` runs it
(fake billing API, sidecar, MLflow server, watchdog supervising the tiny trainer), scraped for real.

- every metric the Grafana dashboard and the Prometheus alert rules query is exported by a
  running service (their /metrics pages, parsed as Prometheus text);
- a real Prometheus server, with our prometheus.yml pointed at the local ports, scrapes all three
  and answers tokens/s and spend through its HTTP query API; every dashboard query returns data.
  It skips, saying why, where the Debian package `prometheus` is not installed (.ci/run installs it).
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from promql_names import (
    SCRAPE_SERIES,
    dashboard_exprs,
    local_prometheus_config,
    metric_names,
    recorded_names,
    rule_exprs,
)

from conftest import REPO, cli_env, run_module
from x1_common import contracts as C
from x1_pretrain.stack.process import Service, http_json, wait_until
from x1_pretrain.stack.workspace import Ports, Workspace, choose_ports, free_port

pytestmark = pytest.mark.slow

DASHBOARD = REPO / "monitoring" / "grafana" / "dashboards" / "x1.json"
PROMETHEUS_YML = REPO / "monitoring" / "prometheus" / "prometheus.yml"
RULES = sorted((REPO / "monitoring" / "prometheus" / "rules").glob("*.yml"))
PROMETHEUS = shutil.which("prometheus")


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value of a /metrics page (labelled series: the last one's value)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_or_empty(url: str) -> dict[str, float]:
    """scrape(), or {} while nothing listens there yet."""
    try:
        return scrape(url)
    except OSError:
        return {}


@dataclass(frozen=True)
class LiveStack:
    ws: Workspace
    ports: Ports

    def env(self) -> dict[str, str]:
        return cli_env()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> Iterator[LiveStack]:
    """The demo's stack (`python -m x1_pretrain.stack up -d` against the fake billing API) on free
    ports, the trainer logging every 2 steps until the module is done."""
    ws = Workspace(tmp_path_factory.mktemp("live") / "workspace")
    shutil.copytree(tiny_data, ws.tokenized)
    ports, _ = choose_ports(use_defaults=False)
    key = "live-test-key-0001"
    fake = Service("fake-billing", [sys.executable, "-m", "budget_sidecar.fake_billing", "--host", "127.0.0.1",
                                    "--port", str(ports.fake_billing), "--provider", "lambda", "--instance-id",
                                    "i-live-0001", "--price-usd-per-hr", "1.10", "--time-scale", "1"],
                   ws.log("fake-billing"), cli_env(BILLING_API_KEY=key),
                   url=f"http://127.0.0.1:{ports.fake_billing}", health_path="/_state")
    env_file = ws.root / "live.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in {
        "PROVIDER": "lambda", "INSTANCE_ID": "i-live-0001", "PROVIDER_API_URL": fake.url, "PLANNED_HOURS": "24",
        "BUDGET_POLL_SECONDS": "1", "X1_CONFIG": "configs/tiny-cpu.yaml", "TOTAL_STEPS": "5000",
        "CKPT_EVERY": "1000", "EVAL_EVERY": "10", "LOG_EVERY": "2", "MLFLOW_WORKERS": "1",
        "TRAIN_EXTRA_ARGS": "--run-name x1-live --budget-check-every-min 0.25", **ports.env()}.items()))
    # Billed in real time: 5000 steps at the demo's 120x would not fit the cap, and the trainer's own
    # projection would stop the run (76) at its first steady interval. Spend still rises ($1.10/h).
    stack_env = cli_env(LAMBDA_API_KEY=key, OMP_NUM_THREADS="1")
    try:
        wait_until(fake.healthy, 60, "the fake billing API")
        # This module runs its own Prometheus, scraping every second.
        up = run_module("x1_pretrain.stack", "up", "-d", "--no-prometheus", "--env-file", str(env_file),
                        "--workspace", str(ws.root), env=stack_env, timeout=420)
        assert up.returncode == 0, up.stdout + up.stderr
        trainer = f"http://127.0.0.1:{ports.trainer}/metrics"
        # Past the first eval: every trainer gauge has been set from a real step.
        wait_until(lambda: scrape_or_empty(trainer).get(C.M_TRAIN_VAL_LOSS, 0) > 0, 180,
                   "the trainer's first eval on /metrics", interval=0.5)
        yield LiveStack(ws, ports)
    finally:
        run_module("x1_pretrain.stack", "down", "--workspace", str(ws.root), timeout=300)
        fake.stop()


def service_metrics(stack: LiveStack) -> dict[str, dict[str, float]]:
    p = stack.ports
    return {job: scrape(f"http://127.0.0.1:{port}/metrics")
            for job, port in (("trainer", p.trainer), ("budget-sidecar", p.sidecar), ("watchdog", p.watchdog))}


def queried_names() -> dict[str, set[str]]:
    """Metric name -> where it is queried (dashboard panels and alert rules), Prometheus' own series left out."""
    recorded = set().union(*(recorded_names(r) for r in RULES))
    where: dict[str, set[str]] = {}
    sources = [(f"panel {title!r}", expr) for title, expr in dashboard_exprs(DASHBOARD)]
    sources += [(f"rule {name}", expr) for rules in RULES for name, expr in rule_exprs(rules)]
    for label, expr in sources:
        for name in metric_names(expr) - SCRAPE_SERIES - recorded:
            where.setdefault(name, set()).add(label)
    return where


def test_every_metric_the_dashboard_and_alert_rules_query_is_exported_by_a_running_service(stack):
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["panels"], "the dashboard has no panels"
    exported = service_metrics(stack)
    everything = set().union(*exported.values())
    queried = queried_names()
    assert {C.M_TRAIN_TOKENS_PER_SECOND, C.M_BUDGET_SPENT, C.M_TRAIN_MFU, C.M_TRAIN_LOSS} <= set(queried)
    missing = {name: sorted(where) for name, where in queried.items() if name not in everything}
    assert not missing, f"queried but exported by no running service: {missing}"
    # And from the service Prometheus scrapes for it: names carry their service's prefix.
    for name in queried:
        job = "trainer" if name.startswith(("x1_train_", "x1_checkpoint_")) else (
            "budget-sidecar" if name.startswith("x1_budget_") else "watchdog")
        assert name in exported[job], f"{name} is not on the {job}'s /metrics"


@pytest.fixture(scope="module")
def prometheus(stack: LiveStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus server scraping the stack every second; its base URL."""
    if PROMETHEUS is None:
        pytest.skip("the Prometheus server is not installed (Debian package `prometheus`; .ci/run installs it)")
    root = tmp_path_factory.mktemp("prometheus")
    p = stack.ports
    config = local_prometheus_config(PROMETHEUS_YML, {
        "trainer": f"127.0.0.1:{p.trainer}", "budget-sidecar": f"127.0.0.1:{p.sidecar}",
        "watchdog": f"127.0.0.1:{p.watchdog}",
    })
    (root / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Service("prometheus", [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                     root / "prometheus.log", stack.env(), url=url, health_path="/-/ready")
    try:
        wait_until(server.healthy, 60, "Prometheus /-/ready", interval=0.3)
        yield url
    finally:
        server.stop()


def query(prometheus: str, expr: str) -> list[dict]:
    body = http_json(f"{prometheus}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_stack_and_answers_tokens_per_second_and_spend(stack, prometheus):
    def positive(expr: str) -> float | None:
        result = query(prometheus, expr)
        return float(result[0]["value"][1]) if result and float(result[0]["value"][1]) > 0 else None

    tokens_per_second = wait_until(lambda: positive(C.M_TRAIN_TOKENS_PER_SECOND), 60, "tokens/s in Prometheus")
    spent = wait_until(lambda: positive(C.M_BUDGET_SPENT), 60, "spend in Prometheus")
    assert 10 < tokens_per_second < 1e6  # the tiny model on a CPU: hundreds to thousands
    budget = json.loads(stack.ws.budget_file.read_text())
    assert 0 < spent <= budget["spent_usd"] <= budget["cap_usd"]  # the sidecar's figure, a scrape behind

    # All three targets up (a scrape can miss on a loaded machine: the next one, a second later, counts).
    def all_up() -> bool:
        up = {r["metric"]["job"]: r["value"][1] for r in query(prometheus, "up")}
        return up == {"trainer": "1", "budget-sidecar": "1", "watchdog": "1"}

    wait_until(all_up, 30, "the trainer, the sidecar and the watchdog up in Prometheus", interval=0.5)
    # Every dashboard panel shows data from the live stack; every alert rule is loaded and evaluates.
    for title, expr in dashboard_exprs(DASHBOARD):
        wait_until(lambda expr=expr: query(prometheus, expr), 15, f"data for panel {title!r} ({expr})", interval=0.5)
    rules = http_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    loaded = {r["name"]: r for g in rules for r in g["rules"]}
    expected = {name for path in RULES for name, _ in rule_exprs(path)}
    assert expected <= set(loaded)

    def rules_evaluated_ok() -> bool:
        groups = http_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
        return all(rule["health"] == "ok" for group in groups for rule in group["rules"])

    wait_until(rules_evaluated_ok, 30, "every rule evaluated without error", interval=1)
