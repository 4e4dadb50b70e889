output "otlp_endpoint" {
  description = "OTLP/gRPC endpoint for gateways and runners (OTEL_EXPORTER_OTLP_ENDPOINT)."
  value       = "http://otel-collector.${var.namespace}.svc.cluster.local:4317"
}

output "metrics_key_hash" {
  description = "'<id>:<sha256>' of Prometheus's API key, for the gateways (FNGATE_ADMIN_KEY_HASH)."
  value       = "${random_id.metrics_key.hex}:${sha256(local.metrics_key)}"
}
