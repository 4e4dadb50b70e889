output "name" {
  description = "Bucket name."
  value       = aws_s3_bucket.this.id
}

output "arn" {
  description = "Bucket ARN."
  value       = aws_s3_bucket.this.arn
}

output "kms_key_arn" {
  description = "KMS key that encrypts the bucket."
  value       = aws_kms_key.this.arn
}

output "read_policy_json" {
  description = "IAM policy: list and read the repository prefix."
  value       = data.aws_iam_policy_document.read.json
}

output "write_policy_json" {
  description = "IAM policy: read and write the repository prefix (deployers)."
  value       = data.aws_iam_policy_document.write.json
}

output "runner_policy_json" {
  description = "IAM policy: read the repository prefix and write TensorRT engine caches under <prefix>/.engines/ (runners)."
  value       = data.aws_iam_policy_document.runner.json
}
