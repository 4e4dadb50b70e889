"""Triton's auto-complete of Python models with no config.pbtxt: their auto_complete_config run by
`python -m runner.triton.complete` (a real process, the model's code in a confined process of its
own), recorded in Redis, and served from there by a gateway and a runner that never run the model's
code to read the repository; again when the model changes; a model whose auto_complete_config fails
is named with why, and the others serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton_http
from redis.exceptions import RedisError
from tritonclient.utils import InferenceServerException

from fngate import clients, keys
from fngate.process import module_command
from runner.triton.complete import INTERVAL_S
from tests.conftest import start_redis

ADD_SUB = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        for kind, names in (("input", ("INPUT0", "INPUT1")), ("output", ("OUTPUT0", "OUTPUT1"))):
            known = [tensor["name"] for tensor in config[kind]]
            for name in names:
                if name not in known:
                    add = getattr(auto_complete_model_config, "add_" + kind)
                    add({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.set_max_batch_size(MAX_BATCH)
        if MAX_BATCH:
            auto_complete_model_config.set_dynamic_batching()
        # What its process could see of the one that ran it: nothing of fngate's settings.
        config["parameters"] = {"seen": {"string_value": os.environ.get("FNGATE_REDIS_URL", "")}}
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            left = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            right = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", left + right), pb_utils.Tensor("OUTPUT1", left - right)
            ]))
        return responses
"""

BROKEN = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32"})
        return auto_complete_model_config

    def execute(self, requests):
        return []
"""


def python_model(root: Path, name: str, code: str) -> Path:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "1" / "model.py").write_text(code)
    return root / name


def complete(root: Path, redis_url: str) -> None:
    """One pass of the completer, as `fngate up` runs it."""
    done = subprocess.run(
        module_command("runner.triton.complete", "--repo", str(root), "--redis", redis_url, "--once"),
        env={**os.environ, "FNGATE_REDIS_URL": redis_url},  # its settings, which the model must not see
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def exercise(url: str, root: Path, redis_url: str) -> None:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    try:
        expected = {"nobatch_auto_complete": 0, "batch_auto_complete": 4}
        for name, batch in expected.items():
            config = client.get_model_config(name)
            assert config["max_batch_size"] == batch, config
            for kind, names in (("input", ["INPUT0", "INPUT1"]), ("output", ["OUTPUT0", "OUTPUT1"])):
                found = [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config[kind]]
                assert found == [(name, "TYPE_FP32", [4]) for name in names], config
            assert config["parameters"]["seen"]["string_value"] == ""
            shape = [2, 4] if batch else [4]
            inputs = [triton_http.InferInput(n, shape, "FP32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
            inputs[1].set_data_from_numpy(np.ones(shape, dtype=np.float32))
            answer = client.infer(name, inputs)
            assert (
                answer.as_numpy("OUTPUT0").tolist() == (np.arange(np.prod(shape)).reshape(shape) + 1).tolist()
            )
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert index["broken_auto_complete"]["state"] == "UNAVAILABLE", index
        assert "auto_complete_config failed" in index["broken_auto_complete"]["reason"], index
        assert "missing 'dims' property" in index["broken_auto_complete"]["reason"], index
        with pytest.raises(InferenceServerException):
            client.get_model_config("broken_auto_complete")
    finally:
        client.close()


async def test_python_models_without_a_config_are_completed_by_their_own_code_confined(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    redis: Any,
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    python_model(root, "nobatch_auto_complete", "MAX_BATCH = 0\n" + ADD_SUB)
    batch = python_model(root, "batch_auto_complete", "MAX_BATCH = 4\n" + ADD_SUB)
    python_model(root, "broken_auto_complete", BROKEN)
    await asyncio.to_thread(complete, root, redis_url)
    records = {
        name.decode(): json.loads(raw) for name, raw in (await redis.hgetall(keys.auto_completed())).items()
    }
    assert sorted(records) == ["batch_auto_complete", "broken_auto_complete", "nobatch_auto_complete"]
    assert records["batch_auto_complete"]["config"]["dynamic_batching"] == {}
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    await asyncio.to_thread(exercise, base, root, redis_url)

    # The model changes: completed again, and served so (the gateway reads its catalog every 2 s).
    (batch / "1" / "model.py").write_text("MAX_BATCH = 2\n" + ADD_SUB)
    await asyncio.to_thread(complete, root, redis_url)
    await asyncio.to_thread(served_with, base, "batch_auto_complete", 2)


def served_with(url: str, name: str, max_batch_size: int) -> None:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    try:
        for _ in range(100):
            if client.get_model_config(name)["max_batch_size"] == max_batch_size:
                break
            time.sleep(0.1)
        assert client.get_model_config(name)["max_batch_size"] == max_batch_size
    finally:
        client.close()


async def test_the_completer_survives_redis_killed_and_back(redis_url: str, tmp_path: Path) -> None:
    """The completer, as `fngate up` keeps it running: Redis killed with SIGKILL under it, it goes
    on (logging), and once Redis is back it records a model added meanwhile, with no restart."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server, url = start_redis(folder)
    root = tmp_path / "models"
    python_model(root, "nobatch_auto_complete", "MAX_BATCH = 0\n" + ADD_SUB)
    log = tmp_path / "completer.log"
    completer = start_completer(root, url, log)
    servers = [server]
    try:
        await until_recorded(url, {"nobatch_auto_complete"})
        servers[0].kill()
        servers[0].wait(timeout=10)
        python_model(root, "batch_auto_complete", "MAX_BATCH = 4\n" + ADD_SUB)
        await asyncio.sleep(2 * INTERVAL_S + 1)  # passes that meet no Redis
        assert completer.poll() is None
        servers[0] = start_redis(folder)[0]  # empty: nothing was persisted
        await until_recorded(url, {"nobatch_auto_complete", "batch_auto_complete"})
    finally:
        completer.terminate()
        completer.wait(timeout=30)
        servers[0].terminate()
        servers[0].wait(timeout=10)
    errors = log.read_text()
    assert completer.returncode == 0, errors
    assert "auto-complete of" in errors and "Traceback" not in errors, errors


def start_completer(root: Path, url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            module_command("runner.triton.complete", "--repo", str(root), "--redis", url),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


async def until_recorded(url: str, names: set[str], timeout_s: float = 60) -> None:
    """Until the completer has recorded each of `names` with a configuration."""
    client = clients.connect(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with contextlib.suppress(RedisError, OSError):
                records = await client.hgetall(keys.auto_completed())
                done = {name.decode() for name, raw in records.items() if "config" in json.loads(raw)}
                if done >= names:
                    return
            assert time.monotonic() < deadline, f"not recorded: {names}"
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()
