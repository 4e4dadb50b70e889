variable "name" {
  description = "Prefix of every resource name."
  type        = string
}

variable "cidr" {
  description = "CIDR of the VPC (a /16 leaves room for /20 private and /24 public subnets)."
  type        = string
}

variable "zone_names" {
  description = "Availability zones to use, by name; empty: <region>a, <region>b and <region>c."
  type        = list(string)
  default     = []
}

variable "az_count" {
  description = "Availability zones to create subnets in."
  type        = number
}

variable "cluster_name" {
  description = "EKS cluster that places load balancers in these subnets (subnet tags)."
  type        = string
}

variable "flow_log_retention_days" {
  description = "Days flow logs are kept."
  type        = number
  default     = 365
}
