"""Functions cannot take their neighbours down: four bad Python functions (one that exits, one that
never returns, one that leaks, one that answers the wrong shape and datatype) beside `classifier` on
one runner process; an in-process model that hangs; and what a function's process can see."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import redis.asyncio as aioredis

from fngate import keys
from tests.e2e import deployments
from tests.runner.slow_model import build_slow_model

NEIGHBOURS = ("classifier", "crasher", "hang", "leak", "misshapen")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLASSIFIER_CALLS = 120
CONCURRENCY = 6
RUNNER_MARGIN_BYTES = 64 * 2**20


def x_body(first: float = 1.0) -> dict[str, Any]:
    return {"inputs": {"x": [[first, 1.0, 2.0, 3.0]]}}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def children(pid: int) -> dict[int, str]:
    """Live child processes of `pid` and their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return int(sock.getsockname()[1])


async def until_ok(call: Callable[[], Awaitable[httpx.Response]], timeout_s: float = 60) -> httpx.Response:
    """Retry while the runner is still starting (the gateway answers 503 or 504 meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await call()
        if response.status_code == 200 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.2)


async def restarts(status: str, function: str, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{status}/metrics")).text
    pattern = rf'fngate_function_restarts_total\{{function="{function}",reason="{reason}"\}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def test_bad_functions_do_not_disturb_their_neighbours(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    repo: Path,
) -> None:
    base = await serve_gateway()
    port = free_port()
    runner = runner_process(FNGATE_FUNCTIONS=json.dumps(NEIGHBOURS), FNGATE_STATUS_PORT=str(port))
    status = f"http://127.0.0.1:{port}"
    session = ort.InferenceSession(
        str(repo / "classifier" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(15)
    inputs = [
        rng.standard_normal((int(rng.integers(1, 4)), 16), dtype=np.float32) for _ in range(CLASSIFIER_CALLS)
    ]
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        def classify(index: int) -> Awaitable[httpx.Response]:
            return client.post("/v1/functions/classifier", json={"inputs": {"input": inputs[index].tolist()}})

        def call(name: str, first: float = 1.0) -> Awaitable[httpx.Response]:
            return client.post(f"/v1/functions/{name}", json=x_body(first))

        # Both loaded before the runner's memory is measured.
        assert (await until_ok(lambda: classify(0))).status_code == 200
        assert (await until_ok(lambda: call("leak"))).status_code == 200
        runner_start_bytes = rss_bytes(runner.pid)

        limit = asyncio.Semaphore(CONCURRENCY)

        async def classified(index: int) -> httpx.Response:
            async with limit:
                return await classify(index)

        async def in_turn(name: str, count: int) -> list[httpx.Response]:
            return [await call(name, float(index)) for index in range(count)]

        neighbours = asyncio.gather(*(classified(index) for index in range(CLASSIFIER_CALLS)))
        crashed, hung, leaked, misshapen = await asyncio.gather(
            in_turn("crasher", 6), in_turn("hang", 3), in_turn("leak", 12), in_turn("misshapen", 4)
        )
        answers = await neighbours

    for number, response in enumerate(answers):
        assert response.status_code == 200, response.text
        expected = session.run(["probabilities"], {"input": inputs[number]})[0]
        np.testing.assert_allclose(
            response.json()["outputs"]["probabilities"], expected, rtol=1e-5, atol=1e-7
        )

    assert crashed[0].json()["error"] == (
        "function 'crasher': its process exited with code 3 while running the batch; "
        "it starts again for the next batch"
    )
    for response in crashed:
        assert response.status_code == 500
        assert response.json()["code"] == "model_failed"
        assert "exited with code 3" in response.json()["error"]
    for response in hung:
        assert response.status_code == 504
        assert response.json() == {
            "error": "function 'hang': the batch ran past its execution timeout of 1000 ms; "
            "its process was stopped and starts again for the next batch",
            "code": "model_timeout",
        }
    for number, response in enumerate(leaked):
        assert response.status_code == 200, response.text
        assert response.json()["outputs"]["y"] == [[number * 2.0, 2.0, 4.0, 6.0]]
    for response in misshapen:
        assert response.status_code == 500
        assert response.json()["code"] == "model_failed"
        assert response.json()["error"].startswith(
            "function 'misshapen': output 'y' has shape [1, 7, 3], declared [-1, 4]: rank 3, not 2; "
            "it is float64, declared FP32"
        )

    assert runner.poll() is None
    for name in NEIGHBOURS:
        assert await redis.xlen(keys.dead_letters(name)) == 0, name
    assert await restarts(status, "leak", "memory") >= 1
    assert await restarts(status, "crasher", "exited") >= 1
    assert rss_bytes(runner.pid) < runner_start_bytes + RUNNER_MARGIN_BYTES
    for pid, cmdline in children(runner.pid).items():
        if "--function leak" in cmdline:  # recycled: never far over its memory_limit_mb of 120
            assert rss_bytes(pid) < 150 * 2**20


async def test_a_function_sees_no_secrets_and_dies_with_its_runner(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis_url: str,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    dump = tmp_path / "snoop.json"
    runner = runner_process(
        FNGATE_FUNCTIONS='["snoop"]',
        SNOOP_DUMP=str(dump),
        SERVICE_API_TOKEN="token-of-the-runner",
        AWS_SECRET_ACCESS_KEY="key-of-the-runner",
    )
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        response = await until_ok(lambda: client.post("/v1/functions/snoop", json=x_body()))
    assert response.status_code == 200, response.text
    view = json.loads(dump.read_text())
    seen = view["environ"]
    assert [name for name in seen if name.startswith(("FNGATE_", "AWS_"))] == []
    assert "SERVICE_API_TOKEN" not in seen
    assert redis_url not in json.dumps(seen)  # the Redis URL (and its password) stays with the runner
    assert seen["SNOOP_DUMP"] == str(dump)  # a function's own settings pass
    assert view["ppid"] == runner.pid
    assert view["cwd"] == view["tempdir"]
    assert Path(view["cwd"]) != Path.cwd()

    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=10)
    for _ in range(100):  # it notices within half a second
        if not alive(view["pid"]):
            break
        await asyncio.sleep(0.1)
    assert not alive(view["pid"])


async def test_a_stuck_in_process_model_gets_no_more_work_and_unload_says_so(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    repo: Path,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "repo"
    build_slow_model(folder / "slow", execution_timeout_ms=300)
    shutil.copytree(repo / "classifier", folder / "classifier")
    base = await serve_gateway(repo=str(folder))
    runner = runner_process(FNGATE_REPO=str(folder), FNGATE_FUNCTIONS='["slow", "classifier"]')
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        loaded = await until_ok(lambda: client.post("/v1/functions/slow", json=x_body(1.0)))
        assert loaded.json()["outputs"]["y"] == [[1.0, 1.0, 2.0, 3.0]]

        # Twenty million turns of onnxruntime's loop: far past the function's 300 ms, and still
        # running at the unload below however fast the machine (the runner is killed at the end).
        stuck = await client.post("/v1/functions/slow", json=x_body(2e7))
        assert stuck.status_code == 504
        assert stuck.json()["code"] == "model_timeout"
        assert "ran past its execution timeout of 300 ms" in stuck.json()["error"]
        assert (await deployments.index(client))[("slow", "1")]["reason"].startswith(
            "stuck: a batch has run for"
        )

        # What a read already under way brought in is refused at once (503, retry)...
        early = await client.post("/v1/functions/slow", json={**x_body(2.0), "timeout_ms": 500})
        if early.status_code == 503:
            assert "this runner gives the function no work until it returns" in early.json()["error"]
        else:
            assert early.json()["code"] == "deadline_exceeded", early.text
        # ...then the runner leaves the function's work in the queue, for other runners...
        left = await client.post("/v1/functions/slow", json={**x_body(3.0), "timeout_ms": 500})
        assert left.status_code == 504, left.text
        assert left.json()["code"] == "deadline_exceeded"
        # ...and serves its other functions.
        classified = await client.post("/v1/functions/classifier", json={"inputs": {"input": [[0.5] * 16]}})
        assert classified.status_code == 200, classified.text

        unloaded = await client.post("/v2/repository/models/slow/unload")
        assert unloaded.status_code == 200, unloaded.text
        state = (await deployments.index(client))[("slow", "1")]
        assert state["state"] == "UNAVAILABLE"
        assert state["reason"].startswith("unloading: a batch has run for")
    runner.kill()  # its thread is still in the loop: it could only be killed at the drain timeout
    runner.wait()
