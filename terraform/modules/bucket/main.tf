# The model repository: a versioned bucket, encrypted with its own KMS key, closed to the public,
# reachable over TLS only. Functions live under <prefix>/<function>/<version>/.

data "aws_caller_identity" "current" {}

resource "aws_kms_key" "this" {
  description             = "fngate model repository ${var.name}"
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

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_144:Cross-region replication is a disaster-recovery choice per deployment; versioning already keeps every model version, and models can be redeployed from their source.
  #checkov:skip=CKV2_AWS_62:No consumer of bucket events: runners and gateways read the repository on demand.
  bucket        = var.name
  force_destroy = false
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "expire-replaced-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_logging" "this" {
  count = var.access_log_bucket != "" ? 1 : 0

  bucket        = aws_s3_bucket.this.id
  target_bucket = var.access_log_bucket
  target_prefix = "${var.name}/"
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid     = "DenyWithoutTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOldTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]
    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.tls_only.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

# ---------------------------------------------------------------- what roles may do with it
data "aws_iam_policy_document" "read" {
  statement {
    sid       = "ListRepository"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.prefix, "${var.prefix}/*"]
    }
  }

  statement {
    sid       = "ReadFunctions"
    actions   = ["s3:GetObject", "s3:GetObjectVersion"]
    resources = ["${aws_s3_bucket.this.arn}/${var.prefix}/*"]
  }

  statement {
    sid       = "DecryptFunctions"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

data "aws_iam_policy_document" "write" {
  source_policy_documents = [data.aws_iam_policy_document.read.json]

  statement {
    sid       = "WriteFunctions"
    actions   = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.this.arn}/${var.prefix}/*"]
  }

  statement {
    sid       = "EncryptFunctions"
    actions   = ["kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }
}

# Runners read the repository and write TensorRT engine caches beside it (runner/backends/engine_cache.py,
# S3EngineStore: <prefix>/.engines/), so that a new GPU runner fetches the engines instead of
# rebuilding them. Nothing else: a runner cannot change a function.
data "aws_iam_policy_document" "runner" {
  source_policy_documents = [data.aws_iam_policy_document.read.json]

  statement {
    sid       = "WriteEngineCaches"
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.this.arn}/${var.prefix}/.engines/*"]
  }

  statement {
    sid       = "EncryptEngineCaches"
    actions   = ["kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }
}
