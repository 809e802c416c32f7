output "queue_url" {
  description = "FERRY_CELERY_SQS_QUEUE_URL of the webhook worker (with FERRY_CELERY_BROKER_URL=sqs://)."
  value       = aws_sqs_queue.tasks.id
}

output "queue_arn" {
  description = "ARN of the task queue (the IAM grant)."
  value       = aws_sqs_queue.tasks.arn
}

output "dead_letter_queue_url" {
  description = "Dead-letter queue: tasks no webhook worker could finish."
  value       = aws_sqs_queue.dead_letter.id
}

output "kms_key_arn" {
  description = "KMS key of both queues."
  value       = aws_kms_key.queue.arn
}
