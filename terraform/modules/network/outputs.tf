output "vpc_id" {
  description = "The VPC."
  value       = aws_vpc.this.id
}

output "private_subnet_ids" {
  description = "Private subnets, one per availability zone (nodes, Redis)."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnets, one per availability zone (internet-facing load balancers)."
  value       = aws_subnet.public[*].id
}
