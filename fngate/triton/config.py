"""config.pbtxt -> a function manifest: read with Triton's schema (model_config_pb2) and protobuf's
text_format, every field mapped onto FunctionManifest or named in a warning."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as pb

from fngate.manifest import DNS_LABEL, FunctionManifest, ManifestError, parse_manifest

CONFIG_FILE = "config.pbtxt"
PLATFORMS = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
    "ensemble": "ensemble",
}
"""Triton's platform -> fngate's backend (or "ensemble", a pipeline)."""
BACKENDS = {"onnxruntime": "onnxruntime", "tensorrt": "tensorrt", "pytorch": "pytorch", "python": "python"}
PLATFORM_OF = {
    "onnxruntime": "onnxruntime_onnx",
    "tensorrt": "tensorrt_plan",
    "pytorch": "pytorch_libtorch",
    "python": "",
}
MODEL_FILES = {
    "onnxruntime": "model.onnx",
    "tensorrt": "model.plan",
    "pytorch": "model.pt",
    "python": "model.py",
}
"""Triton's default_model_filename per backend."""
MAX_DELAY_US = 10_000_000

Signature = Callable[[], "ModelSignature"]
"""Reads the inputs and outputs of the model file (auto-complete); raises ValueError."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorConfig:
    name: str
    datatype: str
    dims: tuple[int, ...]
    """With the batch dimension, as the model file has it (-1 for a variable one)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSignature:
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]


def _name_of(value: int) -> str:
    name: str = pb.DataType.Name(value)
    return name


DATATYPES = {
    _name_of(value): "BYTES" if _name_of(value) == "TYPE_STRING" else _name_of(value).removeprefix("TYPE_")
    for value in pb.DataType.values()
    if _name_of(value) not in ("TYPE_INVALID", "TYPE_BF16")
}
"""Triton's TYPE_* -> the protocol's datatype (TYPE_STRING is BYTES); BF16 has no datatype here."""

# Fields fngate does what Triton does with (paths of set fields, repeated ones without an index).
HONOURED = frozenset(
    {
        "name",
        "platform",
        "backend",
        "max_batch_size",
        "default_model_filename",
        "version_policy.latest",
        "version_policy.latest.num_versions",
        "version_policy.all",
        "version_policy.specific.versions",
        *(f"{kind}.{field}" for kind in ("input", "output") for field in ("name", "data_type", "dims")),
        *(f"{kind}.{field}" for kind in ("input", "output") for field in ("reshape", "reshape.shape")),
        "input.format",  # informational in Triton too
        "sequence_batching",
        "sequence_batching.max_sequence_idle_microseconds",
        *(
            f"sequence_batching.control_input.{field}"
            for field in ("name", "control", "control.kind", "control.data_type")
        ),
        *(f"sequence_batching.control_input.control.{kind}_false_true" for kind in ("int32", "fp32", "bool")),
        "sequence_batching.direct",  # a batch holds each sequence's steps in order (docs/triton)
        "sequence_batching.oldest",
        "sequence_batching.oldest.max_queue_delay_microseconds",
        "sequence_batching.oldest.preferred_batch_size",
        "sequence_batching.state",
        "sequence_batching.state.initial_state",
        *(f"sequence_batching.state.{field}" for field in ("input_name", "output_name", "data_type", "dims")),
        *(
            f"sequence_batching.state.initial_state.{field}"
            for field in ("data_type", "dims", "zero_data", "name")
        ),
        "dynamic_batching",
        "dynamic_batching.preferred_batch_size",
        "dynamic_batching.max_queue_delay_microseconds",
        "dynamic_batching.priority_levels",
        "dynamic_batching.default_priority_level",
        "dynamic_batching.default_queue_policy",
        *(
            f"dynamic_batching.default_queue_policy.{field}"
            for field in ("timeout_action", "default_timeout_microseconds", "allow_timeout_override")
        ),
        "dynamic_batching.default_queue_policy.max_queue_size",
        "dynamic_batching.priority_queue_policy",
        "instance_group.name",
        "instance_group.kind",
        "instance_group.count",  # model.instances: the groups' counts added up, checked below
        "instance_group.rate_limiter.resources.name",  # model.rate_limiter.resources
        "instance_group.rate_limiter.resources.count",
        "instance_group.gpus",  # checked below
        "optimization.execution_accelerators.gpu_execution_accelerator.name",  # checked below
        "optimization.execution_accelerators.gpu_execution_accelerator.parameters",  # checked below
        "ensemble_scheduling.step.model_name",
        "ensemble_scheduling.step.model_version",
        "ensemble_scheduling.step.input_map",
        "ensemble_scheduling.step.output_map",
        "response_cache",
        "response_cache.enable",
        "parameters",  # checked below
    }
)
WHY = {
    "sequence_batching.oldest.max_candidate_sequences": "the steps of every live sequence are "
    "batched together: a live sequence holds a key in Redis, not a batch slot; at most "
    "sequence.max_live are live at once (the parameter fngate_max_live_sequences, default 1000)",
    "sequence_batching.state.use_same_buffer_for_input_output": "a state is copied in and out",
    "sequence_batching.state.use_growable_memory": "a state is copied in and out",
    "sequence_batching": "a sequence's steps are batched with the function's batching "
    "(docs/triton/sequences.md)",
    "model_warmup": "no warm-up requests are run at load",
    "instance_group.rate_limiter": "a runner serves its execution slots first come first served, "
    "for its own device (no priority, no global resources)",
    "model_transaction_policy": "decoupled models (several responses per request) are served for "
    "Python models only",
    "dynamic_batching.preserve_ordering": "every invocation gets its own reply; there is no order to keep",
    "batch_input": "batch inputs are not formed",
    "batch_output": "batch outputs are not scattered",
    "ensemble_scheduling.max_inflight_requests": "a pipeline's steps are bounded by each function's queue",
    "optimization": "only the TensorRT accelerator and its precision are honoured",
    "runtime": "the backend's own runtime library is not chosen",
    "cc_model_filenames": "one model file per version (default_model_filename)",
    "metric_tags": "metrics carry fngate's labels",
    "model_metrics": "metrics carry fngate's buckets",
    "model_repository_agents": "no repository agents run",
    "model_operations": "no custom operations are loaded",
    "instance_group.secondary_devices": "no secondary devices",
    "instance_group.profile": "no TensorRT profile is chosen",
    "instance_group.passive": "every instance takes work",
    "instance_group.host_policy": "no host policy",
}
MAX_INSTANCES = 64
"""model.instances' bound."""
ENGINE_CACHE = {"trt_engine_cache_enable", "trt_engine_cache_path"}
TEXT_GENERATION = {f"text_generation_{field}": field for field in ("input", "output", "parameters")}
"""config.pbtxt `parameters` that declare a text generator: each names a tensor (text_generation)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Mapped:
    """A model's configuration as manifest data (without the model file's path, which is per
    version) and what fngate does not honour of it."""

    data: dict[str, Any]
    warnings: tuple[str, ...]
    model_file: str
    """default_model_filename, or the backend's default; "" for an ensemble."""

    def manifest(self, version: str, source: str) -> FunctionManifest:
        """The manifest of one version (its model file is `{version}/{model_file}`)."""
        data = dict(self.data)
        if self.model_file:
            data["model"] = {**data["model"], "path": f"{version}/{self.model_file}"}
        return parse_manifest(data, source)


def parse_config(text: str, source: str) -> pb.ModelConfig:
    """Triton's text format against Triton's schema; raises ManifestError naming the problem."""
    try:
        return text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as exc:
        raise ManifestError(source, [("", f"not a Triton model configuration: {exc}")]) from exc


def parse_config_json(text: str, source: str) -> pb.ModelConfig:
    """Triton's JSON form of a configuration (a load request's `config`) against Triton's schema;
    raises ManifestError naming the problem."""
    try:
        return json_format.Parse(text, pb.ModelConfig())
    except json_format.ParseError as exc:
        raise ManifestError(source, [("", f"not a Triton model configuration: {exc}")]) from exc


def function_name(model: str) -> str | None:
    """The function a Triton model is served as: its name in lower case with '_' and '.' as '-'
    (function names are DNS-1123 labels: they name Kubernetes objects); None when that is no label.
    V2 clients keep using the model's own name."""
    name = re.sub(r"[_.]", "-", model.lower())
    return name if DNS_LABEL.match(name) and len(name) <= 63 else None


def complete(config: pb.ModelConfig, model: str, signature: Signature | None) -> list[str]:
    """Triton's auto-complete: name, backend and platform, version policy, and for an ONNX model the
    inputs, outputs and max_batch_size that the configuration leaves out, from the model itself
    (`signature`; None: none can be read). Fills `config` in place; returns notes on what it did."""
    notes = []
    config.name = config.name or model
    backend = _backend(config)
    if backend in PLATFORM_OF and not config.backend:
        config.backend = backend
    if backend in PLATFORM_OF and PLATFORM_OF[backend] and not config.platform:
        config.platform = PLATFORM_OF[backend]
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if backend == "onnxruntime" and (not config.input or not config.output) and signature is not None:
        found = signature()
        batchable = all(tensor.dims and tensor.dims[0] == -1 for tensor in (*found.inputs, *found.outputs))
        fresh = not config.input and not config.output and config.max_batch_size == 0
        if fresh and batchable:  # as Triton does with its default-max-batch-size
            config.max_batch_size = 4
            if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
                config.dynamic_batching.SetInParent()
        skip = 1 if config.max_batch_size > 0 else 0
        for target, tensors in ((config.input, found.inputs), (config.output, found.outputs)):
            if not target:
                for tensor in tensors:
                    item = target.add()
                    item.name = tensor.name
                    item.data_type = pb.DataType.Value(_triton_type(tensor.datatype))
                    item.dims.extend(tensor.dims[skip:])
        notes.append("inputs and outputs completed from the model file")
    if backend in MODEL_FILES and not config.default_model_filename:
        config.default_model_filename = MODEL_FILES[backend]
    if not config.instance_group and backend != "ensemble":
        group = config.instance_group.add()
        group.name = config.name
        group.count = 1
    for group in config.instance_group:
        group.count = group.count or 1
        if group.kind == pb.ModelInstanceGroup.KIND_AUTO:  # fngate places by the manifest, not by probing
            group.kind = (
                pb.ModelInstanceGroup.KIND_GPU if backend == "tensorrt" else pb.ModelInstanceGroup.KIND_CPU
            )
    return notes


def map_config(config: pb.ModelConfig, source: str) -> Mapped:
    """A completed configuration as manifest data; raises ManifestError for what fngate cannot serve."""
    backend = _backend(config)
    problems: list[tuple[str, str]] = []
    name = function_name(config.name)
    if name is None:
        problems.append(("name", f"{config.name!r} maps to no function name (a DNS-1123 label)"))
    if backend not in (*BACKENDS, "ensemble"):
        kind = config.platform or config.backend or "none"
        problems.append(
            (
                "backend",
                f"{kind!r} is not served by fngate (onnxruntime, tensorrt, pytorch, python, ensemble)",
            )
        )
    if problems:
        raise ManifestError(source, problems)
    batched = config.max_batch_size > 0
    data: dict[str, Any] = {
        "name": name,
        "description": f"Triton model {config.name}",
        "inputs": [_tensor(item, batched, source, f"input[{i}]") for i, item in enumerate(config.input)],
        "outputs": [_tensor(item, batched, source, f"output[{i}]") for i, item in enumerate(config.output)],
        "batching": _batching(config),
        "cache": {"enabled": config.response_cache.enable},
        "versions": _versions(config.version_policy),
        **_sequence(config, source),
        "triton": {"name": config.name, "config": config_json(config)},
        **_text_generation(config, source),
    }
    warnings = _warnings(config, backend, source)
    model_file = ""
    if backend == "ensemble":
        data["pipeline"] = _pipeline(config, source)
    else:
        model_file = config.default_model_filename or MODEL_FILES[backend]
        data["model"] = {
            "backend": backend,
            "path": model_file,
            **_placement(config, backend),
            **_instances(config),
            **_own_process(config, backend, source),
            **(
                {"decoupled": True}
                if backend == "python" and config.model_transaction_policy.decoupled
                else {}
            ),
        }
    return Mapped(data, tuple(warnings), model_file)


MAX_LIVE_SEQUENCES = "fngate_max_live_sequences"
"""A parameter of a sequence model's config: how many of its sequences may be live at once
(sequence.max_live)."""
OWN_PROCESS = "fngate_own_process"
"""A parameter of a pytorch model's config: "true" runs it in a process of its own (model.own_process)."""


def _own_process(config: pb.ModelConfig, backend: str, source: str) -> dict[str, Any]:
    if OWN_PROCESS not in config.parameters:
        return {}
    value = config.parameters[OWN_PROCESS].string_value
    where = f"parameters.{OWN_PROCESS}"
    if backend != "pytorch":
        raise ManifestError(
            source, [(where, "applies to the pytorch backend (a python model has a process)")]
        )
    if value not in ("true", "false"):
        raise ManifestError(source, [(where, f"{value!r} is not true or false")])
    return {"own_process": value == "true"}


def _text_generation(config: pb.ModelConfig, source: str) -> dict[str, Any]:
    """text_generation from the parameters that name its tensors (none: not a text generator)."""
    named = {
        field: config.parameters[key].string_value
        for key, field in TEXT_GENERATION.items()
        if key in config.parameters
    }
    if not named:
        return {}
    missing = [f"parameters.text_generation_{field}" for field in ("input", "output") if field not in named]
    if missing:
        raise ManifestError(
            source, [(where, "a text generator names its input and its output") for where in missing]
        )
    return {"text_generation": named}


def _backend(config: pb.ModelConfig) -> str:
    platform, backend = str(config.platform), str(config.backend)
    if platform:
        return PLATFORMS.get(platform, platform)
    return BACKENDS.get(backend, backend)


def _triton_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(item: Any, batched: bool, source: str, where: str) -> dict[str, Any]:
    type_name = _name_of(item.data_type)
    datatype = DATATYPES.get(type_name)
    if datatype is None:
        raise ManifestError(source, [(f"{where}.data_type", f"{type_name} has no datatype in fngate")])
    dims = [int(dim) for dim in item.dims]
    spec: dict[str, Any] = {
        "name": item.name,
        "datatype": datatype,
        "shape": [-1, *dims] if batched else dims,
    }
    if item.HasField("reshape"):
        spec["reshape"] = [int(dim) for dim in item.reshape.shape]
    return spec


def _policy(policy: Any) -> dict[str, Any]:
    return {
        "timeout_action": "delay" if policy.timeout_action == pb.ModelQueuePolicy.DELAY else "reject",
        "timeout_us": int(policy.default_timeout_microseconds),
        "allow_timeout_override": policy.allow_timeout_override,
        "max_queue_size": policy.max_queue_size or None,  # Triton's 0 (unbounded): fngate's bound
    }


def _batching(config: pb.ModelConfig) -> dict[str, Any]:
    batching: dict[str, Any] = {"max_batch_size": config.max_batch_size}
    oldest = config.sequence_batching.oldest
    if config.sequence_batching.HasField("oldest"):
        batching["preferred_batch_sizes"] = list(oldest.preferred_batch_size)
        batching["max_queue_delay_us"] = int(oldest.max_queue_delay_microseconds)
        return batching
    if not config.HasField("dynamic_batching"):
        batching["max_queue_delay_us"] = 0
        return batching
    dynamic = config.dynamic_batching
    batching["preferred_batch_sizes"] = list(dynamic.preferred_batch_size)
    batching["max_queue_delay_us"] = int(dynamic.max_queue_delay_microseconds)
    batching["priority_levels"] = int(dynamic.priority_levels)
    batching["default_priority_level"] = int(dynamic.default_priority_level)
    if dynamic.HasField("default_queue_policy"):
        batching["queue_policy"] = _policy(dynamic.default_queue_policy)
    batching["priority_queue_policy"] = {
        int(level): _policy(policy) for level, policy in dynamic.priority_queue_policy.items()
    }
    return batching


CONTROLS = {
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START: "start",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END: "end",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY: "ready",
    pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID: "corrid",
}


def _sequence(config: pb.ModelConfig, source: str) -> dict[str, Any]:
    """`sequence` from sequence_batching: its control inputs and idle timeout (none: no sequences)."""
    if not config.HasField("sequence_batching"):
        return {}
    sequence = config.sequence_batching
    controls = []
    for i, control_input in enumerate(sequence.control_input):
        for j, control in enumerate(control_input.control):
            where = f"sequence_batching.control_input[{i}].control[{j}]"
            kind = CONTROLS.get(control.kind)
            if kind is None:
                raise ManifestError(
                    source, [(where, f"kind {control.kind} is not a sequence control fngate feeds")]
                )
            item: dict[str, Any] = {"input": control_input.name, "kind": kind}
            if kind == "corrid":
                datatype = DATATYPES.get(_name_of(control.data_type), "")
                item["datatype"] = "STRING" if datatype == "BYTES" else datatype or "UINT64"
            elif control.int32_false_true:
                item["datatype"], item["false_true"] = "INT32", list(control.int32_false_true)
            elif control.fp32_false_true:
                item["datatype"], item["false_true"] = "FP32", list(control.fp32_false_true)
            elif control.bool_false_true:
                item["datatype"], item["false_true"] = (
                    "BOOL",
                    [int(value) for value in control.bool_false_true],
                )
            else:
                raise ManifestError(
                    source, [(where, "a start, end or ready control needs its false and true values")]
                )
            controls.append(item)
    found: dict[str, Any] = {
        "controls": controls,
        "states": [_state(state, i, source) for i, state in enumerate(sequence.state)],
    }
    if sequence.max_sequence_idle_microseconds:
        found["idle_timeout_us"] = int(sequence.max_sequence_idle_microseconds)
    if MAX_LIVE_SEQUENCES in config.parameters:
        value = config.parameters[MAX_LIVE_SEQUENCES].string_value
        if not value.isdigit():
            raise ManifestError(source, [(f"parameters.{MAX_LIVE_SEQUENCES}", f"{value!r} is not a number")])
        found["max_live"] = int(value)
    return {"sequence": found}


def _state(state: Any, index: int, source: str) -> dict[str, Any]:
    """An implicit state: zeros at a sequence's start (an initial_state of zero_data, or none)."""
    where = f"sequence_batching.state[{index}]"
    datatype = DATATYPES.get(_name_of(state.data_type))
    if datatype is None or datatype == "BYTES":
        raise ManifestError(source, [(f"{where}.data_type", "a state is a tensor of numbers or booleans")])
    if any(dim < 1 for dim in state.dims):
        raise ManifestError(source, [(f"{where}.dims", "a state's dimensions are fixed (no -1)")])
    for initial in state.initial_state:
        if initial.WhichOneof("state_data") != "zero_data":
            raise ManifestError(
                source,
                [
                    (
                        f"{where}.initial_state",
                        "an initial state from data_file is not honoured: use zero_data",
                    )
                ],
            )
    return {
        "input": state.input_name,
        "output": state.output_name,
        "datatype": datatype,
        "dims": list(state.dims),
    }


def _versions(policy: Any) -> dict[str, Any]:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return {"policy": "all"}
    if choice == "specific":
        return {"policy": "specific", "specific": [str(version) for version in policy.specific.versions]}
    return {"policy": "latest", "latest": max(1, policy.latest.num_versions)}


def _accelerators(config: pb.ModelConfig) -> list[Any]:
    return list(config.optimization.execution_accelerators.gpu_execution_accelerator)


def _instances(config: pb.ModelConfig) -> dict[str, Any]:
    """model.instances (every group's count added up; none where it is one) and the execution
    slots an instance holds (the most any group names of each resource)."""
    out: dict[str, Any] = {}
    count = sum(max(group.count, 1) for group in config.instance_group)
    if count > 1:
        out["instances"] = min(count, MAX_INSTANCES)
    resources: dict[str, int] = {}
    for group in config.instance_group:
        for resource in group.rate_limiter.resources:
            resources[resource.name] = max(resources.get(resource.name, 0), int(resource.count))
    resources = {name: count for name, count in resources.items() if count > 0}
    if resources:
        out["rate_limiter"] = {"resources": resources}
    return out


def _placement(config: pb.ModelConfig, backend: str) -> dict[str, Any]:
    """accelerator and precision from instance_group's kind and (ONNX) the TensorRT accelerator."""
    if backend not in ("onnxruntime", "pytorch"):
        return {}
    accelerators = _accelerators(config) if backend == "onnxruntime" else []
    tensorrt = next((item for item in accelerators if item.name == "tensorrt"), None)
    if tensorrt is not None:
        fp16 = tensorrt.parameters.get("precision_mode", "FP32").upper() == "FP16"
        return {"accelerator": "tensorrt", "precision": "fp16" if fp16 else "fp32"}
    on_gpu = any(group.kind == pb.ModelInstanceGroup.KIND_GPU for group in config.instance_group)
    return {"accelerator": "cuda" if on_gpu else "cpu"}


def _pipeline(config: pb.ModelConfig, source: str) -> dict[str, Any]:
    """ensemble_scheduling as a pipeline: each ensemble tensor is a request input or one step's
    output; a step's model_version -1 follows that function's routing, another pins it."""
    produced: dict[str, str] = {}
    names: list[str] = []
    for index, step in enumerate(config.ensemble_scheduling.step):
        base = function_name(step.model_name)
        if base is None:
            where = f"ensemble_scheduling.step[{index}].model_name"
            raise ManifestError(source, [(where, f"{step.model_name!r} maps to no function name")])
        name = base if base not in names else f"{base[:60]}-{index + 1}"
        names.append(name)
        for output, tensor in step.output_map.items():
            produced[tensor] = f"{name}.{output}"
    requested = {item.name for item in config.input}

    def reference(tensor: str) -> str:
        if tensor in produced:
            return produced[tensor]
        return f"request.{tensor}" if tensor in requested else f"unknown.{tensor}"

    steps = []
    for name, step in zip(names, config.ensemble_scheduling.step, strict=True):
        function = function_name(step.model_name)
        pinned = f"@{step.model_version}" if step.model_version > 0 else ""
        inputs = {model_input: reference(tensor) for model_input, tensor in step.input_map.items()}
        steps.append({"name": name, "function": f"{function}{pinned}", "inputs": inputs})
    outputs = {item.name: reference(item.name) for item in config.output}
    return {"steps": steps, "outputs": outputs}


def _warnings(config: pb.ModelConfig, backend: str, source: str) -> list[str]:
    """Every set field that fngate does not honour, once, with what fngate does instead."""
    seen: dict[str, None] = {}
    for path in set_fields(config):
        if path == "model_transaction_policy.decoupled" and backend == "python":
            continue  # a Python model's response sender streams (model.decoupled)
        if path not in HONOURED:
            top = next((key for key in WHY if path == key or path.startswith(f"{key}.")), path)
            seen.setdefault(f"{top}: not honoured ({WHY.get(top, 'ignored')})")
    groups = list(config.instance_group)
    counts = [max(group.count, 1) for group in groups]
    if len(groups) > 1:
        seen.setdefault(
            f"instance_group: {len(groups)} groups: each runner runs their {sum(counts)} instances alike"
        )
    if sum(counts) > MAX_INSTANCES:
        seen.setdefault(f"instance_group: {sum(counts)} instances: a runner runs {MAX_INSTANCES} at most")
    if any(group.gpus for group in groups):
        seen.setdefault("instance_group.gpus: not honoured (a runner uses the GPU it was given)")
    if backend == "python" and any(group.kind == pb.ModelInstanceGroup.KIND_GPU for group in groups):
        seen.setdefault(
            "instance_group.kind: KIND_GPU: model.py runs as it is; what it puts on a GPU is its own"
        )
    if (
        config.max_batch_size > 0
        and not config.HasField("dynamic_batching")
        and not config.HasField("sequence_batching")
        and backend != "ensemble"
    ):
        seen.setdefault(
            "dynamic_batching: absent, yet fngate runs queued invocations together (up to "
            "max_batch_size, with no queue delay)"
        )
    for accelerator in _accelerators(config):
        if accelerator.name != "tensorrt" or backend != "onnxruntime":
            seen.setdefault(
                f"optimization.execution_accelerators: {accelerator.name!r} on {backend}: not honoured "
                "(fngate honours the tensorrt accelerator of an ONNX model)"
            )
            continue
        seen.update(dict.fromkeys(_parameter_warnings(accelerator.parameters, "gpu_execution_accelerator")))
    seen.update(dict.fromkeys(_model_parameter_warnings(config, backend)))
    return [f"{source}: {text}" for text in seen]


def _parameter_warnings(parameters: Mapping[str, str], where: str) -> Iterator[str]:
    for key, value in parameters.items():
        lowered = key.lower()
        if lowered == "precision_mode":
            if value.upper() not in ("FP16", "FP32"):
                yield f"{where}.parameters.precision_mode: {value}: fngate builds FP32 or FP16 engines only"
        elif lowered == "trt_engine_cache_enable":
            if value.strip().lower() in ("0", "false"):
                yield f"{where}.parameters.{key}: fngate always caches TensorRT engines (in the repository)"
        elif lowered == "trt_engine_cache_path":
            yield (
                f"{where}.parameters.{key}: not honoured (engines are cached in the runner's engine "
                "cache and the repository's .engines/ folder)"
            )
        else:
            yield f"{where}.parameters.{key}: not honoured (ignored)"


def _model_parameter_warnings(config: pb.ModelConfig, backend: str) -> Iterator[str]:
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    engine = {key: value for key, value in parameters.items() if key.lower() in ENGINE_CACHE}
    if engine and backend == "onnxruntime":
        yield from _parameter_warnings(engine, "parameters")
    elif engine:
        yield f"parameters {sorted(engine)}: not used by {backend} (they configure onnxruntime's TensorRT)"
    for key in parameters:
        if key in engine or key in TEXT_GENERATION or key in (OWN_PROCESS, MAX_LIVE_SEQUENCES):
            continue
        if backend == "python" and key != "EXECUTION_ENV_PATH":
            continue  # the model reads them from args["model_config"], as in Triton
        yield f"parameters.{key}: not honoured (ignored)"


def set_fields(message: Message, prefix: str = "") -> Iterator[str]:
    """The path of every field set in `message` (a map or an empty message counts as one field)."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.type != FieldDescriptor.TYPE_MESSAGE or _is_map(field):
            yield path
            continue
        items: Sequence[Message] = value if _repeated(field) else [value]
        for item in items:
            inner = list(set_fields(item, f"{path}."))
            yield from inner or [path]


def _repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf's newer spelling of label == REPEATED
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _is_map(field: Any) -> bool:
    return field.message_type is not None and bool(field.message_type.GetOptions().map_entry)


def config_json(config: pb.ModelConfig) -> dict[str, Any]:
    """The configuration as Triton's /config answers it: every field, defaults included, with
    field names as in config.pbtxt and 64-bit integers as numbers (not the strings of protobuf's
    JSON mapping)."""
    doc: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(config, doc)


WIDE = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}
WIDE |= {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _numbers(message: Message, doc: dict[str, Any]) -> dict[str, Any]:
    fields: list[Any] = list(message.DESCRIPTOR.fields)
    for field in fields:
        if field.name not in doc:
            continue
        value = getattr(message, field.name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and _is_map(field):
            entry = field.message_type.fields_by_name["value"]
            if entry.type == FieldDescriptor.TYPE_MESSAGE:  # JSON's keys are strings, the map's may not be
                doc[field.name] = {str(key): _numbers(value[key], doc[field.name][str(key)]) for key in value}
            elif entry.type in WIDE:
                doc[field.name] = {key: int(item) for key, item in doc[field.name].items()}
            if field.message_type.fields_by_name["key"].type in WIDE:
                doc[field.name] = {str(int(key)): item for key, item in doc[field.name].items()}
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if _repeated(field):
                doc[field.name] = [
                    _numbers(item, part) for item, part in zip(value, doc[field.name], strict=True)
                ]
            else:
                doc[field.name] = _numbers(value, doc[field.name])
        elif field.type in WIDE:
            doc[field.name] = (
                [int(item) for item in doc[field.name]] if _repeated(field) else int(doc[field.name])
            )
    return doc
