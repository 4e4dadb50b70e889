output "gateway_url" {
  description = "Base URL of the gateway's load balancer."
  value       = "${local.https ? "https" : "http"}://${try(data.kubernetes_service_v1.gateway.status[0].load_balancer[0].ingress[0].hostname, "pending")}"
}

output "namespace" {
  description = "The namespace, once it exists (depend on this to place objects in it)."
  value       = kubernetes_namespace_v1.this.metadata[0].name
}

output "admin_api_key" {
  description = "The first admin API key (Authorization: Bearer <key>); give narrower keys to callers."
  value       = local.admin_key
  sensitive   = true
}
