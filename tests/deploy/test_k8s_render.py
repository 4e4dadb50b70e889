"""fngate.k8s: the objects it renders from manifests, checked against their schemas (Kubernetes'
built-ins with kubernetes-validate, KEDA's with the subset in keda.schema.json) and for what
fngate counts on: pools, GPU placement, stream-length and lag triggers, settings the processes accept."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_files import ROOT

from fngate import k8s, keys
from fngate.config import ENV_PREFIX, GatewaySettings, RunnerSettings
from fngate.manifest import FunctionManifest, parse_manifest

KUBERNETES_VERSION = "1.33"
"""The newest Kubernetes whose schemas kubernetes-validate ships here (terraform/variables.tf pins
1.35: no object here uses an API that changed since)."""
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
    options = k8s.Options(
        redis_address="redis.example:6379",
        polling_interval_s=7,
        cooldown_s=120,
        deployed=("classify", "embed", "detect", "segment"),
    )
    return k8s.render(functions, options)


def test_example_functions_render_valid_objects() -> None:
    options = k8s.Options(deployed=("classifier", "normalize"))
    objects = k8s.render(k8s.load_functions(ROOT / "functions"), options)
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds.count("ScaledObject") == kinds.count("Deployment") - 1 >= 1
    for kind in (
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "TriggerAuthentication",
        "CronJob",
    ):
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


def test_scaled_object_triggers_on_stream_length_from_zero_and_on_lag(mixed: list[dict[str, Any]]) -> None:
    scaled = by_name(mixed, "ScaledObject", "fngate-runner-gpu")
    assert scaled["spec"]["pollingInterval"] == 7
    assert scaled["spec"]["cooldownPeriod"] == 120
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    for function, batch in (("detect", 16), ("segment", 8)):
        for stream in keys.levels(function):
            found = [t["metadata"] for t in triggers if t["metadata"]["stream"] == stream]
            length = next(m for m in found if "streamLength" in m)
            lag = next(m for m in found if "lagCount" in m)
            # Stream-length mode (KEDA's: no consumerGroup) counts what waits and what runs; a busy
            # runner holds its read-ahead, and counts as one runner, not RUNNER_READ_AHEAD_BATCHES.
            assert "consumerGroup" not in length
            assert length["streamLength"] == str(batch * k8s.RUNNER_READ_AHEAD_BATCHES)
            # One batch undelivered per runner adds one.
            assert lag["consumerGroup"] == keys.RUNNER_GROUP
            assert lag["lagCount"] == str(batch)
            for metadata in (length, lag):
                assert metadata["activationLagCount"] == "0"  # the first entry wakes the pool
                assert metadata["address"] == "redis.example:6379"
                assert metadata["enableTLS"] == "true"
    authentication = by_name(mixed, "TriggerAuthentication", "fngate-redis")
    assert {t["authenticationRef"]["name"] for t in triggers} == {authentication["metadata"]["name"]}
    assert authentication["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": "fngate-redis", "key": "password"}
    ]


def test_a_redis_cluster_is_read_by_redis_cluster_streams_triggers() -> None:
    options = k8s.Options(redis_cluster=True, redis_address="cfg.example:6379", deployed=("classify",))
    objects = k8s.render([manifest("classify")], options)
    validate(objects)
    triggers = of_kind(objects, "ScaledObject")[0]["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-cluster-streams"}
    for metadata in (t["metadata"] for t in triggers):
        assert metadata["addresses"] == "cfg.example:6379"
        assert "address" not in metadata and "databaseIndex" not in metadata  # a cluster has database 0
        assert metadata["stream"].startswith("fngate:q:{classify}")


def test_target_lag_option_overrides_batch_size() -> None:
    options = k8s.Options(target_lag=3, redis_tls=False, deployed=("classify",))
    objects = k8s.render([manifest("classify")], options)
    metadata = [t["metadata"] for t in of_kind(objects, "ScaledObject")[0]["spec"]["triggers"]]
    assert {m["lagCount"] for m in metadata if "lagCount" in m} == {"3"}
    assert {m["streamLength"] for m in metadata if "streamLength" in m} == {"6"}
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


def test_runner_probes_readiness_and_liveness(mixed: list[dict[str, Any]]) -> None:
    for name in ("fngate-runner-default", "fngate-runner-gpu"):
        container = by_name(mixed, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        for probe_name, path in (("readinessProbe", "/healthz/ready"), ("livenessProbe", "/healthz/live")):
            probe = container[probe_name]["httpGet"]
            assert probe["path"] == path
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
    for container in [*containers(mixed), *cron_containers(mixed)]:
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
        # Only the gateway has an API token, for push activation (test_push_activation_may_patch_...).
        gateway = deployment["metadata"]["name"] == "fngate-gateway"
        assert pod["automountServiceAccountToken"] is gateway
        assert pod["shareProcessNamespace"] is True  # the entry point is not PID 1
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert "limits" in container["resources"]


def test_push_activation_may_patch_the_runner_pools_scale_and_nothing_else(
    mixed: list[dict[str, Any]],
) -> None:
    (role,) = of_kind(mixed, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["fngate-runner-default", "fngate-runner-gpu"],
            "verbs": ["patch"],
        }
    ]
    (binding,) = of_kind(mixed, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "fngate-gateway", "namespace": "fngate"}
    ]
    (gateway,) = [c for c in containers(mixed) if c["name"] == "gateway"]
    assert {"name": "FNGATE_KUBERNETES_WAKE", "value": "true"} in gateway["env"]
    assert not of_kind(mixed, "ClusterRole") and not of_kind(mixed, "ClusterRoleBinding")


def test_without_push_activation_or_pools_no_pod_gets_a_token_or_a_role() -> None:
    # A Role with no resourceNames would cover every Deployment: with no pool, none is made.
    for options in (k8s.Options(push_activation=False, deployed=("classify",)), k8s.Options()):
        objects = k8s.render([manifest("classify")], options)
        assert not of_kind(objects, "Role") and not of_kind(objects, "RoleBinding")
        gateway = by_name(objects, "Deployment", "fngate-gateway")
        assert gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        names = {env["name"] for env in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert "FNGATE_KUBERNETES_WAKE" not in names


def test_service_accounts_carry_the_iam_roles() -> None:
    options = k8s.Options(
        runner_role_arn="arn:aws:iam::1:role/r",
        deployer_role_arn="arn:aws:iam::1:role/d",
        deployed=("classify",),
    )
    objects = k8s.render([manifest("classify")], options)
    # Gateways read no S3 (the registry is in Redis): no role.
    assert "annotations" not in by_name(objects, "ServiceAccount", "fngate-gateway")["metadata"]
    for name, arn in (
        ("fngate-runner", "arn:aws:iam::1:role/r"),
        ("fngate-deployer", "arn:aws:iam::1:role/d"),
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
    rendered = k8s.render([manifest("classify")], k8s.Options(deployed=("classify",)))
    assert limits(rendered)["cpu"] != "99"


def test_main_writes_yaml_json_and_terraform_forms(capsys: pytest.CaptureFixture[str]) -> None:
    functions = str(ROOT / "functions")
    flags = ["--functions", functions, "--namespace", "ml", "--redis-address", "r.example:6380"]
    flags += ["--deployed", "classifier", "--warm-runners", "1"]
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
            deployed=("classifier",),
            warm_runners=1,
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


def cron_containers(objects: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        container
        for cron in of_kind(objects, "CronJob")
        for container in cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    ]


def test_only_deployed_functions_get_pools_and_triggers() -> None:
    functions = [manifest("classify"), manifest("embed"), manifest("detect", pool="gpu", accelerator="cuda")]
    objects = k8s.render(functions, k8s.Options(deployed=("classify",)))
    assert [obj["metadata"]["name"] for obj in of_kind(objects, "ScaledObject")] == ["fngate-runner-default"]
    streams = {t["metadata"]["stream"] for t in of_kind(objects, "ScaledObject")[0]["spec"]["triggers"]}
    assert streams == set(keys.levels("classify"))
    assert "fngate-runner-gpu" not in {obj["metadata"]["name"] for obj in objects}
    # Nothing deployed yet: the gateway, the accounts and the sync job only (a first apply).
    first = k8s.render(functions, k8s.Options())
    assert not of_kind(first, "ScaledObject")
    assert [d["metadata"]["name"] for d in of_kind(first, "Deployment")] == ["fngate-gateway"]
    with pytest.raises(ValueError, match="nameless"):
        k8s.render(functions, k8s.Options(deployed=("nameless",)))


def test_pools_reach_zero_without_fallback_and_warm_runners_keep_one(mixed: list[dict[str, Any]]) -> None:
    for scaled in of_kind(mixed, "ScaledObject"):
        assert scaled["spec"]["minReplicaCount"] == 0
        # A fallback would hold a runner (a GPU node) while KEDA cannot read Redis, for nothing.
        assert "fallback" not in scaled["spec"]
    warm = k8s.render([manifest("classify")], k8s.Options(deployed=("classify",), warm_runners=1))
    assert of_kind(warm, "ScaledObject")[0]["spec"]["minReplicaCount"] == 1
    assert "USD" in k8s.WARM_COST


def test_nodes_can_scale_down_and_disks_are_bounded(mixed: list[dict[str, Any]]) -> None:
    for deployment in of_kind(mixed, "Deployment"):
        template = deployment["spec"]["template"]
        empty_dirs = [v for v in template["spec"]["volumes"] if "emptyDir" in v]
        evictable = template["metadata"]["annotations"][k8s.SAFE_TO_EVICT_VOLUMES].split(",")
        assert sorted(evictable) == sorted(v["name"] for v in empty_dirs)
        assert all(v["emptyDir"].get("sizeLimit") for v in empty_dirs)
    options = k8s.Options(artifact_cache_bytes=4 * 1024**3, deployed=("classify", "detect"))
    functions = [manifest("classify"), manifest("detect", pool="gpu", accelerator="cuda")]
    for name, extra in (("fngate-runner-default", 0), ("fngate-runner-gpu", k8s.TENSORRT_CACHE_BYTES)):
        runner = by_name(k8s.render(functions, options), "Deployment", name)["spec"]["template"]["spec"]
        container = runner["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FNGATE_ARTIFACT_MAX_BYTES"] == str(4 * 1024**3)
        cache = next(v for v in runner["volumes"] if v["name"] == "cache")
        assert cache["emptyDir"]["sizeLimit"] == "5120Mi"  # the cache and a quarter more
        requested = container["resources"]["requests"]["ephemeral-storage"]
        assert requested == f"{(5 * 1024**3 + k8s.TMP_BYTES + extra) // 1024**2}Mi"


def test_runner_pools_have_a_disruption_budget_and_never_idle_exit(mixed: list[dict[str, Any]]) -> None:
    for pool in ("default", "gpu"):
        name = f"fngate-runner-{pool}"
        deployment = by_name(mixed, "Deployment", name)
        pdb = by_name(mixed, "PodDisruptionBudget", name)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        env = {
            e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        # A runner that exits when idle would be restarted by its Deployment for ever (CrashLoopBackOff).
        assert env["FNGATE_IDLE_SHUTDOWN_S"] == "0"


def test_registry_sync_job_runs_ls_sync_as_the_deployer(mixed: list[dict[str, Any]]) -> None:
    cron = by_name(mixed, "CronJob", k8s.SYNC_JOB)
    assert cron["spec"]["suspend"] is True  # run on demand: kubectl create job --from=cronjob/...
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "fngate-deployer"
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["args"] == ["ls", "--sync"]
    assert container["image"] == k8s.Options().runner_image  # boto3 for the S3 repository
    env = {e["name"] for e in container["env"]}
    assert {"FNGATE_REDIS_URL", "FNGATE_REPO"} <= env
    scheduled = k8s.render([], k8s.Options(sync_schedule="*/10 * * * *"))
    assert by_name(scheduled, "CronJob", k8s.SYNC_JOB)["spec"]["suspend"] is False


def test_a_gateway_has_room_for_the_largest_deploy_upload(mixed: list[dict[str, Any]]) -> None:
    # A deploy spools its archive to /tmp (up to max_deploy_bytes) and unpacks it there: a /tmp
    # smaller than both gets the pod evicted mid-deploy; the request covers every volume's limit.
    pod = by_name(mixed, "Deployment", "fngate-gateway")["spec"]["template"]["spec"]
    limits = {v["name"]: mebibytes(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]}
    assert limits["tmp"] * 1024**2 >= 2 * GatewaySettings().max_deploy_bytes
    requested = pod["containers"][0]["resources"]["requests"]["ephemeral-storage"]
    assert mebibytes(requested) == sum(limits.values())


def mebibytes(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity.removesuffix("Mi"))


def test_every_flag_of_the_renderer_is_described(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        k8s.main(["--help"])
    text = capsys.readouterr().out
    flags = [
        f"--{field.name.replace('_', '-').removesuffix('-s')}"
        for field in k8s.dataclasses.fields(k8s.Options)
    ]
    assert set(k8s.FLAG_HELP) == {field.name for field in k8s.dataclasses.fields(k8s.Options)}
    for flag in ["--functions", "--format", "--all-deployed", *flags]:
        shown = flag.removesuffix("s") if flag in ("--service-annotations", "--source-ranges") else flag
        assert shown in text or f"--no-{shown[2:]}" in text, flag
    assert all(text.strip() for text in k8s.FLAG_HELP.values())


def test_a_missing_functions_folder_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert k8s.main(["--functions", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fngate k8s render: --functions folder {tmp_path / 'missing'} does not exist\n"


def test_pools_left_out_are_said_and_all_deployed_renders_each(capsys: pytest.CaptureFixture[str]) -> None:
    functions = ["--functions", str(ROOT / "functions")]
    assert k8s.main(functions) == 0
    captured = capsys.readouterr()
    assert not [doc for doc in yaml.safe_load_all(captured.out) if doc["kind"] == "ScaledObject"]
    every = ", ".join(sorted(manifest.name for manifest in k8s.load_functions(ROOT / "functions")))
    assert f"no runner pools for {every}: not named with --deployed" in captured.err
    assert k8s.main([*functions, "--all-deployed"]) == 0
    captured = capsys.readouterr()
    scaled = [doc for doc in yaml.safe_load_all(captured.out) if doc["kind"] == "ScaledObject"]
    names = {manifest.name for manifest in k8s.load_functions(ROOT / "functions")}
    pools = {pool.name for pool in k8s.pools(k8s.load_functions(ROOT / "functions"), sorted(names))}
    assert len(scaled) == len(pools) >= 1
    assert captured.err == ""


def test_cpu_requests_fit_small_nodes_and_bad_quantities_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = k8s.Options(runner_cpu="500m", gateway_cpu="1.5", deployed=("classify", "detect"))
    objects = k8s.render([manifest("classify"), manifest("detect", pool="gpu", accelerator="cuda")], options)
    resources = {c["name"]: c["resources"] for c in containers(objects) if c["name"] == "gateway"}
    assert resources["gateway"]["requests"]["cpu"] == "1.5" and resources["gateway"]["limits"]["cpu"] == "1.5"
    cpu_pool = by_name(objects, "Deployment", "fngate-runner-default")["spec"]["template"]["spec"]
    assert cpu_pool["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    assert cpu_pool["containers"][0]["resources"]["limits"]["cpu"] == "2"
    gpu_pool = by_name(objects, "Deployment", "fngate-runner-gpu")["spec"]["template"]["spec"]
    assert gpu_pool["containers"][0]["resources"] == {
        **k8s.GPU_RUNNER_RESOURCES,
        "requests": {**k8s.GPU_RUNNER_RESOURCES["requests"], "ephemeral-storage": ANY},
    }
    defaults = k8s.render([manifest("classify")], k8s.Options(deployed=("classify",)))
    runner = by_name(defaults, "Deployment", "fngate-runner-default")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert runner["resources"]["requests"]["cpu"] == "1"
    for bad in ("0", "half", "1.5m", "-1"):
        assert k8s.main(["--functions", str(ROOT / "functions"), "--runner-cpu", bad]) == 1
        assert f"runner-cpu {bad!r}: expected a CPU quantity" in capsys.readouterr().err
