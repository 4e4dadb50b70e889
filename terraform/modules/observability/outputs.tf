output "otlp_endpoint" {
  description = "OTLP/gRPC endpoint for gateways and runners (OTEL_EXPORTER_OTLP_ENDPOINT)."
  value       = "http://otel-collector.${var.namespace}.svc.cluster.local:4317"
}
