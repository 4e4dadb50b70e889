"""`triton_python_backend_utils` as a Triton Python model uses it (`import triton_python_backend_utils
as pb_utils`): tensors, requests, responses, errors, the logger and the BYTES codec, over numpy
arrays, and custom metrics (`MetricFamily`). Business logic scripting (a request's `exec()`) and
rescheduling a request are refused with a clear error: compose models as a pipeline; fngate answers
every request of a batch at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import json
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fngate import custom_metrics
from fngate.tensors import to_bytes

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
NUMPY_TYPES: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
"""Triton's configuration types -> numpy; the protocol's names (without TYPE_) work too."""


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


class Tensor:
    def __init__(self, name: str, data: Any) -> None:
        array = np.asarray(data)
        if array.dtype.kind in "SU":
            array = array.astype(np.object_)
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def triton_dtype(self) -> str:
        return numpy_to_triton_type(self._array.dtype)

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        return cls(name, np.from_dlpack(capsule))


RESCHEDULE_REFUSED = (
    "fngate does not reschedule requests (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE): execute "
    "answers every request of its batch, in that batch"
)
BLS_UNAVAILABLE = "business logic scripting (InferenceRequest.exec) runs in a runner's model process only"


class InferenceRequest:
    """A request as `execute` receives it; built by a model, the start of a BLS call (refused)."""

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: Sequence[str] = (),
        inputs: Sequence[Tensor] = (),
        request_id: str = "",
        correlation_id: int = 0,
        flags: int = 0,
        model_version: int = -1,
        parameters: Mapping[str, Any] | str | None = None,
        **_: Any,
    ) -> None:
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else str(model_name)
        self._version = model_version
        self._outputs = list(requested_output_names)
        self._inputs = list(inputs)
        self._id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def parameters(self) -> str:
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def is_cancelled(self) -> bool:
        """Whether this request's caller left (a closed stream or connection, its deadline passed),
        as its runner said; only a decoupled model's requests are told (any other's batch is
        short: its caller's answer is dropped instead)."""
        index: int | None = getattr(self, "_index", None)
        channel = _CHANNEL
        return (
            index is not None and channel is not None and channel.cancelled(getattr(self, "_batch", 0), index)
        )

    def set_release_flags(self, flags: int) -> None:
        """TRITONSERVER_REQUEST_RELEASE_ALL is what fngate does anyway; a reschedule is refused."""
        if flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise TritonModelException(RESCHEDULE_REFUSED)

    def get_response_sender(self) -> InferenceResponseSender:
        sender: InferenceResponseSender | None = getattr(self, "_sender", None)
        if sender is None:
            raise TritonModelException(
                "a response sender is for decoupled models (model_transaction_policy { decoupled: "
                "true }); this one returns one InferenceResponse per request from execute"
            )
        return sender

    def exec(self, decoupled: bool = False, **_: Any) -> Any:
        """Call the model this request names through fngate's queue (business logic scripting): its
        response, or one with its error (has_error()). With `decoupled=True`, an iterator of its
        responses as they come (a decoupled model's any number), the last one empty when the callee
        ended with the final flag alone."""
        channel = _CHANNEL
        if channel is None:
            raise TritonModelException(BLS_UNAVAILABLE)
        inputs = {tensor.name(): tensor.as_numpy() for tensor in self._inputs}
        if decoupled:
            return map(
                _response, channel.call_decoupled(self._model_name, str(self._version), self._outputs, inputs)
            )
        return _response(channel.call(self._model_name, str(self._version), self._outputs, inputs))

    def async_exec(self, decoupled: bool = False, **_: Any) -> Any:
        """`exec` as an awaitable, for `async def execute`: several at once go out together. With
        `decoupled=True` it resolves to the iterator of the responses."""
        return asyncio.get_running_loop().run_in_executor(
            _calls_pool(), functools.partial(self.exec, decoupled)
        )


def _response(answer: Mapping[str, np.ndarray[Any, Any]] | str) -> InferenceResponse:
    if isinstance(answer, str):
        return InferenceResponse(error=TritonError(answer))
    return InferenceResponse([Tensor(name, array) for name, array in answer.items()])


class InferenceResponseSender:
    """A decoupled model's way to answer one request: any number of responses, the last one (or
    none) with TRITONSERVER_RESPONSE_COMPLETE_FINAL. Each goes to the runner as it is sent, and on
    to the caller. Nothing may be sent after the final flag."""

    def __init__(
        self, index: int, sink: Callable[[int, InferenceResponse | None, bool], None], batch: int = 0
    ) -> None:
        self._index = index
        self._batch = batch
        self._sink = sink
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("a response sender sends a response, or the final flag")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"send takes an InferenceResponse, not a {type(response).__name__}")
        self._closed = final
        self._sink(self._index, response, final)

    def is_cancelled(self) -> bool:
        """Whether the caller of this sender's request left, as its runner said."""
        channel = _CHANNEL
        return channel is not None and channel.cancelled(self._batch, self._index)


class Channel(Protocol):
    """How a model's calls reach its runner (runner.sandbox.ModelCalls): the callee's outputs, or
    its error's message; and a decoupled model's responses, sent up as they are made."""

    def call(
        self, model: str, version: str, outputs: Sequence[str], inputs: Mapping[str, np.ndarray[Any, Any]]
    ) -> Mapping[str, np.ndarray[Any, Any]] | str: ...

    def call_decoupled(
        self, model: str, version: str, outputs: Sequence[str], inputs: Mapping[str, np.ndarray[Any, Any]]
    ) -> Iterator[Mapping[str, np.ndarray[Any, Any]] | str]: ...

    def cancelled(self, batch: int, index: int) -> bool: ...

    def forget(self, batch: int) -> None: ...

    def sent(
        self,
        batch: int,
        index: int,
        final: bool,
        outputs: Mapping[str, np.ndarray[Any, Any]] | None,
        error: tuple[str, str] | None,
    ) -> None: ...


_CHANNEL: Channel | None = None
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def open_channel(channel: Channel) -> None:
    """Set by the model's process (runner.sandbox) before it loads the model."""
    global _CHANNEL  # noqa: PLW0603 - one model a process
    _CHANNEL = channel


def _calls_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL  # noqa: PLW0603 - one model a process
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="bls")
    return _POOL


class InferenceResponse:
    def __init__(
        self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None, **_: Any
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ModelConfig:
    """What a model's `auto_complete_config(auto_complete_model_config)` is handed and answers: the
    configuration so far (`as_dict()`), to which it may add inputs and outputs, set max_batch_size,
    dynamic batching and the transaction policy, with Triton's checks (runner.triton.complete)."""

    def __init__(self, model_config: str | Mapping[str, Any]) -> None:
        found = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        found.setdefault("max_batch_size", 0)
        found.setdefault("input", [])
        found.setdefault("output", [])
        self._model_config: dict[str, Any] = found

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = int(self._model_config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def _add(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        model = self._name()
        name = tensor.get("name")
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(
                f"{kind} '{name}' in auto-complete-config function for model '{model}' contains "
                f"property other than {', '.join(repr(key) for key in allowed)}."
            )
        for needed in ("name", "data_type", "dims"):
            if needed not in tensor:
                raise ValueError(
                    f"{kind} '{name}' in auto-complete-config function for model '{model}' is missing "
                    f"'{needed}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            configured = current.get("data_type", "TYPE_INVALID")
            if configured != "TYPE_INVALID" and configured != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype {configured} for "
                    f"{kind} '{name}', model provides {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects dims {list(tensor['dims'])} but "
                    f"the model configuration specifies dims {list(current['dims'])}"
                )
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(
                    f"model '{model}', tensor '{name}': the model expects optional {tensor['optional']} "
                    f"but the model configuration specifies optional {current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(
                f"model transaction property in auto-complete-config function for model '{self._name()}' "
                "contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name()}', which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in request.inputs() if tensor.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((tensor for tensor in response.output_tensors() if tensor.name() == name), None)


def _config_of(model_config: Mapping[str, Any] | str) -> Mapping[str, Any]:
    return json.loads(model_config) if isinstance(model_config, str) else model_config


def get_input_config_by_name(model_config: Mapping[str, Any] | str, name: str) -> dict[str, Any] | None:
    return next((item for item in _config_of(model_config).get("input", ()) if item["name"] == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any] | str, name: str) -> dict[str, Any] | None:
    return next((item for item in _config_of(model_config).get("output", ()) if item["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any] | str) -> bool:
    return bool(_config_of(model_config).get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(triton_type: str) -> Any:
    name = triton_type if triton_type.startswith("TYPE_") else f"TYPE_{triton_type}"
    return NUMPY_TYPES["TYPE_STRING" if name == "TYPE_BYTES" else name]


def numpy_to_triton_type(dtype: Any) -> str:
    kind = np.dtype(dtype)
    if kind.kind in "OSU":
        return "TYPE_STRING"
    return next(
        name for name, value in NUMPY_TYPES.items() if value is not np.object_ and np.dtype(value) == kind
    )


def triton_to_numpy_type(triton_type: str) -> Any:
    return triton_string_to_numpy(triton_type)


LENGTH = struct.Struct("<I")


def serialize_byte_tensor(input_tensor: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A BYTES tensor in Triton's wire layout (each element, in C order, as its length in 4 bytes
    little-endian then its bytes; a str as UTF-8), as Triton answers it: a 0-d object array holding
    those bytes (`.item()`), or an empty object array for a tensor of no elements."""
    array = np.asarray(input_tensor)
    if array.dtype.kind not in "OSU":
        raise TritonModelException(f"cannot serialize a tensor of {array.dtype} as BYTES")
    if array.size == 0:
        return np.empty(0, dtype=np.object_)
    held = np.empty((), dtype=np.object_)
    held[()] = to_bytes(array)
    return held


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray[Any, Any]:
    """The elements of Triton's BYTES wire layout (bytes, or what serialize_byte_tensor answered)
    as a 1-D object array of bytes."""
    if isinstance(encoded_tensor, np.ndarray) and encoded_tensor.dtype == np.object_:
        encoded_tensor = encoded_tensor.item() if encoded_tensor.size else b""
    view = memoryview(encoded_tensor).cast("B")
    items: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + LENGTH.size > len(view):
            raise TritonModelException(f"BYTES data ends inside the length of element {len(items)}")
        (length,) = LENGTH.unpack_from(view, offset)
        offset += LENGTH.size
        if offset + length > len(view):
            raise TritonModelException(f"BYTES element {len(items)} runs past the end of the data")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    """Lines on the function process's stderr, which the runner's log holds."""

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        print(f"{LogLevel(level).name}: {message}", file=sys.stderr, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)


class MetricFamily:
    """A family of custom metrics (`pb_utils.MetricFamily(name, description, kind)`), exported on
    the gateways' metrics port beside Triton's nv_* series as Triton exports them. A name used again
    is the same family (its first description kept); with another kind it is refused. A process
    may make at most fngate.custom_metrics.MAX_FAMILIES families and MAX_SERIES series."""

    COUNTER = custom_metrics.COUNTER
    GAUGE = custom_metrics.GAUGE
    HISTOGRAM = custom_metrics.HISTOGRAM

    def __new__(cls, name: str, description: str, kind: str) -> MetricFamily:
        with _METRICS_LOCK:
            known = _FAMILIES.get(name)
            if known is not None:
                if known.declared.kind != kind:
                    raise TritonModelException(
                        f"metric family '{name}' is a {known.declared.kind} already, not a {kind}"
                    )
                return known
            if len(_FAMILIES) >= custom_metrics.MAX_FAMILIES:
                raise TritonModelException(
                    f"a model may make at most {custom_metrics.MAX_FAMILIES} metric families"
                )
            try:
                declared = custom_metrics.check_family(
                    name, kind, description, (1.0,) if kind == cls.HISTOGRAM else ()
                )
            except custom_metrics.MetricError as exc:
                raise TritonModelException(str(exc)) from None
            family = super().__new__(cls)
            family.declared = declared
            family._metrics = {}
            _FAMILIES[name] = family
            return family

    declared: custom_metrics.Declared
    _metrics: dict[tuple[str, tuple[float, ...]], Metric]

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        """The series of these labels (the same object for the same labels); a histogram's takes
        its buckets' upper bounds."""
        declared = self.declared
        try:
            checked = custom_metrics.check_labels(declared.name, labels)
            if declared.kind == self.HISTOGRAM:
                declared = custom_metrics.check_family(
                    declared.name, declared.kind, declared.help, buckets or ()
                )
            elif buckets:
                raise custom_metrics.MetricError(
                    f"metric family '{declared.name}': only a histogram takes buckets"
                )
        except custom_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None
        key = (custom_metrics.series_key(checked), declared.buckets)
        with _METRICS_LOCK:
            metric = self._metrics.get(key)
            if metric is None:
                if _series_count() >= custom_metrics.MAX_SERIES:
                    raise TritonModelException(
                        f"a model may make at most {custom_metrics.MAX_SERIES} metric series"
                    )
                metric = self._metrics[key] = Metric(declared, checked)
        return metric


class Metric:
    """One series of a family: `increment`, `set` (a gauge's), `observe` (a histogram's), `value`."""

    def __init__(self, declared: custom_metrics.Declared, labels: dict[str, str]) -> None:
        self._update = custom_metrics.Update(
            declared, labels, counts=[0] * (len(declared.buckets) + 1) if declared.buckets else []
        )
        self._value = 0.0
        _CHANGED[id(self)] = self  # reported once at zero, as Triton exports a series it has made

    def increment(self, value: float) -> None:
        kind = self._update.family.kind
        if kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("a histogram is observed, not incremented")
        value = float(value)
        if kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a counter cannot be incremented by a negative value")
        with _METRICS_LOCK:
            self._value += value
            if kind == MetricFamily.GAUGE:
                self._update.value = self._value
            else:
                self._update.add += value
            _CHANGED[id(self)] = self

    def set(self, value: float) -> None:
        if self._update.family.kind != MetricFamily.GAUGE:
            raise TritonModelException("only a gauge is set")
        with _METRICS_LOCK:
            self._value = self._update.value = float(value)
            _CHANGED[id(self)] = self

    def observe(self, value: float) -> None:
        update = self._update
        if update.family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("only a histogram is observed")
        value = float(value)
        index = next(
            (i for i, bound in enumerate(update.family.buckets) if value <= bound), len(update.family.buckets)
        )
        with _METRICS_LOCK:
            update.counts[index] += 1
            update.observed += 1
            update.add += value
            _CHANGED[id(self)] = self

    def value(self) -> float:
        """A counter's or gauge's value in this process (a histogram has none)."""
        if self._update.family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("a histogram has no single value")
        return self._value

    def _take(self) -> dict[str, Any]:
        update = self._update
        reported = update.encode()
        update.add, update.observed = 0.0, 0
        update.counts = [0] * len(update.counts)
        return reported


_METRICS_LOCK = threading.Lock()
_FAMILIES: dict[str, MetricFamily] = {}
_CHANGED: dict[int, Metric] = {}
"""The series changed since the last report."""


def _series_count() -> int:
    return sum(len(family._metrics) for family in _FAMILIES.values())


def take_metrics() -> list[dict[str, Any]]:
    """The series changed since the last call, as the sandbox reports them to its runner."""
    with _METRICS_LOCK:
        changed = list(_CHANGED.values())
        _CHANGED.clear()
        return [metric._take() for metric in changed]
