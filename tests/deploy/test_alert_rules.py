"""deploy/prometheus/rules.yaml (fngate's names) and triton-rules.yaml (Triton's, from the metrics
port): parsed and checked for what an alert needs (names, durations, severity, texts) and for the
metrics fngate exports; `promtool check rules` (scripts/bootstrap installs it). The alerts on
Triton's names run on a real scrape in tests/e2e/test_triton_metrics.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import ROOT, find_tool

from fngate import nv_metrics

RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
TRITON_RULES = ROOT / "deploy" / "prometheus" / "triton-rules.yaml"
METRICS = {
    "fngate_request_success_total",
    "fngate_request_failure_total",
    "fngate_request_duration_seconds_bucket",
    "fngate_request_duration_seconds_count",
    "fngate_request_duration_seconds_sum",
    "fngate_queue_depth",
}
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")  # level:metric:operations
TEMPLATE = re.compile(r"\{\{(.*?)\}\}")


def rules(path: Path = RULES) -> list[dict[str, Any]]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert set(document) == {"groups"}
    found: list[dict[str, Any]] = []
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"], group.get("name")
        found += group["rules"]
    return found


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


@pytest.mark.parametrize("path", [RULES, TRITON_RULES], ids=lambda path: path.name)
def test_every_rule_is_well_formed(path: Path) -> None:
    names = [rule.get("alert") or rule.get("record") for rule in rules(path)]
    assert len(names) == len(set(names)), "duplicate rule names"
    for rule in rules(path):
        assert ("alert" in rule) != ("record" in rule), rule
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
        if "record" in rule:
            assert RECORD_NAME.match(rule["record"]), rule["record"]
            assert set(rule) == {"record", "expr"}
            continue
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert re.match(r"^Fngate[A-Z][A-Za-z0-9]+$", rule["alert"])
        assert DURATION.match(rule["for"]), rule["for"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])
        for text in rule["annotations"].values():
            for expression in TEMPLATE.findall(text):
                assert "$labels" in expression or "$value" in expression, expression


def test_rules_use_only_metrics_fngate_exports() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        for name in re.findall(r"\bfngate[_:][a-z0-9_:]+", rule["expr"]):
            assert name in METRICS or name in recorded, name


def test_alerts_cover_failures_latency_and_backlog() -> None:
    recorded = {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}

    def expanded(expr: str) -> str:
        for name, definition in recorded.items():
            expr = expr.replace(name, definition)
        return expr

    exprs = {name: expanded(rule["expr"]) for name, rule in alerts().items()}
    assert any(
        "fngate_request_failure_total" in e and "fngate_request_success_total" in e for e in exprs.values()
    )
    assert any(
        "histogram_quantile(0.99" in e and "fngate_request_duration_seconds_bucket" in e
        for e in exprs.values()
    )
    assert any("fngate_queue_depth" in e for e in exprs.values())
    for expr in exprs.values():
        assert "by (function" in expr, expr  # one alert per function, named in its summary


def test_tritons_rules_use_tritons_names_as_the_metrics_port_exports_them() -> None:
    exported = {name for name, *_ in nv_metrics.INFERENCE} | {name for name, _, _ in nv_metrics.GPU}
    exported |= {nv_metrics.FAILURE, "nv_inference_pending_request_count"}
    recorded = {rule["record"] for rule in rules(TRITON_RULES) if "record" in rule}
    for rule in rules(TRITON_RULES):
        for name in re.findall(r"\b(?:nv_|model:)[a-z0-9_:]+", rule["expr"]):
            assert name in exported or name in recorded, name
        assert "fngate_" not in rule["expr"]
    alerts = {rule["alert"]: rule["expr"] for rule in rules(TRITON_RULES) if "alert" in rule}
    for expr in alerts.values():
        assert "by (model" in expr or "by (gpu_uuid" in expr or expr.startswith("model:"), expr


@pytest.mark.parametrize("path", [RULES, TRITON_RULES], ids=lambda path: path.name)
def test_promtool_accepts_the_rules(path: Path) -> None:
    promtool = find_tool("promtool")
    if promtool is None:
        pytest.skip(
            "promtool is not installed (Debian: apt-get install prometheus); rules checked by parsing only"
        )
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
