"""The repository: version policies, traffic, safe names and paths, the folder layouts."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from fngate.errors import FunctionNotFound, InvalidArgument
from fngate.manifest import MANIFEST_FILE, VersionsSpec, load_manifest
from fngate.repository import (
    FolderRepository,
    FunctionVersion,
    check_name,
    collect_files,
    decode_version,
    encode_version,
    make_record,
    policy_problems,
    safe_path,
    served_versions,
    traffic_weights,
)

ROOT = Path(__file__).resolve().parent.parent.parent
VERSIONS = ["1", "2", "3", "4"]


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ({}, ("4",)),
        ({"policy": "latest", "latest": 2}, ("3", "4")),
        ({"policy": "latest", "latest": 9}, ("1", "2", "3", "4")),
        ({"policy": "all"}, ("1", "2", "3", "4")),
        ({"policy": "specific", "specific": ["1", "3", "7"]}, ("1", "3")),
    ],
)
def test_the_version_policy_decides_what_is_served(policy: dict[str, Any], served: tuple[str, ...]) -> None:
    assert served_versions(VERSIONS, VersionsSpec.model_validate(policy)) == served


@pytest.mark.parametrize(
    ("served", "traffic", "weights"),
    [
        (("3", "4"), {}, {"4": 100}),
        (("3", "4"), {"3": 90, "4": 10}, {"3": 90, "4": 10}),
        (("3", "4"), {"2": 50, "4": 50}, {"4": 50}),  # a version not served gets nothing
        (("3", "4"), {"3": 100, "4": 0}, {"3": 100}),
        ((), {}, {}),
    ],
)
def test_traffic_weights(served: tuple[str, ...], traffic: dict[str, int], weights: dict[str, int]) -> None:
    assert traffic_weights(served, VersionsSpec.model_validate({"traffic": traffic})) == weights


def manifest_dict(name: str = "echo", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"backend": "python", "path": "model.py"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        **extra,
    }


def function_folder(folder: Path, name: str = "echo", **extra: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST_FILE).write_text(yaml.safe_dump(manifest_dict(name, **extra)))
    (folder / "model.py").write_text("class Model: ...\n")
    return folder / MANIFEST_FILE


def versions_of(tmp_path: Path, count: int, **extra: Any) -> list[FunctionVersion]:
    manifest = load_manifest(function_folder(tmp_path / "source", **extra))
    return [FunctionVersion(manifest, str(number), tmp_path) for number in range(1, count + 1)]


@pytest.mark.parametrize(
    ("versions", "problem"),
    [
        ({"traffic": {"1": 90, "2": 10}}, "versions ['1'] are not served"),
        ({"policy": "latest", "latest": 2, "traffic": {"1": 90, "2": 20}}, "add up to 110"),
        ({"policy": "specific"}, "name at least one version"),
        ({"policy": "specific", "specific": ["5"]}, "no versions ['5']"),
    ],
)
def test_policy_problems(tmp_path: Path, versions: dict[str, Any], problem: str) -> None:
    record = make_record(versions_of(tmp_path, 2, versions=versions))
    assert any(problem in line for line in policy_problems(record)), policy_problems(record)


def test_a_sound_canary_policy_has_no_problems(tmp_path: Path) -> None:
    canary = {"policy": "latest", "latest": 2, "traffic": {"1": 90, "2": 10}}
    record = make_record(versions_of(tmp_path, 2, versions=canary))
    assert policy_problems(record) == []
    assert record.served == ("1", "2") and dict(record.traffic) == {"1": 90, "2": 10}
    assert record.default is not None and record.default.version == "2"


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a/.", "a\\b", "a/"])
def test_paths_never_leave_the_version_folder(path: str) -> None:
    with pytest.raises(ValueError, match="not a relative path"):
        safe_path(path)


@pytest.mark.parametrize("name", ["../etc", "Echo", "a/b", "", "-x", "x" * 64])
def test_function_names_are_dns_labels(name: str) -> None:
    with pytest.raises(FunctionNotFound):
        check_name(name)


def index_doc(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    version = FolderRepository(tmp_path / "repo").add_version(
        load_manifest(function_folder(tmp_path / "source")),
        collect_files(tmp_path / "source"),
        lambda _count: None,
    )
    return {**encode_version(version), **changes}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"files": [{"path": "../../model.py", "sha256": "0" * 64, "size": 1}]}, "not a relative path"),
        ({"files": [{"path": "model.py", "sha256": "xyz", "size": 1}]}, "needs a sha256"),
        ({"files": [{"path": "other.py", "sha256": "0" * 64, "size": 1}]}, "model file 'model.py'"),
        ({"function": "other"}, "names function 'other'"),
        ({"version": "../1"}, "not a version number"),
    ],
)
def test_an_index_that_names_anything_odd_is_refused(
    tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        decode_version(index_doc(tmp_path, **change), tmp_path, "index")


def test_an_unversioned_folder_is_version_one_with_its_digest(tmp_path: Path) -> None:
    function_folder(tmp_path / "echo")
    record = FolderRepository(tmp_path).get("echo")
    assert list(record.versions) == ["1"] and record.served == ("1",)
    digest = hashlib.sha256()
    for name in sorted(["function.yaml", "model.py"]):
        digest.update(
            name.encode() + b"\0" + hashlib.sha256((tmp_path / "echo" / name).read_bytes()).digest()
        )
    assert record.versions["1"].digest == digest.hexdigest()
    assert record.versions["1"].directory == tmp_path / "echo"


def test_deployed_versions_in_a_folder(tmp_path: Path) -> None:
    repository = FolderRepository(tmp_path / "repo")
    source = function_folder(tmp_path / "source")
    (tmp_path / "source" / "weights").mkdir()
    (tmp_path / "source" / "weights" / "w.bin").write_bytes(b"\x00" * 10)
    progress: list[int] = []
    first = repository.add_version(load_manifest(source), collect_files(source.parent), progress.append)
    second = repository.add_version(load_manifest(source), collect_files(source.parent), progress.append)
    assert (first.version, second.version) == ("1", "2")
    assert sum(progress) == 2 * sum(item.size for item in first.files)
    assert first.digest == second.digest  # the same files
    assert (tmp_path / "repo" / "echo" / "2" / "weights" / "w.bin").read_bytes() == b"\x00" * 10
    index = orjson.loads((tmp_path / "repo" / "echo" / "2.json").read_bytes())
    assert {item["path"] for item in index["files"]} == {"function.yaml", "model.py", "weights/w.bin"}
    record = repository.scan()["echo"]
    assert list(record.versions) == ["1", "2"] and record.served == ("2",)
    assert record.versions["2"].directory == tmp_path / "repo" / "echo" / "2"

    (tmp_path / "repo" / "echo" / "3").mkdir()  # a deploy that died before its index
    assert list(repository.scan()["echo"].versions) == ["1", "2"]
    assert repository.next_version("echo") == "4"

    repository.remove("echo")
    assert repository.scan() == {}
    with pytest.raises(FunctionNotFound):
        repository.remove("echo")


def test_a_version_whose_index_escapes_is_skipped(tmp_path: Path) -> None:
    repository = FolderRepository(tmp_path / "repo")
    source = function_folder(tmp_path / "source")
    repository.add_version(load_manifest(source), collect_files(source.parent), lambda _count: None)
    index = tmp_path / "repo" / "echo" / "1.json"
    doc = orjson.loads(index.read_bytes())
    doc["files"][0]["path"] = "../../../secret"
    index.write_bytes(orjson.dumps(doc))
    assert repository.scan() == {}


def test_an_unversioned_function_is_neither_deployed_over_nor_removed(tmp_path: Path) -> None:
    source = function_folder(tmp_path / "echo")
    repository = FolderRepository(tmp_path)
    with pytest.raises(InvalidArgument, match="unversioned"):
        repository.add_version(load_manifest(source), collect_files(source.parent), lambda _count: None)
    with pytest.raises(InvalidArgument, match="not deployed by fngate"):
        repository.remove("echo")


def test_the_example_functions_scan_as_before() -> None:
    functions = FolderRepository(ROOT / "functions").scan()
    assert {"classifier", "normalize"} <= functions.keys()
    assert all(list(record.versions) == ["1"] for record in functions.values())


def test_a_manifest_changed_in_place_is_read_again_whatever_its_times(tmp_path: Path) -> None:
    """Scans parse a manifest again only when its stat changes; an edit that keeps the size and
    sets the modification time back is still seen (the change time moves)."""
    import os
    import shutil
    import time

    shutil.copytree(ROOT / "functions" / "classifier", tmp_path / "classifier")
    manifest = tmp_path / "classifier" / MANIFEST_FILE
    repository = FolderRepository(tmp_path)
    time.sleep(2.1)  # past the settling time: from here the scans may keep what they read
    assert repository.scan()["classifier"].newest().manifest.batching.max_queue_size == 1000
    before = manifest.stat()
    edited = manifest.read_text().replace("max_queue_size: 1000", "max_queue_size: 2000")
    manifest.write_text(edited)
    os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert manifest.stat().st_size == before.st_size
    time.sleep(2.1)  # settled again: only the change time tells the edit apart
    assert repository.scan()["classifier"].newest().manifest.batching.max_queue_size == 2000


DOUBLER = """
name: "doubler"
backend: "python"
max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [2] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [2] }]
"""


def triton_folder(folder: Path, config: str) -> Path:
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text("class TritonPythonModel: ...\n")
    (folder / "config.pbtxt").write_text(config.replace("doubler", folder.name))
    return folder / "config.pbtxt"


def test_a_folder_that_cannot_be_read_is_named_and_the_others_are_served(tmp_path: Path) -> None:
    import os

    function_folder(tmp_path / "echo")
    triton_folder(tmp_path / "doubler", DOUBLER)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.pbtxt").write_text("name: [")
    triton_folder(tmp_path / "odd", DOUBLER)
    (tmp_path / "odd" / "1" / os.fsdecode(b"w\xff.bin")).write_bytes(b"1")  # the reader chokes on it
    repository = FolderRepository(tmp_path)
    assert sorted(repository.scan()) == ["doubler", "echo"]
    unreadable = repository.unreadable
    assert sorted(unreadable) == ["garbled", "odd"]
    assert unreadable["garbled"].startswith("garbled/config.pbtxt: not a Triton model configuration")
    assert unreadable["odd"].startswith("odd: cannot be read (UnicodeEncodeError")
    with pytest.raises(FunctionNotFound):
        repository.get("odd")
    assert repository.get("echo").name == "echo"


def test_a_folder_edited_into_an_error_serves_on_as_it_was_read_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", "fngate.repository")
    config = triton_folder(tmp_path / "doubler", DOUBLER)
    repository = FolderRepository(tmp_path)
    before = repository.scan()["doubler"]
    config.write_text(DOUBLER + "not_a_field: 1\n")
    assert repository.scan()["doubler"] == before
    assert "not_a_field" in repository.unreadable["doubler"]
    assert "its function serves on as it was read last" in caplog.text
    config.write_text(DOUBLER.replace("max_batch_size: 8", "max_batch_size: 4"))
    assert repository.scan()["doubler"].newest().manifest.batching.max_batch_size == 4
    assert repository.unreadable == {}
    assert "reads well again" in caplog.text
