"""terraform/: what matters about it, read with python-hcl2 (GPU nodes scale to zero, the bucket is
private and TLS-only, Redis speaks TLS and evicts cache entries only, KEDA and Kubernetes are a tested
pair, in-cluster releases wait for the nodes, the renderer gets what it needs), then `terraform fmt`
and `terraform validate` where Terraform exists."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deploy_files import ROOT, TERRAFORM, Module, find_tool, load_hcl

from fngate import k8s
from fngate.manifest import parse_manifest
from runner.backends import engine_cache

TERRAFORM_TIMEOUT_S = 300


def test_gpu_node_group_scales_to_zero_and_is_tainted(modules: dict[str, Module]) -> None:
    eks = modules["eks"]
    gpu = eks.resource("aws_eks_node_group", "gpu")
    assert gpu["scaling_config"][0]["min_size"] == 0
    assert gpu["scaling_config"][0]["desired_size"] == 0
    assert "NVIDIA" in gpu["ami_type"]
    taint = {key: eks.resolve(value) for key, value in gpu["taint"][0].items()}
    assert taint == {"key": k8s.GPU_TAINT_KEY, "value": "true", "effect": "NO_SCHEDULE"}
    labels = {eks.resolve(key): eks.resolve(value) for key, value in gpu["labels"].items()}
    assert labels[k8s.GPU_NODE_LABEL[0]] == k8s.GPU_NODE_LABEL[1]
    # The cluster autoscaler owns the size; Terraform must not reset it on every apply.
    assert gpu["lifecycle"][0]["ignore_changes"] == ["${scaling_config[0].desired_size}"]
    cpu = eks.resource("aws_eks_node_group", "cpu")
    assert "taint" not in cpu


def test_cluster_autoscaler_can_scale_the_gpu_group_from_zero(modules: dict[str, Module]) -> None:
    tags = modules["eks"].resource("aws_autoscaling_group_tag", "gpu_template")["for_each"]
    assert any("node-template/taint/" in key for key in tags)
    assert any("node-template/label/" in key for key in tags)
    release = modules["cluster-addons"].resource("helm_release", "cluster_autoscaler")
    assert release["chart"] == "cluster-autoscaler"
    device_plugin = modules["cluster-addons"].resource("helm_release", "nvidia_device_plugin")
    assert device_plugin["chart"] == "nvidia-device-plugin"


def test_a_gpu_runner_fits_the_node_template_the_autoscaler_scales_from_zero(
    modules: dict[str, Module],
) -> None:
    """cluster-autoscaler places a pending pod on a node group at zero only if the group's node
    template (its ASG tags, beside the instance type's CPUs and memory) holds every resource the pod
    requests and carries the labels and taints it selects and tolerates."""
    eks, root = modules["eks"], modules["root"]
    defaults = {
        name: block.get("default")
        for module in (eks, root)  # the root's defaults, where it passes its own variable on
        for name, block in module.named("variable").items()
    }
    template = {
        interpolate(eks, key, defaults).removeprefix(NODE_TEMPLATE): interpolate(eks, value, defaults)
        for key, value in eks.resource("aws_autoscaling_group_tag", "gpu_template")["for_each"].items()
    }
    # The GPU runner as Terraform renders it with its defaults (runner_artifact_cache_gib).
    options = k8s.Options(
        artifact_cache_bytes=defaults["runner_artifact_cache_gib"] * 1024**3, deployed=("detect",)
    )
    detect = {
        "name": "detect",
        "model": {"backend": "onnxruntime", "path": "model.onnx", "accelerator": "cuda"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        "scaling": {"pool": "gpu"},
    }
    objects = k8s.render([parse_manifest(detect, "detect")], options)
    pod = next(obj for obj in objects if obj["metadata"]["name"] == "fngate-runner-gpu")["spec"]["template"][
        "spec"
    ]
    requests = pod["containers"][0]["resources"]["requests"]
    for resource in ("ephemeral-storage", "nvidia.com/gpu"):
        offered = template.get(f"resources/{resource}")
        assert offered is not None, f"no node-template tag for {resource}"
        assert quantity(requests[resource]) <= quantity(offered), (resource, requests[resource], offered)
    # CPUs and memory come from the instance type: g5.xlarge has 4 vCPUs and 16 GiB, of which kubelet
    # keeps some back.
    assert defaults["gpu_instance_types"] == ["g5.xlarge"]
    assert quantity(requests["cpu"]) <= 4 - 0.5 and quantity(requests["memory"]) <= 16 * 1024**3 * 0.8
    for key, value in pod["nodeSelector"].items():
        assert template[f"label/{key}"] == value
    taints = {
        key.removeprefix("taint/"): value for key, value in template.items() if key.startswith("taint/")
    }
    for key, value in taints.items():
        effect = {"NoSchedule": "NoSchedule"}[value.split(":")[1]]
        assert any(
            t["key"] == key and t["operator"] == "Exists" and t["effect"] == effect
            for t in pod["tolerations"]
        ), key
    # The template describes the nodes the group starts: the same labels and taint.
    gpu = eks.resource("aws_eks_node_group", "gpu")
    labels = {
        interpolate(eks, key, defaults): interpolate(eks, value, defaults)
        for key, value in gpu["labels"].items()
    }
    for key, value in template.items():
        if key.startswith("label/"):
            assert labels[key.removeprefix("label/")] == value
    taint = {key: eks.resolve(value) for key, value in gpu["taint"][0].items()}
    assert taints == {taint["key"]: f"{taint['value']}:NoSchedule"}
    # Terraform refuses a plan whose GPU runners would not fit (another cache size, a smaller disk).
    release = modules["fngate"].resource("helm_release", "fngate")
    condition = release["lifecycle"][0]["precondition"][0]["condition"]
    assert "local.gpu_runner_storage_mib" in condition and "var.gpu_node_ephemeral_storage_mib" in condition
    passed = root.named("module")["fngate"]["gpu_node_ephemeral_storage_mib"]
    assert passed == "${module.eks.gpu_node_ephemeral_storage_mib}"


NODE_TEMPLATE = "k8s.io/cluster-autoscaler/node-template/"


def interpolate(module: Module, text: str, variables: dict[str, Any]) -> str:
    """A tag's key or value with each `${...}` evaluated (evaluate)."""
    return re.sub(r"\$\{([^{}]*)\}", lambda match: str(evaluate(module, match.group(1), variables)), text)


def evaluate(module: Module, expression: str, variables: dict[str, Any]) -> Any:
    """The expressions the node template uses: `local.a.b` (or `(local.a.b)`), `var.x` (or
    `tostring(var.x)`) from `variables`, and the GPU node's ephemeral-storage formula."""
    local = re.fullmatch(r"\(?local\.([\w.]+)\)?", expression)
    if local:
        found = module.resolve("${local." + local.group(1) + "}")
        inner = re.fullmatch(r"\$\{(.*)\}", found) if isinstance(found, str) else None
        return evaluate(module, inner.group(1), variables) if inner else found
    variable = re.fullmatch(r"(?:tostring\()?var\.(\w+)\)?", expression)
    if variable:
        return variables[variable.group(1)]
    formula = re.fullmatch(r"floor\(var\.(\w+) \* 1024 \* ([\d.]+)\) - (\d+)", expression)
    assert formula, f"no reading of {expression!r}"
    gib, share, reserved = variables[formula.group(1)], float(formula.group(2)), int(formula.group(3))
    return math.floor(gib * 1024 * share) - reserved


def quantity(text: str) -> float:
    """A Kubernetes quantity (2, 500m, 8Gi, 34304Mi) in its base unit."""
    units = {"m": 1e-3, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    number, unit = re.fullmatch(r"([\d.]+)([A-Za-z]*)", text).groups()  # type: ignore[union-attr]
    return float(number) * units.get(unit, 1)


def test_network_policies_are_enforced(modules: dict[str, Module]) -> None:
    # The VPC CNI's network policy agent is off unless its add-on is configured so; without it the
    # rendered NetworkPolicies are stored and never enforced.
    addon = modules["eks"].resource("aws_eks_addon", "vpc_cni")
    assert addon["addon_name"] == "vpc-cni"
    assert re.search(r'enableNetworkPolicy\s*=\s*"true"', addon["configuration_values"])
    assert addon["resolve_conflicts_on_create"] == "OVERWRITE"  # EKS installed it unmanaged before
    assert modules["root"].named("module")["fngate"]["depends_on"] == ["${module.eks}"]


def test_bucket_is_private_versioned_encrypted_and_tls_only(modules: dict[str, Module]) -> None:
    bucket = modules["bucket"]
    block = bucket.resource("aws_s3_bucket_public_access_block", "this")
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block[setting] is True, setting
    ownership = bucket.resource("aws_s3_bucket_ownership_controls", "this")
    assert ownership["rule"][0]["object_ownership"] == "BucketOwnerEnforced"  # no ACLs at all
    versioning = bucket.resource("aws_s3_bucket_versioning", "this")
    assert versioning["versioning_configuration"][0]["status"] == "Enabled"
    encryption = bucket.resource("aws_s3_bucket_server_side_encryption_configuration", "this")
    assert encryption["rule"][0]["apply_server_side_encryption_by_default"][0]["sse_algorithm"] == "aws:kms"
    policy = bucket.resource("aws_iam_policy_document", "tls_only", section="data")
    denies = [s for s in policy["statement"] if s["effect"] == "Deny"]
    conditions = {(c["variable"], tuple(c["values"])) for s in denies for c in s["condition"]}
    assert ("aws:SecureTransport", ("false",)) in conditions
    assert bucket.resource("aws_s3_bucket_policy", "this")["policy"].endswith("tls_only.json}")


def test_only_deployers_write_functions_and_runners_write_only_engine_caches(
    modules: dict[str, Module],
) -> None:
    bucket = modules["bucket"]
    read = bucket.resource("aws_iam_policy_document", "read", section="data")
    actions = {action for statement in read["statement"] for action in statement["actions"]}
    assert not any(action.startswith(("s3:Put", "s3:Delete")) for action in actions)
    write = bucket.resource("aws_iam_policy_document", "write", section="data")
    assert "s3:PutObject" in {a for s in write["statement"] for a in s["actions"]}
    # Runners upload TensorRT engine caches to <prefix>/.engines/ (runner/backends/engine_cache.py)
    # and may write nothing else; the key must let them encrypt what they write.
    runner = bucket.resource("aws_iam_policy_document", "runner", section="data")
    assert runner["source_policy_documents"] == ["${data.aws_iam_policy_document.read.json}"]
    writes = [s for s in runner["statement"] if any(a.startswith("s3:Put") for a in s["actions"])]
    assert [s["resources"] for s in writes] == [["${aws_s3_bucket.this.arn}/${var.prefix}/.engines/*"]]
    assert not any(a.startswith("s3:Delete") for s in runner["statement"] for a in s["actions"])
    assert any("kms:GenerateDataKey" in s["actions"] for s in runner["statement"])
    assert engine_cache.PREFIX == ".engines"
    roles = modules["root"].named("module")
    assert roles["runner_role"]["policy_json"] == "${module.bucket.runner_policy_json}"
    assert roles["deployer_role"]["policy_json"] == "${module.bucket.write_policy_json}"
    # Gateways write functions only through the deploy API: the deployer's policy, on the repository.
    assert roles["gateway_role"]["policy_json"] == "${module.bucket.write_policy_json}"
    assert roles["fngate"]["gateway_role_arn"] == "${module.gateway_role.arn}"
    for role in ("runner_role", "deployer_role", "gateway_role"):
        assert roles[role]["service_account"] == f"fngate-{role.removesuffix('_role')}"


def test_redis_has_tls_auth_and_evicts_only_keys_with_a_ttl(modules: dict[str, Module]) -> None:
    redis = modules["redis"]
    group = redis.resource("aws_elasticache_replication_group", "this")
    assert group["transit_encryption_enabled"] is True
    assert group["at_rest_encryption_enabled"] is True
    assert group["auth_token"] == "${random_password.auth_token.result}"
    assert group["automatic_failover_enabled"] is True
    parameters = redis.resource("aws_elasticache_parameter_group", "this")
    assert parameters["family"] == "redis7"
    assert {p["name"]: p["value"] for p in parameters["parameter"]} == {
        "maxmemory-policy": "noeviction",
        "cluster-enabled": '${var.cluster_mode ? "yes" : "no"}',
    }
    assert group["parameter_group_name"] == "${aws_elasticache_parameter_group.this.name}"
    # The pods' URL speaks TLS (rediss://, or rediss+cluster:// in cluster mode) and so does KEDA
    # (the renderer's default, not switched off).
    fngate = modules["fngate"]
    assert fngate.locals["redis_url"].startswith("${local.redis_scheme}://")
    assert fngate.locals["redis_scheme"] == '${var.redis_cluster ? "rediss+cluster" : "rediss"}'
    assert "--no-redis-tls" not in fngate.locals["render_flags"]


def test_redis_in_cluster_mode_has_shards_of_primaries_and_replicas(modules: dict[str, Module]) -> None:
    """Cluster mode: `shards` node groups of a primary and `replicas` replicas each; the pods and
    KEDA are given the configuration endpoint, the cluster URL and redis-cluster-streams triggers."""
    group = modules["redis"].resource("aws_elasticache_replication_group", "this")
    assert group["num_node_groups"] == "${var.cluster_mode ? var.shards : null}"
    assert group["replicas_per_node_group"] == "${var.cluster_mode ? var.replicas : null}"
    assert group["num_cache_clusters"] == "${var.cluster_mode ? null : var.replicas + 1}"
    assert "configuration_endpoint_address" in modules["redis"].named("output")["address"]["value"]
    root = modules["root"]
    assert root.named("module")["redis"]["cluster_mode"] == "${var.redis_cluster_mode}"
    assert root.named("module")["redis"]["shards"] == "${var.redis_shards}"
    assert root.named("module")["fngate"]["redis_cluster"] == "${var.redis_cluster_mode}"
    assert root.named("variable")["redis_cluster_mode"]["default"] is False
    assert 'var.redis_cluster ? ["--redis-cluster"] : []' in modules["fngate"].locals["render_args"]


def test_keda_and_kubernetes_are_pinned_to_a_pair_keda_tests(modules: dict[str, Module]) -> None:
    release = modules["keda"].resource("helm_release", "keda")
    assert release["chart"] == "keda"
    assert release["repository"] == "https://kedacore.github.io/charts"
    variables = modules["root"].named("variable")
    keda_version, kubernetes = (
        variables["keda_chart_version"]["default"],
        variables["kubernetes_version"]["default"],
    )
    tested = modules["keda"].locals["tested_kubernetes"]
    assert kubernetes in tested[".".join(keda_version.split(".")[:2])]
    # keda.sh/docs/2.20/operate/cluster: 2.17 was tested on 1.30-1.32, 2.20 on 1.33-1.35.
    assert tested["2.17"] == ["1.30", "1.31", "1.32"] and tested["2.20"] == ["1.33", "1.34", "1.35"]
    precondition = release["lifecycle"][0]["precondition"][0]["condition"]
    assert "local.tested_kubernetes" in precondition and "var.kubernetes_version" in precondition
    assert modules["root"].named("module")["keda"]["kubernetes_version"] == "${var.kubernetes_version}"
    # EKS standard support lasts 14 months: 1.35 until March 2027 (1.33 ended July 2026).
    assert kubernetes == "1.35"
    variable = variables["keda_chart_version"]
    pattern = re.search(r'regex\("(.+?)",', variable["validation"][0]["condition"])
    assert pattern is not None
    accepts = re.compile(pattern.group(1).replace("\\\\", "\\"))
    assert accepts.match(variable["default"])
    for version in ("2.17.0", "2.18.1", "2.20.3"):
        assert accepts.match(version), version
    for version in ("2.16.1", "2.9.0", "1.5.0", "2.17"):
        assert not accepts.match(version), version


def test_workloads_come_from_the_renderer_with_the_scaling_variables(modules: dict[str, Module]) -> None:
    fngate = modules["fngate"]
    program = fngate.resource("external", "objects", section="data")["program"]
    assert program.startswith("${concat([var.python]")
    args = fngate.locals["render_flags"]
    assert args[:4] == ["-m", "fngate.k8s", "--format", "terraform"]
    flags = dict(zip(args[4::2], args[5::2], strict=True))
    assert flags["--polling-interval"] == "${tostring(var.polling_interval_s)}"
    assert flags["--cooldown"] == "${tostring(var.cooldown_s)}"
    root = modules["root"].named("module")["fngate"]
    assert root["polling_interval_s"] == "${var.keda_polling_interval_s}"
    assert root["cooldown_s"] == "${var.keda_cooldown_s}"
    # Every flag Terraform passes is one the renderer knows.
    options = {"--functions", "--format"} | {
        "--" + field.replace("_", "-").removesuffix("-s") for field in k8s.Options.__dataclass_fields__
    }
    options |= {"--service-annotation", "--source-range"}
    assert set(flags) <= options
    release = fngate.resource("helm_release", "fngate")
    assert release["chart"] == "${var.objects_chart}"
    assert "local.objects" in release["values"][0]
    assert fngate.locals["objects"] == "${jsondecode(data.external.objects.result.objects)}"


def test_in_cluster_releases_wait_for_the_nodes(modules: dict[str, Module]) -> None:
    # The providers only read the API endpoint; without this, Helm releases race node creation.
    root = modules["root"].named("module")
    for name in ("keda", "cluster_addons", "observability", "fngate"):
        assert root[name]["depends_on"] == ["${module.eks}"], name


def test_traces_go_to_the_collectors_otlp_http_port(modules: dict[str, Module]) -> None:
    # fngate exports OTLP over HTTP (fngate/telemetry.py); 4318 is OTLP/HTTP, 4317 gRPC.
    assert "proto.http" in (ROOT / "fngate" / "telemetry.py").read_text(encoding="utf-8")
    endpoint = modules["observability"].named("output")["otlp_endpoint"]["value"]
    assert endpoint.endswith(":4318")
    assert (
        modules["root"].named("module")["fngate"]["otlp_endpoint"] == "${module.observability.otlp_endpoint}"
    )


def test_alert_rules_go_to_fngates_namespace(modules: dict[str, Module]) -> None:
    release = modules["observability"].resource("helm_release", "fngate_monitoring")
    assert release["namespace"] == "${var.fngate_namespace}"
    observability = modules["root"].named("module")["observability"]
    assert observability["fngate_namespace"] == "${module.fngate.namespace}"  # made before, by fngate


def test_one_kms_key_module_for_both_log_groups(modules: dict[str, Module]) -> None:
    key = modules["kms-key"].resource("aws_kms_key", "this")
    assert key["enable_key_rotation"] is True
    for name, group in (
        ("eks", "/aws/eks/${var.name}/cluster"),
        ("network", "/aws/vpc/${var.name}/flow-logs"),
    ):
        module = modules[name]
        assert not any("aws_kms_key" in entry for entry in module.blocks.get("resource", [])), name
        used = module.named("module")["kms_key"]
        assert used["source"] == "../kms-key"
        assert used["log_group_name"] == group
        # Existing keys move into the module instead of being replaced (EKS secrets are encrypted with one).
        assert module.blocks["moved"][0]["to"] == "${module.kms_key.aws_kms_key.this}", name


def test_gpu_nodes_carry_the_accelerator_label_the_autoscaler_knows(modules: dict[str, Module]) -> None:
    eks = modules["eks"]
    label = eks.locals["accelerator_label"]
    assert label["key"] == "k8s.amazonaws.com/accelerator"
    gpu = eks.resource("aws_eks_node_group", "gpu")
    assert "${(local.accelerator_label.key)}" in gpu["labels"] or "${local.accelerator_label.key}" in {
        eks.resolve(key) for key in gpu["labels"]
    }
    tags = eks.resource("aws_autoscaling_group_tag", "gpu_template")["for_each"]
    assert any("${local.accelerator_label.key}" in key for key in tags)


def test_workload_settings_reach_the_renderer(modules: dict[str, Module]) -> None:
    flags = modules["fngate"].locals["render_flags"]
    for flag in ("--warm-runners", "--artifact-cache-bytes", "--sync-schedule", "--deployer-role-arn"):
        assert flag in flags, flag
    args = modules["fngate"].locals["render_args"]
    assert '[for name in var.deployed_functions : ["--deployed", name]]' in args
    root = modules["root"].named("module")["fngate"]
    assert root["deployed_functions"] == "${var.deployed_functions}"
    assert root["warm_runners"] == "${var.warm_runners_per_pool}"
    variables = modules["root"].named("variable")
    assert variables["deployed_functions"]["default"] == []
    assert variables["warm_runners_per_pool"]["default"] == 0
    assert "USD" in variables["warm_runners_per_pool"]["description"]  # its cost, where it is set
    # The deployer account is rendered with the other objects now, not made by Terraform beside them.
    assert not any(
        "kubernetes_service_account_v1" in entry for entry in modules["fngate"].blocks.get("resource", [])
    )


def test_objects_chart_applies_the_objects_it_is_given() -> None:
    template = (TERRAFORM / "charts" / "objects" / "templates" / "objects.yaml").read_text(encoding="utf-8")
    assert "range .Values.items" in template and "toYaml ." in template


def test_alert_rules_file_is_the_one_terraform_loads(modules: dict[str, Module]) -> None:
    rules_file = modules["root"].named("module")["observability"]["rules_file"]
    assert rules_file == "${path.root}/../deploy/prometheus/rules.yaml"
    assert (ROOT / "deploy" / "prometheus" / "rules.yaml").is_file()


def test_every_variable_and_output_is_documented(modules: dict[str, Module]) -> None:
    for name, module in modules.items():
        for section in ("variable", "output"):
            for block_name, block in module.named(section).items():
                assert block.get("description", "").strip(), f"{name}: {section} {block_name}"
    outputs = modules["root"].named("output")
    assert {"gateway_url", "bucket"} <= set(outputs)


def test_example_tfvars_sets_every_required_variable() -> None:
    variables = load_module_variables()
    example = load_hcl(TERRAFORM / "example.tfvars")
    required = {name for name, block in variables.items() if "default" not in block}
    assert required <= set(example), f"example.tfvars misses {sorted(required - set(example))}"
    assert set(example) <= set(variables), (
        f"unknown in example.tfvars: {sorted(set(example) - set(variables))}"
    )


def load_module_variables() -> dict[str, Any]:
    blocks = load_hcl(TERRAFORM / "variables.tf")["variable"]
    return {name: body for entry in blocks for name, body in entry.items()}


# ---------------------------------------------------------------- the terraform binary
def terraform_binary() -> str:
    found = find_tool("terraform")
    if found is None:
        pytest.skip(
            "terraform is not installed (it is neither on PyPI nor in Debian): fmt and validate not run"
        )
    return found


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=TERRAFORM_TIMEOUT_S, check=False
    )


def test_terraform_fmt() -> None:
    done = run([terraform_binary(), "fmt", "-check", "-recursive", "-diff", "-no-color"], TERRAFORM)
    assert done.returncode == 0, done.stdout + done.stderr


def test_terraform_validate(tmp_path: Path) -> None:
    terraform = terraform_binary()
    # A copy, so that init's .terraform/ and lock file stay out of the working tree.
    copy = tmp_path / "terraform"
    shutil.copytree(TERRAFORM, copy, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    init = run([terraform, "init", "-backend=false", "-input=false", "-no-color"], copy)
    if init.returncode != 0:
        output = init.stderr + init.stdout
        first_error = output[output.find("Error:") :].split("\n\n")[:2]
        reason = " ".join(" ".join(first_error).split())[:400]
        pytest.skip(f"terraform init could not install the providers (no registry or mirror): {reason}")
    done = run([terraform, "validate", "-no-color"], copy)
    assert done.returncode == 0, done.stdout + done.stderr
