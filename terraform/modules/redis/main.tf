# Redis 7 on ElastiCache for the invocation streams, the registry and the response cache: TLS in
# transit, an auth token, encryption at rest, a replica in another zone with automatic failover.

data "aws_caller_identity" "current" {}

# Nothing is evicted: results and heartbeats carry TTLs as cache entries do, and evicting one loses
# an answer or a runner. Gateways refuse asynchronous submissions from 80% of maxmemory, before
# Redis refuses writes (docs/deployment.md, "Redis's memory").
resource "aws_elasticache_parameter_group" "this" {
  name        = "${var.name}-redis7${var.cluster_mode ? "-cluster" : ""}"
  family      = "redis7"
  description = "fngate: noeviction; gateways refuse asynchronous work first"

  parameter {
    name  = "maxmemory-policy"
    value = "noeviction"
  }

  # Cluster mode needs a group of its own (cluster-enabled yes); the family stays redis7.
  parameter {
    name  = "cluster-enabled"
    value = var.cluster_mode ? "yes" : "no"
  }
}

resource "aws_elasticache_subnet_group" "this" {
  name        = "${var.name}-redis"
  description = "fngate Redis in the private subnets"
  subnet_ids  = var.subnet_ids
}

resource "aws_security_group" "this" {
  name        = "${var.name}-redis"
  description = "fngate Redis: port 6379 from the cluster's pods only"
  vpc_id      = var.vpc_id

  tags = { Name = "${var.name}-redis" }
}

resource "aws_vpc_security_group_ingress_rule" "clients" {
  count = length(var.client_security_group_ids)

  security_group_id            = aws_security_group.this.id
  description                  = "Redis over TLS from the EKS cluster"
  referenced_security_group_id = var.client_security_group_ids[count.index]
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
}

resource "aws_kms_key" "this" {
  description             = "${var.name} Redis at rest"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdministers"
      Effect    = "Allow"
      Principal = { AWS = "arn:aws:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
}

# ElastiCache accepts printable ASCII without '@', '"' and '/' in a token: letters and digits only
# also keep it safe inside a redis:// URL.
resource "random_password" "auth_token" {
  length  = 64
  special = false
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id = var.name
  description          = "fngate invocation queue, registry and response cache"
  engine               = "redis"
  engine_version       = var.engine_version
  node_type            = var.node_type
  port                 = 6379
  parameter_group_name = aws_elasticache_parameter_group.this.name
  subnet_group_name    = aws_elasticache_subnet_group.this.name
  security_group_ids   = [aws_security_group.this.id]

  # One primary and its replicas, or in cluster mode `shards` of them (each shard's replicas in
  # other zones; a shard's replica takes over when its primary fails).
  num_cache_clusters         = var.cluster_mode ? null : var.replicas + 1
  num_node_groups            = var.cluster_mode ? var.shards : null
  replicas_per_node_group    = var.cluster_mode ? var.replicas : null
  automatic_failover_enabled = true
  multi_az_enabled           = true

  transit_encryption_enabled = true
  auth_token                 = random_password.auth_token.result
  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.this.arn

  snapshot_retention_limit   = var.snapshot_retention_days
  snapshot_window            = "03:00-04:00"
  maintenance_window         = "sun:04:30-sun:05:30"
  auto_minor_version_upgrade = true
  apply_immediately          = false
}
