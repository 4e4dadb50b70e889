"""One bad folder never stops the others: a dozen function and Triton model folders that cannot be
read, dropped into the repository of a running `fngate up --reload`, are each shown UNAVAILABLE
with their reason in the repository index while the good ones keep answering; a folder edited
into an error serves on as it was read last; `fngate validate` names each with its reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from fngate.process import stop_processes
from tests.conftest import free_port, wait_http
from tests.e2e import deployments
from tests.e2e.deployments import ROW, cli, scale_function
from tests.triton_repository import BATCHES, BATCHES_CONFIG

RANKED = (
    "priority_levels: 2 default_priority_level: 1 "
    "priority_queue_policy { key: 2 value { max_queue_size: 8 } }"
)
"""A map keyed by level, as Triton serves it (fngate's reader once failed on it with KeyError: 2)."""


def config(name: str, batching: str = "", extra: str = "") -> str:
    return BATCHES_CONFIG.format(name=name, batching=batching, sleep_s=0) + extra


def triton(folder: Path, text: str, files: dict[str, str] | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(text)
    for path, content in (files if files is not None else {"1/model.py": BATCHES}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(content)


def manifest(folder: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """The scale function's folder, its manifest changed by `change` (a document it edits, or the
    text to write instead)."""
    scale_function(folder, folder.name, 2.0)
    doc = yaml.safe_load((folder / "function.yaml").read_text())
    text = change(doc)
    (folder / "function.yaml").write_text(text if isinstance(text, str) else yaml.safe_dump(doc))


def odd_file_name(folder: Path) -> None:
    """A file whose name is not UTF-8: fngate's reader fails on it (its digest encodes names)."""
    triton(folder, config(folder.name))
    (folder / "1" / os.fsdecode(b"weights-\xff.bin")).write_bytes(b"\x00")


def python_without_config(folder: Path) -> None:
    """A Python model with no config.pbtxt and no auto_complete_config to complete one."""
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(BATCHES)


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "garbled": (lambda folder: triton(folder, "name: [\n"), "not a Triton model configuration"),
    "unknown_field": (lambda folder: triton(folder, config("unknown_field", extra="colour: 3\n")), "colour"),
    "bad_map_key": (
        lambda folder: triton(folder, config("bad_map_key", "priority_queue_policy { key: two value { } }")),
        "not a Triton model configuration",
    ),
    "map_past_levels": (
        lambda folder: triton(
            folder,
            config(
                "map_past_levels",
                "priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 5 value { } }",
            ),
        ),
        "past priority_levels",
    ),
    "bad_type": (
        lambda folder: triton(folder, config("bad_type").replace("TYPE_FP32", "TYPE_FLOAT32")),
        "TYPE_FLOAT32",
    ),
    "no_datatype": (
        lambda folder: triton(folder, config("no_datatype").replace("TYPE_FP32", "TYPE_BF16")),
        "TYPE_BF16 has no datatype",
    ),
    "bad_dims": (
        lambda folder: triton(folder, config("bad_dims").replace("dims: [ 1 ]", "dims: [ one ]")),
        "not a Triton model configuration",
    ),
    "no_model_file": (
        lambda folder: triton(folder, config("no_model_file"), {"1/README": "the model is elsewhere"}),
        "no version folder holds model.py",
    ),
    "odd_file_name": (odd_file_name, "cannot be read (UnicodeEncodeError"),
    # Until its auto_complete_config has run, and then because it completes no input or output.
    "auto_completed": (python_without_config, "auto_complete_config"),
    "bad-yaml": (lambda folder: manifest(folder, lambda doc: "name: [bad-yaml\n"), "bad-yaml/function.yaml"),
    "unknown-backend": (
        lambda folder: manifest(folder, lambda doc: doc["model"].update(backend="caffe")),
        "model.backend",
    ),
    "misnamed": (
        lambda folder: manifest(folder, lambda doc: doc.update(name="other")),
        "differs from its folder",
    ),
}


def start_up(repo: Path, port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    refresh = {"FNGATE_RESCAN_S": "0.3", "FNGATE_CATALOG_REFRESH_S": "0.3"}
    return deployments.start_up(repo, port, tmp_path, "--reload", environ=refresh)


async def good_ones_answer(client: httpx.AsyncClient) -> None:
    scaled = await client.post("/v1/functions/scale", json={"inputs": {"x": [ROW]}})
    assert scaled.status_code == 200, scaled.text
    assert scaled.json()["outputs"]["y"] == [[2 * value for value in ROW]]
    body = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
        "parameters": {"priority": 2},  # the level its priority_queue_policy names
    }
    ranked = await client.post("/v2/models/ranked/infer", json=body)
    assert ranked.status_code == 200, ranked.text


async def test_broken_folders_never_stop_the_others(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    scale_function(repo / "scale", "scale", 2.0)
    triton(repo / "ranked", config("ranked", RANKED))
    log = tmp_path / "up.log"
    up = start_up(repo, (port := free_port()), tmp_path)
    try:
        await wait_http(f"http://127.0.0.1:{port}", timeout_s=60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            await good_ones_answer(client)
            for name, (make, _) in BROKEN.items():  # each made aside, then moved in whole
                make(tmp_path / "aside" / name)
                (tmp_path / "aside" / name).rename(repo / name)
            (repo / "scale" / "function.yaml").write_text("name: [scale\n")  # edited into an error
            deadline = time.monotonic() + 30
            while True:
                await good_ones_answer(client)  # all along
                entries = (await client.post("/v2/repository/index", json={})).json()
                shown = {entry["name"]: entry for entry in entries if "version" not in entry}
                # fngate up runs the auto_complete_config of a Python model with no config.pbtxt
                # (this one has none, so it completes no input).
                completed = "completed: inputs" in shown.get("auto_completed", {}).get("reason", "")
                if (
                    shown.keys() >= BROKEN.keys()
                    and completed
                    and "serves on as it was read last" in log.read_text()
                ):
                    break
                assert time.monotonic() < deadline, (entries, log.read_text()[-3000:])
            assert up.poll() is None
            assert shown.keys() == BROKEN.keys()  # the scale function serves on as it was read last
            for name, (_, reason) in BROKEN.items():
                assert shown[name]["state"] == "UNAVAILABLE" and reason in shown[name]["reason"], shown[name]
                assert str(tmp_path) not in shown[name]["reason"]  # paths within the repository only
            served = {(entry["name"], entry["version"]) for entry in entries if "version" in entry}
            assert served == {("ranked", "1"), ("scale", "1")}
            await good_ones_answer(client)
        text = log.read_text()
        assert "scale/function.yaml: not valid YAML" in text and "Traceback" not in text
        assert all(f"{repo / name}" in text for name in BROKEN)  # each logged with its path
        assert up.poll() is None
    finally:
        stop_processes([up], timeout_s=60)

    shutil.rmtree(repo / "scale")  # mended: `fngate validate` lists it as ok
    scale_function(repo / "scale", "scale", 2.0)
    validated = await cli("validate", str(repo))
    assert validated.returncode == 2, validated.stdout + validated.stderr
    assert "Traceback" not in validated.stderr
    for name, (_, reason) in BROKEN.items():
        named = [line for line in validated.stderr.splitlines() if line.startswith(f"{repo / name}")]
        assert any(reason in line for line in named), (name, validated.stderr)
    assert f"{repo / 'scale' / 'function.yaml'}: ok (scale, python)" in validated.stdout
    assert f"{repo / 'ranked'}: ok (ranked as ranked version 1, python)" in validated.stdout
    assert validated.stdout.count(": ok (") == 2
