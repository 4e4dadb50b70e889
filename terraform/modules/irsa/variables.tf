variable "name" {
  description = "Role name."
  type        = string
}

variable "oidc_provider_arn" {
  description = "The cluster's IAM OIDC provider."
  type        = string
}

variable "oidc_issuer" {
  description = "The cluster's OIDC issuer without https://."
  type        = string
}

variable "namespace" {
  description = "Namespace of the service account."
  type        = string
}

variable "service_account" {
  description = "Name of the service account that assumes the role."
  type        = string
}

variable "policy_json" {
  description = "The role's permissions, an IAM policy document."
  type        = string
}

variable "trusted_role_arns" {
  description = "IAM roles that may also assume this role."
  type        = list(string)
  default     = []
}
