output "otlp_endpoint" {
  # fngate exports over OTLP/HTTP (fngate/telemetry.py), whose port is 4318; the exporter appends
  # /v1/traces to this base URL (OpenTelemetry's OTLP exporter specification). 4317 is gRPC.
  description = "OTLP/HTTP base URL for gateways and runners (OTEL_EXPORTER_OTLP_ENDPOINT)."
  value       = "http://otel-collector.${var.namespace}.svc.cluster.local:4318"
}

output "metrics_key_hash" {
  description = "'<id>:<sha256>' of Prometheus's API key, for the gateways (FNGATE_ADMIN_KEY_HASH)."
  value       = "${random_id.metrics_key.hex}:${sha256(local.metrics_key)}"
}
