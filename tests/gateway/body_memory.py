"""Peak gateway memory per request as a multiple of its body: `python -m tests.gateway.body_memory`.

Not a test (it measures): for each kind of body and size, a fresh gateway process (and a runner for
normalize) takes one request; the gateway's peak RSS (VmHWM, from /proc) minus its RSS before the
request, over the body's size, is the multiple."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from fngate.up.supervisor import start_redis
from tests.conftest import ROOT, child_env, free_socket, wait_http

MiB = 2**20


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def json_body(size_bytes: int, digits: int) -> bytes:
    """A V2 JSON body for normalize of about `size_bytes`, with `digits` decimals per value."""
    per_value = digits + 3 if digits else 2
    count = size_bytes // per_value
    values = np.round(np.random.default_rng(0).random(count), digits) if digits else np.ones(count)
    data = orjson.dumps(
        values.astype(np.float64) if digits else values.astype(np.int64), option=orjson.OPT_SERIALIZE_NUMPY
    )
    head = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,%d],"data":' % count
    return head + data + b'}],"parameters":{"timeout_ms":20000}}'


def binary_body(size_bytes: int) -> tuple[bytes, dict[str, str]]:
    count = size_bytes // 4
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, count],
                    "parameters": {"binary_data_size": count * 4},
                }
            ],
            "outputs": [{"name": "normalized", "parameters": {"binary_data": True}}],
        }
    )
    raw = np.random.default_rng(0).random(count, dtype=np.float32).tobytes()
    return header + raw, {"inference-header-content-length": str(len(header))}


def spawn(module: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", module], env=env, cwd=ROOT, **kwargs)


async def measure(redis_url: str, repo: Path, body: bytes, headers: dict[str, str]) -> tuple[int, float]:
    sock = free_socket()
    gateway = spawn(
        "gateway",
        child_env(
            redis_url,
            repo,
            FNGATE_BIND=f"fd://{sock.fileno()}",
            FNGATE_LOG_LEVEL="WARNING",
            FNGATE_AUTH="false",
        ),
        pass_fds=[sock.fileno()],
    )
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        await wait_http(base)
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            await client.post("/v2/models/normalize/infer", content=b"{}")  # warm the code paths
            before = proc_kib(gateway.pid, "VmRSS")
            response = await client.post("/v2/models/normalize/infer", content=body, headers=headers)
        peak = proc_kib(gateway.pid, "VmHWM")
        return response.status_code, (peak - before) * 1024 / len(body)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        sock.close()


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        redis, url = start_redis(Path(folder))
        runner = spawn(
            "runner",
            child_env(url, ROOT / "functions", FNGATE_FUNCTIONS='["normalize"]', FNGATE_LOG_LEVEL="WARNING"),
        )
        try:
            print("body                       size MiB  status  peak RSS growth / body size")
            for size in (8 * MiB, 32 * MiB, 60 * MiB):
                for name, (body, headers) in {
                    "JSON, 4 decimals/value": (json_body(size, 4), {}),
                    "JSON, 1-digit values": (json_body(size, 0), {}),
                    "binary FP32": binary_body(size),
                }.items():
                    status, multiple = await measure(url, ROOT / "functions", body, headers)
                    print(f"{name:26} {len(body) / MiB:8.1f}  {status:6}  {multiple:5.1f}x", flush=True)
        finally:
            runner.terminate()
            runner.wait(timeout=30)
            redis.terminate()
            redis.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
