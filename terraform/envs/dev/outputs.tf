output "redis_endpoint" {
  description = "Redis Cluster configuration endpoint (TLS, port 6379; FERRY_REDIS_CLUSTER=true)."
  value       = module.redis.configuration_endpoint
}

output "redis_auth_secret_arn" {
  description = "Secrets Manager secret with the Redis AUTH token."
  value       = module.redis.auth_secret_arn
}

output "redis_url_without_auth" {
  description = "FERRY_REDIS_URL without the token: insert ':TOKEN@' after rediss://; FERRY_REDIS_CLUSTER=true."
  value       = module.redis.url_without_auth
}

output "snapshot_bucket" {
  description = "Snapshot bucket name."
  value       = module.snapshots.bucket_name
}

output "snapshot_url" {
  description = "FERRY_SNAPSHOT_URL for the workers."
  value       = module.snapshots.snapshot_url
}

output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = module.gpu_pool.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = module.gpu_pool.cluster_endpoint
}

output "worker_role_arn" {
  description = "IRSA role for the ferry-worker service account."
  value       = module.iam.worker_role_arn
}

output "api_role_arn" {
  description = "IRSA role for the ferry-api service account."
  value       = module.iam.api_role_arn
}

output "celery_queue_url" {
  description = "FERRY_CELERY_SQS_QUEUE_URL for the webhook worker (FERRY_CELERY_BROKER_URL=sqs://)."
  value       = module.celery_queue.queue_url
}

output "celery_dead_letter_queue_url" {
  description = "Webhook tasks that no worker could finish."
  value       = module.celery_queue.dead_letter_queue_url
}
