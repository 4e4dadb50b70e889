"""`fngate up` is private by default: it creates an admin key on first start, keeps it in its state
folder, prints it with curl lines that carry it; `--no-auth` only on a loopback address."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from fngate.process import stop_processes
from tests.conftest import ROOT, free_port, wait_http

BANNER_TIMEOUT_S = 60


def start_up(
    redis_url: str, repo: Path, state: Path, port: int, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    command = [sys.executable, "-m", "fngate.cli.main", "up", "--redis", redis_url, "--repo", str(repo)]
    command += ["--port", str(port), "--grpc-port", "0", "--metrics-port", "0", "--state-dir", str(state)]
    command += ["--gateway-workers", "1", *extra]
    with log.open("wb") as output:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)


async def banner(log: Path, up: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + BANNER_TIMEOUT_S
    while True:
        text = await asyncio.to_thread(log.read_text)
        if "Ctrl-C stops everything" in text:
            return text
        assert up.poll() is None and time.monotonic() < deadline, text
        await asyncio.sleep(0.1)


def read_key(path: Path) -> tuple[str, int]:
    return path.read_text().strip(), path.stat().st_mode


async def test_fngate_up_prints_a_kept_admin_key_and_curl_lines_that_work(
    redis: aioredis.Redis, redis_url: str, repo: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    port = free_port()
    up = start_up(redis_url, repo, state, port, tmp_path / "up.log")
    try:
        text = await banner(tmp_path / "up.log", up)
        key = re.search(r"admin API key: (\S+)", text)
        assert key is not None, text
        kept, mode = await asyncio.to_thread(read_key, state / "admin.key")
        assert kept == key[1] and mode & 0o077 == 0
        curl = next(line for line in text.splitlines() if "curl -s -X POST" in line)
        words = shlex.split(curl.strip())
        name, value = words[words.index("-H") + 1].split(": ", 1)
        headers = {name: value}
        body = words[words.index("-d") + 1]
        url = next(word for word in words if word.startswith("http://"))
        await wait_http(f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.post(url, content=body)).status_code == 401
            deadline = time.monotonic() + 90
            while True:  # the first invocation starts a runner
                response = await client.post(url, content=body, headers=headers)
                if response.status_code == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert response.status_code == 200, response.text
    finally:
        stop_processes([up], timeout_s=30)
    again = start_up(redis_url, repo, state, free_port(), tmp_path / "again.log")
    try:
        assert f"admin API key: {key[1]}" in await banner(tmp_path / "again.log", again)
    finally:
        stop_processes([again], timeout_s=30)


async def test_no_auth_is_refused_unless_the_gateway_listens_on_loopback(
    redis: aioredis.Redis, redis_url: str, repo: Path, tmp_path: Path
) -> None:
    up = start_up(
        redis_url, repo, tmp_path, free_port(), tmp_path / "up.log", "--no-auth", "--host", "0.0.0.0"
    )
    code = await asyncio.to_thread(up.wait, 30)
    assert code == 1
    text = await asyncio.to_thread((tmp_path / "up.log").read_text)
    assert "--no-auth needs a loopback --host" in text
    assert "admin.key" not in os.listdir(tmp_path)
