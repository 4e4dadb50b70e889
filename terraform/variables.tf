# ---------------------------------------------------------------- where and what
variable "name" {
  description = "Name of this deployment: prefixes every AWS resource (cluster, Redis, roles). Lower-case letters, digits and '-'."
  type        = string
  default     = "fngate"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name: 3 to 32 lower-case letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "AWS region of every resource."
  type        = string
}

variable "tags" {
  description = "Tags added to every AWS resource (beside Project and Stack)."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------- network
variable "vpc_cidr" {
  description = "CIDR of the VPC this stack creates: a /20 private and a /24 public subnet per availability zone are cut from it."
  type        = string
  default     = "10.40.0.0/16"
}

variable "az_count" {
  description = "Availability zones to spread subnets, nodes and Redis replicas over (2 or 3)."
  type        = number
  default     = 3

  validation {
    condition     = var.az_count >= 2 && var.az_count <= 3
    error_message = "az_count: 2 or 3."
  }
}

variable "availability_zones" {
  description = "Zone names to place subnets in (the first az_count are used); empty: <region>a, <region>b, <region>c. Set it in regions whose zones are named otherwise for your account."
  type        = list(string)
  default     = []
}

variable "api_allowed_cidrs" {
  description = "CIDRs that may reach the Kubernetes API endpoint (the machine running Terraform and kubectl must be in one). 0.0.0.0/0 is refused."
  type        = list(string)

  validation {
    condition     = length(var.api_allowed_cidrs) > 0 && !contains(var.api_allowed_cidrs, "0.0.0.0/0")
    error_message = "api_allowed_cidrs: list the networks that administer the cluster; 0.0.0.0/0 is refused."
  }
}

variable "gateway_allowed_cidrs" {
  description = "CIDRs that may call the gateway's load balancer; no default: name the callers' networks (0.0.0.0/0 only on purpose, for a public API: every route but health needs an API key)."
  type        = list(string)

  validation {
    condition     = length(var.gateway_allowed_cidrs) > 0
    error_message = "gateway_allowed_cidrs: list the networks that call the gateway."
  }
}

variable "gateway_internal" {
  description = "Make the gateway's load balancer internal (reachable from the VPC and its peers only); false: internet-facing."
  type        = bool
  default     = true
}

variable "gateway_certificate_arn" {
  description = "ACM certificate for HTTPS on the gateway's load balancer (port 443); empty: plain HTTP on port 80."
  type        = string
  default     = ""
}

# ---------------------------------------------------------------- model repository
variable "bucket_name" {
  description = "Name of the model repository bucket; empty: <name>-models-<account id>-<region>."
  type        = string
  default     = ""
}

variable "repo_prefix" {
  description = "Key prefix of the repository in the bucket: functions live under s3://<bucket>/<repo_prefix>/<function>/<version>/."
  type        = string
  default     = "prod"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9/_-]*[a-z0-9]$", var.repo_prefix))
    error_message = "repo_prefix: lower-case letters, digits, '-', '_' and '/', not starting or ending with '/'."
  }
}

variable "noncurrent_version_days" {
  description = "Days an overwritten or deleted model version is kept before the bucket expires it."
  type        = number
  default     = 90
}

variable "access_log_bucket" {
  description = "Existing bucket that receives the repository bucket's server access logs; empty: no access logs."
  type        = string
  default     = ""
}

variable "deployer_role_arns" {
  description = "IAM roles (a CI pipeline's, an operator's) that may assume the deployer role, which writes functions to the repository. The fngate-deployer service account in the cluster may always assume it."
  type        = list(string)
  default     = []
}

# ---------------------------------------------------------------- Redis
variable "redis_node_type" {
  description = "ElastiCache node type of the queue and cache Redis."
  type        = string
  default     = "cache.r7g.large"
}

variable "redis_replicas" {
  description = "Read replicas beside the primary (at least 1: failover to another zone)."
  type        = number
  default     = 1

  validation {
    condition     = var.redis_replicas >= 1 && var.redis_replicas <= 5
    error_message = "redis_replicas: 1 to 5."
  }
}

variable "redis_cluster_mode" {
  description = "ElastiCache in cluster mode: the queue, cache and limits spread over redis_shards primaries, each with redis_replicas replicas (docs/deployment.md, Past one Redis)."
  type        = bool
  default     = false
}

variable "redis_shards" {
  description = "Shards (primaries) in cluster mode; unused without it."
  type        = number
  default     = 3

  validation {
    condition     = var.redis_shards >= 1 && var.redis_shards <= 500
    error_message = "redis_shards: 1 to 500."
  }
}

variable "redis_engine_version" {
  description = "Redis engine version: 7.0 or later, since KEDA reads the consumer-group lag that Redis 7 reports."
  type        = string
  default     = "7.1"

  validation {
    condition     = can(regex("^7\\.", var.redis_engine_version))
    error_message = "redis_engine_version: 7.x (the parameter group family is redis7)."
  }
}

variable "redis_snapshot_retention_days" {
  description = "Days of daily Redis snapshots kept."
  type        = number
  default     = 7
}

# ---------------------------------------------------------------- Kubernetes cluster
variable "kubernetes_version" {
  description = "EKS Kubernetes version: one in EKS standard support (1.35 until March 2027) that keda_chart_version is tested on (modules/keda checks the pair)."
  type        = string
  default     = "1.35"
}

variable "admin_role_arns" {
  description = "IAM roles given cluster-admin on the cluster, beside the identity that runs Terraform."
  type        = list(string)
  default     = []
}

variable "cpu_instance_types" {
  description = "Instance types of the CPU node group (system pods, gateways, CPU runners)."
  type        = list(string)
  default     = ["m7i.xlarge"]
}

variable "cpu_min_size" {
  description = "Fewest CPU nodes; the gateway, KEDA and the cluster add-ons run there, so at least 1."
  type        = number
  default     = 2

  validation {
    condition     = var.cpu_min_size >= 1
    error_message = "cpu_min_size: at least 1."
  }
}

variable "cpu_max_size" {
  description = "Most CPU nodes the cluster autoscaler may start."
  type        = number
  default     = 10
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node group, which scales to zero."
  type        = list(string)
  default     = ["g5.xlarge"]
}

variable "gpus_per_node" {
  description = "GPUs of one node of gpu_instance_types (tells the cluster autoscaler what a node from zero would bring)."
  type        = number
  default     = 1
}

variable "gpu_volume_gib" {
  description = "Root volume of a GPU node, GiB: the GPU runner image, and each GPU runner's artifact cache, /tmp and TensorRT engines (runner_artifact_cache_gib plus a quarter, 1 GiB and 20 GiB)."
  type        = number
  default     = 200
}

variable "gpu_max_size" {
  description = "Most GPU nodes the cluster autoscaler may start."
  type        = number
  default     = 4
}

# ---------------------------------------------------------------- add-ons
variable "keda_chart_version" {
  description = "Version of KEDA's Helm chart (kedacore/keda), pinned: a release that KEDA tests on kubernetes_version (modules/keda checks the pair)."
  type        = string
  default     = "2.20.2"

  validation {
    condition     = can(regex("^2\\.(1[7-9]|[2-9][0-9])\\.[0-9]+$", var.keda_chart_version))
    error_message = "keda_chart_version: an exact version, 2.17.0 or later within KEDA 2."
  }
}

variable "install_prometheus_stack" {
  description = "Install kube-prometheus-stack (Prometheus, Alertmanager, Grafana) with fngate's alert rules; false: only the PrometheusRule, for a cluster that already runs the Prometheus operator."
  type        = bool
  default     = true
}

variable "otlp_export_endpoint" {
  description = "OTLP/HTTP endpoint the OpenTelemetry collector forwards traces and metrics to; empty: the collector logs a summary only."
  type        = string
  default     = ""
}

# ---------------------------------------------------------------- fngate
variable "namespace" {
  description = "Kubernetes namespace of the gateway and runners."
  type        = string
  default     = "fngate"
}

variable "gateway_image" {
  description = "Image of the gateway (Dockerfile target gateway), e.g. <account>.dkr.ecr.<region>.amazonaws.com/fngate/gateway:0.1.0."
  type        = string
}

variable "runner_image" {
  description = "Image of the CPU runner (Dockerfile target runner)."
  type        = string
}

variable "runner_gpu_image" {
  description = "Image of the GPU runner (Dockerfile target runner-gpu)."
  type        = string
}

variable "functions_dir" {
  description = "Folder of <function>/function.yaml manifests whose scaling.pool settings define the runner pools."
  type        = string
  default     = "../functions"
}

variable "deployed_functions" {
  description = "Functions of functions_dir that have been deployed to the repository and synced (docs/deployment.md, step 4): only these get runner pools."
  type        = list(string)
  default     = []
}

variable "warm_runners_per_pool" {
  description = "Runners every pool keeps while idle. 0: pools scale to zero, and a first call after an idle period waits for a runner (minutes when a GPU node must start). 1: no such wait, but one runner per pool runs around the clock, and for a GPU pool one GPU node (a g5.xlarge is about 1 USD an hour on demand, some 730 USD a month)."
  type        = number
  default     = 0

  validation {
    condition     = var.warm_runners_per_pool >= 0
    error_message = "warm_runners_per_pool: 0 or more."
  }
}

variable "runner_artifact_cache_gib" {
  description = "Model files a runner keeps on its node's disk, GiB; also what each runner requests as ephemeral storage (plus a quarter, and 20 GiB of TensorRT engines on GPU nodes)."
  type        = number
  default     = 10
}

variable "registry_sync_schedule" {
  description = "Cron schedule of the fngate-registry-sync job, which records new versions from the repository in the registry (`fngate ls --sync`); empty: run it on demand only."
  type        = string
  default     = ""
}

variable "fngate_python" {
  description = "Python interpreter with fngate installed; Terraform runs `python -m fngate.k8s` with it to render the Kubernetes objects."
  type        = string
  default     = "../.venv/bin/python"
}

variable "gateway_min_replicas" {
  description = "Fewest gateway pods (the HPA scales between min and max on CPU)."
  type        = number
  default     = 2
}

variable "gateway_max_replicas" {
  description = "Most gateway pods."
  type        = number
  default     = 10
}

variable "keda_polling_interval_s" {
  description = "Seconds between KEDA's reads of the stream lag: the longest wait before a runner pool wakes from zero."
  type        = number
  default     = 5
}

variable "keda_cooldown_s" {
  description = "Seconds without lag or pending invocations before KEDA scales a runner pool to zero."
  type        = number
  default     = 300
}

variable "log_level" {
  description = "FNGATE_LOG_LEVEL of the gateway and runners."
  type        = string
  default     = "INFO"
}
