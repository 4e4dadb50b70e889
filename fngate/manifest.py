"""The function manifest (`function.yaml`): its schema and how it is read from YAML."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
TENSOR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorSpec(_Frozen):
    name: str
    datatype: Literal[
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    ]
    shape: tuple[int, ...] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not TENSOR_NAME.match(value):
            raise ValueError(f"{value!r} is not a tensor name (letters, digits, _ . : / -)")
        return value

    @field_validator("shape")
    @classmethod
    def _shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for dim in value:
            if dim < -1 or dim == 0:
                raise ValueError(f"dimension {dim}: use a positive size, or -1 for a variable one")
        return value


class ModelSpec(_Frozen):
    backend: Literal["onnxruntime", "tensorrt", "python"]
    path: str
    accelerator: Literal["cpu", "cuda", "tensorrt"] = "cpu"
    precision: Literal["fp32", "fp16"] = "fp32"
    execution_timeout_ms: Annotated[int, Field(ge=1, le=3_600_000)] | None = None
    """Longest a batch may run; None: the batching timeout (no invocation waits longer anyway)."""
    memory_limit_mb: Annotated[int, Field(ge=1)] | None = None
    """python backend: the function's process is restarted, between batches, once its RSS is over this."""

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in value:
            raise ValueError(f"{value!r} must be a relative path inside the function's folder")
        return value

    @model_validator(mode="after")
    def _accelerator(self) -> ModelSpec:
        if self.backend == "python" and self.accelerator != "cpu":
            raise ValueError("accelerator applies to the onnxruntime and tensorrt backends only")
        if self.backend != "python" and self.memory_limit_mb is not None:
            raise ValueError("memory_limit_mb applies to the python backend only (its own process)")
        return self


class BatchingSpec(_Frozen):
    max_batch_size: Annotated[int, Field(ge=0, le=65536)] = 32
    preferred_batch_sizes: tuple[Annotated[int, Field(ge=1)], ...] = ()
    max_queue_delay_us: Annotated[int, Field(ge=0, le=10_000_000)] = 2000
    max_queue_size: Annotated[int, Field(ge=1)] = 1000
    max_queue_bytes: Annotated[int, Field(ge=0)] = 256 * 1024 * 1024
    """Past this many bytes of queued invocations, new ones are refused (503); 0: no limit."""
    timeout_ms: Annotated[int, Field(ge=1, le=3_600_000)] = 5000

    @model_validator(mode="after")
    def _preferred(self) -> BatchingSpec:
        for size in self.preferred_batch_sizes:
            if size > self.max_batch_size:
                raise ValueError(f"preferred batch size {size} is over max_batch_size {self.max_batch_size}")
        return self


class CacheSpec(_Frozen):
    enabled: bool = False
    ttl_s: Annotated[int, Field(ge=1)] = 3600


class ScalingSpec(_Frozen):
    pool: str = "default"
    min_replicas: Annotated[int, Field(ge=0)] = 0
    max_replicas: Annotated[int, Field(ge=1)] = 4
    idle_unload_s: Annotated[float, Field(gt=0)] = 300

    @field_validator("pool")
    @classmethod
    def _pool(cls, value: str) -> str:
        if not DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a DNS-1123 label")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> ScalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is over max_replicas {self.max_replicas}")
        return self


class VersionsSpec(_Frozen):
    # Versions are numbers in YAML (`traffic: {1: 90, 2: 10}`) and strings everywhere else.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)

    policy: Literal["latest", "all", "specific"] = "latest"
    latest: Annotated[int, Field(ge=1)] = 1
    specific: tuple[str, ...] = ()
    traffic: dict[str, Annotated[int, Field(ge=0, le=100)]] = Field(default_factory=dict)


class FunctionManifest(_Frozen):
    name: Annotated[str, Field(max_length=63)]
    description: str = ""
    model: ModelSpec
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    batching: BatchingSpec = BatchingSpec()
    cache: CacheSpec = CacheSpec()
    scaling: ScalingSpec = ScalingSpec()
    versions: VersionsSpec = VersionsSpec()

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a DNS-1123 label (lower-case letters, digits and '-')")
        return value

    @model_validator(mode="after")
    def _tensors(self) -> FunctionManifest:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [spec.name for spec in specs]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"{kind}: duplicate names {duplicates}")
            if self.batching.max_batch_size > 0:
                for spec in specs:
                    if spec.shape[0] != -1:
                        raise ValueError(
                            f"{kind}: {spec.name}: with batching on (max_batch_size > 0) the first "
                            f"dimension is the batch dimension and must be -1, not {spec.shape[0]}"
                        )
        return self

    @property
    def batched(self) -> bool:
        return self.batching.max_batch_size > 0

    @property
    def execution_timeout_s(self) -> float:
        return (self.model.execution_timeout_ms or self.batching.timeout_ms) / 1000

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.outputs if spec.name == name), None)


class ManifestError(Exception):
    """A manifest that cannot be used; `problems` lists each as (field path, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(self.lines()))

    def lines(self) -> Iterator[str]:
        for where, message in self.problems:
            yield f"{self.source}: {where}: {message}" if where else f"{self.source}: {message}"


def parse_manifest(data: Any, source: str) -> FunctionManifest:
    """Validate already-parsed YAML or JSON; raises ManifestError naming every problem."""
    if not isinstance(data, dict):
        raise ManifestError(source, [("", "a manifest is a mapping of keys to values")])
    try:
        return FunctionManifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, [(_field_path(err["loc"]), err["msg"]) for err in exc.errors()]) from exc


def load_manifest(path: Path) -> FunctionManifest:
    """Read and validate one `function.yaml` (safe YAML loading only)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(str(path), [("", f"cannot read: {exc.strerror}")]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(str(path), [("", f"not valid YAML: {exc}")]) from exc
    return parse_manifest(data, str(path))


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
