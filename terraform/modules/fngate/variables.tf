variable "objects_chart" {
  description = "Path of the chart that applies a list of Kubernetes objects (charts/objects)."
  type        = string
}

variable "python" {
  description = "Python interpreter with fngate installed, relative to the root module or absolute."
  type        = string
}

variable "functions_dir" {
  description = "Folder of <function>/function.yaml manifests, relative to the root module or absolute."
  type        = string
}

variable "namespace" {
  description = "Namespace of the gateway and runners."
  type        = string
}

variable "gateway_image" {
  description = "Gateway image."
  type        = string
}

variable "runner_image" {
  description = "CPU runner image."
  type        = string
}

variable "runner_gpu_image" {
  description = "GPU runner image."
  type        = string
}

variable "repo" {
  description = "Model repository URL, s3://bucket/prefix (FNGATE_REPO)."
  type        = string
}

variable "redis_address" {
  description = "Redis primary endpoint host name."
  type        = string
}

variable "redis_port" {
  description = "Redis port."
  type        = number
}

variable "redis_cluster" {
  description = "Redis is in cluster mode: redis_address is its configuration endpoint."
  type        = bool
  default     = false
}

variable "redis_auth_token" {
  description = "Redis AUTH token."
  type        = string
  sensitive   = true
}

variable "gateway_role_arn" {
  description = "IAM role of the gateway's service account."
  type        = string
}

variable "runner_role_arn" {
  description = "IAM role of the runners' service account."
  type        = string
}

variable "deployer_role_arn" {
  description = "IAM role of the fngate-deployer service account."
  type        = string
}

variable "otlp_endpoint" {
  description = "OTLP/HTTP base URL of the collector (OTEL_EXPORTER_OTLP_ENDPOINT)."
  type        = string
}

variable "keda_release" {
  description = "The KEDA release this one must follow (its CRDs define ScaledObject)."
  type        = string
}

variable "polling_interval_s" {
  description = "KEDA pollingInterval of every runner pool, seconds."
  type        = number
}

variable "cooldown_s" {
  description = "KEDA cooldownPeriod of every runner pool, seconds."
  type        = number
}

variable "gateway_min_replicas" {
  description = "Fewest gateway pods."
  type        = number
}

variable "gateway_max_replicas" {
  description = "Most gateway pods."
  type        = number
}

variable "gateway_allowed_cidrs" {
  description = "CIDRs that may reach the gateway's load balancer."
  type        = list(string)
}

variable "gateway_certificate_arn" {
  description = "ACM certificate for HTTPS on the load balancer; empty: HTTP."
  type        = string
}

variable "gateway_internal" {
  description = "An internal load balancer (the VPC and its peers only) instead of an internet-facing one."
  type        = bool
}

variable "log_level" {
  description = "FNGATE_LOG_LEVEL."
  type        = string
}

variable "deployed_functions" {
  description = "Functions (of functions_dir) that have been deployed; only these get runner pools and KEDA triggers."
  type        = list(string)
}

variable "warm_runners" {
  description = "Runners each pool keeps when idle (0: pools scale to zero)."
  type        = number
}

variable "artifact_cache_bytes" {
  description = "A runner's model file cache (FNGATE_ARTIFACT_MAX_BYTES), and the base of its ephemeral-storage request."
  type        = number
}

variable "gpu_node_ephemeral_storage_mib" {
  description = "Ephemeral storage a GPU node offers pods, MiB (the eks module's node template): every GPU runner's request must fit."
  type        = number
}

variable "registry_sync_schedule" {
  description = "Cron schedule of the fngate-registry-sync job; empty: suspended, run on demand."
  type        = string
}

variable "extra_admin_key_hashes" {
  description = "Further admin API keys the gateways accept, as '<id>:<sha256>' (Prometheus's, for /metrics)."
  type        = list(string)
  default     = []
}
