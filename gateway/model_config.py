"""A function's manifest as Triton's model configuration JSON (the model configuration extension),
which perf_analyzer, model-analyzer and tritonclient read before anything else."""

from __future__ import annotations

from typing import Any

from fngate.manifest import FunctionManifest, TensorSpec
from fngate.pipeline import REQUEST, order

PLATFORMS = {
    "onnxruntime": "onnxruntime_onnx",
    "tensorrt": "tensorrt_plan",
    "pytorch": "pytorch_libtorch",
    "python": "",
}
"""Triton's platform per backend; a Python backend model has none."""


def data_type(datatype: str) -> str:
    """Triton's configuration names a datatype TYPE_<name>, and BYTES TYPE_STRING."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def platform_of(manifest: FunctionManifest) -> str:
    """What model metadata reports: Triton's platform, "python", or "ensemble" for a pipeline (for
    a Triton model, what Triton reports: its platform, else its backend)."""
    if manifest.triton is not None:
        config = manifest.triton.config
        return str(config.get("platform") or config.get("backend") or "")
    if manifest.pipeline is not None:
        return "ensemble"
    return PLATFORMS[manifest.model.backend] or "python"


def backend_of(manifest: FunctionManifest) -> str:
    return manifest.model.backend if manifest.pipeline is None else "pipeline"


def model_config(manifest: FunctionManifest) -> dict[str, Any]:
    """The configuration of one version. With batching on, dims leave out the batch dimension. A
    Triton model answers its own configuration, as Triton completed it."""
    if manifest.triton is not None:
        return manifest.triton.config
    if manifest.pipeline is not None:
        return ensemble_config(manifest)
    batching = manifest.batching
    accelerator = manifest.model.accelerator
    on_gpu = accelerator != "cpu" or manifest.model.backend == "tensorrt"
    config: dict[str, Any] = {
        "name": manifest.name,
        "platform": PLATFORMS[manifest.model.backend],
        "backend": manifest.model.backend,
        "version_policy": _version_policy(manifest),
        "max_batch_size": batching.max_batch_size,
        "input": [_tensor(spec, manifest.batched) for spec in manifest.inputs],
        "output": [_tensor(spec, manifest.batched) for spec in manifest.outputs],
        "instance_group": [
            {
                "name": f"{manifest.name}_0",
                "kind": "KIND_GPU" if on_gpu else "KIND_CPU",
                "count": manifest.model.instances,
                "gpus": [],
                "profile": [],
                "passive": False,
                "host_policy": "",
            }
        ],
        "default_model_filename": manifest.model.path,
        "response_cache": {"enable": manifest.cache.enabled},
        "model_warmup": [],
        # How long the gateway may hold an invocation (a cold load, then its deadline): clients that
        # wait for an answer, `fngate invoke` among them, read it here.
        "parameters": {
            "load_timeout_s": {"string_value": f"{manifest.model.load_timeout_s:g}"},
            "timeout_ms": {"string_value": str(batching.timeout_ms)},
        },
    }
    if manifest.batched:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
            "preserve_ordering": False,
            "priority_levels": 0,
            "default_priority_level": 0,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": batching.timeout_ms * 1000,
                "allow_timeout_override": True,
                "max_queue_size": batching.max_queue_size,
            },
        }
    if accelerator == "tensorrt":
        config["optimization"] = {
            "execution_accelerators": {
                "gpu_execution_accelerator": [
                    {"name": "tensorrt", "parameters": {"precision_mode": manifest.model.precision.upper()}}
                ]
            }
        }
    return config


def _tensor(spec: TensorSpec, batched: bool) -> dict[str, Any]:
    dims = list(spec.shape[1:] if batched else spec.shape)
    return {"name": spec.name, "data_type": data_type(spec.datatype), "dims": dims}


def _version_policy(manifest: FunctionManifest) -> dict[str, Any]:
    versions = manifest.versions
    if versions.policy == "all":
        return {"all": {}}
    if versions.policy == "specific":
        return {"specific": {"versions": [int(version) for version in versions.specific]}}
    return {"latest": {"num_versions": versions.latest}}


def ensemble_config(manifest: FunctionManifest) -> dict[str, Any]:
    """A pipeline as Triton describes an ensemble: its own inputs and outputs, and the steps in the
    order they run, each mapping its function's tensors to the ensemble's (`input_map`: the
    function's input -> the ensemble tensor it reads; `output_map`: its output -> the tensor it
    makes). Tensors between steps are named `<step>.<output>`; a pinned step names its version."""
    spec = manifest.pipeline
    assert spec is not None
    named = {reference: name for name, reference in reversed(spec.outputs.items())}

    def tensor(reference: str) -> str:
        source, _, name = reference.partition(".")
        return name if source == REQUEST else named.get(reference, reference)

    read = {reference for step in spec.steps for reference in step.inputs.values()} | set(
        spec.outputs.values()
    )
    steps = []
    for index in order(spec):
        step = spec.steps[index]
        outputs = sorted(
            {reference.partition(".")[2] for reference in read if reference.partition(".")[0] == step.name}
        )
        steps.append(
            {
                "model_name": step.function_name,
                "model_version": int(step.pinned) if step.pinned else -1,
                "input_map": {name: tensor(reference) for name, reference in step.inputs.items()},
                "output_map": {name: tensor(f"{step.name}.{name}") for name in outputs},
            }
        )
    return {
        "name": manifest.name,
        "platform": "ensemble",
        "version_policy": _version_policy(manifest),
        "max_batch_size": manifest.batching.max_batch_size,
        "input": [_tensor(item, manifest.batched) for item in manifest.inputs],
        "output": [_tensor(item, manifest.batched) for item in manifest.outputs],
        "ensemble_scheduling": {"step": steps},
        "response_cache": {"enable": manifest.cache.enabled},
    }
