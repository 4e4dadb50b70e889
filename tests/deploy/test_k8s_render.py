"""fngate.k8s: the objects it renders from manifests, checked against their schemas (Kubernetes'
built-ins with kubernetes-validate, KEDA's with the subset in keda.schema.json) and for what
fngate counts on: pools, GPU placement, lag-mode triggers, settings the processes accept."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_files import ROOT

from fngate import k8s, keys
from fngate.config import ENV_PREFIX, GatewaySettings, RunnerSettings
from fngate.manifest import FunctionManifest, parse_manifest

KUBERNETES_VERSION = "1.33"  # terraform/variables.tf: kubernetes_version
KEDA_SCHEMA = json.loads((Path(__file__).parent / "keda.schema.json").read_text(encoding="utf-8"))


def manifest(
    name: str, *, pool: str = "default", accelerator: str = "cpu", batch: int = 8
) -> FunctionManifest:
    return parse_manifest(
        {
            "name": name,
            "model": {"backend": "onnxruntime", "path": "model.onnx", "accelerator": accelerator},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            "batching": {"max_batch_size": batch},
            "scaling": {"pool": pool, "min_replicas": 0, "max_replicas": 3},
        },
        name,
    )


def of_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def by_name(objects: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name)


def containers(objects: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c for obj in of_kind(objects, "Deployment") for c in obj["spec"]["template"]["spec"]["containers"]
    ]


@pytest.fixture
def mixed() -> list[dict[str, Any]]:
    """Two CPU functions in the default pool, a CUDA one and a TensorRT one in the gpu pool."""
    functions = [
        manifest("classify"),
        manifest("embed", batch=0),
        manifest("detect", pool="gpu", accelerator="cuda", batch=16),
        manifest("segment", pool="gpu", accelerator="tensorrt"),
    ]
    options = k8s.Options(redis_address="redis.example:6379", polling_interval_s=7, cooldown_s=120)
    return k8s.render(functions, options)


def test_example_functions_render_valid_objects() -> None:
    objects = k8s.render(k8s.load_functions(ROOT / "functions"), k8s.Options())
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds.count("ScaledObject") == kinds.count("Deployment") - 1 >= 1
    for kind in ("Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "TriggerAuthentication"):
        assert kind in kinds
    validate(objects)


def test_mixed_pools_render_valid_objects(mixed: list[dict[str, Any]]) -> None:
    validate(mixed)


def validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            schema = {"$ref": f"#/$defs/{obj['kind']}", "$defs": KEDA_SCHEMA["$defs"]}
            jsonschema.Draft202012Validator(schema).validate(obj)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_keda_schema_refuses_what_keda_would_not_read(mixed: list[dict[str, Any]]) -> None:
    scaled = by_name(mixed, "ScaledObject", "fngate-runner-default")
    schema = {"$ref": "#/$defs/ScaledObject", "$defs": KEDA_SCHEMA["$defs"]}
    for broken in ({"lagCount": 5}, {"lagcount": "5"}, {"enableTLS": "yes"}):
        copy = json.loads(json.dumps(scaled))
        copy["spec"]["triggers"][0]["metadata"] |= broken
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(schema).validate(copy)


def test_one_runner_deployment_and_scaled_object_per_pool(mixed: list[dict[str, Any]]) -> None:
    runners = [obj["metadata"]["name"] for obj in of_kind(mixed, "Deployment")]
    assert runners == ["fngate-gateway", "fngate-runner-default", "fngate-runner-gpu"]
    for pool, functions in (("default", ["classify", "embed"]), ("gpu", ["detect", "segment"])):
        deployment = by_name(mixed, "Deployment", f"fngate-runner-{pool}")
        env = {
            e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["FNGATE_POOL"] == pool
        assert json.loads(env["FNGATE_FUNCTIONS"]) == functions
        scaled = by_name(mixed, "ScaledObject", f"fngate-runner-{pool}")
        assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert scaled["spec"]["minReplicaCount"] == 0
        assert scaled["spec"]["maxReplicaCount"] == 3
        assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it; an apply must not reset it


def test_scaled_object_triggers_on_lag_from_zero_and_on_pending_entries(mixed: list[dict[str, Any]]) -> None:
    scaled = by_name(mixed, "ScaledObject", "fngate-runner-gpu")
    assert scaled["spec"]["pollingInterval"] == 7
    assert scaled["spec"]["cooldownPeriod"] == 120
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    for function, target in (("detect", "16"), ("segment", "8")):
        stream = [t["metadata"] for t in triggers if t["metadata"]["stream"] == keys.invocations(function)]
        lag = next(m for m in stream if "lagCount" in m)
        pending = next(m for m in stream if "pendingEntriesCount" in m)
        assert lag["lagCount"] == pending["pendingEntriesCount"] == target
        assert lag["activationLagCount"] == "0"
        assert "pendingEntriesCount" not in lag  # KEDA would read a lagCount trigger as lag mode anyway
        for metadata in (lag, pending):
            assert metadata["consumerGroup"] == keys.RUNNER_GROUP
            assert metadata["address"] == "redis.example:6379"
            assert metadata["enableTLS"] == "true"
    authentication = by_name(mixed, "TriggerAuthentication", "fngate-redis")
    assert {t["authenticationRef"]["name"] for t in triggers} == {authentication["metadata"]["name"]}
    assert authentication["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": "fngate-redis", "key": "password"}
    ]


def test_target_lag_option_overrides_batch_size() -> None:
    objects = k8s.render([manifest("classify")], k8s.Options(target_lag=3, redis_tls=False))
    metadata = [t["metadata"] for t in of_kind(objects, "ScaledObject")[0]["spec"]["triggers"]]
    assert {m.get("lagCount", m.get("pendingEntriesCount")) for m in metadata} == {"3"}
    assert {m["enableTLS"] for m in metadata} == {"false"}


def test_gpu_pool_runs_the_gpu_image_on_gpu_nodes(mixed: list[dict[str, Any]]) -> None:
    options = k8s.Options()
    gpu = by_name(mixed, "Deployment", "fngate-runner-gpu")["spec"]["template"]["spec"]
    assert gpu["containers"][0]["image"] == options.gpu_image
    assert gpu["nodeSelector"] == {k8s.GPU_NODE_LABEL[0]: k8s.GPU_NODE_LABEL[1]}
    assert {"key": k8s.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["mountPath"] for m in gpu["containers"][0]["volumeMounts"]}
    assert k8s.TENSORRT_CACHE_DIR in mounts
    cpu = by_name(mixed, "Deployment", "fngate-runner-default")["spec"]["template"]["spec"]
    assert cpu["containers"][0]["image"] == options.runner_image
    assert "nodeSelector" not in cpu and "tolerations" not in cpu
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]


def test_runner_readiness_means_models_loaded(mixed: list[dict[str, Any]]) -> None:
    for name in ("fngate-runner-default", "fngate-runner-gpu"):
        container = by_name(mixed, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        probe = container["readinessProbe"]["httpGet"]
        assert probe["path"] == "/healthz/ready"
        port = next(p for p in container["ports"] if p["name"] == probe["port"])
        assert port["containerPort"] == k8s.RUNNER_PORT


def test_gateway_objects(mixed: list[dict[str, Any]]) -> None:
    gateway = by_name(mixed, "Deployment", "fngate-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FNGATE_HOST"] == "0.0.0.0"
    assert env["FNGATE_PORT"] == str(k8s.GATEWAY_PORT)
    selector = gateway["spec"]["selector"]["matchLabels"]
    service = by_name(mixed, "Service", "fngate-gateway")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["selector"] == selector
    assert (
        by_name(mixed, "PodDisruptionBudget", "fngate-gateway")["spec"]["selector"]["matchLabels"] == selector
    )
    hpa = by_name(mixed, "HorizontalPodAutoscaler", "fngate-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "fngate-gateway"
    assert hpa["spec"]["minReplicas"] >= 2  # with maxUnavailable 1, a drain keeps one gateway up


def test_every_fngate_variable_is_a_setting(mixed: list[dict[str, Any]]) -> None:
    # An unknown FNGATE_* variable stops start-up, so the objects may set only known ones...
    known = {
        ENV_PREFIX + name.upper() for cls in (GatewaySettings, RunnerSettings) for name in cls.model_fields
    }
    for container in containers(mixed):
        for env in container["env"]:
            assert not env["name"].startswith(ENV_PREFIX) or env["name"] in known, env["name"]
        assert "FNGATE_REDIS_URL" in {env["name"] for env in container["env"]}
    # ...and Kubernetes must not add its own: service links name variables after Services (fngate-*).
    for deployment in of_kind(mixed, "Deployment"):
        assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_pods_run_unprivileged(mixed: list[dict[str, Any]]) -> None:
    for deployment in of_kind(mixed, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == k8s.UID
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert "limits" in container["resources"]


def test_service_accounts_carry_the_iam_roles() -> None:
    options = k8s.Options(gateway_role_arn="arn:aws:iam::1:role/g", runner_role_arn="arn:aws:iam::1:role/r")
    objects = k8s.render([manifest("classify")], options)
    for name, arn in (
        ("fngate-gateway", "arn:aws:iam::1:role/g"),
        ("fngate-runner", "arn:aws:iam::1:role/r"),
    ):
        account = by_name(objects, "ServiceAccount", name)
        assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": arn}
    names = {d["spec"]["template"]["spec"]["serviceAccountName"] for d in of_kind(objects, "Deployment")}
    assert names == {"fngate-gateway", "fngate-runner"}


def test_duplicate_function_names_are_refused() -> None:
    with pytest.raises(ValueError, match="classify"):
        k8s.render([manifest("classify"), manifest("classify", pool="other")], k8s.Options())


def test_render_returns_no_shared_objects(mixed: list[dict[str, Any]]) -> None:
    def limits(objects: list[dict[str, Any]]) -> dict[str, str]:
        runner = by_name(objects, "Deployment", "fngate-runner-default")
        return runner["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]  # type: ignore[no-any-return]

    limits(mixed)["cpu"] = "99"
    assert limits(k8s.render([manifest("classify")], k8s.Options()))["cpu"] != "99"


def test_main_writes_yaml_json_and_terraform_forms(capsys: pytest.CaptureFixture[str]) -> None:
    functions = str(ROOT / "functions")
    flags = ["--functions", functions, "--namespace", "ml", "--redis-address", "r.example:6380"]
    flags += ["--service-annotation", "a.example/b=c=d", "--source-range", "10.0.0.0/8", "--cooldown", "60"]
    assert k8s.main(flags) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    expected = k8s.render(
        k8s.load_functions(ROOT / "functions"),
        k8s.Options(
            namespace="ml",
            redis_address="r.example:6380",
            service_annotations=("a.example/b=c=d",),
            source_ranges=("10.0.0.0/8",),
            cooldown_s=60,
        ),
    )
    assert documents == expected
    assert by_name(documents, "Service", "fngate-gateway")["metadata"]["annotations"] == {
        "a.example/b": "c=d"
    }
    assert k8s.main([*flags, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"apiVersion": "v1", "kind": "List", "items": expected}
    assert k8s.main([*flags, "--format", "terraform"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["objects"] and json.loads(result["objects"]) == expected


def test_main_names_the_invalid_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "function.yaml").write_text("name: Not_A_Label\nmodel: {}\n", encoding="utf-8")
    assert k8s.main(["--functions", str(tmp_path)]) == 1
    assert "function.yaml" in capsys.readouterr().err


def test_main_refuses_a_malformed_annotation(capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s.main(["--functions", str(ROOT / "functions"), "--service-annotation", "novalue"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
