# IRSA roles for the Ferry pods. The worker may read, write and delete objects under its
# snapshot prefix, read the model weights named in model_object_arns, and nothing else in S3; the API (and the webhook worker, same service
# account) gets a role that denies S3 outright, so no policy attached later by mistake can
# open the bucket to it, and that may use the one Celery queue on SQS (the webhook relay
# sends to it, the webhook worker receives from it).

data "aws_region" "current" {}

locals {
  bucket_name = element(split(":::", var.snapshot_bucket_arn), 1)
  # Model weights the workers may read (FERRY_MODEL=s3://...): bucket ARN -> key prefixes under it.
  model_prefixes = { for arn in var.model_object_arns :
    split("/", arn)[0] => join("/", slice(split("/", arn), 1, length(split("/", arn))))...
  }
}

data "aws_iam_policy_document" "assume" {
  for_each = {
    worker = var.worker_service_account
    api    = var.api_service_account
  }
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.namespace}:${each.value}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "worker" {
  name               = "${var.name}-worker"
  description        = "Ferry GPU worker: snapshot objects under s3://${local.bucket_name}/${var.snapshot_prefix}/ only"
  assume_role_policy = data.aws_iam_policy_document.assume["worker"].json
  tags               = var.tags
}

data "aws_iam_policy_document" "worker" {
  statement {
    sid       = "SnapshotObjects"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${var.snapshot_bucket_arn}/${var.snapshot_prefix}/*"]
  }
  statement {
    sid       = "ListSnapshotPrefix"
    actions   = ["s3:ListBucket"]
    resources = [var.snapshot_bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.snapshot_prefix}/*"]
    }
  }
  dynamic "statement" {
    for_each = length(var.model_object_arns) > 0 ? [var.model_object_arns] : []
    content {
      sid       = "ReadModelWeights"
      actions   = ["s3:GetObject"]
      resources = statement.value
    }
  }
  dynamic "statement" {
    for_each = local.model_prefixes
    content {
      actions   = ["s3:ListBucket"]
      resources = [statement.key]
      condition {
        test     = "StringLike"
        variable = "s3:prefix"
        values   = statement.value
      }
    }
  }
  statement {
    sid       = "SnapshotKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.snapshot_kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "worker" {
  name   = "snapshots"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.worker.json
}

resource "aws_iam_role" "api" {
  name               = "${var.name}-api"
  description        = "Ferry API and webhook worker: the Celery SQS queue, no S3 access"
  assume_role_policy = data.aws_iam_policy_document.assume["api"].json
  tags               = var.tags
}

data "aws_iam_policy_document" "api" {
  statement {
    sid       = "NoS3"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = ["*"]
  }
  statement {
    sid = "CeleryQueue"
    actions = [
      "sqs:SendMessage", "sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility",
      "sqs:GetQueueAttributes", "sqs:GetQueueUrl",
    ]
    resources = [var.celery_queue_arn]
  }
  statement {
    sid       = "CeleryQueueKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.celery_queue_kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["sqs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "api" {
  name   = "celery-queue-no-s3"
  role   = aws_iam_role.api.id
  policy = data.aws_iam_policy_document.api.json
}
