"""TensorRT engine caches across pods, on the CPU: keys, a build saved to the store and found by the
next pod, and every way a cache is not used (another key, a damaged or hostile archive), against a
folder store and against S3 (moto's server)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import tarfile
from pathlib import Path

import orjson
import pytest
from prometheus_client import REGISTRY

from runner.backends.engine_cache import (
    META,
    EngineCache,
    EngineKey,
    EngineStore,
    FolderEngineStore,
    S3EngineStore,
)
from runner.backends.onnx import files_sha256
from tests.s3 import Bucket

KEY = EngineKey(
    "a" * 64, "10.16.1", "9.0", "NVIDIA H200", "580", "fp16", "onnxruntime 1.31.1", "0123456789abcdef"
)
ENGINE = b"serialized engine " * 100


def events(function: str, event: str) -> float:
    return (
        REGISTRY.get_sample_value("fngate_engine_cache_events_total", {"function": function, "event": event})
        or 0
    )


def build(cache: EngineCache) -> None:
    """What onnxruntime's TensorRT provider leaves in the folder after a build."""
    (cache.folder / "TensorrtExecutionProvider_cache_sm90_123.engine").write_bytes(ENGINE)
    (cache.folder / "TensorrtExecutionProvider_cache_sm90_123.profile").write_bytes(b"profile")
    (cache.folder / "TensorrtExecutionProvider_cache_sm90.timing").write_bytes(b"timing")


def folder_store(tmp_path: Path) -> EngineStore:
    return FolderEngineStore(tmp_path / "repo")


def s3_store(bucket: Bucket) -> EngineStore:
    return S3EngineStore(bucket.client(), bucket.name, "prod")


def test_key_names_everything_an_engine_depends_on() -> None:
    assert (
        KEY.name
        == f"{'a' * 64}/trt10.16.1-sm90-nvidia-h200-r580-fp16-onnxruntime-1.31.1-0123456789abcdef.tar"
    )
    names = {KEY.name}
    for field, other in [
        ("files_sha256", "b" * 64),
        ("tensorrt", "10.9.0"),
        ("compute_capability", "8.6"),
        ("device", "NVIDIA H100 80GB HBM3"),  # the same compute capability as an H200's
        ("driver", "575"),
        ("precision", "fp32"),
        ("builder", "onnxruntime 1.30.0"),
        ("options", "fedcba9876543210"),
    ]:
        changed = dataclasses.replace(KEY, **{field: other})
        names.add(changed.name)
        assert KEY.mismatch(changed.fields()) == f"{field} is {other!r}, not {getattr(KEY, field)!r}"
    assert len(names) == 9
    assert KEY.mismatch(KEY.fields()) is None
    assert KEY.mismatch(["not", "a", "mapping"]) == "it records no key"


def test_a_build_is_saved_and_the_next_pod_downloads_it(tmp_path: Path) -> None:
    store = folder_store(tmp_path)
    first = EngineCache(tmp_path / "pod-a", KEY, store, "fc-roundtrip")
    with first.locked():
        assert first.prepare() == "miss"
        assert list(first.folder.iterdir()) == []
        build(first)
        assert first.save()
    assert (tmp_path / "repo" / ".engines" / KEY.name).is_file()

    second = EngineCache(tmp_path / "pod-b", KEY, store, "fc-roundtrip")
    with second.locked():
        assert second.prepare() == "downloaded"
        assert not second.save()  # nothing new to upload
    built = {path.name: path.read_bytes() for path in first.folder.iterdir()}
    assert {path.name: path.read_bytes() for path in second.folder.iterdir()} == built
    assert orjson.loads((second.folder / META).read_bytes()) == KEY.fields()

    again = EngineCache(tmp_path / "pod-b", KEY, store, "fc-roundtrip")
    assert again.prepare() == "local"
    for event, count in [("miss", 1), ("uploaded", 1), ("downloaded", 1), ("local", 1)]:
        assert events("fc-roundtrip", event) == count


def test_an_engine_built_on_first_use_is_stored_beside_the_first(tmp_path: Path) -> None:
    """A pod that downloaded its engine meets a shape no engine covers: TensorRT builds one while
    the batch runs, and the store then holds both for the next pod."""
    store = folder_store(tmp_path)
    first = EngineCache(tmp_path / "pod-a", KEY, store, "fc-first-use")
    first.prepare()
    build(first)
    assert first.save()
    second = EngineCache(tmp_path / "pod-b", KEY, store, "fc-first-use")
    assert second.prepare() == "downloaded"
    assert not second.changed()
    (second.folder / "TensorrtExecutionProvider_cache_sm90_456.engine").write_bytes(b"another shape")
    assert second.changed()
    assert second.save()
    assert not second.changed() and not second.save()
    third = EngineCache(tmp_path / "pod-c", KEY, store, "fc-first-use")
    assert third.prepare() == "downloaded"
    assert sorted(path.name for path in third.folder.glob("*.engine")) == [
        "TensorrtExecutionProvider_cache_sm90_123.engine",
        "TensorrtExecutionProvider_cache_sm90_456.engine",
    ]
    assert events("fc-first-use", "uploaded") == 2


def test_the_key_covers_every_file_of_the_version_and_which_is_the_model(tmp_path: Path) -> None:
    version = tmp_path / "version"
    version.mkdir()
    (version / "model.onnx").write_bytes(b"graph")
    (version / "model.onnx.data").write_bytes(b"weights")
    (version / "function.yaml").write_text("name: f\n")
    digest = files_sha256(version, "model.onnx")
    (version / "function.yaml").write_text("name: f\ndescription: its settings are in the options\n")
    assert files_sha256(version, "model.onnx") == digest
    assert files_sha256(version, "model.onnx.data") != digest  # another file is the model
    (version / "model.onnx.data").write_bytes(b"other weights")  # ONNX external data
    assert files_sha256(version, "model.onnx") != digest
    # The artifact cache's view: links named by each blob's sha256, read from the link.
    blobs, view = tmp_path / "blobs", tmp_path / "view"
    blobs.mkdir()
    view.mkdir()
    for path in version.iterdir():
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.write_bytes(path.read_bytes())
        (view / path.name).symlink_to(blob)
    assert files_sha256(view, "model.onnx") == files_sha256(version, "model.onnx")


def test_without_a_store_the_cache_stays_local(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "pod", KEY, None, "fc-local")
    assert cache.prepare() == "miss"
    build(cache)
    assert not cache.save()
    assert EngineCache(tmp_path / "pod", KEY, None, "fc-local").prepare() == "local"


def test_a_stored_cache_of_another_key_is_never_used(tmp_path: Path) -> None:
    store = folder_store(tmp_path)
    other = dataclasses.replace(KEY, tensorrt="10.9.0")
    stale = EngineCache(tmp_path / "pod-old", other, None, "fc-mismatch")
    stale.prepare()
    build(stale)
    stale.save()
    # The stale archive placed under this key's name, as a confused upload would leave it.
    archive = tmp_path / "stale.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(stale.folder.iterdir()):
            tar.add(path, arcname=path.name)
    store.store(KEY.name, archive)

    cache = EngineCache(tmp_path / "pod", KEY, store, "fc-mismatch")
    assert cache.prepare() == "mismatch"
    assert list(cache.folder.iterdir()) == []
    assert events("fc-mismatch", "mismatch") == 1
    build(cache)
    assert cache.save()  # the rebuilt engine replaces the stale one
    assert EngineCache(tmp_path / "pod-next", KEY, store, "fc-mismatch").prepare() == "downloaded"


def test_a_local_folder_of_another_key_is_discarded(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "pod", KEY, None, "fc-local-mismatch")
    cache.prepare()
    build(cache)
    cache.save()
    (cache.folder / META).write_bytes(orjson.dumps({**KEY.fields(), "compute_capability": "8.0"}))
    assert EngineCache(tmp_path / "pod", KEY, None, "fc-local-mismatch").prepare() == "miss"
    assert list(cache.folder.iterdir()) == []


def hostile(name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        meta = orjson.dumps(KEY.fields())
        info = tarfile.TarInfo(META)
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        info = tarfile.TarInfo(name)
        info.size = len(ENGINE)
        tar.addfile(info, io.BytesIO(ENGINE))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "content",
    [b"not a tar archive at all", hostile("../escaped.engine"), hostile("nested/x.engine"), b""],
    ids=["garbage", "parent-path", "nested-path", "empty"],
)
def test_a_damaged_or_hostile_archive_is_ignored(tmp_path: Path, content: bytes) -> None:
    store = folder_store(tmp_path)
    (tmp_path / "bad.tar").write_bytes(content)
    store.store(KEY.name, tmp_path / "bad.tar")
    cache = EngineCache(tmp_path / "pod", KEY, store, "fc-hostile")
    assert cache.prepare() == "miss"
    assert list(cache.folder.iterdir()) == []
    assert not list(tmp_path.rglob("escaped.engine"))


def test_a_failed_upload_costs_the_next_pod_a_build_not_this_one_its_model(tmp_path: Path) -> None:
    (tmp_path / "repo").write_text("a file where the store's folder should be")
    cache = EngineCache(tmp_path / "pod", KEY, FolderEngineStore(tmp_path / "repo"), "fc-upload")
    assert cache.prepare() == "miss"
    build(cache)
    assert not cache.save()
    assert events("fc-upload", "upload_failed") == 1
    assert EngineCache(tmp_path / "pod", KEY, None, "fc-upload").prepare() == "local"


def test_keys_cannot_leave_the_stores_prefix(tmp_path: Path) -> None:
    store = FolderEngineStore(tmp_path)
    with pytest.raises(ValueError, match="not an engine cache key"):
        store.fetch("../outside.tar", tmp_path / "x")


def test_engine_caches_persist_in_s3(tmp_path: Path, s3: Bucket) -> None:
    store = s3_store(s3)
    assert not store.fetch(KEY.name, tmp_path / "absent.tar")
    first = EngineCache(tmp_path / "pod-a", KEY, store, "fc-s3")
    assert first.prepare() == "miss"
    build(first)
    assert first.save()
    stored = s3.client().head_object(Bucket=s3.name, Key=s3.key(".engines", *KEY.name.split("/")))
    assert stored["ContentLength"] > len(ENGINE)

    second = EngineCache(tmp_path / "pod-b", KEY, store, "fc-s3")
    assert second.prepare() == "downloaded"
    assert {p.name: p.read_bytes() for p in second.folder.iterdir()} == {
        p.name: p.read_bytes() for p in first.folder.iterdir()
    }
    other = dataclasses.replace(KEY, compute_capability="8.6")
    assert EngineCache(tmp_path / "pod-c", other, store, "fc-s3").prepare() == "miss"


def test_an_s3_store_that_refuses_is_a_miss_not_a_failed_load(tmp_path: Path, s3: Bucket) -> None:
    store = s3_store(s3)
    seed = EngineCache(tmp_path / "pod-a", KEY, store, "fc-s3-down")
    seed.prepare()
    build(seed)
    assert seed.save()
    s3.server.fault = 503
    cache = EngineCache(tmp_path / "pod-b", KEY, store, "fc-s3-down")
    assert cache.prepare() == "miss"
    assert list(cache.folder.iterdir()) == []


@pytest.mark.parametrize("where", ["local", "downloaded"])
def test_a_cache_tensorrt_refuses_is_deleted_reported_stale_and_replaced(tmp_path: Path, where: str) -> None:
    store = folder_store(tmp_path)
    seed = EngineCache(tmp_path / "pod-a", KEY, store, f"fc-stale-{where}")
    seed.prepare()
    build(seed)
    (seed.folder / "TensorrtExecutionProvider_cache_sm90_123.engine").write_bytes(b"damaged")
    assert seed.save()  # what a pod with a bad disk, or a bad build, left in the repository
    cache = EngineCache(
        tmp_path / ("pod-a" if where == "local" else "pod-b"), KEY, store, f"fc-stale-{where}"
    )
    assert cache.prepare() == where
    cache.discard("onnxruntime could not create the TensorRT provider: could not deserialize engine")
    assert cache.event == "stale"
    assert list(cache.folder.iterdir()) == []
    assert events(f"fc-stale-{where}", "stale") == 1
    build(cache)  # the next session builds afresh
    assert cache.save()
    fresh = EngineCache(tmp_path / "pod-c", KEY, store, f"fc-stale-{where}")
    assert fresh.prepare() == "downloaded"
    assert (fresh.folder / "TensorrtExecutionProvider_cache_sm90_123.engine").read_bytes() == ENGINE
