output "arn" {
  description = "Role ARN, for the service account's eks.amazonaws.com/role-arn annotation."
  value       = aws_iam_role.this.arn
}
