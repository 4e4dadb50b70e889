# fngate's workloads. The Kubernetes objects (gateway Deployment, Service, PDB and HPA; per runner
# pool of the deployed functions a Deployment, PDB and KEDA ScaledObject; the service accounts and
# the registry-sync job) come from one renderer, fngate/k8s.py, which Terraform runs here and which
# users without Terraform run themselves (`python -m fngate.k8s`): one source for both paths. They
# are applied as one Helm release, so a pool removed from the manifests is removed from the cluster.
# What the release needs first (namespace, Redis Secret) is made here with the Kubernetes provider.

locals {
  redis_secret = "fngate-redis"
  redis_scheme = var.redis_cluster ? "rediss+cluster" : "rediss"
  redis_url    = "${local.redis_scheme}://:${var.redis_auth_token}@${var.redis_address}:${var.redis_port}/0"
  https        = var.gateway_certificate_arn != ""
  service_annotations = merge(
    {
      "service.beta.kubernetes.io/aws-load-balancer-type"                              = "nlb"
      "service.beta.kubernetes.io/aws-load-balancer-cross-zone-load-balancing-enabled" = "true"
      # The in-tree controller reads -internal, the AWS Load Balancer Controller -scheme.
      "service.beta.kubernetes.io/aws-load-balancer-internal" = tostring(var.gateway_internal)
      "service.beta.kubernetes.io/aws-load-balancer-scheme"   = var.gateway_internal ? "internal" : "internet-facing"
    },
    local.https ? {
      "service.beta.kubernetes.io/aws-load-balancer-ssl-cert"  = var.gateway_certificate_arn
      "service.beta.kubernetes.io/aws-load-balancer-ssl-ports" = "443"
    } : {},
  )
  render_flags = [
    "-m", "fngate.k8s", "--format", "terraform",
    "--functions", abspath(var.functions_dir),
    "--namespace", var.namespace,
    "--image", var.gateway_image,
    "--runner-image", var.runner_image,
    "--gpu-image", var.runner_gpu_image,
    "--repo", var.repo,
    "--redis-address", "${var.redis_address}:${var.redis_port}",
    "--redis-secret", local.redis_secret,
    "--warm-runners", tostring(var.warm_runners),
    "--artifact-cache-bytes", tostring(var.artifact_cache_bytes),
    "--sync-schedule", var.registry_sync_schedule,
    "--api-keys-secret", kubernetes_secret_v1.api_keys.metadata[0].name,
    "--polling-interval", tostring(var.polling_interval_s),
    "--cooldown", tostring(var.cooldown_s),
    "--gateway-min-replicas", tostring(var.gateway_min_replicas),
    "--gateway-max-replicas", tostring(var.gateway_max_replicas),
    "--service-port", local.https ? "443" : "80",
    "--gateway-role-arn", var.gateway_role_arn,
    "--runner-role-arn", var.runner_role_arn,
    "--deployer-role-arn", var.deployer_role_arn,
    "--otlp-endpoint", var.otlp_endpoint,
    "--log-level", var.log_level,
  ]
  render_args = concat(
    local.render_flags,
    var.redis_cluster ? ["--redis-cluster"] : [],
    flatten([for key, value in local.service_annotations : ["--service-annotation", "${key}=${value}"]]),
    flatten([for cidr in var.gateway_allowed_cidrs : ["--source-range", cidr]]),
    flatten([for name in var.deployed_functions : ["--deployed", name]]),
  )
}

resource "kubernetes_namespace_v1" "this" {
  metadata {
    name = var.namespace
    labels = {
      "app.kubernetes.io/part-of"          = "fngate"
      "pod-security.kubernetes.io/enforce" = "restricted"
    }
  }
}

# FNGATE_REDIS_URL for the pods (key url) and the AUTH token for KEDA's TriggerAuthentication (key
# password); the renderer refers to both by this Secret's name.
resource "kubernetes_secret_v1" "redis" {
  metadata {
    name      = local.redis_secret
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  data = {
    url      = local.redis_url
    password = var.redis_auth_token
  }
}

# The first admin API key: the gateways get only its '<id>:<sha256>' through this Secret (the renderer
# names it: --api-keys-secret); the key itself is in Terraform's state and the sensitive output
# admin_api_key. More keys, with narrower scopes: `fngate keys create`.
resource "random_id" "admin_key" {
  byte_length = 6
}

resource "random_password" "admin_key" {
  length           = 43
  override_special = "-_"
}

locals {
  admin_key = "fng_${random_id.admin_key.hex}_${random_password.admin_key.result}"
}

resource "kubernetes_secret_v1" "api_keys" {
  metadata {
    name      = "fngate-api-keys"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  data = {
    admin = join(",", concat(["${random_id.admin_key.hex}:${sha256(local.admin_key)}"], var.extra_admin_key_hashes))
  }
}

data "external" "objects" {
  program     = concat([var.python], local.render_args)
  working_dir = path.root
}

locals {
  objects = jsondecode(data.external.objects.result.objects)
  # What each GPU runner (a Deployment that selects GPU nodes) requests of a node's disk, MiB.
  gpu_runner_storage_mib = [
    for obj in local.objects : tonumber(trimsuffix(obj.spec.template.spec.containers[0].resources.requests["ephemeral-storage"], "Mi"))
    if obj.kind == "Deployment" && can(obj.spec.template.spec.nodeSelector)
  ]
}

resource "helm_release" "fngate" {
  name      = "fngate"
  namespace = kubernetes_namespace_v1.this.metadata[0].name
  chart     = var.objects_chart
  # Naming the KEDA release orders this one after KEDA's CRDs, without making the rendering wait.
  description = "fngate workloads (after ${var.keda_release})"
  wait        = true
  timeout     = 900

  values = [yamlencode({ items = local.objects })]

  lifecycle {
    precondition {
      condition     = alltrue([for mib in local.gpu_runner_storage_mib : mib <= var.gpu_node_ephemeral_storage_mib])
      error_message = "A GPU runner requests more ephemeral storage than a GPU node offers (gpu_volume_gib, runner_artifact_cache_gib): its pods would stay Pending."
    }
  }
}

data "kubernetes_service_v1" "gateway" {
  metadata {
    name      = "fngate-gateway"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }

  depends_on = [helm_release.fngate]
}
