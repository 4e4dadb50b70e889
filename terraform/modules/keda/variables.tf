variable "chart_version" {
  description = "Version of the kedacore/keda chart (2.17 or later)."
  type        = string
}

variable "namespace" {
  description = "Namespace KEDA runs in."
  type        = string
  default     = "keda"
}
