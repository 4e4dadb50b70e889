"""The artifact cache and Artifacts: files verified before use, written atomically, reused after a
restart, evicted least recently used first; one download and one load for concurrent requests."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import yaml

from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import FunctionManifest, load_manifest
from fngate.registry import ModelState
from fngate.repository import ArtifactFile, FunctionVersion, collect_files
from fngate.s3 import S3Repository
from runner.artifacts import ArtifactCache, Artifacts
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

    def fetch(self, item: ArtifactFile, target: Path) -> None:
        self.fetched.append(item.path)
        target.write_bytes(self.damage if self.damage is not None else self.contents[item.path])


def blobs(root: Path) -> list[str]:
    return sorted(path.name for path in (root / "blobs").iterdir())


def test_files_are_fetched_once_and_reused_after_a_restart(tmp_path: Path) -> None:
    source = Source({"model.py": MODEL, "weights/w.bin": b"\x01" * 100})
    view, download_s = ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    assert (view / "model.py").read_bytes() == MODEL
    assert (view / "weights" / "w.bin").read_bytes() == b"\x01" * 100
    assert sorted(source.fetched) == ["model.py", "weights/w.bin"] and download_s > 0

    restarted = ArtifactCache(tmp_path, 1 << 20)
    again, download_s = restarted.materialize(source.version(), source.fetch)
    assert again == view and download_s == 0
    assert len(source.fetched) == 2


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
    view, _ = ArtifactCache(tmp_path, 1 << 20).materialize(source.version(), source.fetch)
    assert (view / "model.py").read_bytes() == MODEL
    assert source.fetched == ["model.py", "model.py"]


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
