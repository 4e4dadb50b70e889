"""The artifact cache and Artifacts: files verified before use (as they download, or on disk unless
their sidecar record matches), written atomically, reused after a restart, evicted least recently
used first; one download and one load for concurrent requests; large models read in parallel parts
and loaded from verified memory."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import FunctionManifest, load_manifest
from fngate.registry import ModelState
from fngate.repository import ArtifactFile, FunctionVersion, collect_files, make_record
from fngate.s3 import READ_THREADS, S3Repository
from runner.artifacts import ArtifactCache, Artifacts
from runner.backends import load_backend
from runner.models import LoadedModels
from tests.s3 import Bucket

MODEL = b"class Model:\n    def __init__(self, directory):\n        pass\n"
MANIFEST = {
    "name": "echo",
    "model": {"backend": "python", "path": "model.py"},
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
}


def artifact(path: str, content: bytes) -> ArtifactFile:
    return ArtifactFile(path, hashlib.sha256(content).hexdigest(), len(content))


class Source:
    """The repository side of a fetch: contents by path, optionally served damaged."""

    def __init__(self, contents: dict[str, bytes]) -> None:
        self.contents = contents
        self.fetched: list[str] = []
        self.damage: bytes | None = None

    def version(self, version: str = "1") -> FunctionVersion:
        files = tuple(artifact(path, content) for path, content in self.contents.items())
        return FunctionVersion(
            FunctionManifest.model_validate(MANIFEST), version, Path(), version * 64, files
        )

    def fetch(self, item: ArtifactFile, target: Path) -> str:
        self.fetched.append(item.path)
        data = self.damage if self.damage is not None else self.contents[item.path]
        target.write_bytes(data)
        return hashlib.sha256(data).hexdigest()


def blobs(root: Path) -> list[str]:
    return sorted(path.name for path in (root / "blobs").iterdir())


def test_files_are_fetched_once_and_reused_after_a_restart(tmp_path: Path) -> None:
    source = Source({"model.py": MODEL, "weights/w.bin": b"\x01" * 100})
    placed = ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    view, download_s = placed.view, placed.download_s
    assert (view / "model.py").read_bytes() == MODEL
    assert (view / "weights" / "w.bin").read_bytes() == b"\x01" * 100
    assert sorted(source.fetched) == ["model.py", "weights/w.bin"] and download_s > 0

    restarted = ArtifactCache(tmp_path, 1 << 20)
    again = restarted.materialize(source.version(), source.fetch)
    assert again.view == view and again.download_s == 0
    assert len(source.fetched) == 2
    assert restarted.verifications.hashed_bytes == 0  # the records of the files it wrote matched


@pytest.mark.parametrize(
    ("damage", "problem"),
    [(MODEL.upper(), "does not match"), (MODEL[:10], "bytes where the deploy recorded")],
)
def test_a_damaged_download_is_refused_and_leaves_nothing(
    tmp_path: Path, damage: bytes, problem: str
) -> None:
    source = Source({"model.py": MODEL})
    source.damage = damage
    with pytest.raises(Unavailable, match=problem):
        ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    assert blobs(tmp_path) == []  # neither the file nor a temporary one
    assert list((tmp_path / "views").iterdir()) == []


def test_a_file_damaged_in_the_cache_is_fetched_again(tmp_path: Path) -> None:
    source = Source({"model.py": MODEL})
    ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    (tmp_path / "blobs" / artifact("model.py", MODEL).sha256).write_bytes(b"bit rot")
    view = ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch).view
    assert (view / "model.py").read_bytes() == MODEL
    assert source.fetched == ["model.py", "model.py"]


def test_a_file_changed_in_the_cache_with_the_same_size_is_detected(tmp_path: Path) -> None:
    source = Source({"model.py": MODEL})
    ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    blob = tmp_path / "blobs" / artifact("model.py", MODEL).sha256
    with blob.open("r+b") as handle:  # in place: same inode, same size, new contents
        handle.write(b"import os; os.system('x')"[: len(MODEL)])
    assert blob.stat().st_size == len(MODEL)
    restarted = ArtifactCache(tmp_path, 1 << 20)
    view = restarted.materialize(source.version(), source.fetch).view
    assert (view / "model.py").read_bytes() == MODEL
    assert source.fetched == ["model.py", "model.py"]
    assert restarted.verifications.hashed_bytes == len(MODEL)


def test_a_file_changed_in_place_with_its_mtime_set_back_is_detected(tmp_path: Path) -> None:
    """What a user cannot set back, the ctime, is in the record."""
    source = Source({"model.py": MODEL})
    ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    blob = tmp_path / "blobs" / artifact("model.py", MODEL).sha256
    before = blob.stat()
    with blob.open("r+b") as handle:
        handle.write(b"import os; os.system('x')"[: len(MODEL)])
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (blob.stat().st_size, blob.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    restarted = ArtifactCache(tmp_path, 1 << 20)
    view = restarted.materialize(source.version(), source.fetch).view
    assert (view / "model.py").read_bytes() == MODEL
    assert source.fetched == ["model.py", "model.py"]


def test_a_file_whose_record_does_not_match_is_hashed_once_and_recorded_again(tmp_path: Path) -> None:
    source = Source({"model.py": MODEL})
    ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    blob = tmp_path / "blobs" / artifact("model.py", MODEL).sha256
    os.utime(blob, ns=(time.time_ns(), time.time_ns() - 10**10))  # same bytes, another mtime
    restarted = ArtifactCache(tmp_path, 1 << 20)
    for _ in range(2):
        restarted.materialize(source.version(), source.fetch)
    assert source.fetched == ["model.py"]  # intact: not fetched again
    assert restarted.verifications.hashed_bytes == len(MODEL)  # hashed the first time only


def test_versions_sharing_a_file_share_its_download(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, 1 << 20)
    first = Source({"model.py": MODEL, "factor.txt": b"2"})
    second = Source({"model.py": MODEL, "factor.txt": b"3"})
    cache.materialize(first.version("1"), first.fetch)
    cache.materialize(second.version("2"), second.fetch)
    assert second.fetched == ["factor.txt"]


def test_least_recently_used_files_that_no_model_holds_go_first(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, 350)
    sources = {name: Source({"model.py": name.encode() * 100}) for name in "abcd"}
    sha = {name: artifact("model.py", name.encode() * 100).sha256 for name in "abcd"}
    for name in "abc":
        cache.materialize(sources[name].version(), sources[name].fetch)
    cache.release(sources["b"].version())
    cache.release(sources["c"].version())
    cache.materialize(sources["b"].version(), sources["b"].fetch)  # b is now more recent than c
    cache.release(sources["b"].version())
    # a (oldest, but held by a loaded model) stays; c, the least recently used of the rest, goes.
    cache.materialize(sources["d"].version(), sources["d"].fetch)
    assert blobs(tmp_path) == sorted([sha["a"], sha["b"], sha["d"]])


def deploy(s3: Bucket, tmp_path: Path, factor: str) -> FunctionVersion:
    folder = tmp_path / f"echo-{factor}"
    folder.mkdir()
    (folder / "function.yaml").write_text(yaml.safe_dump(MANIFEST))
    (folder / "model.py").write_bytes(MODEL)
    (folder / "factor.txt").write_text(factor)
    repository = S3Repository(s3.repo)
    return repository.add_version(
        load_manifest(folder / "function.yaml"), collect_files(folder), lambda _n: None
    )


async def test_concurrent_requests_cause_one_download_and_one_load(s3: Bucket, tmp_path: Path) -> None:
    await asyncio.to_thread(deploy, s3, tmp_path, "2")
    record = await asyncio.to_thread(S3Repository(s3.repo).get, "echo")
    reports: list[tuple[str, str, str]] = []

    async def report(function: str, version: str, state: ModelState) -> None:
        reports.append((function, version, state.state))

    artifacts = await asyncio.to_thread(Artifacts, s3.repo, tmp_path / "cache", 1 << 20)
    models = LoadedModels(1, artifacts, report)
    models.offer({"echo": record})
    first, second = await asyncio.gather(models.get(record.versions["1"]), models.get(record.versions["1"]))
    assert first is second
    assert s3.server.count("GET", s3.key("echo", "1", "model.py")) == 1
    assert reports == [("echo", "1", "LOADING"), ("echo", "1", "READY")]
    assert (first.function.directory / "factor.txt").read_text() == "2"
    models.close()


async def test_the_s3_repository_keeps_versions_and_their_checksums(s3: Bucket, tmp_path: Path) -> None:
    repository = S3Repository(s3.repo + "/")
    assert repository.url == s3.repo
    first = await asyncio.to_thread(deploy, s3, tmp_path, "2")
    second = await asyncio.to_thread(deploy, s3, tmp_path, "3")
    assert (first.version, second.version) == ("1", "2")
    assert await asyncio.to_thread(repository.next_version, "echo") == "3"
    head = s3.client().head_object(Bucket=s3.name, Key=s3.key("echo", "2", "factor.txt"))
    assert head["Metadata"]["sha256"] == hashlib.sha256(b"3").hexdigest()
    record = (await asyncio.to_thread(repository.scan))["echo"]
    assert list(record.versions) == ["1", "2"] and record.served == ("2",)
    assert record.versions["2"].digest == second.digest
    with pytest.raises(FunctionNotFound):
        await asyncio.to_thread(repository.get, "../echo")
    await asyncio.to_thread(repository.remove, "echo")
    assert await asyncio.to_thread(repository.scan) == {}


WIDTH = 192
"""The test model's weights: 192 x 192 FP32, 144 KiB, read in ranged parts (of at least PART_BYTES)."""
PART_BYTES = 8 * 1024


def deploy_matmul(s3: Bucket, folder: Path) -> tuple[FunctionVersion, np.ndarray]:
    weights = np.random.default_rng(20).standard_normal((WIDTH, WIDTH), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"))
    manifest = {
        "name": "matmul",
        "model": {"backend": "onnxruntime", "path": "model.onnx"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, WIDTH]}],
    }
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest))
    version = S3Repository(s3.repo).add_version(
        load_manifest(folder / "function.yaml"), collect_files(folder), lambda _n: None
    )
    return version, weights


async def test_a_large_model_is_read_in_parallel_parts_and_loaded_from_verified_memory(
    s3: Bucket, tmp_path: Path
) -> None:
    version, weights = await asyncio.to_thread(deploy_matmul, s3, tmp_path / "matmul")
    model_file = next(item for item in version.files if item.path == "model.onnx")
    s3.server.requests.clear()
    artifacts = Artifacts(s3.repo, tmp_path / "cache", 1 << 24, PART_BYTES)
    materialized = await asyncio.to_thread(artifacts.materialize, version)
    assert materialized.model_bytes == (tmp_path / "matmul" / "model.onnx").read_bytes()
    # Read into memory: one ranged GET per read thread, not one per PART_BYTES (18 here).
    assert model_file.size > READ_THREADS * PART_BYTES
    assert s3.server.count("GET", s3.key("matmul", "1", "model.onnx")) == READ_THREADS
    loaded = materialized.function
    backend = load_backend(loaded.manifest, loaded.directory, 1, None, materialized.model_bytes)
    x = np.ones((2, WIDTH), dtype=np.float32)
    np.testing.assert_allclose(backend.run({"x": x}, ["y"])["y"], x @ weights, rtol=1e-4)
    backend.close()

    assert artifacts.cache is not None
    artifacts.cache.flush()  # the cache's copy, written in the background
    assert (tmp_path / "cache" / "blobs" / model_file.sha256).read_bytes() == materialized.model_bytes
    s3.server.requests.clear()
    restarted = Artifacts(s3.repo, tmp_path / "cache", 1 << 24, PART_BYTES)
    again = await asyncio.to_thread(restarted.materialize, version)
    assert again.model_bytes is None and again.download_s == 0  # from disk: the session reads the file
    assert (again.function.directory / "model.onnx").read_bytes() == materialized.model_bytes
    assert s3.server.requests == [] and restarted.verifications is not None
    assert restarted.verifications.hashed_bytes == 0  # its record matched


async def test_a_model_changed_in_the_repository_is_refused_and_never_cached(
    s3: Bucket, tmp_path: Path
) -> None:
    version, _ = await asyncio.to_thread(deploy_matmul, s3, tmp_path / "matmul")
    original = (tmp_path / "matmul" / "model.onnx").read_bytes()
    tampered = original[:-4] + bytes(b ^ 0xFF for b in original[-4:])  # the same size
    s3.client().put_object(Bucket=s3.name, Key=s3.key("matmul", "1", "model.onnx"), Body=tampered)
    artifacts = Artifacts(s3.repo, tmp_path / "cache", 1 << 24, PART_BYTES)
    models = LoadedModels(1, artifacts)
    models.offer({"matmul": make_record([version])})
    with pytest.raises(Unavailable, match=r"model.onnx: sha256 .* does not match"):
        await models.get(version)
    assert artifacts.cache is not None
    artifacts.cache.flush()
    assert blobs(tmp_path / "cache") == [next(i.sha256 for i in version.files if i.path == "function.yaml")]
    models.close()
