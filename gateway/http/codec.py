"""Open Inference Protocol (V2 REST) and serverless (/v1) bodies <-> validated tensors, and replies
<-> responses.

Everything a client can get wrong in a body is caught here or in gateway.validation, before
anything is queued: names, datatypes, ranks, dimensions, data lengths, batch rows, malformed JSON
and binary framing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import orjson

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest, TensorSpec
from fngate.sequences import Step, step_of
from fngate.tensors import DATATYPES, Tensors, element_count, from_bytes, from_json, to_bytes, to_json_data
from fngate.wire import Reply
from gateway.http.tensor_data import Decoded, outline_of, shape_of_outline
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

HEADER_LENGTH = "inference-header-content-length"
NO_SHARED: Mapping[str, SharedTensor] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class InferRequest:
    inputs: Tensors
    outputs: tuple[str, ...] | None
    binary_outputs: frozenset[str]
    request_id: str | None
    timeout_ms: int | None
    use_cache: bool = True
    priority: int = 0
    """Triton's `priority` request parameter (0: the function's default level)."""
    queue_timeout_us: int | None = None
    """Triton's `timeout` request parameter, in µs (fngate.queue.place)."""
    sequence: Step | None = None
    """Triton's `sequence_id`, `sequence_start` and `sequence_end` request parameters."""
    shared_inputs: tuple[SharedTensor, ...] = ()
    """Inputs in shared memory regions, to read before the call (gateway.shared_memory)."""
    shared_outputs: Mapping[str, SharedTensor] = dataclasses.field(default_factory=lambda: NO_SHARED)
    """Outputs to write into shared memory regions instead of the response."""
    placed: Placed = NOTHING_PLACED
    """The shared outputs' regions, once found."""

    @property
    def shares_memory(self) -> bool:
        return bool(self.shared_inputs or self.shared_outputs)


def parse_v2(body: bytes, header_length: str | None, manifest: FunctionManifest) -> InferRequest:
    """A V2 infer request received whole, JSON or with the binary tensor data extension."""
    header: bytes | memoryview = body
    binary = memoryview(b"")
    json_size = header_size(header_length)
    if json_size is not None:
        if json_size > len(body):
            raise InvalidArgument(
                f"Inference-Header-Content-Length {json_size} is outside the body of {len(body)} bytes"
            )
        whole = memoryview(body)  # slices of a view: the binary part is not copied
        binary = whole[json_size:]
        header = whole[:json_size]
    return v2_request(load_json(header), binary, manifest, {})


def header_size(header_length: str | None) -> int | None:
    """The size of the JSON part that Inference-Header-Content-Length declares."""
    if header_length is None:
        return None
    try:
        json_size = int(header_length)
    except ValueError:
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length!r} is not a number") from None
    if json_size <= 0:
        raise InvalidArgument(f"Inference-Header-Content-Length {json_size} is outside the body")
    return json_size


def v2_request(
    doc: dict[str, Any], binary: memoryview, manifest: FunctionManifest, decoded: Mapping[Any, Decoded]
) -> InferRequest:
    """A V2 request from its parsed JSON, its binary part and the tensors that gateway.http.decoding
    decoded as they arrived (by input index; their `data` is null in `doc`)."""
    inputs, shared = _v2_inputs(doc, binary, manifest, decoded)
    if not shared:  # else once the shared inputs are read
        check_complete(manifest, inputs)
    outputs, binary_outputs, shared_outputs = _requested_outputs(doc, manifest)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    params = _params(doc, "request")
    return InferRequest(
        inputs,
        outputs,
        binary_outputs,
        request_id,
        _timeout(params),
        _use_cache(params),
        _natural(params, "priority") or 0,
        _natural(params, "timeout"),
        step_of(params),
        shared,
        shared_outputs,
    )


def _v2_inputs(
    doc: Mapping[str, Any], view: memoryview, manifest: FunctionManifest, decoded: Mapping[Any, Decoded]
) -> tuple[Tensors, tuple[SharedTensor, ...]]:
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument("'inputs' must be a non-empty list of tensors")
    offset = 0
    inputs: Tensors = {}
    shared: list[SharedTensor] = []
    for index, item in enumerate(raw_inputs):
        if not isinstance(item, dict):
            raise InvalidArgument(f"inputs[{index}] must be an object")
        spec = input_spec(manifest, item.get("name"), f"inputs[{index}].name")
        name = spec.name
        check_new(inputs, spec)
        if any(tensor.name == name for tensor in shared):
            raise InvalidArgument(f"input '{name}' is given twice")
        datatype = check_datatype(spec, item.get("datatype"))
        shape = check_shape(spec, item.get("shape"), manifest)
        params = _params(item, f"input '{name}'")
        size = params.get("binary_data_size")
        in_region = shared_of(params, name, f"input '{name}'") if params else None
        if in_region is not None:
            if "data" in item or size is not None:
                raise InvalidArgument(
                    f"input '{name}' must set only one of 'data', 'binary_data_size' and "
                    "'shared_memory_region'"
                )
            shared.append(dataclasses.replace(in_region, datatype=datatype, shape=shape))
        elif size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidArgument(f"input '{name}': binary_data_size must be a non-negative integer")
            if "data" in item:
                raise InvalidArgument(f"input '{name}' has both 'data' and binary_data_size")
            if offset + size > len(view):
                raise InvalidArgument(
                    f"input '{name}': binary_data_size {size} runs past the {len(view)} bytes of binary data"
                )
            inputs[name] = from_bytes(datatype, shape, view[offset : offset + size], f"input '{name}'")
            offset += size
        elif index in decoded:
            inputs[name] = _from_decoded(decoded[index], spec, shape, False)
        elif "data" in item:
            inputs[name] = from_json(datatype, shape, item["data"], f"input '{name}'")
        else:
            raise InvalidArgument(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
    if offset != len(view):
        raise InvalidArgument(f"{len(view) - offset} bytes of binary data are not claimed by any input")
    return inputs, tuple(shared)


def parse_v1(body: bytes, manifest: FunctionManifest) -> InferRequest:
    """The serverless body received whole: {"inputs": {"<name>": nested lists}, "outputs": [names]?}."""
    return v1_request(load_json(body), manifest, {})


def v1_request(
    doc: dict[str, Any], manifest: FunctionManifest, decoded: Mapping[Any, Decoded]
) -> InferRequest:
    """A /v1 request from its parsed JSON and the tensors decoded as they arrived (by name)."""
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, dict) or not raw_inputs:
        raise InvalidArgument("'inputs' must be an object mapping input names to nested lists")
    inputs: Tensors = {}
    for name, data in raw_inputs.items():
        spec = input_spec(manifest, name, "inputs")
        found = decoded.get(name)
        if found is not None and found.values is not None:
            outlined = shape_of_outline(found.outline, f"input '{name}'")
            check_shape(spec, outlined, manifest)
            inputs[name] = _from_decoded(found, spec, outlined, True)
            continue
        nested = found.strings if found is not None else data
        shape = _nested_shape(nested, f"input '{name}'")
        check_shape(spec, shape, manifest)
        inputs[name] = from_json(spec.datatype, shape, nested, f"input '{name}'")
    check_complete(manifest, inputs)
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(name, str) for name in outputs):
            raise InvalidArgument("'outputs' must be a list of output names")
        for name in outputs:
            output_spec(manifest, name)
        outputs = tuple(outputs)
    return InferRequest(inputs, outputs, frozenset(), None, _timeout(doc), _use_cache(doc))


def _from_decoded(
    found: Decoded, spec: TensorSpec, shape: tuple[int, ...], nested: bool
) -> np.ndarray[Any, Any]:
    """A tensor from what the streaming decoder found: its numbers checked against the shape, in
    count, nesting (flat, or nested like the shape) and datatype."""
    where = f"input '{spec.name}'"
    if found.values is None:
        if spec.datatype != "BYTES":
            raise InvalidArgument(f"{where}: data is not a well-formed array of {spec.datatype}")
        return from_json(spec.datatype, shape, found.strings, where)
    if spec.datatype == "BYTES":
        raise InvalidArgument(f"{where}: BYTES data must be strings")
    values = found.values
    count = element_count(shape)
    if values.size != count:
        raise InvalidArgument(
            f"{where}: {values.size} elements of data but shape {list(shape)} needs {count}"
        )
    if not nested and not _is_flat(found.outline, count) and found.outline != outline_of(shape):
        raise InvalidArgument(f"{where}: data must be flat or nested like its shape {list(shape)}")
    dtype = DATATYPES[spec.datatype]
    if values.dtype != dtype:  # decoded before its datatype was known
        if values.dtype.kind == "b" and spec.datatype != "BOOL":
            raise InvalidArgument(f"{where}: booleans in data of datatype {spec.datatype}")
        if (
            dtype.kind in "iu"
            and values.size
            and (
                values.dtype.kind == "f"
                or values.min() < np.iinfo(dtype).min
                or values.max() > np.iinfo(dtype).max
            )
        ):
            raise InvalidArgument(f"{where}: data is not a well-formed array of {spec.datatype}")
        values = values.astype(dtype)
    return values.reshape(shape)


def _is_flat(outline: bytes, count: int) -> bool:
    return len(outline) == count + 1 and outline.count(b",") == count - 1 and outline[:1] == b"["


def render_v2(
    request: InferRequest, reply: Reply, manifest: FunctionManifest
) -> tuple[bytes, dict[str, str]]:
    """The V2 response body and extra headers; outputs asked for in binary go after the JSON."""
    outputs = []
    buffers: list[bytes] = []
    written = request.placed.write(reply.outputs) if request.placed.outputs else {}
    for name, array in reply.outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": _datatype(manifest, name), "shape": array.shape}
        if name in written:
            shared = request.shared_outputs[name]
            entry["parameters"] = {
                "shared_memory_region": shared.region,
                "shared_memory_byte_size": written[name],
                **({"shared_memory_offset": shared.offset} if shared.offset else {}),
            }
        elif name in request.binary_outputs:
            raw = to_bytes(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            buffers.append(raw)
        else:
            entry["data"] = _json_data(array)
        outputs.append(entry)
    doc: dict[str, Any] = {
        "model_name": manifest.model_name,
        "model_version": reply.version,
        "outputs": outputs,
        "parameters": {"batch_id": reply.batch_id, "batch_size": reply.batch_size, "cache_hit": reply.cached},
    }
    if request.request_id is not None:
        doc["id"] = request.request_id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not buffers:
        return header, {"content-type": "application/json"}
    return b"".join([header, *buffers]), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def render_v1(reply: Reply) -> bytes:
    doc = {
        "outputs": {name: _nested(array) for name, array in reply.outputs.items()},
        "version": reply.version,
        "batch": {"id": reply.batch_id, "size": reply.batch_size},
        "cached": reply.cached,
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def load_json(body: bytes | memoryview, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON object from a request body; an empty body is `empty`, or refused when that is None."""
    if not bytes(body).strip():
        if empty is not None:
            return empty
        raise InvalidArgument("the request body is empty")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the body must be a JSON object")
    return doc


def _params(item: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    params = item.get("parameters", {})
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be an object")
    return params


def _requested_outputs(
    doc: Mapping[str, Any], manifest: FunctionManifest
) -> tuple[tuple[str, ...] | None, frozenset[str], Mapping[str, SharedTensor]]:
    binary_all = bool(_params(doc, "request").get("binary_data_output", False))
    raw = doc.get("outputs")
    if raw is None:
        names = None
        binary = {spec.name for spec in manifest.outputs} if binary_all else set()
        return names, frozenset(binary), NO_SHARED
    if not isinstance(raw, list):
        raise InvalidArgument("'outputs' must be a list of {\"name\": ...} objects")
    wanted: list[str] = []
    binary = set()
    shared: dict[str, SharedTensor] = {}
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidArgument(f"outputs[{index}] must be an object")
        spec = output_spec(manifest, item.get("name"))
        wanted.append(spec.name)
        params = _params(item, f"output '{spec.name}'")
        in_region = shared_of(params, spec.name, f"output '{spec.name}'") if params else None
        if in_region is not None:
            shared[spec.name] = in_region
        elif params.get("binary_data", binary_all):
            binary.add(spec.name)
    return tuple(wanted), frozenset(binary), shared or NO_SHARED


def _timeout(params: Mapping[str, Any]) -> int | None:
    value = params.get("timeout_ms")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument("timeout_ms must be a positive integer")
    return value


def _natural(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    return None if value is None else natural(value, f"'{name}'")


def _use_cache(params: Mapping[str, Any]) -> bool:
    value = params.get("cache", True)
    if not isinstance(value, bool):
        raise InvalidArgument("'cache' must be true or false")
    return value


def _nested_shape(data: Any, where: str) -> list[int]:
    shape: list[int] = []
    level = data
    while isinstance(level, list):
        if not level:
            raise InvalidArgument(f"{where}: empty lists are not tensors")
        shape.append(len(level))
        level = level[0]
    if not shape:
        raise InvalidArgument(f"{where}: expected nested lists, got a scalar")
    return shape


def _datatype(manifest: FunctionManifest, name: str) -> str:
    spec = manifest.output(name)
    return spec.datatype if spec is not None else "BYTES"


def _json_data(array: np.ndarray[Any, Any]) -> Any:
    if array.dtype.kind in "OSU" or (array.dtype.itemsize == 2 and array.dtype.kind == "f"):
        return to_json_data(array)
    return array.ravel()


def _nested(array: np.ndarray[Any, Any]) -> Any:
    if array.dtype.kind in "OSU" or (array.dtype.itemsize == 2 and array.dtype.kind == "f"):
        return np.asarray(to_json_data(array), dtype=object).reshape(array.shape).tolist()
    return array
