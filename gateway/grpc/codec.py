"""The Open Inference Protocol's gRPC messages <-> validated tensors and replies. The messages are
the generated modules that tritonclient ships (compiled from Triton's grpc_service.proto and
model_config.proto): nothing here is hand-written protobuf.

A request's tensors come as `raw_input_contents` (one buffer per input, in the V2 binary layout)
or as typed `contents`, never a mix; an answer's outputs go back as `raw_output_contents`, as
Triton sends them. Everything a client can get wrong is refused here or in gateway.validation,
before anything is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest
from fngate.tensors import DATATYPES, Tensors, element_count, from_bytes, to_bytes
from fngate.wire import Reply
from gateway.shared_memory import NOTHING_PLACED, Placed, SharedTensor, shared_of
from gateway.validation import (
    check_complete,
    check_datatype,
    check_new,
    check_shape,
    input_spec,
    natural,
    output_spec,
)

# The typed field of InferTensorContents that carries each datatype (FP16 only travels raw).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def inputs_of(
    request: service_pb2.ModelInferRequest, manifest: FunctionManifest
) -> tuple[Tensors, tuple[SharedTensor, ...]]:
    """A ModelInferRequest's tensors, checked against the function, and those it names in shared
    memory regions (which have no raw_input_contents of their own, as Triton reads them)."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise InvalidArgument("the request has no inputs")
    inputs: Tensors = {}
    shared: list[SharedTensor] = []
    at = 0
    for index, tensor in enumerate(request.inputs):
        spec = input_spec(manifest, tensor.name, f"inputs[{index}].name")
        check_new(inputs, spec)
        datatype = check_datatype(spec, tensor.datatype)
        shape = check_shape(spec, list(tensor.shape), manifest)
        where = f"input '{spec.name}'"
        in_region = shared_of(parameters(tensor.parameters), spec.name, where) if tensor.parameters else None
        if in_region is not None:
            if tensor.HasField("contents") or any(item.name == spec.name for item in shared):
                raise InvalidArgument(f"{where}: given twice, or in a shared memory region and in contents")
            shared.append(dataclasses.replace(in_region, datatype=datatype, shape=shape))
        elif raw:
            if tensor.HasField("contents"):
                raise InvalidArgument(f"{where}: typed contents beside raw_input_contents")
            if at >= len(raw):
                raise InvalidArgument(_RAW_COUNT.format(len(raw), len(request.inputs) - len(shared)))
            inputs[spec.name] = from_bytes(datatype, shape, raw[at], where)
            at += 1
        else:
            inputs[spec.name] = _typed(tensor.contents, datatype, shape, where)
    if at != len(raw):
        raise InvalidArgument(_RAW_COUNT.format(len(raw), len(request.inputs) - len(shared)))
    if not shared:
        check_complete(manifest, inputs)
    return inputs, tuple(shared)


_RAW_COUNT = (
    "{} raw_input_contents for {} inputs not in shared memory: send one raw buffer per input, or "
    "typed contents for all of them"
)


def shared_outputs(
    request: service_pb2.ModelInferRequest, manifest: FunctionManifest
) -> dict[str, SharedTensor]:
    """The outputs asked for in shared memory regions, by name."""
    shared: dict[str, SharedTensor] = {}
    for item in request.outputs:
        if item.parameters:
            params = parameters(item.parameters)
            in_region = shared_of(params, item.name, f"output '{item.name}'")
            if in_region is not None:
                output_spec(manifest, item.name)
                shared[item.name] = in_region
    return shared


def _typed(contents: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray[Any, Any]:
    field = CONTENTS.get(datatype)
    if field is None:
        raise InvalidArgument(f"{where}: {datatype} travels only in raw_input_contents")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise InvalidArgument(
            f"{where}: {len(values)} elements in {field} but shape {list(shape)} needs {count}"
        )
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        out[:] = list(values)
        return out.reshape(shape)
    try:
        return np.array(values, dtype=DATATYPES[datatype]).reshape(shape)
    except OverflowError as exc:
        raise InvalidArgument(f"{where}: a value does not fit {datatype}: {exc}") from None


def outputs_of(request: service_pb2.ModelInferRequest, manifest: FunctionManifest) -> tuple[str, ...] | None:
    """The outputs asked for, checked; None: all of them."""
    if not request.outputs:
        return None
    return tuple(output_spec(manifest, item.name).name for item in request.outputs)


def parameters(params: Mapping[str, service_pb2.InferParameter]) -> dict[str, Any]:
    """A request's parameters as plain values."""
    found: dict[str, Any] = {}
    for name, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        found[name] = getattr(param, choice) if choice else None
    return found


def timeout_ms(params: Mapping[str, Any], remaining_s: float | None) -> int | None:
    """What the caller waits: the gRPC deadline, Triton's `timeout` parameter (µs) and fngate's
    `timeout_ms`, whichever is shortest."""
    found: list[int] = []
    if remaining_s is not None:
        found.append(max(1, int(remaining_s * 1000)))
    for name, per_ms in (("timeout", 1000), ("timeout_ms", 1)):
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgument(f"parameter '{name}' must be a positive integer")
        found.append(max(1, -(-value // per_ms)))
    return min(found) if found else None


def natural_parameter(params: Mapping[str, Any], name: str) -> int | None:
    """A non-negative integer parameter (Triton's `priority`, `timeout`), None when absent."""
    value = params.get(name)
    return None if value is None else natural(value, f"parameter '{name}'")


def use_cache(params: Mapping[str, Any]) -> bool:
    value = params.get("cache", True)
    if not isinstance(value, bool):
        raise InvalidArgument("parameter 'cache' must be true or false")
    return value


def response_of(
    reply: Reply, manifest: FunctionManifest, request_id: str, placed: Placed = NOTHING_PLACED
) -> service_pb2.ModelInferResponse:
    """The response of a reply; the outputs `placed` in shared memory are written there, and have
    an empty raw_output_contents entry (each output keeps its index)."""
    response = service_pb2.ModelInferResponse(
        model_name=manifest.name, model_version=reply.version, id=request_id
    )
    written = placed.write(reply.outputs) if placed.outputs else {}
    for name, array in reply.outputs.items():
        spec = manifest.output(name)
        tensor = response.outputs.add(name=name, datatype=spec.datatype if spec else "BYTES")
        tensor.shape.extend(array.shape)
        if name in written:
            _, shared = placed.outputs[name]
            tensor.parameters["shared_memory_region"].string_param = shared.region
            tensor.parameters["shared_memory_byte_size"].int64_param = written[name]
            if shared.offset:
                tensor.parameters["shared_memory_offset"].int64_param = shared.offset
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(to_bytes(array))
    response.parameters["batch_id"].string_param = reply.batch_id
    response.parameters["batch_size"].int64_param = reply.batch_size
    response.parameters["cache_hit"].bool_param = reply.cached
    return response


def model_config(document: dict[str, Any]) -> model_config_pb2.ModelConfig:
    """Triton's model configuration from its JSON form (gateway.model_config)."""
    return json_format.ParseDict(document, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)


def statistics(document: dict[str, Any]) -> service_pb2.ModelStatisticsResponse:
    return json_format.ParseDict(document, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)


def metadata(document: dict[str, Any]) -> service_pb2.ModelMetadataResponse:
    return json_format.ParseDict(document, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)
