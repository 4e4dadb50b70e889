variable "name" {
  description = "Prefix of every resource name; also the replication group id."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the Redis security group."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets Redis nodes are placed in (one per zone)."
  type        = list(string)
}

variable "client_security_group_ids" {
  description = "Security groups whose members may connect to port 6379."
  type        = list(string)
}

variable "engine_version" {
  description = "Redis engine version (7.x)."
  type        = string
}

variable "node_type" {
  description = "ElastiCache node type."
  type        = string
}

variable "replicas" {
  description = "Replicas beside the primary (of each shard, in cluster mode)."
  type        = number
}

variable "cluster_mode" {
  description = "Cluster mode: `shards` primaries, the slots spread over them."
  type        = bool
}

variable "shards" {
  description = "Shards (primaries) in cluster mode."
  type        = number
}

variable "snapshot_retention_days" {
  description = "Days of daily snapshots kept."
  type        = number
}
