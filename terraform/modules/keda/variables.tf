variable "chart_version" {
  description = "Version of the kedacore/keda chart, exact (2.17.0 or later)."
  type        = string
}

variable "namespace" {
  description = "Namespace KEDA runs in."
  type        = string
  default     = "keda"
}

variable "kubernetes_version" {
  description = "The cluster's Kubernetes version (major.minor), checked against the versions KEDA tests."
  type        = string
}
