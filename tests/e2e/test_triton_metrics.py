"""`fngate up` as a user runs it, from a folder whose own `gateway.py`, `runner.py` and `fngate/`
would shadow fngate's, and its metrics port as Prometheus and Triton's dashboards read it: Triton's
nv_* names (with Triton's labels and units) beside fngate's, without a key; the alert rules of
deploy/prometheus/triton-rules.yaml and the dashboard in deploy/grafana evaluated on that scrape."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fngate import nv_metrics
from fngate.nvml import read_gpus
from fngate.process import stop_processes
from tests.conftest import ROOT, free_socket

UP_TIMEOUT_S = 60
RULES = ROOT / "deploy" / "prometheus" / "triton-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fngate-triton.json"
SHADOW = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nraise SystemExit(3)\n"
SUCCEEDED, FAILED, CACHE_HITS = 3, 2, 2
INTERVAL_S = 15


@dataclasses.dataclass(frozen=True)
class Scraped:
    version: str
    before: str
    after: str
    v2: httpx.Response
    keyless_main_metrics: int
    shadowed: Path


def free_port() -> int:
    with free_socket() as sock:
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """One `fngate up` (two gateway workers sharing the metrics port), started by its console
    script from a folder with shadowing modules; three invocations of classifier answered by a
    runner and two by the cache, two failed ones of misshapen, and a scrape of the metrics port
    before and after."""
    work = tmp_path_factory.mktemp("shadowed")
    for module in ("gateway", "runner"):
        (work / f"{module}.py").write_text(SHADOW.format(marker=str(work / f"{module}-ran")))
    (work / "fngate").mkdir()  # the clone's own folder, seen from its parent
    repo = work / "repo"
    shutil.copytree(ROOT / "functions" / "classifier", repo / "classifier")
    with (repo / "classifier" / "function.yaml").open("a") as manifest:
        manifest.write("cache: {enabled: true}\n")
    shutil.copytree(ROOT / "tests" / "functions" / "misshapen", repo / "misshapen")
    manifest = repo / "misshapen" / "function.yaml"
    manifest.write_text(manifest.read_text().replace("pool: isolation", "pool: default"))
    port, metrics_port = free_port(), free_port()
    state = work / "state"
    command = [str(Path(sys.executable).with_name("fngate")), "up", "--repo", str(repo)]
    command += ["--port", str(port), "--metrics-port", str(metrics_port), "--state-dir", str(state)]
    command += ["--gateway-workers", "2", "--no-standby-runner", "--grpc-port", "0"]
    log = work / "up.log"
    with log.open("wb") as output:
        up = subprocess.Popen(
            command, cwd=work, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    base, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not _answers(f"{base}/v2/health/ready"):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        key = (state / "admin.key").read_text().strip()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            before = httpx.get(metrics, timeout=10).text
            for row in [*range(SUCCEEDED), *range(CACHE_HITS)]:  # answered by a runner, then the cache
                body = {"inputs": {"input": [[float(row)] * 16]}}
                answer = client.post("/v1/functions/classifier", json=body)
                assert answer.status_code == 200, answer.text
            for _ in range(FAILED):
                answer = client.post("/v1/functions/misshapen", json={"inputs": {"x": [[1, 2, 3, 4]]}})
                assert answer.status_code == 500 and answer.json()["code"] == "model_failed", answer.text
            v2 = client.get("/v2")
            after = httpx.get(metrics, timeout=10)
            assert after.status_code == 200, after.text
            keyless = httpx.get(f"{base}/metrics", timeout=10).status_code
        yield Scraped(metadata.version("fngate"), before, after.text, v2, keyless, work)
    finally:
        stop_processes([up], timeout_s=60)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name as written, sorted labels); the text must parse as
    Prometheus's (whose parser would add `_total` to the counters' names)."""
    assert list(text_string_to_metric_families(text))
    found = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is not None and not line.startswith("#"):
            labels = tuple(sorted(LABEL.findall(match.group(2) or "")))
            found[(match.group(1), labels)] = float(match.group(3))
    return found


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def test_fngate_up_runs_its_own_components_whatever_the_current_folder_holds(scraped: Scraped) -> None:
    assert scraped.v2.status_code == 200, scraped.v2.text
    assert scraped.v2.json()["version"] == scraped.version != "0+unknown"
    assert sorted(path.name for path in scraped.shadowed.glob("*-ran")) == []
    version = subprocess.run(
        [str(Path(sys.executable).with_name("fngate")), "--version"],
        cwd=scraped.shadowed,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert version.stdout.strip() == f"fngate {scraped.version}"


def test_the_metrics_port_has_tritons_names_beside_fngates_without_a_key(scraped: Scraped) -> None:
    after = scraped.after
    classifier = {"model": "classifier", "version": "1"}
    misshapen = {"model": "misshapen", "version": "1"}
    assert value(scraped.before, "nv_inference_request_success", **classifier) == 0
    assert value(after, "nv_inference_request_success", **classifier) == SUCCEEDED
    for reason in nv_metrics.REASONS:  # as Triton labels failures: by reason
        assert value(after, "nv_inference_request_failure", **classifier, reason=reason) == 0
    assert value(after, "nv_inference_request_failure", **misshapen, reason="BACKEND") == FAILED
    assert value(after, "nv_inference_count", **classifier) == SUCCEEDED  # one row each
    assert 1 <= value(after, "nv_inference_exec_count", **classifier) <= SUCCEEDED
    durations = {name: value(after, name, **classifier) for name, *_ in nv_metrics.INFERENCE}
    # Microseconds: a request's duration covers its queue time and its batch's.
    request_us = durations["nv_inference_request_duration_us"]
    assert request_us >= durations["nv_inference_queue_duration_us"] > 0
    assert request_us >= durations["nv_inference_compute_infer_duration_us"] > 0
    assert request_us < 120 * 1_000_000 * SUCCEEDED
    assert "# TYPE nv_inference_request_success counter" in after  # Triton's name: no _total
    assert value(after, "nv_cache_num_hits_per_model", model="classifier") == CACHE_HITS
    assert value(after, "nv_cache_num_misses_per_model", model="classifier") == SUCCEEDED
    # fngate's own name counts this gateway's answers, the cache's included.
    successes = value(after, "fngate_request_success_total", function="classifier", version="1")
    assert successes == SUCCEEDED + CACHE_HITS
    assert ("nv_gpu_utilization" in after) == bool(read_gpus())  # from NVML, where there is a GPU
    assert scraped.keyless_main_metrics == 401  # the gateway's own port still wants a key


def _series_values(before: float, after: float) -> str:
    """A counter that grows by what the scrape saw, every interval, for 30 minutes."""
    return f"{before:g}+{after - before:g}x120"


def test_tritons_alerts_on_a_real_scrape(scraped: Scraped, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (scripts/bootstrap installs Debian's prometheus package)")
    before, after = samples(scraped.before), samples(scraped.after)
    series = [
        {"series": _selector(name, labels), "values": _series_values(before.get((name, labels), 0), count)}
        for (name, labels), count in after.items()
        if name.startswith("nv_inference_")
    ]
    # No GPU here: one that is nearly full and always busy, to see the GPU alerts fire.
    gpu = '{gpu_uuid="GPU-00000000-0000-0000-0000-000000000000"}'
    series += [
        {"series": f"nv_gpu_memory_total_bytes{gpu}", "values": "100x120"},
        {"series": f"nv_gpu_memory_used_bytes{gpu}", "values": "97x120"},
        {"series": f"nv_gpu_utilization{gpu}", "values": "0.99x120"},
    ]
    rules = {
        rule.get("alert"): rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    expected = _expected_alerts(before, after)
    tests = [
        {
            "expr": f"count by ({'gpu_uuid' if name.startswith('FngateGpu') else 'model'}) ({rules[name]})",
            "eval_time": "20m",
            "exp_samples": [{"labels": labels, "value": 1} for labels in expected[name]],
        }
        for name in expected
    ]
    assert {name for name in rules if name} == set(expected)
    document = {
        "rule_files": [str(RULES)],
        "evaluation_interval": f"{INTERVAL_S}s",
        "tests": [{"interval": f"{INTERVAL_S}s", "input_series": series, "promql_expr_test": tests}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(document, sort_keys=False))
    done = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected["FngateModelFailureRate"] == ['{model="misshapen"}']


def _expected_alerts(
    before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> dict[str, list[str]]:
    """Which models each alert names, computed here from the same increments."""

    def grew(name: str, model: str) -> float:
        return sum(
            count - before.get((metric, labels), 0)
            for (metric, labels), count in after.items()
            if metric == name and dict(labels)["model"] == model
        )

    models = sorted(
        {dict(labels)["model"] for name, labels in after if name == "nv_inference_request_success"}
    )
    firing: dict[str, list[str]] = {
        "FngateModelFailureRate": [],
        "FngateModelSlow": [],
        "FngateModelQueueing": [],
    }
    for model in models:
        success, failure = (
            grew("nv_inference_request_success", model),
            grew("nv_inference_request_failure", model),
        )
        if failure / (success + failure) > 0.05 and failure / INTERVAL_S > 0.1:
            firing["FngateModelFailureRate"].append(f'{{model="{model}"}}')
        if success and grew("nv_inference_request_duration_us", model) / success > 1e6:
            firing["FngateModelSlow"].append(f'{{model="{model}"}}')
        if success and grew("nv_inference_queue_duration_us", model) / success > 1e5:
            firing["FngateModelQueueing"].append(f'{{model="{model}"}}')
    gpu = ['{gpu_uuid="GPU-00000000-0000-0000-0000-000000000000"}']
    return {**firing, "FngateGpuMemoryNearlyFull": gpu, "FngateGpuSaturated": gpu}


def _selector(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    return name + "{" + ",".join(f'{key}="{text}"' for key, text in labels) + "}"


def test_the_dashboard_reads_what_the_metrics_port_exports(scraped: Scraped, tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs and all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    families = set(re.findall(r"^# TYPE (\S+) ", scraped.after, re.MULTILINE))
    exported = families | {name for name, _, _ in nv_metrics.GPU}
    used = {name for expr in exprs for name in re.findall(r"\bnv_[a-z_]+\b", expr)}
    assert used <= exported, used - exported
    assert {"nv_inference_request_success", "nv_inference_queue_duration_us", "nv_gpu_utilization"} <= used
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: the dashboard's queries were not parsed")
    concrete = [expr.replace("$__rate_interval", "1m").replace("$model", ".*") for expr in exprs]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:panel{index}:expr", "expr": expr}
                    for index, expr in enumerate(concrete)
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "dashboard.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


TRITON_SCRAPE = Path(__file__).with_name("triton-2.51-metrics.txt")


def families_of(text: str) -> dict[str, tuple[str, str, set[frozenset[str]]]]:
    """Each family's type, help and the label names of its samples."""
    found = {}
    for family in text_string_to_metric_families(text):
        names = {frozenset(sample.labels) for sample in family.samples}
        found[family.name] = (family.type, family.documentation, names)
    return found


def test_tritons_families_are_as_triton_exports_them(scraped: Scraped) -> None:
    """Every family of a real Triton's CPU scrape is on fngate's metrics port with Triton's type,
    help text and label names: a dashboard, alert or recording rule written against Triton reads it."""
    triton = families_of(TRITON_SCRAPE.read_text())
    ours = families_of(scraped.after)
    missing = sorted(triton.keys() - ours.keys())
    assert missing == [], f"Triton's families fngate does not export: {missing}"
    for name, (kind, text, labels) in triton.items():
        assert ours[name][:2] == (kind, text), name
        assert ours[name][2] == labels, (name, ours[name][2], labels)
    reasons = {
        sample.labels["reason"]
        for family in text_string_to_metric_families(scraped.after)
        if family.name == "nv_inference_request_failure"
        for sample in family.samples
    }
    assert reasons == {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
    assert 0.0 <= value(scraped.after, "nv_cpu_utilization") <= 1.0
    used, total = (value(scraped.after, f"nv_cpu_memory_{kind}_bytes") for kind in ("used", "total"))
    assert 0 < used < total
