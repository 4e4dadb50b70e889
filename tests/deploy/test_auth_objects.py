"""Private by default on Kubernetes and AWS: the gateways' admin key from a Secret, NetworkPolicies
(runners take traffic from Prometheus only), and Terraform with no open CIDR default and an internal
load balancer unless told otherwise."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
from deploy_files import ROOT, Module

from fngate import k8s
from fngate.config import GatewaySettings

KUBERNETES_VERSION = "1.33"


def rendered(**options: Any) -> list[dict[str, Any]]:
    return k8s.render(k8s.load_functions(ROOT / "functions"), k8s.Options(**options))


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def test_gateways_take_the_admin_key_hash_from_a_secret() -> None:
    objects = rendered(api_keys_secret="keys")
    gateway = named(objects, "Deployment", "fngate-gateway")
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FNGATE_ADMIN_KEY_HASH"]["valueFrom"] == {
        "secretKeyRef": {"name": "keys", "key": "admin", "optional": True}
    }
    assert "admin_key_hash" in GatewaySettings.model_fields
    assert "FNGATE_AUTH" not in env  # auth is on: the setting's default


def test_network_policies_let_runners_take_traffic_only_from_prometheus() -> None:
    objects = rendered(prometheus_label="app=prom", deployed=("classifier", "normalize"))
    for obj in objects:
        if obj["kind"] == "NetworkPolicy":
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    runner = named(objects, "NetworkPolicy", "fngate-runner")["spec"]
    assert runner["policyTypes"] == ["Ingress"]
    (rule,) = runner["ingress"]
    assert rule["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "prom"}}}]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    runners = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != "fngate-gateway"]
    assert runners
    for deployment in runners:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert runner["podSelector"]["matchLabels"].items() <= labels.items()
    gateway = named(objects, "NetworkPolicy", "fngate-gateway")["spec"]
    # Clients reach the gateway's HTTP and gRPC ports, Prometheus its metrics port, nothing else.
    assert gateway["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]},
        {"from": rule["from"], "ports": [{"port": "metrics", "protocol": "TCP"}]},
    ]
    labels = named(objects, "Deployment", "fngate-gateway")["spec"]["template"]["metadata"]["labels"]
    assert gateway["podSelector"]["matchLabels"].items() <= labels.items()


def test_terraform_has_no_open_cidr_default_and_an_internal_load_balancer(modules: dict[str, Module]) -> None:
    variables = modules["root"].named("variable")
    assert "default" not in variables["gateway_allowed_cidrs"]
    assert variables["gateway_internal"]["default"] is True
    annotations = modules["fngate"].locals["service_annotations"]
    assert "aws-load-balancer-internal" in annotations and "var.gateway_internal" in annotations
    assert "aws-load-balancer-ssl-cert" in annotations  # TLS on the load balancer with a certificate
    assert modules["root"].named("module")["fngate"]["gateway_internal"] == "${var.gateway_internal}"


def test_terraform_makes_the_admin_key_secret_the_renderer_names(modules: dict[str, Module]) -> None:
    fngate = modules["fngate"]
    secret = fngate.resource("kubernetes_secret_v1", "api_keys")
    assert "${random_id.admin_key.hex}:${sha256(local.admin_key)}" in secret["data"]["admin"]
    assert "var.extra_admin_key_hashes" in secret["data"]["admin"]
    flags = fngate.locals["render_flags"]
    assert flags[flags.index("--api-keys-secret") + 1] == "${kubernetes_secret_v1.api_keys.metadata[0].name}"
    assert modules["root"].named("output")["admin_api_key"]["sensitive"] is True


def test_prometheus_scrapes_the_gateways_with_a_key_they_accept(modules: dict[str, Module]) -> None:
    observability = modules["observability"]
    secret = observability.resource("kubernetes_secret_v1", "metrics_key")
    assert secret["data"]["key"] == "${local.metrics_key}"
    release = observability.resource("helm_release", "fngate_monitoring")
    assert "authorization" in release["values"][0] and "local.metrics_key_secret" in release["values"][0]
    hashed = observability.named("output")["metrics_key_hash"]["value"]
    assert hashed == "${random_id.metrics_key.hex}:${sha256(local.metrics_key)}"
    root = modules["root"].named("module")["fngate"]
    assert root["extra_admin_key_hashes"] == ["${module.observability.metrics_key_hash}"]
