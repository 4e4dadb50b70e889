variable "description" {
  description = "What the key encrypts, for the KMS console."
  type        = string
}

variable "log_group_name" {
  description = "The CloudWatch Logs log group that may use the key."
  type        = string
}
