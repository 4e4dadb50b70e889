"""Process settings for gateway and runner: frozen, read once from `FNGATE_*` variables or flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "FNGATE_"
CLIENT_VARIABLES = frozenset({"FNGATE_API_KEY"})
"""Read by CLI commands that call a gateway (`fngate deploy --gateway`), not by any process."""


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    redis_url: str = "redis://127.0.0.1:6379/0"
    cache_url: str = ""
    """A Redis for the response cache; empty: the queue's Redis (one round trip per invocation)."""
    repo: str = "functions"
    log_level: str = "INFO"
    redis_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    """A Redis command (or connection) that takes longer fails: a gateway answers 503 rather than
    wait out the invocation's deadline on a Redis that stopped answering; a runner retries."""
    sched_batch: bool = False
    """Run the process under Linux's SCHED_BATCH (fngate.process.batch_scheduling): fewer context
    switches between fngate's own processes where they share CPUs; `fngate up` turns it on."""


class RepositoryLimits(BaseSettings):
    """What deploys may leave in the repository: read by the gateway's deploy API and by `fngate
    deploy`, which both store versions."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid")

    max_versions: Annotated[int, Field(ge=1)] = 10
    """Stored versions kept per function (a manifest's versions.max_stored may keep fewer): a deploy
    removes the oldest past it, except those still served or named (docs/repository.md)."""
    max_repository_bytes: Annotated[int, Field(ge=0)] = 100 * 1024**3
    """What the repository (every object under its prefix, or file in its folder) may hold: a
    deploy that would leave more, once the versions it removes are counted, is refused (413) with
    nothing uploaded. 0: no limit."""


class GatewaySettings(_Settings, RepositoryLimits):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    bind: str = ""
    """A Hypercorn bind (`fd://3`, `unix:/path`); overrides host and port when set. `fd://N` is a
    socket already listening (a supervisor's, that outlives this process: `fngate up`'s; with
    workers > 1, they all serve it)."""
    workers: Annotated[int, Field(ge=1)] = 1
    server: Literal["uvicorn", "hypercorn"] = "uvicorn"
    deadline_admission: bool = True
    """Refuse at once (503) an invocation whose estimated wait (the invocations ahead of it at the
    batch cost its runners measured) passes its deadline, rather than queue it to time out."""
    group_invocations: bool = True
    """The synchronous invocations of one function (and priority level) that a gateway process
    takes in one event-loop turn share one stream entry (up to max_batch_size of them): one entry
    to add, read, acknowledge and count in Redis and the runners, instead of one each. Off: one
    entry each (for comparison)."""
    kubernetes_wake: bool = False
    """In a Kubernetes pod (as `fngate k8s render` makes it): an invocation for a runner pool with no
    live runner also sets the pool's Deployment from 0 to 1 replica through the Kubernetes API
    (with the pod's service account), at once rather than at KEDA's next poll (docs/deployment.md)."""
    allow_client_shm: bool = False
    """Triton's system shared memory extension (`--allow-client-shm`): clients on the gateway's host
    register POSIX shared memory objects and name them in requests instead of sending tensors. Off by
    default: the gateway reads and writes those objects with its own user's rights."""
    server_name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] = "fngate"
    """The name server metadata answers (GET /v2, gRPC ServerMetadata). Triton's example clients
    check for "triton": set it to that for clients that do."""
    """The HTTP server: uvicorn (httptools, uvloop; the fastest on the benchmark) or Hypercorn (HTTP/2)."""
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = 8001
    """The Open Inference Protocol over gRPC (GRPCInferenceService) on `host`, as Triton's 8001; 0:
    no gRPC front end."""
    grpc_bind: str = ""
    """`fd://N`: a socket already bound and listening for gRPC (a supervisor's, that outlives this
    process: `fngate up`'s); overrides host and grpc_port when set."""
    grpc_reuse_port: bool = False
    """Bind the gRPC port with SO_REUSEPORT: set for the worker processes of `workers` > 1, which
    share it (the kernel spreads connections over them). Off otherwise, so that a second gateway
    on the same port fails to start instead of sharing it."""
    grpc_idle_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """A gRPC connection with no RPC for this long is sent away (GOAWAY; clients reconnect at their
    next call). When a process is at max_connections, the longest idle one goes first."""
    grpc_drain_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """An answer a gRPC client takes none of (its flow-control window stays shut) for this long is
    cancelled (RST_STREAM CANCEL) and its bytes let go."""
    grpc_max_parked_bytes: Annotated[int, Field(ge=1024)] = 128 * 1024 * 1024
    """Answer bytes waiting for gRPC clients' windows, on one connection (four times it over the
    process): an answer past it fails its RPC with RESOURCE_EXHAUSTED."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    max_decode_bytes: Annotated[int, Field(ge=1024)] = 256 * 1024 * 1024
    """What one gateway process holds at once for invocation bodies being decoded (compressed
    bodies, binary tensor data, the tensors JSON bodies fill): past it a request is answered 503
    with Retry-After (gRPC: UNAVAILABLE) instead of allocating more; a request alone is never refused."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """The whole request body must arrive within this; past it, 408 and the connection is closed."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """How long a connection may take to send a request's head, or stay idle between requests: the
    HTTP server's idle limit (uvicorn's timeout_keep_alive, Hypercorn's keep_alive_timeout). Behind
    an HTTP load balancer, keep the balancer's idle timeout below this one."""
    max_header_bytes: Annotated[int, Field(ge=1024)] = 32 * 1024
    """The most a request's line and headers may take; past it, 431 and the connection is closed."""
    max_headers: Annotated[int, Field(ge=8)] = 100
    """The most headers a request may have; past it, 431 and the connection is closed."""
    max_connections: Annotated[int, Field(ge=1)] = 2048
    """Open HTTP connections per gateway process; past it, a new one is answered 503 with
    Retry-After and closed (on uvicorn; on Hypercorn, requests past it are answered so)."""
    max_client_connections: Annotated[int, Field(ge=0)] = 1024
    """Open HTTP connections per gateway process from one client (an IPv4 address, an IPv6 /64);
    past it, a new one is answered 503 with Retry-After and closed, so that one client cannot
    hold all of max_connections. 0: no limit of its own. Behind a proxy that does not keep
    clients' addresses (an HTTP load balancer, an ingress), its connections all count as one
    client: raise this to max_connections there."""
    redis_connections: Annotated[int, Field(ge=2)] = 256
    """Connections to the queue's Redis per gateway process; invocations wait for one when all are busy."""
    reply_block_ms: Annotated[int, Field(ge=1, le=10_000)] = 1000
    catalog_refresh_s: Annotated[float, Field(gt=0)] = 2.0
    retry_after_s: Annotated[int, Field(ge=1)] = 1
    load_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """How long POST /v2/repository/models/{name}/load waits for a runner to report the model ready."""
    auth: bool = True
    """Every route but health needs an API key with its scope (`fngate keys create`). Turn it off
    only behind something else that authenticates, or on a loopback address."""
    auth_refresh_s: Annotated[float, Field(gt=0)] = 1.0
    """How often the gateway checks Redis for created or revoked API keys."""
    in_flight_ttl_s: Annotated[float, Field(gt=0)] = 300.0
    """An invocation counts against its key's max_in_flight until answered, or this long at most
    (the bound when a gateway dies with invocations in flight)."""
    max_deploy_bytes: Annotated[int, Field(ge=1024)] = 2 * 1024**3
    """The largest archive PUT /v1/functions/{name} accepts."""
    max_unpacked_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024**3
    """The most an archive PUT /v1/functions/{name} may unpack to (checked from each file's header
    before its bytes are read: 413 past it)."""
    max_unpack_ratio: Annotated[float, Field(ge=1)] = 100.0
    """...and at most this many times the archive's own size (a model compresses a few times, a
    gzip of zeros a thousand)."""
    admin_key_hash: str = ""
    """`<key id>:<sha256 hex>` of admin keys accepted besides the keys in Redis, comma-separated
    (`fngate keys hash` prints one): from a Kubernetes Secret, a new cluster has keys (its first
    admin's, Prometheus's) before anyone writes to Redis."""
    callback_secret: SecretStr = SecretStr("")
    """Signs the callbacks of asynchronous invocations (HMAC-SHA256, `X-Fngate-Signature`); shared
    with their receivers. Empty: invocations with a callback are refused (callbacks are always
    signed; `fngate up` makes one)."""
    callback_allow: str = ""
    """Internal receivers that callbacks may reach: networks (10.1.0.0/16, 127.0.0.1) and host
    names, separated by commas. Every other loopback, private, link-local, multicast or unspecified
    address is refused, and so is a name that resolves to one."""
    result_quota_bytes: Annotated[int, Field(ge=0)] = 256 * 2**20
    """What one API key's asynchronous results may hold in Redis at once (their records and
    replies, until each expires or is fetched with ?delete=true); past it, its asynchronous
    submissions get 429. 0: no quota of bytes."""
    result_memory_share: Annotated[float, Field(ge=0, le=1)] = 0.25
    """The share of the memory from which Redis refuses asynchronous submissions to everyone (80%
    of its maxmemory) that one API key's results may hold: a key's quota is the smaller of this and
    result_quota_bytes, so that no key's results lock the others out. 0: no share; no effect
    on a Redis without maxmemory."""
    # The metrics port (gateway/http/metrics_port.py): Prometheus scrapes it without a key.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 8002
    """GET /metrics without an API key, with Triton's nv_* names beside fngate's (Triton's port);
    0: no metrics port."""
    metrics_host: str = ""
    """The metrics port's address; empty: the gateway's `host` (as Triton's shares its HTTP address)."""
    metrics_bind: str = ""
    """`fd://N`: a socket already bound for the metrics port (a supervisor's, shared by its workers)."""


class RunnerSettings(_Settings):
    functions: tuple[str, ...] = ()
    """Functions to serve; empty serves every function in the repository (refreshed every rescan_s)."""
    pool: str = "default"
    intra_op_threads: Annotated[int, Field(ge=0)] = 0
    """onnxruntime's threads per session (spinning off); 0: one per CPU the runner may use (its
    container's CPU limit counts), at most 4."""
    claim_idle_ms: Annotated[int, Field(ge=10)] = 2000
    claim_interval_ms: Annotated[int, Field(ge=10)] = 500
    max_deliveries: Annotated[int, Field(ge=1)] = 3
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    rescan_s: Annotated[float, Field(gt=0)] = 2.0
    read_block_ms: Annotated[int, Field(ge=1, le=10_000)] = 1000
    reply_maxlen: Annotated[int, Field(ge=100)] = 100_000
    idle_shutdown_s: Annotated[float, Field(ge=0)] = 0
    """With no model loaded and no work this long, the runner exits (fngate up's scale to zero);
    0, the default and the setting on Kubernetes, never."""
    status_host: str = "0.0.0.0"
    status_port: Annotated[int, Field(ge=0, le=65535)] = 9100
    """The runner's /metrics and /healthz port; 0 picks a free one (several runners on one host)."""
    artifact_dir: str = "~/.cache/fngate/artifacts"
    """Local cache of model files downloaded from an S3 repository, keyed by sha256."""
    artifact_max_bytes: Annotated[int, Field(ge=0)] = 20 * 1024**3
    """Past this, least recently used files that no loaded model needs are deleted."""
    heartbeat_s: Annotated[float, Field(gt=0)] = 2.0
    load_retry_s: Annotated[float, Field(ge=0)] = 30.0
    """After a failed load, invocations get the failure at once for this long; a load request retries."""
    retire_after_s: Annotated[float, Field(ge=0)] = 10.0
    """A version the policy no longer serves is unloaded once a newer one is ready here and it was
    unused for this long (gateways see the newer one become ready within their refresh interval)."""
    require_accelerator: bool = False
    """Refuse to serve a function whose accelerator (cuda, tensorrt) this runner cannot give, instead
    of running it on a lesser one (CPU at worst) with a warning and the reason recorded."""
    gpu_device: Annotated[int, Field(ge=0)] = 0
    """The GPU this runner uses, by its CUDA index (as CUDA_VISIBLE_DEVICES leaves them numbered)."""
    engine_cache_dir: str = "~/.cache/fngate/engines"
    """Local TensorRT engine and timing caches: one folder per model, TensorRT version, GPU and precision."""
    # The memory budget (docs/memory.md).
    memory_budget: bool = True
    """Hold the models' memory to a budget: idle models are unloaded least recently used first to
    make room for a load, and a load that cannot fit is left to another runner. False: load
    whatever is asked until the process dies."""
    memory_budget_bytes: Annotated[int, Field(ge=0)] = 0
    """What models may take of this runner's host memory (their processes included); 0:
    memory_budget_share of its memory cgroup's limit (or of the machine's memory) less what the
    runner itself holds when it starts."""
    memory_budget_share: Annotated[float, Field(gt=0, le=1)] = 0.8
    gpu_memory_budget_bytes: Annotated[int, Field(ge=0)] = 0
    """What models may take of the GPU's memory (NVML); 0: memory_budget_share of its total."""
    rate_limiter_resources: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    """Execution slots of this runner's device (Triton's --rate-limiter-resource), e.g.
    {"GPU_EXEC_SLOTS": 8}: a batch of a function whose model.rate_limiter needs some waits until
    they are free. A resource not named here has as many as the most any function needs."""


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """`FNGATE_*` variables that no settings class knows: a typo there must stop startup."""
    env = os.environ if environ is None else environ
    known = CLIENT_VARIABLES | {
        ENV_PREFIX + name.upper() for cls in (GatewaySettings, RunnerSettings) for name in cls.model_fields
    }
    return sorted(key for key in env if key.upper().startswith(ENV_PREFIX) and key.upper() not in known)
