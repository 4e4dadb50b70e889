variable "name" {
  description = "Bucket name (globally unique)."
  type        = string
}

variable "prefix" {
  description = "Key prefix of the repository; the read and write policies cover it only."
  type        = string
}

variable "noncurrent_version_days" {
  description = "Days a replaced or deleted object version is kept."
  type        = number
}

variable "access_log_bucket" {
  description = "Existing bucket for server access logs; empty: none."
  type        = string
  default     = ""
}
