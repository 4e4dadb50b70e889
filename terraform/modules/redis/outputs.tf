output "address" {
  description = "Primary endpoint host name; in cluster mode the configuration endpoint, which names every node."
  value = (var.cluster_mode
    ? aws_elasticache_replication_group.this.configuration_endpoint_address
  : aws_elasticache_replication_group.this.primary_endpoint_address)
}

output "port" {
  description = "Redis port."
  value       = aws_elasticache_replication_group.this.port
}

output "auth_token" {
  description = "The AUTH token (also in Terraform state: keep the state encrypted)."
  value       = random_password.auth_token.result
  sensitive   = true
}
