# fngate on AWS: a VPC, the model repository bucket, Redis for the queue and cache, an EKS cluster
# whose GPU node group scales to zero, KEDA, the cluster add-ons, observability, and the fngate
# workloads. Each part is a module under modules/; this file only wires them together.

data "aws_caller_identity" "current" {}

locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.name}-models-${data.aws_caller_identity.current.account_id}-${var.region}"
}

module "network" {
  source = "./modules/network"

  name         = var.name
  cidr         = var.vpc_cidr
  zone_names   = var.availability_zones
  az_count     = var.az_count
  cluster_name = var.name
}

module "bucket" {
  source = "./modules/bucket"

  name                    = local.bucket_name
  prefix                  = var.repo_prefix
  noncurrent_version_days = var.noncurrent_version_days
  access_log_bucket       = var.access_log_bucket
}

module "eks" {
  source = "./modules/eks"

  name               = var.name
  kubernetes_version = var.kubernetes_version
  subnet_ids         = module.network.private_subnet_ids
  api_allowed_cidrs  = var.api_allowed_cidrs
  admin_role_arns    = var.admin_role_arns
  cpu_instance_types = var.cpu_instance_types
  cpu_min_size       = var.cpu_min_size
  cpu_max_size       = var.cpu_max_size
  gpu_instance_types = var.gpu_instance_types
  gpus_per_node      = var.gpus_per_node
  gpu_max_size       = var.gpu_max_size
  gpu_volume_gib     = var.gpu_volume_gib
}

module "redis" {
  source = "./modules/redis"

  name                      = var.name
  vpc_id                    = module.network.vpc_id
  subnet_ids                = module.network.private_subnet_ids
  client_security_group_ids = [module.eks.cluster_security_group_id]
  engine_version            = var.redis_engine_version
  node_type                 = var.redis_node_type
  replicas                  = var.redis_replicas
  cluster_mode              = var.redis_cluster_mode
  shards                    = var.redis_shards
  snapshot_retention_days   = var.redis_snapshot_retention_days
}

# ---------------------------------------------------------------- IAM roles for service accounts
# Runners read the repository and write engine caches beside it. Functions are written by the
# deployer and by the gateways' deploy API (PUT /v1/functions/{name}, behind the `deploy` scope): the
# way a workstation deploys with an API key alone, without S3 or Redis credentials.
module "gateway_role" {
  source = "./modules/irsa"

  name              = "${var.name}-gateway"
  oidc_provider_arn = module.eks.oidc_provider_arn
  oidc_issuer       = module.eks.oidc_issuer
  namespace         = var.namespace
  service_account   = "fngate-gateway"
  policy_json       = module.bucket.write_policy_json
}

module "runner_role" {
  source = "./modules/irsa"

  name              = "${var.name}-runner"
  oidc_provider_arn = module.eks.oidc_provider_arn
  oidc_issuer       = module.eks.oidc_issuer
  namespace         = var.namespace
  service_account   = "fngate-runner"
  policy_json       = module.bucket.runner_policy_json
}

module "deployer_role" {
  source = "./modules/irsa"

  name              = "${var.name}-deployer"
  oidc_provider_arn = module.eks.oidc_provider_arn
  oidc_issuer       = module.eks.oidc_issuer
  namespace         = var.namespace
  service_account   = "fngate-deployer"
  policy_json       = module.bucket.write_policy_json
  trusted_role_arns = var.deployer_role_arns
}

module "cluster_autoscaler_role" {
  source = "./modules/irsa"

  name              = "${var.name}-cluster-autoscaler"
  oidc_provider_arn = module.eks.oidc_provider_arn
  oidc_issuer       = module.eks.oidc_issuer
  namespace         = "kube-system"
  service_account   = "cluster-autoscaler"
  policy_json       = module.eks.cluster_autoscaler_policy_json
}

# ---------------------------------------------------------------- in the cluster
# Everything below runs on the nodes, so it waits for the whole eks module, node groups included,
# not only for the API endpoint that the providers read (a first apply would otherwise race the
# nodes, and Helm's wait would time out on pods with nowhere to run). See docs/deployment.md for the
# two-stage first apply that keeps the Kubernetes providers from being configured by unknown values.
module "keda" {
  source = "./modules/keda"

  chart_version      = var.keda_chart_version
  kubernetes_version = var.kubernetes_version

  depends_on = [module.eks]
}

module "cluster_addons" {
  source = "./modules/cluster-addons"

  cluster_name         = module.eks.name
  region               = var.region
  kubernetes_version   = var.kubernetes_version
  autoscaler_role_arn  = module.cluster_autoscaler_role.arn
  gpu_node_label_key   = module.eks.gpu_node_label.key
  gpu_node_label_value = module.eks.gpu_node_label.value

  depends_on = [module.eks]
}

module "observability" {
  source = "./modules/observability"

  objects_chart        = "${path.root}/charts/objects"
  rules_file           = "${path.root}/../deploy/prometheus/rules.yaml"
  fngate_namespace     = module.fngate.namespace
  install_prometheus   = var.install_prometheus_stack
  otlp_export_endpoint = var.otlp_export_endpoint

  depends_on = [module.eks]
}

module "fngate" {
  source = "./modules/fngate"

  objects_chart                  = "${path.root}/charts/objects"
  python                         = var.fngate_python
  functions_dir                  = var.functions_dir
  namespace                      = var.namespace
  gateway_image                  = var.gateway_image
  runner_image                   = var.runner_image
  runner_gpu_image               = var.runner_gpu_image
  repo                           = "s3://${module.bucket.name}/${var.repo_prefix}"
  redis_address                  = module.redis.address
  redis_port                     = module.redis.port
  redis_cluster                  = var.redis_cluster_mode
  redis_auth_token               = module.redis.auth_token
  gateway_role_arn               = module.gateway_role.arn
  runner_role_arn                = module.runner_role.arn
  deployer_role_arn              = module.deployer_role.arn
  otlp_endpoint                  = module.observability.otlp_endpoint
  keda_release                   = module.keda.release
  polling_interval_s             = var.keda_polling_interval_s
  cooldown_s                     = var.keda_cooldown_s
  deployed_functions             = var.deployed_functions
  warm_runners                   = var.warm_runners_per_pool
  artifact_cache_bytes           = var.runner_artifact_cache_gib * 1024 * 1024 * 1024
  gpu_node_ephemeral_storage_mib = module.eks.gpu_node_ephemeral_storage_mib
  registry_sync_schedule         = var.registry_sync_schedule
  gateway_min_replicas           = var.gateway_min_replicas
  gateway_max_replicas           = var.gateway_max_replicas
  gateway_allowed_cidrs          = var.gateway_allowed_cidrs
  gateway_certificate_arn        = var.gateway_certificate_arn
  gateway_internal               = var.gateway_internal
  extra_admin_key_hashes         = [module.observability.metrics_key_hash]
  log_level                      = var.log_level

  depends_on = [module.eks]
}
