"""Kubernetes objects for a cluster deployment, rendered from function manifests: the gateway's
Deployment, Service, PodDisruptionBudget and HPA, and per runner pool a Deployment that KEDA scales
from zero on the length and lag of its functions' streams. The one source of these objects, for
Terraform too."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fngate import keys
from fngate.config import GatewaySettings
from fngate.kube import runner_deployment
from fngate.manifest import FunctionManifest, ManifestError, load_manifest

Obj = dict[str, Any]

# Contracts with terraform/modules/eks (the GPU node group's label and taint) and the Dockerfile.
GPU_NODE_LABEL = ("nvidia.com/gpu.present", "true")
GPU_TAINT_KEY = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class Port:
    """A port a process listens on: its name in the pod, its number, the FNGATE_ variable that
    sets it, and whether anyone may reach it (the gateway's Service and NetworkPolicy) or only
    Prometheus. A new port is one line in GATEWAY_PORTS or RUNNER_PORTS (and the Dockerfile's EXPOSE)."""

    name: str
    number: int
    setting: str
    public: bool = True


GATEWAY_PORTS = (
    Port("http", 8000, "FNGATE_PORT"),
    Port("grpc", 8001, "FNGATE_GRPC_PORT"),
    Port("metrics", 8002, "FNGATE_METRICS_PORT", public=False),
)
"""The gateway's; the Service serves `http` on service_port and every other public port on its
number. `metrics` is Triton's metrics port (/metrics without a key), for Prometheus alone."""
RUNNER_PORTS = (Port("metrics", 9100, "FNGATE_STATUS_PORT", public=False),)
"""The runner's metrics and health port: /healthz/ready answers while Redis does and it consumes."""
GATEWAY_PORT = GATEWAY_PORTS[0].number
RUNNER_PORT = RUNNER_PORTS[0].number
RUNNER_READ_AHEAD_BATCHES = 2
"""A busy runner holds up to this many batches (of max_batch_size) read and not yet answered: the
one running and at most one read ahead (runner/consumer.py): the stream-length target per runner."""
UID = 10001
CACHE_DIR = "/var/cache/fngate"
TENSORRT_CACHE_DIR = "/var/cache/fngate/tensorrt"
POOL_LABEL = "fngate/pool"
WARM_COST = (
    "keeps one runner per pool running around the clock, and for a GPU pool one GPU node "
    "(a g5.xlarge costs about 1 USD an hour on demand, some 730 USD a month)"
)
# cluster-autoscaler removes no node that runs a pod with an emptyDir volume, unless the pod names
# the volume in this annotation (kubernetes/autoscaler, cluster-autoscaler/FAQ.md: "What types of
# pods can prevent CA from removing a node?"); runners keep nothing there that another cannot refetch.
SAFE_TO_EVICT_VOLUMES = "cluster-autoscaler.kubernetes.io/safe-to-evict-local-volumes"
TMP_BYTES = 1024**3
GATEWAY_TMP_BYTES = 2 * GatewaySettings.model_fields["max_deploy_bytes"].default + TMP_BYTES
"""A deploy upload spools to the gateway's /tmp (up to max_deploy_bytes) and is unpacked beside it."""
TENSORRT_CACHE_BYTES = 20 * 1024**3
SYNC_JOB = "fngate-registry-sync"

GATEWAY_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
CPU_RUNNER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
GPU_RUNNER_RESOURCES = {
    "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
    "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
}
SYNC_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}


@dataclasses.dataclass(frozen=True)
class Options:
    """Each field is also a flag of `main` (`--redis-address` for redis_address)."""

    namespace: str = "fngate"
    image: str = "fngate/gateway:latest"
    runner_image: str = "fngate/runner:latest"
    gpu_image: str = "fngate/runner-gpu:latest"
    repo: str = "s3://fngate-models/prod"
    redis_address: str = "redis:6379"
    """host:port, for KEDA; the pods' URL (with the password) is in redis_secret."""
    redis_cluster: bool = False
    """Redis is a cluster (redis_address its configuration endpoint, or host:port of nodes,
    comma-separated): KEDA reads it with redis-cluster-streams triggers."""
    redis_tls: bool = True
    redis_secret: str = "fngate-redis"
    """A Secret with keys `url` (FNGATE_REDIS_URL) and `password`, made beside these objects."""
    deployed: tuple[str, ...] = ()
    """The functions that have been deployed (`fngate deploy`, or `fngate ls --sync`, made their
    stream and runner group): only they get runner pools and triggers."""
    polling_interval_s: int = 5
    cooldown_s: int = 300
    target_lag: int = 0
    """Waiting invocations per runner before KEDA adds one; 0: each function's max_batch_size. The
    stream-length target is RUNNER_READ_AHEAD_BATCHES times this."""
    warm_runners: int = 0
    """Runners each pool keeps when idle, over the manifests' min_replicas. 1 removes the cold start
    from zero, and keeps one runner per pool, and for a GPU pool one GPU node, running (WARM_COST)."""
    artifact_cache_bytes: int = 10 * 1024**3
    """Model files a runner keeps (FNGATE_ARTIFACT_MAX_BYTES): sizes its cache volume and its
    ephemeral-storage request."""
    sync_schedule: str = ""
    """Cron schedule of the registry-sync job (`fngate ls --sync`); empty: suspended, run on demand."""
    gateway_min_replicas: int = 2
    gateway_max_replicas: int = 10
    gateway_workers: int = 1
    service_type: str = "LoadBalancer"
    service_port: int = 80
    service_annotations: tuple[str, ...] = ()
    """KEY=VALUE pairs."""
    source_ranges: tuple[str, ...] = ()
    gateway_role_arn: str = ""
    runner_role_arn: str = ""
    deployer_role_arn: str = ""
    otlp_endpoint: str = ""
    """The collector's OTLP/HTTP base URL (port 4318): the processes export traces over HTTP."""
    log_level: str = "INFO"
    api_keys_secret: str = "fngate-api-keys"
    """A Secret whose key `admin` holds an admin API key's '<id>:<sha256>' (`fngate keys hash`); the
    gateways accept that key whatever Redis holds. Optional: without it, keys come from Redis only."""
    prometheus_label: str = "app.kubernetes.io/name=prometheus"
    """KEY=VALUE of the Prometheus pods (any namespace): the only ones that may reach a runner."""
    runner_cpu: str = ""
    """CPU each CPU runner pod requests (a Kubernetes quantity: 500m, 1, 1.5); empty: 1
    (CPU_RUNNER_RESOURCES). The limit is the larger of it and 2. A node must hold two during a
    rolling update (the old and its surge): on a 2-core node, 500m."""
    gateway_cpu: str = ""
    """CPU each gateway pod requests; empty: 250m (GATEWAY_RESOURCES). The limit is the larger of
    it and 1; the HPA scales gateways at 70% of the request."""
    push_activation: bool = True
    """Gateways wake a runner pool at zero (its Deployment from 0 to 1 replica) the moment work
    arrives for it, rather than at KEDA's next poll: their pods get the service-account token, and
    a Role that lets them patch the scale of the runner Deployments and nothing else."""

    def __post_init__(self) -> None:
        if self.warm_runners < 0 or self.target_lag < 0 or self.artifact_cache_bytes < 1024**2:
            raise ValueError(
                "warm_runners and target_lag must be 0 or more, artifact_cache_bytes 1 MiB or more"
            )
        for name in ("runner_cpu", "gateway_cpu"):
            value = getattr(self, name)
            if value and millicores(value) <= 0:
                raise ValueError(
                    f"{name.replace('_', '-')} {value!r}: expected a CPU quantity above 0 (500m, 1, 1.5)"
                )
        for pair in self.service_annotations:
            key, sep, _ = pair.partition("=")
            if not key or not sep:
                raise ValueError(f"service annotation {pair!r}: expected KEY=VALUE")


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str
    functions: tuple[FunctionManifest, ...]

    @property
    def gpu(self) -> bool:
        return any(needs_gpu(manifest) for manifest in self.functions)

    @property
    def min_replicas(self) -> int:
        return max(manifest.scaling.min_replicas for manifest in self.functions)

    @property
    def max_replicas(self) -> int:
        return max(manifest.scaling.max_replicas for manifest in self.functions)


def millicores(quantity: str) -> int:
    """A CPU quantity (`500m`, `2`, `1.5`) in thousandths of a CPU; -1 for what is not one."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", quantity)
    if not match:
        return -1
    value = float(match[1])
    if match[2]:  # millicores are whole
        return int(value) if value.is_integer() else -1
    return round(value * 1000)


def _cpu(resources: Obj, request: str) -> Obj:
    """`resources` with its CPU request set to `request` ('' keeps it) and its limit raised to it."""
    resources = copy.deepcopy(resources)
    if request:
        resources["requests"]["cpu"] = request
        if millicores(request) > millicores(resources["limits"]["cpu"]):
            resources["limits"]["cpu"] = request
    return resources


def needs_gpu(manifest: FunctionManifest) -> bool:
    model = manifest.model_spec  # None for a pipeline: its steps run in their own pools
    return model is not None and (model.backend == "tensorrt" or model.accelerator in ("cuda", "tensorrt"))


def pools(manifests: Sequence[FunctionManifest], deployed: Sequence[str]) -> list[Pool]:
    """The deployed functions grouped by `scaling.pool`, in name order; raises ValueError on a
    duplicate name, or on a deployed name that no manifest defines."""
    names = [manifest.name for manifest in manifests]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"functions defined more than once: {', '.join(duplicates)}")
    unknown = sorted(set(deployed) - set(names))
    if unknown:
        raise ValueError(f"deployed functions without a manifest: {', '.join(unknown)}")
    grouped: dict[str, list[FunctionManifest]] = {}
    for manifest in sorted(manifests, key=lambda m: m.name):
        if manifest.name in deployed:
            grouped.setdefault(manifest.scaling.pool, []).append(manifest)
    return [Pool(name, tuple(members)) for name, members in sorted(grouped.items())]


def targets(manifest: FunctionManifest, options: Options) -> tuple[int, int]:
    """(lagCount, streamLength) of a function's triggers: entries per runner before KEDA adds one.
    The length counts what runners hold too, and a busy runner holds RUNNER_READ_AHEAD_BATCHES
    batches, so a length target of one batch would count each busy runner twice and double the
    pool with nothing waiting. A runner runs a batch on each of a model's instances at once, and
    reads one ahead for each: per runner, each target is that many times larger."""
    lag = options.target_lag or max(1, manifest.batching.max_batch_size) * manifest.instances
    return lag, lag * RUNNER_READ_AHEAD_BATCHES


def render(manifests: Sequence[FunctionManifest], options: Options) -> list[Obj]:
    """Every object, in apply order; the namespace and the Redis Secret are made beforehand."""
    served = pools(manifests, options.deployed)
    wake = options.push_activation and bool(served)
    objects = [
        _service_account("gateway", options.gateway_role_arn, options),
        _service_account("runner", options.runner_role_arn, options),
        _service_account("deployer", options.deployer_role_arn, options),
        *(_wake_role(served, options) if wake else []),
        _trigger_authentication(options),
        *_gateway(options, wake),
        _registry_sync(options),
        *_network_policies(options),
    ]
    for pool in served:
        objects += [_runner(pool, options), _runner_budget(pool, options), _scaled_object(pool, options)]
    return copy.deepcopy(objects)  # no dict shared between objects, or with this module


def _object(api: str, kind: str, name: str, component: str, options: Options, **labels: str) -> Obj:
    labels = {**_selector(component), "app.kubernetes.io/part-of": "fngate", **labels}
    metadata = {"name": name, "namespace": options.namespace, "labels": labels}
    return {"apiVersion": api, "kind": kind, "metadata": metadata}


def _selector(component: str, **labels: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "fngate", "app.kubernetes.io/component": component, **labels}


def _mebibytes(count: int) -> str:
    return f"{-(-count // 1024**2)}Mi"


def _trigger_authentication(options: Options) -> Obj:
    auth = _object("keda.sh/v1alpha1", "TriggerAuthentication", "fngate-redis", "runner", options)
    ref = {"parameter": "password", "name": options.redis_secret, "key": "password"}
    return auth | {"spec": {"secretTargetRef": [ref]}}


def _service_account(component: str, role_arn: str, options: Options) -> Obj:
    account = _object("v1", "ServiceAccount", f"fngate-{component}", component, options)
    if role_arn:  # IRSA: the pods' AWS credentials are this role's
        account["metadata"]["annotations"] = {"eks.amazonaws.com/role-arn": role_arn}
    return account | {"automountServiceAccountToken": False}


def _wake_role(served: Sequence[Pool], options: Options) -> list[Obj]:
    """Push activation's rights, and no more: patch the scale of these runner Deployments, by name
    (a Role with no resourceNames would cover every Deployment of the namespace: none is made)."""
    role = _object("rbac.authorization.k8s.io/v1", "Role", "fngate-gateway-wake", "gateway", options)
    names = [runner_deployment(pool.name) for pool in served]
    rule = {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": names,
        "verbs": ["patch"],
    }
    role["rules"] = [rule]
    binding = _object(
        "rbac.authorization.k8s.io/v1", "RoleBinding", "fngate-gateway-wake", "gateway", options
    )
    binding["roleRef"] = {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "fngate-gateway-wake",
    }
    account = {"kind": "ServiceAccount", "name": "fngate-gateway", "namespace": options.namespace}
    binding["subjects"] = [account]
    return [role, binding]


def _container(
    name: str, image: str, args: list[str], env: dict[str, str], options: Options, ports: Sequence[Port] = ()
) -> Obj:
    env |= {port.setting: str(port.number) for port in ports}
    if options.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = options.otlp_endpoint
    env |= {"FNGATE_REPO": options.repo, "FNGATE_LOG_LEVEL": options.log_level}
    env["OTEL_SERVICE_NAME"] = f"fngate-{name}"
    secret = {"secretKeyRef": {"name": options.redis_secret, "key": "url"}}
    url = {"name": "FNGATE_REDIS_URL", "valueFrom": secret}
    container = {
        "name": name,
        "image": image,
        "args": args,
        "env": [url, *({"name": key, "value": value} for key, value in env.items())],
        "securityContext": CONTAINER_SECURITY | {"capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}],
    }
    if ports:
        container["ports"] = [
            {"name": port.name, "containerPort": port.number, "protocol": "TCP"} for port in ports
        ]
    return container


def _pod(account: str, container: Obj, cache_bytes: int, pod: Obj, tmp_bytes: int = TMP_BYTES) -> Obj:
    """A pod spec: unprivileged, no API token, `tmp` and `cache` volumes of bounded size."""
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": _mebibytes(tmp_bytes)}},
        {"name": "cache", "emptyDir": {"sizeLimit": _mebibytes(cache_bytes)}},
        *pod.pop("volumes", []),
    ]
    return {
        "serviceAccountName": f"fngate-{account}",
        "automountServiceAccountToken": False,
        # Service links would add FNGATE_* variables for Services named fngate-*, and an unknown
        # FNGATE_ variable stops startup.
        "enableServiceLinks": False,
        # The pause container is the pod's PID 1, not the image's entry point: a SIGTERM that comes
        # as the container starts (a pod deleted as it is made, like the first runner before KEDA
        # sets its pool to zero) reaches a process that dies of it or handles it, never an init
        # that the kernel shields from it (it lingered out its 60 s grace).
        "shareProcessNamespace": True,
        "securityContext": POD_SECURITY | {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
        **pod,
    }


def _deployment(
    name: str,
    labels: dict[str, str],
    container: Obj,
    pod: Obj,
    cache_bytes: int,
    options: Options,
    tmp_bytes: int = TMP_BYTES,
) -> Obj:
    spec = _pod(container["name"], container, cache_bytes, pod, tmp_bytes)
    deployment = _object("apps/v1", "Deployment", name, container["name"], options, **labels)
    evictable = ",".join(volume["name"] for volume in spec["volumes"])
    template_metadata = {
        "labels": deployment["metadata"]["labels"],
        "annotations": {SAFE_TO_EVICT_VOLUMES: evictable},
    }
    template = {"metadata": template_metadata, "spec": spec}
    # No replicas: the HPA (KEDA's, for runners) owns the count, and `kubectl apply` or a Helm upgrade
    # would reset a count written here.
    selector = {"selector": {"matchLabels": _selector(container["name"], **labels)}}
    return deployment | {"spec": selector | {"template": template}}


def _gateway(options: Options, wake: bool) -> list[Obj]:
    env = {"FNGATE_HOST": "0.0.0.0", "FNGATE_WORKERS": str(options.gateway_workers)}
    if wake:
        env["FNGATE_KUBERNETES_WAKE"] = "true"
    container = _container("gateway", options.image, ["gateway"], env, options, GATEWAY_PORTS)
    admin = {"secretKeyRef": {"name": options.api_keys_secret, "key": "admin", "optional": True}}
    container["env"].append({"name": "FNGATE_ADMIN_KEY_HASH", "valueFrom": admin})
    resources = _cpu(GATEWAY_RESOURCES, options.gateway_cpu)
    resources["requests"]["ephemeral-storage"] = _mebibytes(GATEWAY_TMP_BYTES + TMP_BYTES)
    container |= {
        "resources": resources,
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10},
        # The load balancer stops sending before Hypercorn stops accepting.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "10"]}}},
    }
    selector = _selector("gateway")
    spread = {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "labelSelector": {"matchLabels": selector},
    }
    pod: Obj = {"terminationGracePeriodSeconds": 30, "topologySpreadConstraints": [spread]}
    if wake:  # the token its Role (_wake_role) gives rights to; no other pod has one
        pod["automountServiceAccountToken"] = True
    spread["whenUnsatisfiable"] = "ScheduleAnyway"
    service = _object("v1", "Service", "fngate-gateway", "gateway", options)
    service["metadata"]["annotations"] = dict(pair.split("=", 1) for pair in options.service_annotations)
    ports = [
        {
            "name": port.name,
            "port": options.service_port if port.name == "http" else port.number,
            "targetPort": port.name,
            "protocol": "TCP",
        }
        for port in GATEWAY_PORTS
        if port.public
    ]
    service["spec"] = {"type": options.service_type, "selector": selector, "ports": ports}
    if options.source_ranges:
        service["spec"]["loadBalancerSourceRanges"] = list(options.source_ranges)
    pdb = _object("policy/v1", "PodDisruptionBudget", "fngate-gateway", "gateway", options)
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    hpa = _object("autoscaling/v2", "HorizontalPodAutoscaler", "fngate-gateway", "gateway", options)
    cpu = {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
    hpa["spec"] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "fngate-gateway"},
        "minReplicas": options.gateway_min_replicas,
        "maxReplicas": options.gateway_max_replicas,
        "metrics": [{"type": "Resource", "resource": cpu}],
    }
    deployment = _deployment("fngate-gateway", {}, container, pod, TMP_BYTES, options, GATEWAY_TMP_BYTES)
    return [deployment, service, pdb, hpa]


def _network_policies(options: Options) -> list[Obj]:
    """Each component accepts traffic on its ports only: public ports from anywhere (the load
    balancer's source ranges say from where), the others from Prometheus alone. Runners have no
    public port: they only call out."""
    key, _, value = options.prometheus_label.partition("=")
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {key: value}}}
    policies = []
    for component, ports in (("gateway", GATEWAY_PORTS), ("runner", RUNNER_PORTS)):
        policy = _object("networking.k8s.io/v1", "NetworkPolicy", f"fngate-{component}", component, options)
        ingress: list[Obj] = []
        for public in (True, False):
            listed = [{"port": port.name, "protocol": "TCP"} for port in ports if port.public is public]
            if listed:
                ingress.append({"ports": listed} if public else {"from": [prometheus], "ports": listed})
        policy["spec"] = {
            "podSelector": {"matchLabels": _selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        }
        policies.append(policy)
    return policies


def _runner(pool: Pool, options: Options) -> Obj:
    env = {"FNGATE_POOL": pool.name, "FNGATE_FUNCTIONS": json.dumps([m.name for m in pool.functions])}
    # Model files from S3 are cached on the pod's writable cache volume (the root filesystem is read-only).
    env["FNGATE_ARTIFACT_DIR"] = f"{CACHE_DIR}/artifacts"
    env["FNGATE_ARTIFACT_MAX_BYTES"] = str(options.artifact_cache_bytes)
    # A runner that exits when idle is restarted by its Deployment, again and again (CrashLoopBackOff):
    # here KEDA scales the pool to zero, so idle shutdown stays off whatever the image says.
    env["FNGATE_IDLE_SHUTDOWN_S"] = "0"
    if pool.gpu:
        env["FNGATE_ENGINE_CACHE_DIR"] = TENSORRT_CACHE_DIR
    image = options.gpu_image if pool.gpu else options.runner_image
    container = _container("runner", image, ["runner"], env, options, RUNNER_PORTS)
    container["readinessProbe"] = {
        "httpGet": {"path": "/healthz/ready", "port": "metrics"},
        "periodSeconds": 5,
    }
    # Live while the process serves its status port; a model load that takes minutes is not a hang.
    container["livenessProbe"] = {
        "httpGet": {"path": "/healthz/live", "port": "metrics"},
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    # Files beyond artifact_cache_bytes that loaded models still need may stay a while: a quarter more.
    cache_bytes = options.artifact_cache_bytes * 5 // 4
    scratch_bytes = cache_bytes + TMP_BYTES + (TENSORRT_CACHE_BYTES if pool.gpu else 0)
    resources = (
        copy.deepcopy(GPU_RUNNER_RESOURCES) if pool.gpu else _cpu(CPU_RUNNER_RESOURCES, options.runner_cpu)
    )
    resources["requests"]["ephemeral-storage"] = _mebibytes(scratch_bytes)
    container["resources"] = resources
    # Runners drain on SIGTERM (FNGATE_DRAIN_TIMEOUT_S, 30 s by default) before they exit.
    pod: Obj = {"terminationGracePeriodSeconds": 60}
    if pool.gpu:
        container["volumeMounts"].append({"name": "tensorrt-cache", "mountPath": TENSORRT_CACHE_DIR})
        pod["nodeSelector"] = {GPU_NODE_LABEL[0]: GPU_NODE_LABEL[1]}
        pod["tolerations"] = [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
        size = _mebibytes(TENSORRT_CACHE_BYTES)
        pod["volumes"] = [{"name": "tensorrt-cache", "emptyDir": {"sizeLimit": size}}]
    labels = {POOL_LABEL: pool.name}
    return _deployment(runner_deployment(pool.name), labels, container, pod, cache_bytes, options)


def _runner_budget(pool: Pool, options: Options) -> Obj:
    """Node drains (upgrades, scale-down) take a pool's runners one at a time."""
    name = runner_deployment(pool.name)
    pdb = _object("policy/v1", "PodDisruptionBudget", name, "runner", options, **{POOL_LABEL: pool.name})
    pdb["spec"] = {
        "maxUnavailable": 1,
        "selector": {"matchLabels": _selector("runner", **{POOL_LABEL: pool.name})},
    }
    return pdb


def _scaled_object(pool: Pool, options: Options) -> Obj:
    triggers: list[Obj] = []
    for manifest in pool.functions:
        lag_target, length_target = targets(manifest, options)
        names = keys.level_names(manifest.batching.priorities)
        for level, stream in enumerate(keys.levels(manifest.name, manifest.batching.priorities)):
            common = _redis_target(options) | {"stream": stream}
            common["enableTLS"] = "true" if options.redis_tls else "false"
            # The stream's length (XLEN, KEDA's streamLength mode: no consumerGroup) is what waits
            # or runs: an entry leaves its stream when it is answered or cancelled. It cannot be
            # nil and cannot fail, so it wakes the pool from zero and keeps it up while batches run.
            # The lag (entries not yet delivered to the group) adds runners sooner under a backlog,
            # but Redis answers nil for it once an entry ahead of the group was deleted (a cancel),
            # and KEDA reads nil as -1: inactive; the length alone must be enough to wake the pool.
            # activationLagCount is the activation threshold of every mode in KEDA 2.20.
            length = common | {"streamLength": str(length_target), "activationLagCount": "0"}
            lag = common | {"consumerGroup": keys.RUNNER_GROUP, "lagCount": str(lag_target)}
            lag["activationLagCount"] = "0"
            suffix = f"-{names[level]}" if level else ""  # every priority level counts
            for kind, metadata in (("length", length), ("lag", lag)):
                trigger = {
                    "type": "redis-cluster-streams" if options.redis_cluster else "redis-streams",
                    "name": f"{kind}-{manifest.name}{suffix}",
                    "metadata": metadata,
                }
                triggers.append(trigger | {"authenticationRef": {"name": "fngate-redis"}})
    name = runner_deployment(pool.name)
    scaled = _object("keda.sh/v1alpha1", "ScaledObject", name, "runner", options, **{POOL_LABEL: pool.name})
    # No fallback: a trigger fails only when KEDA cannot read Redis, and then no runner could serve
    # either; a fallback would hold a runner (and a GPU node) for nothing.
    scaled["spec"] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
        "pollingInterval": options.polling_interval_s,
        "cooldownPeriod": options.cooldown_s,
        "minReplicaCount": max(pool.min_replicas, options.warm_runners),
        "maxReplicaCount": max(pool.max_replicas, options.warm_runners),
        "triggers": triggers,
    }
    return scaled


def _redis_target(options: Options) -> Obj:
    """Where KEDA reads the streams: one Redis's database 0, or a cluster's nodes."""
    if options.redis_cluster:
        return {"addresses": options.redis_address}
    return {"address": options.redis_address, "databaseIndex": "0"}


def _registry_sync(options: Options) -> Obj:
    """`fngate ls --sync` as the deployer: the registry rewritten from the S3 repository, and every
    function's stream and group made. Suspended unless scheduled; run it on demand with
    `kubectl create job --from=cronjob/fngate-registry-sync`."""
    container = _container("registry-sync", options.runner_image, ["ls", "--sync"], {}, options)
    container["resources"] = SYNC_RESOURCES
    pod = _pod("deployer", container, TMP_BYTES, {"restartPolicy": "Never"})
    job = {
        "backoffLimit": 2,
        "activeDeadlineSeconds": 600,
        "ttlSecondsAfterFinished": 86400,
        "template": {"metadata": {"labels": _selector("deployer")}, "spec": pod},
    }
    cron = _object("batch/v1", "CronJob", SYNC_JOB, "deployer", options)
    cron["spec"] = {
        "schedule": options.sync_schedule or "*/5 * * * *",
        "suspend": not options.sync_schedule,
        "concurrencyPolicy": "Forbid",
        "successfulJobsHistoryLimit": 1,
        "failedJobsHistoryLimit": 3,
        "jobTemplate": {"spec": job},
    }
    return cron


def load_functions(folder: Path) -> list[FunctionManifest]:
    """Every `*/function.yaml` below folder; raises ManifestError for the first invalid one."""
    return [load_manifest(path) for path in sorted(folder.glob("*/function.yaml"))]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # shared dicts (selectors, resources) are written out, not as YAML anchors


FLAG_HELP = {
    "namespace": "the namespace of every object (default: fngate)",
    "image": "the gateway's image (default: fngate/gateway:latest)",
    "runner_image": "the CPU runners' image (default: fngate/runner:latest)",
    "gpu_image": "the image of runner pools whose functions need a GPU (default: fngate/runner-gpu:latest)",
    "repo": "the model repository the pods serve: s3://bucket/prefix (default: s3://fngate-models/prod)",
    "redis_address": "host:port of Redis, for KEDA's triggers (default: redis:6379); the pods' URL is in "
    "--redis-secret",
    "redis_tls": "(--no-redis-tls) KEDA reaches Redis without TLS (default: with TLS)",
    "redis_cluster": "Redis is a cluster: KEDA reads it with redis-cluster-streams triggers, and "
    "--redis-address names its configuration endpoint or nodes (host:port, comma-separated)",
    "redis_secret": "a Secret with keys `url` (the pods' FNGATE_REDIS_URL) and `password` (default: "
    "fngate-redis)",
    "deployed": "a function that has been deployed (its stream and runner group exist): only these get "
    "runner pools and KEDA triggers; repeat for each (see --all-deployed)",
    "polling_interval_s": "seconds between KEDA's looks at the queues (default: 5)",
    "cooldown_s": "seconds a pool stays up after its queues empty before KEDA scales it to zero "
    "(default: 300)",
    "target_lag": "waiting invocations per runner before KEDA adds one (default 0: each function's "
    "max_batch_size)",
    "warm_runners": "runners each pool keeps when idle, over the manifests' min_replicas (default 0; 1 "
    f"{WARM_COST})",
    "artifact_cache_bytes": "bytes of model files a runner keeps; sizes its cache volume (default: 10 GiB)",
    "sync_schedule": "cron schedule of the registry-sync job (`fngate ls --sync`; default: suspended, run "
    "on demand)",
    "gateway_min_replicas": "the gateway HPA's minimum (default: 2)",
    "gateway_max_replicas": "the gateway HPA's maximum (default: 10)",
    "gateway_workers": "gateway processes per pod (default: 1)",
    "service_type": "the gateway Service's type (default: LoadBalancer)",
    "service_port": "the gateway Service's port (default: 80)",
    "service_annotations": "KEY=VALUE annotation of the gateway Service (a load balancer's settings); "
    "repeat for each",
    "source_ranges": "a CIDR allowed to reach the gateway Service (loadBalancerSourceRanges); repeat "
    "for each",
    "gateway_role_arn": "IAM role of the gateway pods' service account (IRSA; default: none)",
    "runner_role_arn": "IAM role of the runner pods' service account (IRSA; default: none)",
    "deployer_role_arn": "IAM role of the deployer service account, the registry-sync job's (IRSA; "
    "default: none)",
    "otlp_endpoint": "the collector's OTLP/HTTP base URL (port 4318) for traces (default: none, no traces)",
    "log_level": "DEBUG, INFO, WARNING or ERROR (default: INFO)",
    "api_keys_secret": "a Secret whose key `admin` holds an admin key's '<id>:<sha256>' (`fngate keys "
    "hash`; default: fngate-api-keys, optional)",
    "runner_cpu": "CPU each CPU runner pod requests (500m, 1, 1.5; default: 1; its limit the larger of it "
    "and 2): a node holds two in a rolling update, so a 2-core node needs 500m",
    "gateway_cpu": "CPU each gateway pod requests (default: 250m; its limit the larger of it and 1)",
    "push_activation": "(--no-push-activation) gateways do not wake a runner pool at zero themselves; "
    "KEDA's poll alone does (default: they set its Deployment from 0 to 1 replica at its first "
    "invocation, with a Role that allows that alone)",
    "prometheus_label": "KEY=VALUE of the Prometheus pods that may reach the runners' and gateways' metrics "
    "(default: app.kubernetes.io/name=prometheus)",
}
"""Each Options field's flag help (tests/deploy/test_k8s_render.py checks every flag has one)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fngate k8s render", description=__doc__)
    parser.add_argument(
        "--functions",
        type=Path,
        default=Path("functions"),
        help="the folder of */function.yaml the pools come from (default: ./functions)",
    )
    parser.add_argument(
        "--format",
        choices=["yaml", "json", "terraform"],
        default="yaml",
        help="yaml (for kubectl apply -f -), json (a List) or terraform (an external data source's)",
    )
    parser.add_argument(
        "--all-deployed",
        action="store_true",
        help="every function of --functions has been deployed: each gets its runner pool",
    )
    for field in dataclasses.fields(Options):
        flag, default = "--" + field.name.replace("_", "-").removesuffix("-s"), field.default
        text = FLAG_HELP.get(field.name)
        if isinstance(default, bool):  # --no-redis-tls turns one off, --redis-cluster one on
            name, action = (flag, "store_true") if not default else (f"--no-{flag[2:]}", "store_false")
            parser.add_argument(name, dest=field.name, action=action, help=text)
        elif isinstance(default, tuple):
            parser.add_argument(
                flag.removesuffix("s"), dest=field.name, action="append", default=[], help=text
            )
        else:
            parser.add_argument(flag, dest=field.name, type=type(default), default=default, help=text)
    args = vars(parser.parse_args(argv))
    folder, output, everything = args.pop("functions"), args.pop("format"), args.pop("all_deployed")
    if not folder.is_dir():
        print(f"fngate k8s render: --functions folder {folder} does not exist", file=sys.stderr)
        return 2
    try:
        manifests = load_functions(folder)
        if everything:
            args["deployed"] = [manifest.name for manifest in manifests]
        values: dict[str, Any] = {key: tuple(v) if isinstance(v, list) else v for key, v in args.items()}
        options = Options(**values)
        objects = render(manifests, options)
    except ManifestError as exc:
        print("\n".join(exc.lines()), file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"fngate k8s render: {exc}", file=sys.stderr)
        return 1
    note = pools_note(folder, manifests, options.deployed)
    if note:
        print(f"fngate k8s render: {note}", file=sys.stderr)
    if output == "yaml":
        sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False))
    elif output == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": objects}, sys.stdout, indent=2)
    else:  # Terraform's external data source reads one JSON object of strings
        json.dump({"objects": json.dumps(objects)}, sys.stdout)
    return 0


def pools_note(folder: Path, manifests: Sequence[FunctionManifest], deployed: Sequence[str]) -> str:
    """Why functions of the folder got no runner pool ('' when each got one)."""
    if not manifests:
        return f"no runner pools: {folder} holds no */function.yaml"
    left_out = sorted(manifest.name for manifest in manifests if manifest.name not in deployed)
    if not left_out:
        return ""
    what = "no runner pools" if len(left_out) == len(manifests) else "no runner pool"
    return (
        f"{what} for {', '.join(left_out)}: not named with --deployed. A pool's KEDA triggers read "
        "its functions' streams, which `fngate deploy` (or `fngate ls --sync`) creates, and KEDA "
        "scales no pool whose stream is missing; deploy them, then render with --deployed NAME for "
        "each (or --all-deployed)"
    )


if __name__ == "__main__":
    sys.exit(main())
