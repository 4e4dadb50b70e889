variable "cluster_name" {
  description = "EKS cluster whose node groups the autoscaler discovers."
  type        = string
}

variable "region" {
  description = "AWS region of the cluster."
  type        = string
}

variable "kubernetes_version" {
  description = "Kubernetes minor version (1.33): picks the cluster autoscaler image."
  type        = string
}

variable "autoscaler_role_arn" {
  description = "IAM role of the cluster autoscaler's service account."
  type        = string
}

variable "gpu_node_label_key" {
  description = "Label key that GPU nodes carry."
  type        = string
}

variable "gpu_node_label_value" {
  description = "Value of that label."
  type        = string
}

variable "scale_down_unneeded_time" {
  description = "How long a node stays unneeded before the autoscaler removes it (a GPU node costs while idle)."
  type        = string
  default     = "5m"
}

variable "cluster_autoscaler_chart_version" {
  description = "Version of the kubernetes/autoscaler cluster-autoscaler chart."
  type        = string
  default     = "9.52.1"
}

variable "nvidia_device_plugin_chart_version" {
  description = "Version of NVIDIA's nvidia-device-plugin chart."
  type        = string
  default     = "0.17.1"
}

variable "metrics_server_chart_version" {
  description = "Version of the metrics-server chart."
  type        = string
  default     = "3.12.2"
}
