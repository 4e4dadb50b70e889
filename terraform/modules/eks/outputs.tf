output "name" {
  description = "Cluster name."
  value       = aws_eks_cluster.this.name
}

output "endpoint" {
  description = "API server endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "certificate_authority" {
  description = "Base64 CA certificate of the API server."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "oidc_provider_arn" {
  description = "IAM OIDC provider of the cluster (IRSA)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer" {
  description = "OIDC issuer host and path, without https:// (the prefix of IRSA trust conditions)."
  value       = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
}

output "cluster_security_group_id" {
  description = "Security group EKS attaches to the control plane and every managed node."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "gpu_node_label" {
  description = "Label that every GPU node carries (key, value)."
  value       = local.gpu_label
}

output "cluster_autoscaler_policy_json" {
  description = "IAM policy for the cluster autoscaler: scale this cluster's node groups."
  value       = data.aws_iam_policy_document.cluster_autoscaler.json
}

output "gpu_node_ephemeral_storage_mib" {
  description = "Ephemeral storage a GPU node offers pods, MiB, as the cluster autoscaler's node template says (a GPU runner's request must fit)."
  value       = local.gpu_ephemeral_storage_mib
}
