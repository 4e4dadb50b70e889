output "arn" {
  description = "ARN of the key, for the log group's kms_key_id."
  value       = aws_kms_key.this.arn
}
