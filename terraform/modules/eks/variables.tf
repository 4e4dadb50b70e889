variable "name" {
  description = "Cluster name; prefixes the cluster's roles and keys."
  type        = string
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of the control plane's network interfaces and of the nodes."
  type        = list(string)
}

variable "api_allowed_cidrs" {
  description = "CIDRs that may reach the public API endpoint."
  type        = list(string)
}

variable "admin_role_arns" {
  description = "IAM roles given cluster-admin."
  type        = list(string)
  default     = []
}

variable "cpu_instance_types" {
  description = "Instance types of the CPU node group."
  type        = list(string)
}

variable "cpu_min_size" {
  description = "Fewest CPU nodes."
  type        = number
}

variable "cpu_max_size" {
  description = "Most CPU nodes."
  type        = number
}

variable "gpu_instance_types" {
  description = "Instance types of the GPU node group."
  type        = list(string)
}

variable "gpus_per_node" {
  description = "GPUs of one GPU node."
  type        = number
}

variable "gpu_max_size" {
  description = "Most GPU nodes."
  type        = number
}

variable "log_retention_days" {
  description = "Days control plane logs are kept."
  type        = number
  default     = 365
}

variable "gpu_accelerator" {
  description = "Value of the k8s.amazonaws.com/accelerator label on GPU nodes (the GPU model, e.g. nvidia-a10g for g5)."
  type        = string
  default     = "nvidia-a10g"
}

variable "cpu_volume_gib" {
  description = "Root volume of a CPU node, GiB: images plus the artifact caches of the runners it holds."
  type        = number
  default     = 100
}

variable "gpu_volume_gib" {
  description = "Root volume of a GPU node, GiB: the GPU runner image, and each GPU runner's artifact, /tmp and TensorRT engine caches (its ephemeral-storage request)."
  type        = number
  default     = 200
}
