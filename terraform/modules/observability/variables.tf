variable "namespace" {
  description = "Namespace of the collector and of Prometheus."
  type        = string
  default     = "observability"
}

variable "fngate_namespace" {
  description = "Namespace of fngate's pods, where its PrometheusRule and PodMonitor go."
  type        = string
}

variable "objects_chart" {
  description = "Path of the chart that applies a list of Kubernetes objects (charts/objects)."
  type        = string
}

variable "rules_file" {
  description = "Prometheus rule file (groups: ...) with fngate's alerts."
  type        = string
}

variable "install_prometheus" {
  description = "Install kube-prometheus-stack; false where the Prometheus operator already runs."
  type        = bool
}

variable "otlp_export_endpoint" {
  description = "OTLP/HTTP endpoint the collector forwards to; empty: log a summary only."
  type        = string
  default     = ""
}

variable "otel_collector_chart_version" {
  description = "Version of the opentelemetry-collector chart."
  type        = string
  default     = "0.110.7"
}

variable "prometheus_stack_chart_version" {
  description = "Version of the kube-prometheus-stack chart."
  type        = string
  default     = "77.14.0"
}
