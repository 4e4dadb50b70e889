"""Accelerated backends: the provider choice and its fallback, TensorRT options and profiles, the
CPU fallback of a real model, the native TensorRT backend's error paths; and, marked `gpu`, the
same models on CUDA and TensorRT (skipped, with the reason, where there is no GPU)."""

from __future__ import annotations

import enum
import importlib.util
import logging
import time
import types
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client import REGISTRY

from fngate.config import RunnerSettings
from fngate.errors import InvalidArgument, ModelFailed, Unavailable
from fngate.manifest import (
    BatchingSpec,
    FunctionManifest,
    ManifestError,
    ModelSpec,
    TensorSpec,
    load_manifest,
    parse_manifest,
)
from runner import gpu
from runner.backends import load_backend
from runner.backends.engine_cache import FolderEngineStore, options_fingerprint
from runner.backends.onnx import OnnxBackend, create_session
from runner.backends.providers import (
    CPU,
    CUDA,
    NOT_SHAPING,
    TENSORRT,
    Acceleration,
    Environment,
    Profile,
    choose,
    library_version,
    options,
    probe,
    profile,
    session_problem,
)
from runner.backends.tensorrt import (
    KEPT_ERRORS,
    TensorRTBackend,
    build_plan,
    explain,
    numpy_dtype,
    process_logger,
    release,
)
from tests.runner.gpu_support import classifier, require_gpu, require_tensorrt, rows

H200 = gpu.Device(0, "NVIDIA H200", "GPU-1", "9.0", 141 * 1024**3, 0)
NO_GPU = gpu.NoDevice("NVML did not start: driver not loaded")
GPU_BUILD = (TENSORRT, CUDA, CPU)
CPU_BUILD = ("AzureExecutionProvider", CPU)
CPU_ONLY_HERE = CUDA not in probe(0).available


@pytest.mark.parametrize(
    ("accelerator", "environment", "providers", "reasons"),
    [
        ("cpu", Environment(CPU_BUILD, NO_GPU), (CPU,), []),
        ("cpu", Environment(GPU_BUILD, H200, "10.16.1"), (CPU,), []),
        ("cuda", Environment(GPU_BUILD, H200, "10.16.1"), (CUDA, CPU), []),
        ("tensorrt", Environment(GPU_BUILD, H200, "10.16.1"), (TENSORRT, CUDA, CPU), []),
        (
            "tensorrt",
            Environment(CPU_BUILD, NO_GPU),
            (CPU,),
            [
                "TensorRT provider unavailable: onnxruntime has no TensorrtExecutionProvider (the installed "
                "onnxruntime is the CPU package",
                "CUDA provider unavailable: onnxruntime has no CUDA",
            ],
        ),
        (
            "tensorrt",
            Environment(GPU_BUILD, NO_GPU, "10.16.1"),
            (CPU,),
            [
                "TensorRT provider unavailable: no NVIDIA GPU is visible "
                "(NVML did not start: driver not loaded)"
            ],
        ),
        (
            "tensorrt",
            Environment(GPU_BUILD, H200, "", "libnvinfer.so.10: cannot open shared object file"),
            (CUDA, CPU),
            ["TensorRT provider unavailable: TensorRT's libraries cannot be loaded (libnvinfer.so.10"],
        ),
        (
            "tensorrt",
            Environment(
                GPU_BUILD, H200, "10.16.1", cuda_problem="libcublas.so.13: cannot open shared object"
            ),
            (CPU,),
            [
                "TensorRT provider unavailable: the CUDA libraries onnxruntime links cannot be loaded "
                "(libcublas.so.13: cannot open shared object)",
                "CUDA provider unavailable: the CUDA libraries",
            ],
        ),
        (
            "cuda",
            Environment(
                CPU_BUILD, H200, package_problem="onnxruntime and onnxruntime-gpu are both installed"
            ),
            (CPU,),
            ["CUDA provider unavailable: onnxruntime has no CUDAExecutionProvider (onnxruntime and "],
        ),
    ],
)
def test_choose_takes_providers_in_order_and_says_why_it_skipped_one(
    accelerator: str, environment: Environment, providers: tuple[str, ...], reasons: list[str]
) -> None:
    choice = choose(accelerator, environment)
    assert choice.providers == providers
    if not reasons:
        assert choice.reason is None
    else:
        assert choice.reason is not None
        for reason in reasons:
            assert reason in choice.reason


def manifest_with(
    batching: BatchingSpec, *inputs: TensorSpec, model: dict[str, str] | None = None
) -> FunctionManifest:
    return FunctionManifest(
        name="m",
        model=ModelSpec.model_validate({"backend": "onnxruntime", "path": "model.onnx", **(model or {})}),
        inputs=inputs,
        outputs=(
            TensorSpec(name="out", datatype="FP32", shape=(-1, 4) if batching.max_batch_size else (4,)),
        ),
        batching=batching,
    )


def test_profile_covers_the_manifests_batch_range_tuned_for_the_largest_preferred_size() -> None:
    manifest = manifest_with(
        BatchingSpec(max_batch_size=32, preferred_batch_sizes=(8, 16)),
        TensorSpec(name="input", datatype="FP32", shape=(-1, 256)),
        TensorSpec(name="mask", datatype="INT64", shape=(-1, 3, 4)),
    )
    assert profile(manifest) == (
        Profile("input:1x256,mask:1x3x4", "input:16x256,mask:16x3x4", "input:32x256,mask:32x3x4"),
        "",
    )
    without_preferred = manifest_with(
        BatchingSpec(max_batch_size=8), TensorSpec(name="x", datatype="FP32", shape=(-1, 2))
    )
    assert profile(without_preferred) == (Profile("x:1x2", "x:8x2", "x:8x2"), "")


@pytest.mark.parametrize(
    ("batching", "shape", "reason"),
    [
        (BatchingSpec(max_batch_size=0), (1, 16), ""),  # static: TensorRT needs no profile
        (BatchingSpec(max_batch_size=0), (-1, 16), "variable dimensions and batching is off"),
        (BatchingSpec(max_batch_size=8), (-1, -1), "variable dimension besides the batch dimension"),
    ],
)
def test_no_profile_where_the_manifest_cannot_give_one(
    batching: BatchingSpec, shape: tuple[int, ...], reason: str
) -> None:
    found, why = profile(manifest_with(batching, TensorSpec(name="x", datatype="FP32", shape=shape)))
    assert found is None
    assert reason in why and bool(why) == bool(reason)


def test_tensorrt_options_ask_for_fp16_caches_and_profiles(tmp_path: Path) -> None:
    spec = TensorSpec(name="input", datatype="FP32", shape=(-1, 16))
    fp16 = manifest_with(
        BatchingSpec(max_batch_size=32), spec, model={"accelerator": "tensorrt", "precision": "fp16"}
    )
    chosen = options(TENSORRT, fp16, tmp_path, 1)
    assert chosen == {
        "device_id": "1",
        "trt_fp16_enable": "True",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(tmp_path),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(tmp_path),
        "trt_profile_min_shapes": "input:1x16",
        "trt_profile_opt_shapes": "input:32x16",
        "trt_profile_max_shapes": "input:32x16",
    }
    assert options(CUDA, fp16, tmp_path, 1) == {"device_id": "1"}
    assert options(CPU, fp16, tmp_path, 1) == {}
    fp32 = manifest_with(BatchingSpec(max_batch_size=32), spec, model={"accelerator": "tensorrt"})
    assert options(TENSORRT, fp32, tmp_path, 1)["trt_fp16_enable"] == "False"
    # The engine key changes with what shapes the engine, not with where it is kept.
    moved = options(TENSORRT, fp16, tmp_path / "elsewhere", 0)
    assert options_fingerprint(chosen, NOT_SHAPING) == options_fingerprint(moved, NOT_SHAPING)
    assert options_fingerprint(chosen, NOT_SHAPING) != options_fingerprint(
        options(TENSORRT, fp32, tmp_path, 1), NOT_SHAPING
    )


def test_acceleration_comes_from_the_runner_settings(tmp_path: Path) -> None:
    settings = RunnerSettings(
        engine_cache_dir=str(tmp_path / "engines"), require_accelerator=True, gpu_device=1
    )
    store = FolderEngineStore(tmp_path / "repo")
    assert Acceleration.from_settings(settings, store) == Acceleration(tmp_path / "engines", store, True, 1)
    assert Acceleration.from_settings(RunnerSettings()).engine_dir == Path.home() / ".cache/fngate/engines"


def test_library_version_reads_tensorrts_number() -> None:
    assert library_version(101601) == "10.16.1"
    assert library_version(100900) == "10.9.0"
    assert library_version(8601) == "8.6.1"


def test_manifest_takes_precision_for_onnxruntime_and_cuda_but_not_tensorrt_for_python() -> None:
    base = {
        "name": "m",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
    }
    fp16 = {"backend": "onnxruntime", "path": "m.onnx", "accelerator": "tensorrt", "precision": "fp16"}
    assert parse_manifest({**base, "model": fp16}, "f").model.precision == "fp16"
    assert (
        parse_manifest({**base, "model": {"backend": "tensorrt", "path": "m.plan"}}, "f").model.backend
        == "tensorrt"
    )
    python = {"backend": "python", "path": "m.py"}
    cuda = parse_manifest({**base, "model": {**python, "accelerator": "cuda"}}, "f")
    assert cuda.model.accelerator == "cuda"
    with pytest.raises(ManifestError, match="a python function takes cpu or cuda"):
        parse_manifest({**base, "model": {**python, "accelerator": "tensorrt"}}, "f")
    with pytest.raises(ManifestError, match=r"model\.precision"):
        parse_manifest({**base, "model": {**fp16, "precision": "int8"}}, "f")


cpu_only = pytest.mark.skipif(not CPU_ONLY_HERE, reason="onnxruntime here has GPU providers")


@cpu_only
def test_an_accelerated_function_falls_back_to_cpu_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifest, folder = classifier(tmp_path, accelerator="tensorrt", precision="fp16")
    plain, plain_folder = classifier(tmp_path / "plain")
    labels = {"function": "classifier", "asked": "tensorrt", "device": CPU}
    before = REGISTRY.get_sample_value("fngate_accelerator_fallbacks_total", labels) or 0
    with caplog.at_level(logging.INFO, logger="runner.backends.onnx"):
        backend = OnnxBackend(manifest, folder, 1, Acceleration(engine_dir=tmp_path / "engines"))
    reference = OnnxBackend(plain, plain_folder, 1)
    try:
        assert backend.device == CPU
        assert backend.fallback_reason is not None
        assert (
            "TensorRT provider unavailable: onnxruntime has no TensorrtExecutionProvider"
            in backend.fallback_reason
        )
        assert "CUDA provider unavailable" in backend.fallback_reason
        assert backend.device_memory_bytes == 0
        assert reference.device == CPU and reference.fallback_reason is None
        batch = rows(5)
        np.testing.assert_array_equal(
            backend.run(batch, ["probabilities"])["probabilities"],
            reference.run(batch, ["probabilities"])["probabilities"],
        )
    finally:
        backend.close()
        reference.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith(
            "classifier runs on CPUExecutionProvider (asked: tensorrt; TensorRT provider unavailable"
        )
        for m in warnings
    ), warnings
    assert REGISTRY.get_sample_value("fngate_accelerator_fallbacks_total", labels) == before + 1


@cpu_only
def test_a_runner_that_requires_the_accelerator_refuses_the_fallback(tmp_path: Path) -> None:
    manifest, folder = classifier(tmp_path, accelerator="cuda")
    with pytest.raises(
        Unavailable, match=r"asks for accelerator cuda and this runner requires it.*CUDA provider"
    ):
        OnnxBackend(manifest, folder, 1, Acceleration(require=True))


def test_cpu_functions_run_on_cpu_without_a_reason(tmp_path: Path) -> None:
    manifest, folder = classifier(tmp_path)
    backend = load_backend(manifest, folder, 1)
    try:
        assert isinstance(backend, OnnxBackend)
        assert (backend.device, backend.fallback_reason) == (CPU, None)
    finally:
        backend.close()


tensorrt_missing = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here"
)


@tensorrt_missing
def test_an_engine_without_tensorrt_installed_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    manifest, folder = classifier(tmp_path, backend="tensorrt", path="model.plan")
    (folder / "model.plan").write_bytes(b"not an engine")
    with pytest.raises(Unavailable, match=r"needs TensorRT's Python package.*install fngate\[gpu,tensorrt\]"):
        load_backend(manifest, folder, 1)


def test_the_tensorrt_backend_refuses_an_onnx_file(tmp_path: Path) -> None:
    manifest, folder = classifier(tmp_path, backend="tensorrt")
    with pytest.raises(InvalidArgument, match="use backend: onnxruntime with accelerator: tensorrt"):
        load_backend(manifest, folder, 1)


@pytest.mark.parametrize(
    ("said", "expected"),
    [
        (
            "6: The engine plan file is not compatible with this version of TensorRT, expecting library "
            "version 10.16.1.11 got 10.9.0.34, please rebuild.",
            "built by another TensorRT version than this runner's 10.16.1.11; "
            "rebuild it with TensorRT 10.16.1.11",
        ),
        (
            "6: The engine plan file is generated on an incompatible device, expecting compute 9.0 got "
            "compute 8.6, please rebuild.",
            "built for another GPU than this runner's NVIDIA H200 (compute capability 9.0)",
        ),
        (
            "1: [stdArchiveReader.cpp::StdArchiveReader::32] Error Code 1: Serialization (Serialization "
            "assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)",
            "not a TensorRT engine, or it is damaged",
        ),
        ("", "TensorRT cannot load the engine (TensorRT: no reason given; TensorRT logs to the first"),
    ],
)
def test_a_refused_engine_is_explained(said: str, expected: str) -> None:
    reason = explain([said] if said else [], "10.16.1.11", H200)
    assert expected in reason
    assert said in reason


@pytest.mark.parametrize(
    ("asked", "providers", "given", "problem"),
    [
        ([(CUDA, {"device_id": "1"}), (CPU, {})], [CUDA, CPU], {CUDA: {"device_id": "1"}}, None),
        ([(CPU, {})], [CPU], {CPU: {}}, None),
        # onnxruntime's own fallback from TensorRT: CUDA and CPU, none of the options.
        (
            [(TENSORRT, {"device_id": "1"}), (CUDA, {"device_id": "1"}), (CPU, {})],
            [CUDA, CPU],
            {CUDA: {"device_id": "0"}},
            "onnxruntime did not create the TensorRT provider (the session has",
        ),
        # The same fallback from CUDA, where TensorRT is installed: CUDA again, on GPU 0.
        (
            [(CUDA, {"device_id": "1"}), (CPU, {})],
            [CUDA, CPU],
            {CUDA: {"device_id": "0"}},
            "onnxruntime created the CUDA provider on GPU 0, not 1",
        ),
        ([(CUDA, {"device_id": "0"}), (CPU, {})], [CPU], {CPU: {}}, "did not create the CUDA provider"),
    ],
)
def test_a_session_is_compared_with_what_was_asked_for(
    asked: list[tuple[str, dict[str, str]]],
    providers: list[str],
    given: dict[str, dict[str, str]],
    problem: str | None,
) -> None:
    found = session_problem(asked, providers, given)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@cpu_only
def test_a_cpu_onnxruntime_asked_for_cuda_reports_the_fallback(tmp_path: Path) -> None:
    import onnxruntime

    _manifest, folder = classifier(tmp_path)
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):  # onnxruntime's own, on stderr
        session, problem = create_session(
            onnxruntime, folder / "model.onnx", 1, [(CUDA, {"device_id": "0"}), (CPU, {})]
        )
    assert session.get_providers() == [CPU]
    assert problem is not None
    assert "onnxruntime did not create the CUDA provider" in problem
    batch = rows(3)
    assert session.run(["probabilities"], batch)[0].shape == (3, 4)


def test_a_model_that_no_provider_can_load_fails_its_load(tmp_path: Path) -> None:
    import onnxruntime

    (tmp_path / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(Exception, match=r"(?i)protobuf|load"):
        create_session(onnxruntime, tmp_path / "model.onnx", 1, [(CPU, {})])


@pytest.mark.parametrize(
    ("datatype", "expected"),
    [
        ("FLOAT", np.float32),
        ("HALF", np.float16),
        ("INT64", np.int64),
        ("BOOL", np.bool_),
        ("UINT8", np.uint8),
    ],
)
def test_engine_datatypes_numpy_holds_are_mapped(datatype: str, expected: type) -> None:
    assert numpy_dtype("m", "x", datatype) == np.dtype(expected)


@pytest.mark.parametrize("datatype", ["BF16", "FP8", "INT4", "FP4"])
def test_engine_datatypes_numpy_cannot_hold_are_refused_by_name(datatype: str) -> None:
    with pytest.raises(Unavailable, match=rf"m: tensor 'logits' of the engine is {datatype}, which fngate"):
        numpy_dtype("m", "logits", datatype)


class Severity(enum.IntEnum):
    """TensorRT's ILogger.Severity, for a stand-in of its module."""

    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


def stand_in_tensorrt() -> types.ModuleType:
    """What process_logger uses of the tensorrt module: ILogger and its severities."""

    class ILogger:
        def __init__(self) -> None:
            pass

    ILogger.Severity = Severity  # type: ignore[attr-defined]
    module = types.ModuleType("tensorrt")
    module.ILogger = ILogger  # type: ignore[attr-defined]
    return module


def test_one_tensorrt_logger_serves_the_process_and_each_load_reads_its_own_errors() -> None:
    trt = stand_in_tensorrt()
    logger = process_logger(trt)
    assert process_logger(trt) is logger
    first = logger.mark()
    logger.log(Severity.ERROR, "the engine plan file is not compatible")
    logger.log(Severity.WARNING, "a warning is logged, not kept")
    second = logger.mark()
    logger.log(Severity.INTERNAL_ERROR, "magic tag does not match")
    assert logger.errors_since(first) == [
        "the engine plan file is not compatible",
        "magic tag does not match",
    ]
    assert logger.errors_since(second) == ["magic tag does not match"]
    assert logger.errors_since(logger.mark()) == []
    for number in range(KEPT_ERRORS + 5):
        logger.log(Severity.ERROR, f"error {number}")
    kept = logger.errors_since(first)
    assert len(kept) == KEPT_ERRORS and kept[-1] == f"error {KEPT_ERRORS + 4}"


def test_closing_an_engine_selects_its_gpu_and_frees_everything_after_a_failure() -> None:
    calls: list[tuple[str, object]] = []

    def call(function: str, argument: object) -> None:
        calls.append((function, argument))
        if (function, argument) in (("cudaFree", 0x200), ("cudaStreamDestroy", "stream")):
            raise ModelFailed(f"m: {function} failed: an illegal memory access was encountered")

    failure = release(call, 3, [0x100, 0x200, 0x300], "stream")
    assert calls == [
        ("cudaSetDevice", 3),  # first: another thread may have made another GPU current
        ("cudaFree", 0x100),
        ("cudaFree", 0x200),
        ("cudaFree", 0x300),  # still freed after the failure before it
        ("cudaStreamDestroy", "stream"),
    ]
    assert failure is not None and "cudaFree failed" in failure.message
    assert release(lambda *_: None, 0, [], None) is None


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_gpu_is_described_by_nvml() -> None:
    device = require_gpu()
    assert device.total_bytes > device.used_bytes > 0
    assert device.compute_capability.count(".") == 1
    assert gpu.read_memory(0) is not None
    assert probe(0).cuda_problem == ""


@pytest.mark.gpu
def test_tensorrts_libraries_load_beside_the_gpu() -> None:
    require_tensorrt()
    environment = probe(0)
    assert environment.tensorrt_problem == ""
    assert environment.tensorrt_version.startswith("10.")


@pytest.mark.gpu
def test_an_engine_built_on_first_use_is_stored(tmp_path: Path) -> None:
    """Inputs without a profile (a variable dimension besides the batch): TensorRT builds the
    engine for the first shapes it sees, and the runner stores what it built."""
    require_tensorrt()
    _manifest, folder = classifier(tmp_path, accelerator="tensorrt")
    data = yaml.safe_load((folder / "function.yaml").read_text())
    data["inputs"][0]["shape"] = [-1, -1]
    (folder / "function.yaml").write_text(yaml.safe_dump(data))
    manifest = load_manifest(folder / "function.yaml")
    assert profile(manifest)[0] is None
    store = FolderEngineStore(tmp_path / "repo")
    backend = OnnxBackend(manifest, folder, 1, Acceleration(tmp_path / "pod", store, require=True))
    try:
        backend.run(rows(3), ["probabilities"])
        for _ in range(100):
            if list((tmp_path / "repo").rglob("*.tar")):
                break
            time.sleep(0.1)
        assert list((tmp_path / "repo").rglob("*.tar"))
    finally:
        backend.close()


@pytest.mark.gpu
def test_cuda_provider_runs_the_model_like_the_cpu(tmp_path: Path) -> None:
    require_gpu()
    manifest, folder = classifier(tmp_path, accelerator="cuda")
    backend = OnnxBackend(manifest, folder, 1, Acceleration(require=True))
    reference = OnnxBackend(*classifier(tmp_path / "cpu"), 1)
    try:
        assert (backend.device, backend.fallback_reason) == (CUDA, None)
        assert backend.device_memory_bytes >= 0
        for count in (1, 7, 32):
            batch = rows(count, seed=count)
            np.testing.assert_allclose(
                backend.run(batch, ["probabilities"])["probabilities"],
                reference.run(batch, ["probabilities"])["probabilities"],
                atol=1e-4,
            )
    finally:
        backend.close()
        reference.close()


@pytest.mark.gpu
def test_tensorrt_fp16_builds_once_and_another_pod_reuses_the_engine(tmp_path: Path) -> None:
    require_tensorrt()
    manifest, folder = classifier(tmp_path, accelerator="tensorrt", precision="fp16")
    store = FolderEngineStore(tmp_path / "repo")
    first = OnnxBackend(manifest, folder, 1, Acceleration(tmp_path / "pod-a", store, require=True))
    reference = OnnxBackend(*classifier(tmp_path / "cpu"), 1)
    try:
        assert (first.device, first.fallback_reason) == (TENSORRT, None)
        engines = sorted((tmp_path / "pod-a").rglob("*.engine"))
        assert len(engines) == 1
        for count in (1, 5, 17, 32):  # every size inside the profile: no rebuild
            batch = rows(count, seed=count)
            np.testing.assert_allclose(
                first.run(batch, ["probabilities"])["probabilities"],
                reference.run(batch, ["probabilities"])["probabilities"],
                atol=2e-2,
            )
        assert sorted((tmp_path / "pod-a").rglob("*.engine")) == engines
        assert list((tmp_path / "repo").rglob("*.tar"))
    finally:
        first.close()
        reference.close()
    second = OnnxBackend(manifest, folder, 1, Acceleration(tmp_path / "pod-b", store, require=True))
    try:
        assert second.device == TENSORRT
        built = {path.name: path.read_bytes() for path in engines}
        fetched = {path.name: path.read_bytes() for path in (tmp_path / "pod-b").rglob("*.engine")}
        assert fetched == built
    finally:
        second.close()


@pytest.mark.gpu
def test_a_stored_engine_tensorrt_refuses_is_deleted_rebuilt_and_replaced(tmp_path: Path) -> None:
    require_tensorrt()
    manifest, folder = classifier(tmp_path, accelerator="tensorrt", precision="fp16")
    store = FolderEngineStore(tmp_path / "repo")
    OnnxBackend(manifest, folder, 1, Acceleration(tmp_path / "pod-a", store, require=True)).close()
    (engine,) = (tmp_path / "pod-a").rglob("*.engine")
    engine.write_bytes(bytes(64) + engine.read_bytes()[64:])  # damaged, its recorded key intact
    (archive,) = (tmp_path / "repo").rglob("*.tar")
    archive.unlink()
    labels = {"function": "classifier", "event": "stale"}
    stale = REGISTRY.get_sample_value("fngate_engine_cache_events_total", labels) or 0
    again = OnnxBackend(manifest, folder, 1, Acceleration(tmp_path / "pod-a", store, require=True))
    try:
        assert (again.device, again.fallback_reason) == (TENSORRT, None)
        assert REGISTRY.get_sample_value("fngate_engine_cache_events_total", labels) == stale + 1
        assert list((tmp_path / "repo").rglob("*.tar"))  # the rebuilt engine is stored
    finally:
        again.close()


def plan_function(tmp_path: Path, max_rows: int, manifest_rows: int) -> tuple[FunctionManifest, Path]:
    """The classifier as a `.plan` built here with a profile up to `max_rows`, served by a
    manifest that allows `manifest_rows`."""
    manifest, folder = classifier(tmp_path, backend="tensorrt", path="model.plan")
    build_plan(
        manifest.model_copy(update={"batching": BatchingSpec(max_batch_size=max_rows)}),
        folder / "model.onnx",
        folder / "model.plan",
    )
    return manifest.model_copy(update={"batching": BatchingSpec(max_batch_size=manifest_rows)}), folder


@pytest.mark.gpu
def test_native_tensorrt_engine_serves_any_batch_of_its_profile(tmp_path: Path) -> None:
    require_tensorrt()
    manifest, folder = plan_function(tmp_path, 32, 32)
    backend = load_backend(manifest, folder, 1)
    reference = OnnxBackend(*classifier(tmp_path / "cpu"), 1)
    try:
        assert isinstance(backend, TensorRTBackend)
        assert (backend.device, backend.fallback_reason) == ("TensorRT", None)
        assert backend.device_memory_bytes > 0
        for count in (1, 9, 32):
            batch = rows(count, seed=count)
            np.testing.assert_allclose(
                backend.run(batch, ["probabilities"])["probabilities"],
                reference.run(batch, ["probabilities"])["probabilities"],
                atol=1e-3,
            )
    finally:
        backend.close()
        reference.close()


@pytest.mark.gpu
def test_native_engine_with_too_small_a_profile_is_unavailable(tmp_path: Path) -> None:
    require_tensorrt()
    manifest, folder = plan_function(tmp_path, 8, 32)
    with pytest.raises(Unavailable, match="takes 1 to 8 rows of 'input', but max_batch_size is 32"):
        load_backend(manifest, folder, 1)


@pytest.mark.gpu
def test_a_damaged_engine_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    require_tensorrt()
    manifest, folder = plan_function(tmp_path, 32, 32)
    plan = bytearray((folder / "model.plan").read_bytes())
    plan[:16] = bytes(16)
    (folder / "model.plan").write_bytes(bytes(plan))
    with pytest.raises(Unavailable, match="classifier: "):
        load_backend(manifest, folder, 1)
