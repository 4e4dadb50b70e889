"""The CLI as a new user meets it: help on every flag, one-line errors with exit code 2, the state
`fngate up` leaves for the other commands, and `fngate invoke`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fngate
from fngate.cli import main as cli
from fngate.manifest import schema_json
from fngate.up import supervisor
from fngate.up.state import UpState, read_up, state_dir, write_up

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No test sees a real `fngate up` of this machine, nor FNGATE_* variables."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for name in ("FNGATE_REPO", "FNGATE_REDIS_URL", "FNGATE_CACHE_URL"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "state" / "fngate"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"fngate {fngate.__version__}"


def test_every_command_and_flag_has_help() -> None:
    parser = cli.build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    undocumented = [
        f"{name} {action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert undocumented == []
    assert all(choice.help for choice in commands._choices_actions)


def test_up_keeps_a_standby_runner_unless_told_not_to() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["up"]).standby_runner is True
    assert parser.parse_args(["up", "--no-standby-runner"]).standby_runner is False


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_up_starts_a_gateway_process_per_two_cpus(cpus: int, workers: int) -> None:
    """The runners and Redis keep the other half of the machine; never none, never more than 4."""
    assert cli.gateway_workers(cpus) == workers


def test_up_sizes_its_gateway_to_the_cpus_it_may_use() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["up"]).gateway_workers == cli.gateway_workers(len(os.sched_getaffinity(0)))
    assert parser.parse_args(["up", "--gateway-workers", "3"]).gateway_workers == 3


def test_user_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "ls", "--repo", str(tmp_path / "missing"))
    assert (code, out) == (2, "")
    assert err == f"fngate ls: repository folder {tmp_path / 'missing'} does not exist\n"

    (tmp_path / "repo").mkdir()
    code, _, err = run(
        capsys, "rm", "nope", "--repo", str(tmp_path / "repo"), "--redis", "redis://127.0.0.1:1"
    )
    assert code == 2
    assert err.count("\n") == 1
    assert "'nope' is not in the repository" in err

    code, _, err = run(capsys, "deploy", str(tmp_path / "none.yaml"), "--repo", str(tmp_path / "repo"))
    assert code == 2
    assert err == f"fngate deploy: {tmp_path / 'none.yaml'} does not exist\n"


def test_a_model_file_missing_at_deploy_is_a_user_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = tmp_path / "classifier"
    shutil.copytree(ROOT / "functions" / "classifier", folder)
    (folder / "model.onnx").unlink()
    code, _, err = run(capsys, "deploy", str(folder / "function.yaml"), "--repo", str(tmp_path / "repo"))
    assert code == 2
    assert err == (
        f"fngate deploy: {folder / 'function.yaml'}: model.onnx does not exist in the function's folder "
        "(model.path)\n"
    )


def test_an_unreachable_redis_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cache", "clear", "classifier", "--redis", "redis://127.0.0.1:1/0")
    assert code == 1
    assert err.count("\n") == 1
    assert err.startswith("fngate cache: redis at redis://127.0.0.1:1/0 is unreachable")


def test_up_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # --metrics-port 0: its default (8002) may be a running `fngate up`'s, as the README runs it
        command = (
            "up",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--repo",
            str(ROOT / "functions"),
        )
        code, _, err = run(capsys, *command)
    assert code == 2
    assert err.startswith(f"fngate up: cannot listen on 127.0.0.1:{port}")
    assert err.count("\n") == 1


def test_up_refuses_a_runner_python_without_fngate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An interpreter that cannot run fngate's runner is named before anything starts (the system's
    Python, which has no fngate), and so is a path that is no interpreter."""
    repo = str(ROOT / "functions")
    common = ("--port", "0", "--grpc-port", "0", "--metrics-port", "0", "--repo", repo)
    code, _, err = run(capsys, "up", *common, "--runner-python", "/usr/bin/python3")
    assert code == 2
    assert err.startswith("fngate up: --runner-python /usr/bin/python3 cannot import fngate's runner")
    assert "No module named" in err and err.count("\n") == 1
    code, _, err = run(capsys, "up", *common, "--runner-python", str(tmp_path / "none"))
    assert code == 2
    assert err == f"fngate up: --runner-python {tmp_path / 'none'}: no executable file there\n"


def test_gateway_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = run(capsys, "gateway", "--port", str(port))
    assert code == 2
    assert err.startswith(f"fngate gateway: cannot listen on 127.0.0.1:{port} (Address already in use)")


def test_commands_find_the_running_up(
    capsys: pytest.CaptureFixture[str], private_state: Path, tmp_path: Path, redis_url: str
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    write_up(UpState("http://127.0.0.1:9", redis_url, str(served), pid=os.getpid()), private_state)
    assert read_up(state_dir()) is not None
    manifest = str(ROOT / "functions" / "classifier" / "function.yaml")

    # A deploy to a folder that fngate up does not serve warns instead of printing curl lines.
    other = tmp_path / "other"
    code, out, err = run(capsys, "deploy", manifest, "--repo", str(other))
    assert code == 0
    assert "curl" not in out
    assert f"serves {served}, not {other}" in err
    # With no flags, deploy goes to the folder fngate up serves and points at its gateway.
    code, out, err = run(capsys, "deploy", manifest)
    assert code == 0, err
    assert f"to {served}/classifier/1/" in out
    assert "curl -s -X POST http://127.0.0.1:9/v1/functions/classifier" in out
    code, out, err = run(capsys, "ls")
    assert code == 0, err
    assert out.splitlines()[1].split()[:2] == ["classifier", "1"]


def test_state_of_a_dead_up_is_ignored(private_state: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_up(UpState("http://127.0.0.1:9", "redis://x", "/nowhere", dead.pid), private_state)
    assert read_up(private_state) is None


def test_the_banner_suggests_a_function_that_exists(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "functions" / "normalize", tmp_path / "normalize")
    example = supervisor.example_invocation(str(tmp_path))
    assert example is not None
    assert example[0] == "normalize"
    assert supervisor.example_invocation(str(tmp_path / "normalize")) is None


def test_schema_is_published(capsys: pytest.CaptureFixture[str]) -> None:
    """Every key is documented too: tests/test_docs.py checks the manifest reference against it."""
    code, out, _ = run(capsys, "schema")
    assert code == 0
    assert out == schema_json()
    assert (ROOT / "docs" / "function.schema.json").read_text() == out, (
        "run: fngate schema > docs/function.schema.json"
    )


def test_editors_accept_the_examples_with_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    validator = jsonschema.Draft202012Validator(json.loads(schema_json()))
    for path in sorted((ROOT / "functions").glob("*/function.yaml")):
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == [], path
    assert list(validator.iter_errors({"name": "x", "modle": {}}))


async def test_invoke_json_and_npy(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any, tmp_path: Path
) -> None:
    base = await serve_gateway()
    await inprocess_runner()
    row = [[0.5] * 16]
    batch = tmp_path / "batch.npy"
    np.save(batch, np.full((2, 16), 0.5, dtype=np.float32))

    def invoke(*argv: str) -> tuple[int, str, str]:
        result = subprocess.run(
            [sys.executable, "-m", "fngate.cli.main", "invoke", *argv, "--gateway", base],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
        )  # fmt: skip
        return result.returncode, result.stdout, result.stderr

    code, out, err = await asyncio.to_thread(invoke, "classifier", json.dumps({"input": row}))
    assert code == 0, err
    assert len(json.loads(out)["outputs"]["probabilities"]) == 1
    code, out, err = await asyncio.to_thread(invoke, "classifier", f"@{batch}")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["outputs"][0]["shape"] == [2, 4]
    code, out, err = await asyncio.to_thread(
        invoke, "classifier", json.dumps({"input": row}), "--version", "1"
    )
    assert code == 0, err
    assert json.loads(out)["model_version"] == "1"
    code, out, err = await asyncio.to_thread(invoke, "classifier", json.dumps({"pixels": row}))
    assert code == 2, err
    assert err.startswith("fngate invoke: 400: unknown input 'pixels'")
    code, out, err = await asyncio.to_thread(invoke, "nope", json.dumps({"input": row}))
    assert code == 2
    assert "404" in err


async def test_invoke_sends_ups_admin_key_to_ups_gateway_only(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: Any,
    redis_url: str,
    private_state: Path,
    repo: Path,
) -> None:
    import redis as sync_redis

    from fngate import apikeys

    client = sync_redis.Redis.from_url(redis_url)
    try:
        apikeys.admin_key(client, private_state / "admin.key")
    finally:
        client.close()
    base = await serve_gateway(auth=True)
    await inprocess_runner()
    write_up(UpState(base, redis_url, str(repo), os.getpid()), private_state)
    body = json.dumps({"input": [[0.5] * 16]})

    def invoke(*argv: str) -> tuple[int, str, str]:
        result = subprocess.run(
            [sys.executable, "-m", "fngate.cli.main", "invoke", "classifier", body, *argv],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
        )  # fmt: skip
        return result.returncode, result.stdout, result.stderr

    code, out, err = await asyncio.to_thread(invoke)
    assert code == 0, err
    assert "probabilities" in out
    # Another address (the same server, as far as the CLI can tell, a different one): no key sent.
    elsewhere = base.replace("127.0.0.1", "localhost")
    code, _, err = await asyncio.to_thread(invoke, "--gateway", elsewhere)
    assert code == 2
    assert err.startswith("fngate invoke: 401"), err


def test_deploy_needs_to_be_told_where_when_no_up_runs(capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(path.name for path in (ROOT / "functions").iterdir())
    code, out, err = run(capsys, "deploy", str(ROOT / "functions" / "classifier" / "function.yaml"))
    assert (code, out) == (2, "")
    assert err.startswith("fngate deploy: no fngate up is running and no repository was given: pass --repo")
    assert sorted(path.name for path in (ROOT / "functions").iterdir()) == before


def invoke_on_a_terminal(*argv: str) -> tuple[int, str, str]:
    """`fngate invoke ARGV` with stderr on a terminal, as a user at one sees it."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "fngate.cli.main", "invoke", *argv],
        stdout=subprocess.PIPE,
        stderr=secondary,
        cwd=ROOT,
    )
    os.close(secondary)
    seen = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    os.close(primary)
    assert process.stdout is not None
    with process.stdout:
        out = process.stdout.read().decode()
    return process.wait(timeout=60), out, seen.decode(errors="replace")


async def test_invoke_waits_out_a_cold_start_and_says_what_it_waits_for(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any
) -> None:
    base = await serve_gateway()
    await inprocess_runner(pool="slowload")  # its model takes 3 s to load
    body = json.dumps({"x": [[1, 2, 3, 4]]})
    code, out, err = await asyncio.to_thread(
        invoke_on_a_terminal, "slowload", body, "--gateway", base, "--timeout-s", "2"
    )
    assert (code, out) == (1, "")
    assert "loading slowload (" in err, err
    assert "slowload did not answer within 2 s: its model is loading; wait longer with --timeout-s" in err
    assert "no gateway" not in err
    # By default it waits as long as the gateway may hold the invocation: the load, then its deadline.
    code, out, err = await asyncio.to_thread(invoke_on_a_terminal, "slowload", body, "--gateway", base)
    assert code == 0, err
    assert json.loads(out)["outputs"]["y"] == [[2, 4, 6, 8]]
    code, _, err = await asyncio.to_thread(
        invoke_on_a_terminal, "slowload", body, "--gateway", "http://127.0.0.1:1"
    )
    assert code == 1
    assert "no gateway answers at http://127.0.0.1:1" in err
