"""Kubernetes objects for a cluster deployment, rendered from function manifests: the gateway's
Deployment, Service, PodDisruptionBudget and HPA, and per runner pool a Deployment that KEDA scales
from zero on the lag of its functions' streams. The one source of these objects, for Terraform too."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fngate import keys
from fngate.manifest import FunctionManifest, ManifestError, load_manifest

Obj = dict[str, Any]

# Contracts with terraform/modules/eks (the GPU node group's label and taint) and the Dockerfile.
GPU_NODE_LABEL = ("nvidia.com/gpu.present", "true")
GPU_TAINT_KEY = "nvidia.com/gpu"
GATEWAY_PORT = 8000
RUNNER_PORT = 9100
"""The runner's metrics and health port: GET /healthz/ready answers once models are loaded and consuming."""
UID = 10001
CACHE_DIR = "/var/cache/fngate"
TENSORRT_CACHE_DIR = "/var/cache/fngate/tensorrt"
POOL_LABEL = "fngate/pool"

GATEWAY_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
CPU_RUNNER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
GPU_RUNNER_RESOURCES = {
    "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
    "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
}
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
    redis_tls: bool = True
    redis_secret: str = "fngate-redis"
    """A Secret with keys `url` (FNGATE_REDIS_URL) and `password`, made beside these objects."""
    polling_interval_s: int = 5
    cooldown_s: int = 300
    target_lag: int = 0
    """Waiting invocations per runner before KEDA adds one; 0: each function's max_batch_size."""
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
    otlp_endpoint: str = ""
    log_level: str = "INFO"
    api_keys_secret: str = "fngate-api-keys"
    """A Secret whose key `admin` holds an admin API key's '<id>:<sha256>' (`fngate keys hash`); the
    gateways accept that key whatever Redis holds. Optional: without it, keys come from Redis only."""
    prometheus_label: str = "app.kubernetes.io/name=prometheus"
    """KEY=VALUE of the Prometheus pods (any namespace): the only ones that may reach a runner."""

    def __post_init__(self) -> None:
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


def needs_gpu(manifest: FunctionManifest) -> bool:
    return manifest.model.backend == "tensorrt" or manifest.model.accelerator in ("cuda", "tensorrt")


def pools(manifests: Sequence[FunctionManifest]) -> list[Pool]:
    """Functions grouped by `scaling.pool`, in name order; raises ValueError on a duplicate name."""
    names = [manifest.name for manifest in manifests]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"functions defined more than once: {', '.join(duplicates)}")
    grouped: dict[str, list[FunctionManifest]] = {}
    for manifest in sorted(manifests, key=lambda m: m.name):
        grouped.setdefault(manifest.scaling.pool, []).append(manifest)
    return [Pool(name, tuple(members)) for name, members in sorted(grouped.items())]


def render(manifests: Sequence[FunctionManifest], options: Options) -> list[Obj]:
    """Every object, in apply order; the namespace and the Redis Secret are made beforehand."""
    objects = [
        _service_account("gateway", options.gateway_role_arn, options),
        _service_account("runner", options.runner_role_arn, options),
        _trigger_authentication(options),
        *_gateway(options),
        *_network_policies(options),
    ]
    for pool in pools(manifests):
        objects += [_runner(pool, options), _scaled_object(pool, options)]
    return copy.deepcopy(objects)  # no dict shared between objects, or with this module


def _object(api: str, kind: str, name: str, component: str, options: Options, **labels: str) -> Obj:
    labels = {**_selector(component), "app.kubernetes.io/part-of": "fngate", **labels}
    metadata = {"name": name, "namespace": options.namespace, "labels": labels}
    return {"apiVersion": api, "kind": kind, "metadata": metadata}


def _selector(component: str, **labels: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "fngate", "app.kubernetes.io/component": component, **labels}


def _trigger_authentication(options: Options) -> Obj:
    auth = _object("keda.sh/v1alpha1", "TriggerAuthentication", "fngate-redis", "runner", options)
    ref = {"parameter": "password", "name": options.redis_secret, "key": "password"}
    return auth | {"spec": {"secretTargetRef": [ref]}}


def _service_account(component: str, role_arn: str, options: Options) -> Obj:
    account = _object("v1", "ServiceAccount", f"fngate-{component}", component, options)
    if role_arn:  # IRSA: the pods' AWS credentials are this role's
        account["metadata"]["annotations"] = {"eks.amazonaws.com/role-arn": role_arn}
    return account | {"automountServiceAccountToken": False}


def _container(name: str, image: str, env: dict[str, str], port: tuple[str, int], options: Options) -> Obj:
    if options.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = options.otlp_endpoint
    env |= {"FNGATE_REPO": options.repo, "FNGATE_LOG_LEVEL": options.log_level}
    env["OTEL_SERVICE_NAME"] = f"fngate-{name}"
    secret = {"secretKeyRef": {"name": options.redis_secret, "key": "url"}}
    url = {"name": "FNGATE_REDIS_URL", "valueFrom": secret}
    return {
        "name": name,
        "image": image,
        "args": [name],
        "env": [url, *({"name": key, "value": value} for key, value in env.items())],
        "ports": [{"name": port[0], "containerPort": port[1], "protocol": "TCP"}],
        "securityContext": CONTAINER_SECURITY | {"capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}],
    }


def _deployment(name: str, labels: dict[str, str], container: Obj, pod: Obj, options: Options) -> Obj:
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}, *pod.pop("volumes", [])]
    pod = {
        "serviceAccountName": f"fngate-{container['name']}",
        "automountServiceAccountToken": False,
        # Service links would add FNGATE_* variables for Services named fngate-*, and an unknown
        # FNGATE_ variable stops startup.
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY | {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
        **pod,
    }
    deployment = _object("apps/v1", "Deployment", name, container["name"], options, **labels)
    template = {"metadata": {"labels": deployment["metadata"]["labels"]}, "spec": pod}
    # No replicas: the HPA (KEDA's, for runners) owns the count, and `kubectl apply` or a Helm upgrade
    # would reset a count written here. A new runner Deployment starts one pod until KEDA's first poll.
    spec = {"selector": {"matchLabels": _selector(container["name"], **labels)}}
    return deployment | {"spec": spec | {"template": template}}


def _gateway(options: Options) -> list[Obj]:
    env = {
        "FNGATE_HOST": "0.0.0.0",
        "FNGATE_PORT": str(GATEWAY_PORT),
        "FNGATE_WORKERS": str(options.gateway_workers),
    }
    container = _container("gateway", options.image, env, ("http", GATEWAY_PORT), options)
    admin = {"secretKeyRef": {"name": options.api_keys_secret, "key": "admin", "optional": True}}
    container["env"].append({"name": "FNGATE_ADMIN_KEY_HASH", "valueFrom": admin})
    container |= {
        "resources": GATEWAY_RESOURCES,
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
    pod = {"terminationGracePeriodSeconds": 30, "topologySpreadConstraints": [spread]}
    spread["whenUnsatisfiable"] = "ScheduleAnyway"
    service = _object("v1", "Service", "fngate-gateway", "gateway", options)
    service["metadata"]["annotations"] = dict(pair.split("=", 1) for pair in options.service_annotations)
    port = {"name": "http", "port": options.service_port, "targetPort": "http", "protocol": "TCP"}
    service["spec"] = {"type": options.service_type, "selector": selector, "ports": [port]}
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
    deployment = _deployment("fngate-gateway", {}, container, pod, options)
    return [deployment, service, pdb, hpa]


def _network_policies(options: Options) -> list[Obj]:
    """Gateways accept traffic on their HTTP port only (the load balancer's source ranges say from
    where); runners accept none but Prometheus on their status port: they only call out."""
    gateway = _object("networking.k8s.io/v1", "NetworkPolicy", "fngate-gateway", "gateway", options)
    gateway["spec"] = {
        "podSelector": {"matchLabels": _selector("gateway")},
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"port": "http", "protocol": "TCP"}]}],
    }
    key, _, value = options.prometheus_label.partition("=")
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {key: value}}}
    runner = _object("networking.k8s.io/v1", "NetworkPolicy", "fngate-runner", "runner", options)
    runner["spec"] = {
        "podSelector": {"matchLabels": _selector("runner")},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [prometheus], "ports": [{"port": "metrics", "protocol": "TCP"}]}],
    }
    return [gateway, runner]


def _runner(pool: Pool, options: Options) -> Obj:
    env = {"FNGATE_POOL": pool.name, "FNGATE_FUNCTIONS": json.dumps([m.name for m in pool.functions])}
    # Model files from S3 are cached on the pod's writable cache volume (the root filesystem is read-only).
    env["FNGATE_ARTIFACT_DIR"] = f"{CACHE_DIR}/artifacts"
    if pool.gpu:
        env["FNGATE_ENGINE_CACHE_DIR"] = TENSORRT_CACHE_DIR
    image = options.gpu_image if pool.gpu else options.runner_image
    container = _container("runner", image, env, ("metrics", RUNNER_PORT), options)
    ready = {"path": "/healthz/ready", "port": "metrics"}
    container["readinessProbe"] = {"httpGet": ready, "periodSeconds": 5}
    container["resources"] = GPU_RUNNER_RESOURCES if pool.gpu else CPU_RUNNER_RESOURCES
    # Runners drain on SIGTERM (FNGATE_DRAIN_TIMEOUT_S, 30 s by default) before they exit.
    pod: Obj = {"terminationGracePeriodSeconds": 60}
    if pool.gpu:
        container["volumeMounts"].append({"name": "tensorrt-cache", "mountPath": TENSORRT_CACHE_DIR})
        pod["nodeSelector"] = {GPU_NODE_LABEL[0]: GPU_NODE_LABEL[1]}
        pod["tolerations"] = [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
        pod["volumes"] = [{"name": "tensorrt-cache", "emptyDir": {"sizeLimit": "20Gi"}}]
    labels = {POOL_LABEL: pool.name}
    return _deployment(f"fngate-runner-{pool.name}", labels, container, pod, options)


def _scaled_object(pool: Pool, options: Options) -> Obj:
    triggers: list[Obj] = []
    for manifest in pool.functions:
        target = str(options.target_lag or max(1, manifest.batching.max_batch_size))
        common = {"address": options.redis_address, "stream": keys.invocations(manifest.name)}
        common |= {"consumerGroup": keys.RUNNER_GROUP, "databaseIndex": "0"}
        common["enableTLS"] = "true" if options.redis_tls else "false"
        # Lag (entries not yet delivered to the group) wakes the pool at the first one; pending
        # entries (delivered, not yet acknowledged) keep it up while batches run.
        lag = common | {"lagCount": target, "activationLagCount": "0"}
        pending = common | {"pendingEntriesCount": target}
        for name, metadata in ((f"lag-{manifest.name}", lag), (f"pending-{manifest.name}", pending)):
            trigger = {"type": "redis-streams", "name": name, "metadata": metadata}
            triggers.append(trigger | {"authenticationRef": {"name": "fngate-redis"}})
    name = f"fngate-runner-{pool.name}"
    scaled = _object("keda.sh/v1alpha1", "ScaledObject", name, "runner", options, **{POOL_LABEL: pool.name})
    scaled["spec"] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
        "pollingInterval": options.polling_interval_s,
        "cooldownPeriod": options.cooldown_s,
        "minReplicaCount": pool.min_replicas,
        "maxReplicaCount": pool.max_replicas,
        # Until the consumer group exists KEDA cannot read the lag; one runner then creates it.
        "fallback": {"failureThreshold": 3, "replicas": 1},
        "triggers": triggers,
    }
    return scaled


def load_functions(folder: Path) -> list[FunctionManifest]:
    """Every `*/function.yaml` below folder; raises ManifestError for the first invalid one."""
    return [load_manifest(path) for path in sorted(folder.glob("*/function.yaml"))]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # shared dicts (selectors, resources) are written out, not as YAML anchors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fngate k8s render", description=__doc__)
    parser.add_argument("--functions", type=Path, default=Path("functions"), help="folder of */function.yaml")
    parser.add_argument("--format", choices=["yaml", "json", "terraform"], default="yaml")
    for field in dataclasses.fields(Options):
        flag, default = "--" + field.name.replace("_", "-").removesuffix("-s"), field.default
        if isinstance(default, bool):
            parser.add_argument(f"--no-{flag[2:]}", dest=field.name, action="store_false")
        elif isinstance(default, tuple):
            parser.add_argument(flag.removesuffix("s"), dest=field.name, action="append", default=[])
        else:
            parser.add_argument(flag, dest=field.name, type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    folder, output = args.pop("functions"), args.pop("format")
    try:
        values: dict[str, Any] = {key: tuple(v) if isinstance(v, list) else v for key, v in args.items()}
        options = Options(**values)
        objects = render(load_functions(folder), options)
    except ManifestError as exc:
        print("\n".join(exc.lines()), file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"fngate k8s render: {exc}", file=sys.stderr)
        return 1
    if output == "yaml":
        sys.stdout.write(yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False))
    elif output == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": objects}, sys.stdout, indent=2)
    else:  # Terraform's external data source reads one JSON object of strings
        json.dump({"objects": json.dumps(objects)}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
