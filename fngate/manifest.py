"""The function manifest (`function.yaml`): its schema and how it is read from YAML."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fngate.pipeline import REQUEST, STEP_REFERENCE, graph_problems
from fngate.tensors import DATATYPES

MANIFEST_FILE = "function.yaml"
"""A function's manifest, in its folder."""
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
TENSOR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")
TRITON_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class _Frozen(BaseModel):
    # Attribute docstrings become the JSON Schema's descriptions (editors show them).
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class TensorSpec(_Frozen):
    """An input or output tensor."""

    name: str
    """The tensor's name, as the model and clients know it."""
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
    """An Open Inference Protocol datatype."""
    shape: tuple[int, ...] = Field(min_length=1)
    """Dimensions, -1 for a variable one; with batching on, the first is the batch dimension (-1)."""
    reshape: tuple[int, ...] | None = None
    """The shape the model takes (an input) or gives (an output) when it is not `shape`, without
    the batch dimension (Triton's reshape); clients see `shape`."""

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


class RateLimiterSpec(_Frozen):
    """What a batch of the function holds of the runner's execution slots while it runs."""

    resources: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    """Named resources and how many of each, e.g. {GPU_EXEC_SLOTS: 4} (Triton's rate_limiter
    resources); a batch waits until they are free (docs/memory.md)."""


DEFAULT_MAX_OUTPUT_BYTES = 64 * 2**20
"""The gateway's own limit on a message (GatewaySettings.max_body_bytes, which bounds a request's
body and a gRPC message): an answer no larger than the largest request it takes."""
DEFAULT_MEMORY_LIMIT_MB = 4096
"""A python function's cgroup limit when its manifest sets no memory_limit_mb."""
MAX_OUTPUT_BYTES = 512 * 2**20
"""Redis's proto-max-bulk-len by default: a reply entry's tensors travel in one field."""


class ModelSpec(_Frozen):
    """The model and where it runs."""

    backend: Literal["onnxruntime", "tensorrt", "pytorch", "python"]
    """onnxruntime (an .onnx file), tensorrt (a .plan engine), pytorch (a TorchScript .pt file; the
    runner needs fngate[torch]) or python (a model.py)."""
    path: str
    """The model file, relative to the manifest, inside its folder."""
    accelerator: Literal["cpu", "cuda", "tensorrt"] = "cpu"
    """onnxruntime's execution provider; for a python function, cuda gives its process the
    runner's GPU (docs/gpu.md); for a pytorch one, cuda runs it on the runner's GPU."""
    precision: Literal["fp32", "fp16"] = "fp32"
    """fp16 lets TensorRT build half-precision engines."""
    execution_timeout_ms: Annotated[int, Field(ge=1, le=3_600_000)] | None = None
    """Longest a batch may run; None: the batching timeout (no invocation waits longer anyway)."""
    memory_limit_mb: Annotated[int, Field(ge=1)] | None = None
    """python backend: the memory its process and every process it starts may use together (its
    cgroup's limit), and its process is restarted, between batches, once its RSS is over this.
    None: the cgroup's limit is 4096 MiB, and there is no limit where the runner makes no cgroups
    (docs/isolation.md)."""
    pids_limit: Annotated[int, Field(ge=8, le=65536)] = 1024
    """python backend: the most processes and threads its process and every process it starts may
    have at once (its cgroup's pids.max); a batch that reaches it is answered as it went, then
    the process and all it started are stopped and it starts again for the next batch."""
    working_folder_limit_mb: Annotated[int, Field(ge=1, le=1_048_576)] = 512
    """python backend: the size of its working folder (TMPDIR), a tmpfs of its own whose files
    count against its memory limit; a write past it fails with ENOSPC."""
    max_output_bytes: Annotated[int, Field(ge=1, le=MAX_OUTPUT_BYTES)] = DEFAULT_MAX_OUTPUT_BYTES
    """The most bytes an invocation's outputs may take (the tensors' data as they are sent back);
    an invocation whose outputs pass it is answered model_failed, its batch mates as usual."""
    load_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    """Longest an invocation waits for its model to load (runner start and download included)
    before its own deadline starts to run (docs/cold-start.md)."""
    instances: Annotated[int, Field(ge=1, le=64)] = 1
    """Executions of the model at once in one runner (Triton's instance_group count): as many
    sessions or processes, each counted in the runner's memory budget (docs/memory.md)."""
    rate_limiter: RateLimiterSpec = RateLimiterSpec()
    own_process: bool = False
    """pytorch backend: run the model in a process of its own, started and confined as a Python
    function's (docs/isolation.md), with its memory_limit_mb, pids_limit and
    working_folder_limit_mb: a crash, a hang or a leak of the model stops that process, never the
    runner. A python function always has one."""
    decoupled: bool = False
    """python backend, a Triton Python model with `model_transaction_policy { decoupled: true }`:
    it answers each request through a response sender, any number of responses, streamed to the
    caller as they are made (gRPC ModelStreamInfer); it is not served by the one-answer routes."""

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in value:
            raise ValueError(f"{value!r} must be a relative path inside the function's folder")
        return value

    @model_validator(mode="after")
    def _accelerator(self) -> ModelSpec:
        if self.backend in ("python", "pytorch") and self.accelerator == "tensorrt":
            raise ValueError(
                "accelerator tensorrt applies to the onnxruntime and tensorrt backends only; a "
                f"{self.backend} function takes cpu or cuda"
            )
        # A stored manifest carries every default: only others count.
        if self.own_process and self.backend != "pytorch":
            raise ValueError("own_process applies to the pytorch backend (a python function always has one)")
        process = ("memory_limit_mb", "pids_limit", "working_folder_limit_mb")
        for field in (*process, "decoupled"):
            if getattr(self, field) == ModelSpec.model_fields[field].default:
                continue
            if self.backend == "python" or (field in process and self.own_process):
                continue
            raise ValueError(
                f"{field} applies to a process of the model's own: the python backend's, or the "
                "pytorch backend's with own_process"
                if field in process
                else "decoupled applies to the python backend only"
            )
        return self

    @property
    def in_process(self) -> bool:
        """Whether the model runs in a process of its own (runner.sandbox)."""
        return self.backend == "python" or self.own_process


def _clashes(names: list[str], specs: tuple[TensorSpec, ...]) -> list[str]:
    """The names given twice, or among the specs' names."""
    return sorted({name for name in names if names.count(name) > 1} | set(names) & {s.name for s in specs})


MAX_PRIORITY_LEVELS = 16
"""Each priority level is a stream of its own that every runner reads: a handful is plenty."""


class QueuePolicySpec(_Frozen):
    """How long an invocation may wait in its priority level's queue, and what happens then
    (Triton's ModelQueuePolicy)."""

    timeout_action: Literal["reject", "delay"] = "reject"
    """Past its queue timeout an invocation is refused (reject: 504), or kept and served after
    every invocation of its level that is still within its own (delay)."""
    timeout_us: Annotated[int, Field(ge=0)] = 0
    """The queue timeout; 0: none (the invocation's deadline, batching.timeout_ms, still holds)."""
    allow_timeout_override: bool = False
    """A request's `timeout` parameter (µs) may shorten the queue timeout (never lengthen it)."""
    max_queue_size: Annotated[int, Field(ge=1)] | None = None
    """Queued invocations of this level past which new ones get 503; None: batching.max_queue_size."""


class BatchingSpec(_Frozen):
    """Dynamic batching across every gateway's invocations."""

    max_batch_size: Annotated[int, Field(ge=0, le=65536)] = 32
    """Most rows in one batch; 0 turns batching off (shapes are then whole tensors)."""
    preferred_batch_sizes: tuple[Annotated[int, Field(ge=1)], ...] = ()
    """Under concurrent load, a batch waits (at most max_queue_delay_us) to reach one of these."""
    max_queue_delay_us: Annotated[int, Field(ge=0, le=10_000_000)] = 2000
    """How long a batch may wait to fill, under concurrent load only."""
    max_queue_size: Annotated[int, Field(ge=1)] = 1000
    """Queued invocations past which new ones get 503 with Retry-After."""
    max_queue_bytes: Annotated[int, Field(ge=0)] = 256 * 1024 * 1024
    """Past this many bytes of queued invocations, new ones are refused (503); 0: no limit."""
    timeout_ms: Annotated[int, Field(ge=1, le=3_600_000)] = 5000
    """Each invocation's deadline (a request may ask for less)."""
    async_timeout_s: Annotated[int, Field(ge=1, le=7 * 86400)] = 3600
    """The deadline of an asynchronous invocation (`Prefer: respond-async`), from its submission."""
    result_ttl_s: Annotated[int, Field(ge=1, le=30 * 86400)] = 3600
    """How long an asynchronous invocation's result is kept after it is done (or failed): the time
    its caller has to collect it (a long-poll collects it at once; a callback needs none). One
    still pending is kept until this long after its deadline. Every result counts against its
    key's result_quota_bytes until then."""
    max_async_queue_size: Annotated[int, Field(ge=1)] = 10000
    """Queued asynchronous invocations past which new ones get 503 with Retry-After; they wait in
    a queue of their own, served only with the batch slots synchronous invocations leave."""

    priority_levels: Annotated[int, Field(ge=0, le=MAX_PRIORITY_LEVELS)] = 0
    """Levels of the request parameter `priority`, 1 the highest; each level's invocations are
    served before the next level's, across every gateway and runner. 0: one level."""
    default_priority_level: Annotated[int, Field(ge=0, le=MAX_PRIORITY_LEVELS)] = 0
    """The level of an invocation that names none (or one outside 1..priority_levels)."""
    queue_policy: QueuePolicySpec = QueuePolicySpec()
    """The queue policy of every level that priority_queue_policy does not name."""
    priority_queue_policy: dict[Annotated[int, Field(ge=1, le=MAX_PRIORITY_LEVELS)], QueuePolicySpec] = Field(
        default_factory=dict
    )
    """Queue policies by priority level."""

    @model_validator(mode="after")
    def _preferred(self) -> BatchingSpec:
        for size in self.preferred_batch_sizes:
            if size > self.max_batch_size:
                raise ValueError(f"preferred batch size {size} is over max_batch_size {self.max_batch_size}")
        return self

    @model_validator(mode="after")
    def _priorities(self) -> BatchingSpec:
        if self.priority_levels:
            if not 1 <= self.default_priority_level <= self.priority_levels:
                raise ValueError(
                    f"default_priority_level {self.default_priority_level} must be one of the "
                    f"priority_levels 1..{self.priority_levels}"
                )
        elif self.default_priority_level:
            raise ValueError("default_priority_level needs priority_levels")
        stray = sorted(level for level in self.priority_queue_policy if level > max(self.priority_levels, 1))
        if stray:
            raise ValueError(f"priority_queue_policy names levels {stray} past priority_levels")
        return self

    @property
    def priorities(self) -> int:
        """How many priority levels (streams) the function's synchronous invocations have."""
        return max(self.priority_levels, 1)

    def policy(self, level: int) -> QueuePolicySpec:
        """The queue policy of priority `level` (1-based)."""
        return self.priority_queue_policy.get(level, self.queue_policy)

    def queue_limit(self, level: int) -> int:
        """The most invocations priority `level` (1-based) may hold."""
        return self.policy(level).max_queue_size or self.max_queue_size


class CacheSpec(_Frozen):
    """The response cache shared by every gateway."""

    enabled: bool = False
    """Answer repeated invocations from the cache."""
    ttl_s: Annotated[int, Field(ge=1)] = 3600
    """How long a cached response lives."""


class ScalingSpec(_Frozen):
    """Runners and idle unloading."""

    pool: str = "default"
    """The runner pool that serves the function (a DNS-1123 label); pools scale apart."""
    min_replicas: Annotated[int, Field(ge=0)] = 0
    """Runners of the pool kept on Kubernetes even when idle (0: scale to zero)."""
    max_replicas: Annotated[int, Field(ge=1)] = 4
    """Most runners of the pool."""
    idle_unload_s: Annotated[float, Field(gt=0)] = 300
    """A model unused this long is unloaded; the next invocation loads it again."""

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
    """Which stored versions are served, and how unpinned invocations split over them."""

    # Versions are numbers in YAML (`traffic: {1: 90, 2: 10}`) and strings everywhere else.
    model_config = ConfigDict(
        frozen=True, extra="forbid", coerce_numbers_to_str=True, use_attribute_docstrings=True
    )

    policy: Literal["latest", "all", "specific"] = "latest"
    """latest (the newest `latest` versions), all, or specific (those in `specific`)."""
    latest: Annotated[int, Field(ge=1)] = 1
    """With policy latest: how many of the newest versions."""
    specific: tuple[str, ...] = ()
    """With policy specific: the version numbers."""
    traffic: dict[str, Annotated[int, Field(ge=0, le=100)]] = Field(default_factory=dict)
    """Weights by version, e.g. {1: 90, 2: 10}; they add up to 100."""
    max_stored: Annotated[int, Field(ge=1)] | None = None
    """Stored versions to keep, at most the deployment's max_versions (unset: that many); a deploy
    removes the oldest past it that nothing serves or names."""


class StepSpec(_Frozen):
    """One step of a pipeline: a deployed function and where each of its inputs comes from."""

    name: Annotated[str, Field(max_length=63)]
    """The step's name (a DNS-1123 label), which later steps use in their references."""
    function: str
    """The function it calls: `mlp` follows that function's routing (canaries apply), `mlp@2` pins it."""
    inputs: dict[str, str] = Field(min_length=1)
    """The function's inputs by name, each `request.<input>` or `<step>.<output>`."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a DNS-1123 label (lower-case letters, digits and '-')")
        if value == REQUEST:
            raise ValueError(f"'{REQUEST}' names the pipeline's own inputs; give the step another name")
        return value

    @field_validator("function")
    @classmethod
    def _function(cls, value: str) -> str:
        name, _, version = value.partition("@")
        if not DNS_LABEL.match(name) or (version and not re.match(r"^[1-9][0-9]{0,8}$", version)):
            raise ValueError(f"{value!r} is not a function (`name`) or a pinned version (`name@2`)")
        return value

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value: dict[str, str]) -> dict[str, str]:
        for name, reference in value.items():
            if not STEP_REFERENCE.match(reference):
                raise ValueError(f"input {name}: {reference!r} is not `request.<input>` or `<step>.<output>`")
        return value

    @property
    def function_name(self) -> str:
        return self.function.partition("@")[0]

    @property
    def pinned(self) -> str | None:
        """The version named after '@', if any."""
        return self.function.partition("@")[2] or None


class PipelineSpec(_Frozen):
    """Functions composed into one: each step is batched with that function's other invocations."""

    steps: tuple[StepSpec, ...] = Field(min_length=1)
    """The steps; their order does not matter (references make the graph, a DAG)."""
    outputs: dict[str, str] = Field(min_length=1)
    """The pipeline's outputs by name, each `<step>.<output>` (or `request.<input>`)."""

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, value: dict[str, str]) -> dict[str, str]:
        for name, reference in value.items():
            if not STEP_REFERENCE.match(reference):
                raise ValueError(f"{name}: {reference!r} is not `<step>.<output>` or `request.<input>`")
        return value

    @model_validator(mode="after")
    def _steps(self) -> PipelineSpec:
        names = [step.name for step in self.steps]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"steps: duplicate names {duplicates}")
        return self


class TritonSpec(_Frozen):
    """What a function read from a Triton model repository keeps of it, so that it answers as
    Triton would (fngate.triton)."""

    name: Annotated[str, Field(min_length=1, max_length=255)]
    """The model's name in Triton (its folder), which V2 clients use; may differ from the function's."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The model configuration as Triton's /config answers it (config.pbtxt as JSON)."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not TRITON_NAME.match(value):
            raise ValueError(f"{value!r} is not a model name (letters, digits, _ . -)")
        return value


class SequenceControl(_Frozen):
    """A model input the server fills for each invocation of a sequence (Triton's control_input)."""

    input: str
    """The model input it feeds (not one of the function's `inputs`: callers never send it)."""
    kind: Literal["start", "end", "ready", "corrid"]
    """`start`: true on a sequence's first invocation; `end`: true on its last; `ready`: true on
    every row that carries an invocation; `corrid`: the sequence's id."""
    datatype: Literal["BOOL", "INT32", "INT64", "UINT32", "UINT64", "FP32", "STRING"] = "INT32"
    """The tensor's datatype (a `corrid` of a string id is STRING)."""
    false_true: tuple[float, float] = (0, 1)
    """The values for false and true (`start`, `end`, `ready`)."""


MAX_STATE_BYTES = 1 << 20
"""The most bytes a sequence's implicit state may hold (its states together, one row each): it
lives in Redis between steps and travels with each."""


class SequenceState(_Frozen):
    """An implicit state of a stateful model (Triton's sequence_batching.state): the model's output
    `output` of one step is its input `input` at the sequence's next; the first step gets zeros."""

    input: str
    """The model input that takes the state (not one of the function's `inputs`)."""
    output: str
    """The model output that gives the next state (not one of the function's `outputs`)."""
    datatype: Literal[
        "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
        "FP64",
    ]  # fmt: skip
    """Its datatype (not BYTES)."""
    dims: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    """Its shape, without the batch dimension, every dimension fixed."""


class SequenceSpec(_Frozen):
    """A stateful model's invocations come in sequences (Triton's sequence batching): each carries
    its sequence's id, its first a start flag and its last an end flag. The gateway refuses an
    invocation without an id, and one of a sequence that was not started (or was idle past
    `idle_timeout_us`); the runner fills the control inputs."""

    controls: tuple[SequenceControl, ...] = ()
    """The inputs the server fills, in place of the caller."""
    idle_timeout_us: Annotated[int, Field(ge=1)] = 1_000_000
    """How long a sequence lives without an invocation (Triton's max_sequence_idle_microseconds,
    whose default this is); past it, the next invocation must start it again."""
    states: tuple[SequenceState, ...] = ()
    """Its implicit states, kept between steps (Triton's sequence_batching.state)."""
    max_live: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    """How many sequences of the function may be live at once, across every gateway: a start past
    them is refused with 503 until one ends or idles out (each holds its state in Redis)."""

    @property
    def state_bytes(self) -> int:
        """What its states hold for one sequence (one row each), back to back."""
        return sum(math.prod(state.dims) * DATATYPES[state.datatype].itemsize for state in self.states)


class TextGenerationSpec(_Frozen):
    """A function that generates text: the OpenAI-compatible routes serve it (`POST
    /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`)."""

    input: str
    """The BYTES input, of one element, that takes the prompt (a chat's messages as `role: content`
    lines)."""
    output: str
    """The BYTES output that carries the text: each response of a decoupled model one piece of it
    (a token), in order; another model's one answer the whole."""
    parameters: str | None = None
    """A BYTES input, of one element, that takes the request's sampling parameters as one JSON
    object (those it gave of max_tokens, temperature, top_p, stop, seed, presence_penalty,
    frequency_penalty), as vLLM's Triton backend takes `sampling_parameters`; none: the model gets
    the prompt alone."""


class FunctionManifest(_Frozen):
    """A function: its model (or the pipeline of functions it is), tensors, batching, cache, scaling
    and versions."""

    # `model` is stored as model_spec (pydantic's own names start with model_); YAML, JSON and the
    # schema say `model`.
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    name: Annotated[str, Field(max_length=63)]
    """The function's name: a DNS-1123 label (lower-case letters, digits, '-')."""
    description: str = ""
    """Free text."""
    model_spec: ModelSpec | None = Field(default=None, alias="model")
    """The model and where it runs (a function has either `model` or `pipeline`)."""
    pipeline: PipelineSpec | None = None
    """Other functions composed into this one (a function has either `model` or `pipeline`)."""
    inputs: tuple[TensorSpec, ...] = Field(min_length=1)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1)
    batching: BatchingSpec = BatchingSpec()
    cache: CacheSpec = CacheSpec()
    scaling: ScalingSpec = ScalingSpec()
    versions: VersionsSpec = VersionsSpec()
    triton: TritonSpec | None = None
    """Set for a model read from a Triton model repository (or imported from one)."""
    sequence: SequenceSpec | None = None
    """Set for a stateful model whose invocations come in sequences (Triton's sequence_batching)."""
    text_generation: TextGenerationSpec | None = None
    """Set for a function that generates text: its prompt input and text output, for the
    OpenAI-compatible routes."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a DNS-1123 label (lower-case letters, digits and '-')")
        return value

    @model_validator(mode="after")
    def _model_or_pipeline(self) -> FunctionManifest:
        if self.model_spec is None and self.pipeline is None:
            raise ValueError(
                "model (a function's model) or pipeline (steps calling other functions) is required"
            )
        if self.model_spec is not None and self.pipeline is not None:
            raise ValueError("a function has either a model or a pipeline, not both")
        if self.model_spec is not None and self.model_spec.decoupled and self.cache.enabled:
            raise ValueError("a decoupled model's answers are streams: its cache cannot be enabled")
        if self.sequence is not None:
            if self.pipeline is not None:
                raise ValueError(
                    "sequence: a pipeline's steps are functions of their own; a step may be a sequence"
                )
            if self.cache.enabled:
                raise ValueError(
                    "sequence: a sequence's answers depend on its state: its cache cannot be enabled"
                )
            names = [control.input for control in self.sequence.controls]
            names += [state.input for state in self.sequence.states]
            taken = _clashes(names, self.inputs)
            if taken:
                raise ValueError(
                    f"sequence: control and state inputs {taken} are fed twice (or are among the inputs)"
                )
            taken = _clashes([state.output for state in self.sequence.states], self.outputs)
            if taken:
                raise ValueError(
                    f"sequence: state outputs {taken} are named twice (or are among the outputs)"
                )
            if self.sequence.state_bytes > MAX_STATE_BYTES:
                raise ValueError(
                    f"sequence: the states hold {self.sequence.state_bytes} bytes a sequence, past the "
                    f"{MAX_STATE_BYTES} fngate keeps"
                )
        return self

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

    @model_validator(mode="after")
    def _text_generation(self) -> FunctionManifest:
        generation = self.text_generation
        if generation is None:
            return self
        taken = {"input": generation.input}
        if generation.parameters is not None:
            taken["parameters"] = generation.parameters
        if len(set(taken.values())) < len(taken):
            raise ValueError("text_generation: its input and parameters are two inputs, not one")
        for field, name in taken.items():
            spec = self.input(name)
            if spec is None or spec.datatype != "BYTES" or any(dim not in (1, -1) for dim in spec.shape):
                raise ValueError(
                    f"text_generation.{field}: {name!r} must name a BYTES input of one element (each "
                    "dimension 1 or -1)"
                )
        others = [spec.name for spec in self.inputs if spec.name not in taken.values()]
        if others:
            raise ValueError(
                f"text_generation: the inputs {others} would be missing from every call (a text "
                "generator takes its prompt and, if named, its parameters, nothing else)"
            )
        output = self.output(generation.output)
        if output is None or output.datatype != "BYTES":
            raise ValueError(f"text_generation.output: {generation.output!r} must name a BYTES output")
        return self

    @property
    def model(self) -> ModelSpec:
        """The model of a function that has one; a pipeline has none (check `pipeline` first)."""
        if self.model_spec is None:
            raise AttributeError(f"function '{self.name}' is a pipeline: it has no model")
        return self.model_spec

    @property
    def model_name(self) -> str:
        """The name V2 clients know it by: the Triton model's, else the function's."""
        return self.triton.name if self.triton is not None else self.name

    @property
    def batched(self) -> bool:
        return self.batching.max_batch_size > 0

    @property
    def instances(self) -> int:
        """Batches a runner runs at once (model.instances; a pipeline runs none of its own: 1)."""
        return self.model_spec.instances if self.model_spec is not None else 1

    @property
    def execution_timeout_s(self) -> float:
        timeout_ms = self.model_spec.execution_timeout_ms if self.model_spec is not None else None
        return (timeout_ms or self.batching.timeout_ms) / 1000

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
        manifest = FunctionManifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(
            source, [(_field_path(err["loc"]), _message(err)) for err in exc.errors()]
        ) from exc
    if manifest.pipeline is not None:
        problems = graph_problems(manifest)
        if problems:  # a pipeline whose steps do not make a graph is no manifest at all
            raise ManifestError(source, problems)
    return manifest


SCHEMA_ID = "https://fngate.dev/function.schema.json"


def schema() -> dict[str, Any]:
    """The JSON Schema of function.yaml, for editors (yaml-language-server) and `fngate schema`."""
    doc = FunctionManifest.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "fngate function manifest (function.yaml)",
        **{key: value for key, value in doc.items() if key != "title"},
    }


def schema_json() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


def _message(error: Any) -> str:
    """Pydantic's message in plain words: no 'Value error,' prefix; unknown keys with a suggestion."""
    kind, loc = error["type"], error["loc"]
    if kind == "extra_forbidden":
        known = _keys_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f" (known keys: {', '.join(known)})"
        return f"unknown key{hint}"
    if kind == "missing":
        return "is required"
    if kind == "literal_error":
        return f"{error['input']!r} is not allowed: use {error['msg'].removeprefix('Input should be ')}"
    message: str = error["msg"]
    return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _keys_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys a mapping at `loc` may have (walking the manifest's models along the path)."""
    model: Any = FunctionManifest
    for part in loc:
        if isinstance(part, int):
            continue
        fields = _fields_of(model)
        if part not in fields:
            return []
        model = _model_of(fields[part].annotation)
    return list(_fields_of(model))


def _fields_of(model: Any) -> dict[str, Any]:
    """A model's fields by the name YAML uses (the alias, where there is one)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return {}
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside an annotation such as `tuple[TensorSpec, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


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
