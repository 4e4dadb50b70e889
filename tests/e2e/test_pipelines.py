"""Pipelines over real runners: answers equal to calling the steps in turn, steps batched with
direct calls, a failing middle step, the deadline between steps, and steps' pools woken from zero."""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client import REGISTRY

from fngate import keys
from fngate.cli.deploy import deploy
from fngate.repository import FolderRepository
from fngate.up.scaler import LocalScaler
from tests.conftest import on_cluster_too, queued_invocations, wait_http
from tests.e2e.deployments import ROW, invoke, scale_function
from tests.e2e.test_observability import Receiver, receiver
from tests.e2e.test_scale_to_zero import scaler

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["receiver", "scaler"]  # fixtures of the observability and scale-to-zero tests
ROWS = np.arange(3 * 16, dtype=np.float32).reshape(3, 16) - 20

MODEL = """import time

import numpy as np


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        {body}
"""
MODELS = {
    "double": "return {'y': inputs['x'] * 2}",
    "merge": "return {'out': np.concatenate([inputs['a'], inputs['b']], axis=1)}",
    "reject": "raise ValueError('no rows accepted here')",
    "slow": "time.sleep(float(inputs['x'][0, 0]))\n        return {'y': inputs['x']}",  # x[0, 0] seconds
}


def tensor(name: str, width: int) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": [-1, width]}


def step(name: str, function: str, **inputs: str) -> dict[str, Any]:
    return {"name": name, "function": function, "inputs": inputs}


def write(folder: Path, manifest: dict[str, Any]) -> None:
    (folder / manifest["name"]).mkdir(parents=True, exist_ok=True)
    (folder / manifest["name"] / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


def python_function(folder: Path, name: str, inputs: list[Any], outputs: list[Any]) -> None:
    batching = {"max_batch_size": 32, "max_queue_delay_us": 0, "timeout_ms": 20000}
    model = {"backend": "python", "path": "model.py"}
    write(folder, {"name": name, "model": model, "inputs": inputs, "outputs": outputs, "batching": batching})
    (folder / name / "model.py").write_text(MODEL.replace("{body}", MODELS[name]))


def pipeline(
    name: str, outputs: list[Any], steps: list[Any], sources: dict[str, str], **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "inputs": [tensor("input", 16)],
        "outputs": outputs,
        "batching": {"timeout_ms": 20000},
        "pipeline": {"steps": steps, "outputs": sources},
        **extra,
    }


def make_repository(folder: Path, scoring_pool: str = "default") -> Path:
    """normalize and classifier (the examples; the classifier's deadline longer, its pool given),
    small python functions, and the pipelines over them."""
    for name in ("normalize", "classifier"):
        shutil.copytree(ROOT / "functions" / name, folder / name)
    classifier = yaml.safe_load((folder / "classifier" / "function.yaml").read_text())
    classifier["batching"]["timeout_ms"] = 20000
    classifier["scaling"] = {"pool": scoring_pool}
    write(folder, classifier)
    shutil.copytree(folder / "classifier", folder / "memo-classifier")
    write(folder, {**classifier, "name": "memo-classifier", "cache": {"enabled": True, "ttl_s": 60}})
    shutil.copytree(folder / "classifier", folder / "narrow")
    write(
        folder, {**classifier, "name": "narrow", "batching": {**classifier["batching"], "max_queue_size": 1}}
    )
    python_function(folder, "double", [tensor("x", 16)], [tensor("y", 16)])
    python_function(folder, "merge", [tensor("a", 4), tensor("b", 16)], [tensor("out", 20)])
    python_function(folder, "reject", [tensor("x", 16)], [tensor("y", 16)])
    python_function(folder, "slow", [tensor("x", 16)], [tensor("y", 16)])
    norm = step("norm", "normalize", input="request.input")
    probabilities = [tensor("probabilities", 4)]
    write(
        folder,
        pipeline(
            "scored",
            probabilities,
            [norm, step("score", "classifier", input="norm.normalized")],
            {"probabilities": "score.probabilities"},
        ),
    )
    write(
        folder,
        pipeline(
            "diamond",
            [tensor("merged", 20), tensor("normalized", 16)],
            [
                step("join", "merge", a="left.probabilities", b="right.y"),
                norm,
                step("left", "classifier", input="norm.normalized"),
                step("right", "double", x="norm.normalized"),
            ],
            {"merged": "join.out", "normalized": "norm.normalized"},
        ),
    )
    scored = [norm, step("score", "classifier", input="norm.normalized")]
    cache = {"enabled": True, "ttl_s": 60}
    write(
        folder,
        pipeline("cached", probabilities, scored, {"probabilities": "score.probabilities"}, cache=cache),
    )
    write(
        folder,
        pipeline(
            "memo",
            [*probabilities, tensor("normalized", 16)],
            [norm, step("score", "memo-classifier", input="norm.normalized")],
            {"probabilities": "score.probabilities", "normalized": "norm.normalized"},
        ),
    )
    write(
        folder,
        pipeline(
            "crowded",
            probabilities,
            [norm, step("score", "narrow", input="norm.normalized")],
            {"probabilities": "score.probabilities"},
        ),
    )
    write(
        folder,
        pipeline(
            "broken",
            probabilities,
            [
                norm,
                step("middle", "reject", x="norm.normalized"),
                step("score", "classifier", input="middle.y"),
            ],
            {"probabilities": "score.probabilities"},
        ),
    )
    write(
        folder,
        pipeline(
            "sluggish",
            probabilities,
            [step("wait", "slow", x="request.input"), step("score", "classifier", input="wait.y")],
            {"probabilities": "score.probabilities"},
        ),
    )
    return folder


@pytest.fixture(scope="module")
def pipelines_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repository(tmp_path_factory.mktemp("pipelines"))


@pytest.fixture
async def stack(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    pipelines_repo: Path,
    redis: aioredis.Redis,
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway and one runner serving every function of the pipelines' repository."""
    base = await serve_gateway(repo=str(pipelines_repo))
    await inprocess_runner(repo=str(pipelines_repo))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        yield client


def normalized(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def classified(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    session = ort.InferenceSession(str(ROOT / "functions" / "classifier" / "model.onnx"))
    result: np.ndarray[Any, Any] = session.run(["probabilities"], {"input": rows.astype(np.float32)})[0]
    return result


async def call(
    client: httpx.AsyncClient, name: str, rows: np.ndarray[Any, Any], **extra: Any
) -> httpx.Response:
    return await client.post(f"/v1/functions/{name}", json={"inputs": {"input": rows.tolist()}, **extra})


def steps_done(step_name: str) -> float:
    labels = {"pipeline": "scored", "step": step_name, "outcome": "success"}
    return REGISTRY.get_sample_value("fngate_pipeline_steps_total", labels) or 0.0


@on_cluster_too
async def test_two_step_and_diamond_pipelines_answer_as_their_steps_in_turn(
    stack: httpx.AsyncClient, redis: aioredis.Redis
) -> None:
    counted = [steps_done(name) for name in ("norm", "score")]
    scored = await call(stack, "scored", ROWS)
    assert scored.status_code == 200, scored.text
    expected = classified(normalized(ROWS))
    np.testing.assert_allclose(
        np.array(scored.json()["outputs"]["probabilities"]), expected, rtol=1e-5, atol=1e-6
    )
    assert scored.json()["version"] == "1"
    assert [steps_done(name) for name in ("norm", "score")] == [before + 1 for before in counted]
    assert not await redis.exists(keys.invocations("scored"))  # no runner reads a pipeline's own stream

    diamond = await call(stack, "diamond", ROWS)
    assert diamond.status_code == 200, diamond.text
    outputs = diamond.json()["outputs"]
    norm = normalized(ROWS)
    np.testing.assert_allclose(
        np.array(outputs["merged"]),
        np.concatenate([classified(norm), norm * 2], axis=1),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(np.array(outputs["normalized"]), norm, rtol=1e-6)

    # The V2 route and the metadata Triton's clients read describe the pipeline itself.
    body = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 16], "data": ROWS.ravel().tolist()}]
    }
    v2 = await stack.post("/v2/models/scored/infer", json=body)
    assert v2.status_code == 200, v2.text
    assert v2.json()["outputs"][0]["name"] == "probabilities"
    metadata = (await stack.get("/v2/models/scored")).json()
    assert metadata["platform"] == "ensemble"
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
    config = (await stack.get("/v2/models/diamond/config")).json()
    assert config["platform"] == "ensemble"
    assert [item["model_name"] for item in config["ensemble_scheduling"]["step"]] == [
        "normalize",
        "classifier",
        "double",
        "merge",
    ]
    assert config["ensemble_scheduling"]["step"][0]["output_map"] == {"normalized": "normalized"}


@on_cluster_too
async def test_a_pipeline_with_its_cache_on_answers_a_repeat_from_the_cache(stack: httpx.AsyncClient) -> None:
    first = await call(stack, "cached", ROWS)
    assert first.status_code == 200, first.text
    assert (first.headers["x-fngate-cache"], first.json()["cached"]) == ("miss", False)
    again = await call(stack, "cached", ROWS)
    assert (again.headers["x-fngate-cache"], again.json()["cached"]) == ("hit", True)
    assert again.json()["outputs"] == first.json()["outputs"]
    stats = (await stack.get("/v2/models/classifier/stats")).json()["model_stats"][0]
    assert stats["execution_count"] == 1  # the repeat ran no step


async def test_a_step_whose_function_has_its_cache_on_shares_it_with_direct_calls(
    stack: httpx.AsyncClient,
) -> None:
    first = await call(stack, "memo", ROWS)
    assert first.status_code == 200, first.text
    again = await call(stack, "memo", ROWS)
    assert again.status_code == 200, again.text
    assert again.json()["outputs"] == first.json()["outputs"]
    stats = (await stack.get("/v2/models/memo-classifier/stats")).json()["model_stats"][0]
    assert stats["execution_count"] == 1  # the second `score` was answered from the cache
    normalized_rows = np.array(first.json()["outputs"]["normalized"], dtype=np.float32)
    direct = await call(stack, "memo-classifier", normalized_rows)
    assert direct.headers["x-fngate-cache"] == "hit"
    assert direct.json()["outputs"]["probabilities"] == first.json()["outputs"]["probabilities"]


async def test_a_failing_middle_step_is_named_and_later_steps_do_not_run(stack: httpx.AsyncClient) -> None:
    response = await call(stack, "broken", ROWS)
    assert response.status_code == 500, response.text
    doc = response.json()
    assert doc["code"] == "model_failed"
    assert doc["error"].startswith("step 'middle' (reject v1): "), doc
    assert "no rows accepted here" in doc["error"]
    stats = (await stack.get("/v2/models/classifier/stats")).json()["model_stats"][0]
    assert stats["execution_count"] == 0  # `score`, after the failed step, never ran
    # A bad request is still refused at the gateway against the pipeline's own inputs.
    wrong = await call(stack, "scored", np.ones((1, 8), dtype=np.float32))
    assert wrong.status_code == 400


def expired(function: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "fngate_runner_invocations_total", {"function": function, "outcome": "deadline_exceeded"}
        )
        or 0.0
    )


async def test_a_step_that_would_start_after_the_deadline_is_not_run(
    stack: httpx.AsyncClient, redis: aioredis.Redis
) -> None:
    warm = await stack.post("/v1/functions/slow", json={"inputs": {"x": [[0.0] * 16]}})  # loaded now
    assert warm.status_code == 200, warm.text
    before = expired("classifier")
    response = await call(stack, "sluggish", np.full((1, 16), 1.5, dtype=np.float32), timeout_ms=500)
    assert response.status_code == 504, response.text
    # `wait` (1.5 s) finishes after the deadline and queues `score`, which the runner answers
    # without running it.
    for _ in range(100):
        if (
            expired("classifier") > before
            and await queued_invocations(redis, keys.invocations("classifier")) == 0
        ):
            break
        await asyncio.sleep(0.1)
    assert expired("classifier") == before + 1
    stats = (await stack.get("/v2/models/classifier/stats")).json()["model_stats"][0]
    assert stats["execution_count"] == 0


async def test_pipeline_steps_share_batches_with_direct_calls(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    pipelines_repo: Path,
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway(repo=str(pipelines_repo))
    # The classifier has no runner yet: its invocations, direct or from pipelines, wait together.
    await inprocess_runner(repo=str(pipelines_repo), functions=("normalize",))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        piped = [asyncio.create_task(call(client, "scored", ROWS[i : i + 1])) for i in range(3)]
        direct = [asyncio.create_task(call(client, "classifier", ROWS[i : i + 1])) for i in range(3)]
        for _ in range(300):
            if await queued_invocations(redis, keys.invocations("classifier")) == 6:
                break
            await asyncio.sleep(0.05)
        assert (
            await queued_invocations(redis, keys.invocations("classifier")) == 6
        )  # 3 direct, 3 after `norm`
        await inprocess_runner(repo=str(pipelines_repo), functions=("classifier",))
        piped_replies = await asyncio.gather(*piped)
        direct_replies = await asyncio.gather(*direct)
    assert all(reply.status_code == 200 for reply in (*piped_replies, *direct_replies))
    piped_batches = {reply.json()["batch"]["id"] for reply in piped_replies}
    direct_batches = {reply.json()["batch"]["id"] for reply in direct_replies}
    assert piped_batches == direct_batches and len(piped_batches) == 1
    assert piped_replies[0].json()["batch"]["size"] == 6


async def test_a_pipeline_wakes_the_pools_of_its_steps_from_zero(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any], tmp_path: Path
) -> None:
    repo = make_repository(tmp_path / "repo", scoring_pool="scoring")
    base = await serve_gateway(repo=str(repo))
    local: LocalScaler = await scaler(idle_shutdown_s=30.0, repository=repo)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        response = await call(client, "scored", ROWS)
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(
        np.array(response.json()["outputs"]["probabilities"]),
        classified(normalized(ROWS)),
        rtol=1e-5,
        atol=1e-6,
    )
    started = {name for _at, name, count in local.timeline if count > 0}
    assert {"default", "scoring"} <= started


async def test_one_trace_with_a_span_per_step_under_the_request(
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    receiver: tuple[Receiver, str],
    pipelines_repo: Path,
    redis: aioredis.Redis,
) -> None:
    spans, endpoint = receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "FNGATE_REPO": str(pipelines_repo),
    }
    base = gateway_process(**env)
    await wait_http(base)
    runner_process(**env)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        response = await call(client, "scored", ROWS)
    assert response.status_code == 200, response.text
    for _ in range(100):
        if spans.named("step score") and spans.named("POST"):
            break
        await asyncio.sleep(0.1)
    (server,) = [
        span for span in spans.named("POST /v1/functions/{name}") if span["service"] == "fngate-gateway"
    ]
    (request,) = spans.named("pipeline scored")
    assert (request["trace"], request["parent"]) == (server["trace"], server["id"])
    for name, function in (("norm", "normalize"), ("score", "classifier")):
        (step_span,) = spans.named(f"step {name}")
        assert (step_span["trace"], step_span["parent"]) == (request["trace"], request["id"])
        assert step_span["attributes"]["fngate.function"].string_value == function
        (execute,) = spans.named(f"execute {function}")
        assert (execute["trace"], execute["parent"]) == (request["trace"], request["id"])


async def test_a_pinned_step_runs_its_version_and_an_unpinned_one_follows_routing(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    (tmp_path / "repo").mkdir()
    repository = FolderRepository(tmp_path / "repo")
    x = {"name": "x", "datatype": "FP32", "shape": [-1, 2]}
    y = {"name": "y", "datatype": "FP32", "shape": [-1, 2]}
    paths = [scale_function(tmp_path / f"v{factor}", "scale", factor, {"policy": "all"}) for factor in (2, 3)]
    for name, function in (("pinned", "scale@1"), ("routed", "scale")):
        doc = {
            "name": name,
            "inputs": [x],
            "outputs": [y],
            "batching": {"max_batch_size": 16},  # as many rows as its step takes
            "pipeline": {"steps": [step("s", function, x="request.x")], "outputs": {"y": "s.y"}},
        }
        write(tmp_path / "pipelines", doc)
        paths.append(tmp_path / "pipelines" / name / "function.yaml")
    out, err = io.StringIO(), io.StringIO()
    for path in paths:  # one at a time: both versions of `scale`
        assert await asyncio.to_thread(deploy, path, repository, redis_url, None, out, err) == 0, (
            err.getvalue()
        )
    base = await serve_gateway(repo=str(tmp_path / "repo"))
    await inprocess_runner(repo=str(tmp_path / "repo"))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        pinned = await invoke(client, "/v1/functions/pinned")
        routed = await invoke(client, "/v1/functions/routed")
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["outputs"]["y"] == [[value * 2 for value in ROW]]
    assert routed.json()["outputs"]["y"] == [[value * 3 for value in ROW]]  # the newest served: 100 %


async def test_a_full_queue_of_a_later_step_is_a_503_naming_the_step(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    pipelines_repo: Path,
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway(repo=str(pipelines_repo))
    await inprocess_runner(repo=str(pipelines_repo), functions=("normalize",))  # nobody serves `narrow`
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        waiting = asyncio.create_task(call(client, "narrow", ROWS[:1], timeout_ms=2000))
        for _ in range(100):
            if await queued_invocations(redis, keys.invocations("narrow")) == 1:  # its one place is taken
                break
            await asyncio.sleep(0.05)
        response = await call(client, "crowded", ROWS[:1])
        assert (await waiting).status_code == 504
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]
    assert response.json()["code"] == "overloaded"
    assert response.json()["error"] == (
        "step 'score' (narrow v1): function 'narrow' has too many invocations queued (max_queue_size); "
        "retry later"
    )
