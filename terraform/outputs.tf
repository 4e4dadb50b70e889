output "gateway_url" {
  description = "Base URL of the gateway's load balancer (it answers once DNS has propagated, a few minutes after apply)."
  value       = module.fngate.gateway_url
}

output "bucket" {
  description = "Name of the model repository bucket."
  value       = module.bucket.name
}

output "repo" {
  description = "The repository URL to pass to `fngate deploy --repo`."
  value       = "s3://${module.bucket.name}/${var.repo_prefix}"
}

output "deployer_role_arn" {
  description = "IAM role that may write functions to the repository."
  value       = module.deployer_role.arn
}

output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name <this>)."
  value       = module.eks.name
}

output "redis_address" {
  description = "Primary endpoint of the queue and cache Redis, or its configuration endpoint in cluster mode (TLS, auth token in the fngate-redis Secret)."
  value       = module.redis.address
}

output "namespace" {
  description = "Kubernetes namespace of the gateway and runners."
  value       = var.namespace
}

output "admin_api_key" {
  description = "The first admin API key: `terraform output -raw admin_api_key`. Create narrower ones with `fngate keys create`."
  value       = module.fngate.admin_api_key
  sensitive   = true
}
