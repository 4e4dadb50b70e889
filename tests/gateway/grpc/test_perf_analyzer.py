"""Triton's perf_analyzer runs unchanged against the gateway: it reads the model's metadata and
configuration, drives JSON and binary tensors at concurrency 1 to 16, and reads the statistics."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import perf_analyzer
from tests.conftest import free_port
from tests.gateway.test_auth import create_key

WINDOWS = [
    "--measurement-mode",
    "time_windows",
    "--measurement-interval",
    "250",
    "--stability-percentage",
    "999",
]
"""Three windows of 250 ms a level, each taken as stable: the test checks what perf_analyzer reads
and drives, not the figures."""


@pytest.fixture(scope="module")
def perf_command() -> list[str]:
    command, why = perf_analyzer.provide()
    if not command:
        pytest.skip(why)
    return command


async def run(command: list[str], tmp_path: Path, name: str) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        async with asyncio.timeout(120):
            output, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    text = output.decode(errors="replace")
    (tmp_path / f"{name}.txt").write_text(text)
    assert process.returncode == 0, text[-3000:]
    return text


@pytest.mark.timeout(300)
async def test_perf_analyzer_json_and_binary(
    perf_command: list[str],
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: Any,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    await inprocess_runner()
    # Short windows keep it bounded on a small machine (a count window lasts 1 s at least, a time
    # window as long as asked): every level of 1 to 16 for binary tensors, every fifth for JSON.
    common = [
        *perf_command,
        "-m", "classifier", "-u", base.removeprefix("http://"), "-i", "http",
        *WINDOWS, "--max-trials", "10",
    ]  # fmt: skip
    binary = await run([*common, "--concurrency-range", "1:16"], tmp_path, "binary")
    json_format = ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    as_json = await run([*common, "--concurrency-range", "1:16:5", *json_format], tmp_path, "json")
    for output, wanted in ((binary, list(range(1, 17))), (as_json, [1, 6, 11, 16])):
        levels = [int(level) for level in re.findall(r"Concurrency: (\d+), throughput", output)]
        assert levels == wanted, output[-3000:]
        # Server-side figures come from the statistics extension, summed by the runner.
        assert re.search(r"Server:\s+Inference count: [1-9]", output), output[-3000:]


@pytest.mark.timeout(300)
async def test_perf_analyzer_over_grpc_with_a_key(
    perf_command: list[str],
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    tmp_path: Path,
) -> None:
    """`-i grpc` with the key in a header (-H), binary tensors only, as Triton users run it."""
    key, _ = create_key(redis_url, "invoke:classifier")
    port = free_port()
    await serve_gateway(grpc_port=port, auth=True)
    await inprocess_runner()
    output = await run(
        [
            *perf_command,
            "-m", "classifier", "-u", f"127.0.0.1:{port}", "-i", "grpc",
            "-H", f"authorization: Bearer {key}",
            *WINDOWS, "--max-trials", "3", "--concurrency-range", "1:8:7",
        ],
        tmp_path,
        "grpc",
    )  # fmt: skip
    levels = [int(level) for level in re.findall(r"Concurrency: (\d+), throughput", output)]
    assert levels == [1, 8], output[-3000:]
    assert re.search(r"Server:\s+Inference count: [1-9]", output), output[-3000:]
