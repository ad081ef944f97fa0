"""The metric names a PromQL expression reads, and the names the X1 services export.

Used to check that every query of the Grafana dashboard and every alert rule reads a metric the
services really export: statically against x1_common.contracts here, and against a live scrape
of the process-mode stack where a test has one.

The parser is deliberately small. It understands what PromQL in this repo uses: selectors with
label matchers, functions, aggregations with by/without, on/ignoring/group_left/group_right,
range and subquery brackets, offset and @ modifiers, numbers, strings and Grafana's $variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

from x1_common import contracts as C

KEYWORDS = frozenset({
    # aggregation operators (followed by `by (...)`, `without (...)` or `(`)
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # modifiers and binary operators spelled as words
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless", "atan2",
    # literals
    "inf", "nan",
})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MODIFIER = re.compile(r"\boffset\s+-?\w+|@\s*[\w.()]+")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")

# Counters: prometheus_client exports them with a `_total` suffix on the contract's name.
COUNTERS = frozenset({C.M_TRAIN_TOKENS, C.M_BUDGET_POLL_FAILURES, C.M_WATCHDOG_RESTARTS, C.M_WATCHDOG_DOWNTIME})
# Series Prometheus itself writes for every scrape target.
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects (function and keyword names excluded)."""
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub("1", text)
    text = _MATCHERS.sub("", text)
    text = _BRACKETS.sub("", text)
    text = _LABEL_LIST.sub(r"\1", text)
    text = _MODIFIER.sub("", text)
    names = set()
    for m in _IDENTIFIER.finditer(text):
        before = text[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":  # the exponent of 1e9, the x of 0x1f
            continue
        if text[m.end():].lstrip().startswith("("):  # a function call
            continue
        if m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def contract_metric_names() -> set[str]:
    """Every name the trainer, sidecar and watchdog export, as a scrape shows it."""
    declared = {value for key, value in vars(C).items() if key.startswith("M_") and isinstance(value, str)}
    return (declared - COUNTERS) | {name + "_total" for name in COUNTERS}


def dashboard_exprs(path: Path) -> Iterator[tuple[str, str]]:
    """(panel title, expression) for every query of a Grafana dashboard JSON, rows included."""

    def walk(panels: list[dict]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield panel.get("title", ""), target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(json.loads(path.read_text(encoding="utf-8"))["panels"])


def rule_exprs(path: Path) -> Iterator[tuple[str, str]]:
    """(alert or record name, expression) for every rule of a Prometheus rules file."""
    for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule.get("record"), str(rule["expr"])


def recorded_names(path: Path) -> set[str]:
    return {rule["record"] for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]
            for rule in group["rules"] if "record" in rule}


def local_prometheus_config(config_path: Path, targets: dict[str, str], scrape_interval: str = "1s") -> dict:
    """monitoring/prometheus/prometheus.yml for a Prometheus started by a test: each job scrapes
    `targets[job]` (e.g. "127.0.0.1:40123") instead of the compose service name, rule files are
    absolute paths, and scrapes come every `scrape_interval`."""
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = scrape_interval
    config["rule_files"] = [str(config_path.parent / pattern) for pattern in config.get("rule_files", [])]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(targets) <= set(jobs), f"unknown jobs {set(targets) - set(jobs)}; prometheus.yml has {set(jobs)}"
    config["scrape_configs"] = [{**jobs[name], "static_configs": [{"targets": [target]}]}
                                for name, target in targets.items()]
    return config
