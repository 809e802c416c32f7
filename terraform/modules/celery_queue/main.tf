# The SQS queue Celery's webhook tasks travel on (FERRY_CELERY_BROKER_URL=sqs://): kombu cannot
# use a Redis Cluster as a broker. Encrypted with a KMS key of its own; a task that is received
# `max_receive_count` times without being acknowledged (a webhook worker that dies on it each
# time) moves to the dead-letter queue instead of circling for ever.

data "aws_caller_identity" "current" {}

resource "aws_kms_key" "queue" {
  description         = "${var.name} Celery queue (SQS) server-side encryption"
  enable_key_rotation = true
  # The account administers the key; IAM policies grant its use (kms:ViaService sqs).
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdmin"
      Effect    = "Allow"
      Principal = { AWS = "arn:aws:iam::${data.aws_caller_identity.current.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })
  tags = var.tags
}

resource "aws_sqs_queue" "dead_letter" {
  name                              = "${var.name}-webhooks-dlq"
  message_retention_seconds         = 1209600 # 14 days, the SQS maximum: time to look at what failed
  kms_master_key_id                 = aws_kms_key.queue.arn
  kms_data_key_reuse_period_seconds = 300
  tags                              = var.tags
}

resource "aws_sqs_queue" "tasks" {
  # kombu's name for the Celery queue "<key prefix>:webhooks" (":" becomes "_").
  name                              = "${var.key_prefix}_webhooks"
  visibility_timeout_seconds        = var.visibility_timeout_s
  message_retention_seconds         = 345600 # 4 days
  receive_wait_time_seconds         = 10     # long polling
  kms_master_key_id                 = aws_kms_key.queue.arn
  kms_data_key_reuse_period_seconds = 300
  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dead_letter.arn
    maxReceiveCount     = var.max_receive_count
  })
  tags = var.tags
}

resource "aws_sqs_queue_redrive_allow_policy" "dead_letter" {
  queue_url = aws_sqs_queue.dead_letter.id
  redrive_allow_policy = jsonencode({
    redrivePermission = "byQueue"
    sourceQueueArns   = [aws_sqs_queue.tasks.arn]
  })
}
