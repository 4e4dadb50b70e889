# An IAM role that one Kubernetes service account assumes through the cluster's OIDC provider (IRSA),
# optionally also assumable by the IAM roles in trusted_role_arns, with one inline policy.

data "aws_iam_policy_document" "trust" {
  statement {
    sid     = "ServiceAccount"
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${var.service_account}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }

  dynamic "statement" {
    for_each = length(var.trusted_role_arns) > 0 ? [var.trusted_role_arns] : []
    content {
      sid     = "TrustedRoles"
      actions = ["sts:AssumeRole"]
      principals {
        type        = "AWS"
        identifiers = statement.value
      }
    }
  }
}

resource "aws_iam_role" "this" {
  name                 = var.name
  assume_role_policy   = data.aws_iam_policy_document.trust.json
  max_session_duration = 3600
}

resource "aws_iam_role_policy" "this" {
  name   = "${var.name}-access"
  role   = aws_iam_role.this.id
  policy = var.policy_json
}
