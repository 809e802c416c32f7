output "configuration_endpoint" {
  description = "Configuration endpoint host name (TLS on port 6379): any node of the cluster answers it with the slot map."
  value       = aws_elasticache_replication_group.this.configuration_endpoint_address
}

output "port" {
  description = "Redis port."
  value       = aws_elasticache_replication_group.this.port
}

output "url_without_auth" {
  description = "rediss:// URL without the token; FERRY_REDIS_URL is rediss://:TOKEN@host:6379 with FERRY_REDIS_CLUSTER=true."
  value       = "rediss://${aws_elasticache_replication_group.this.configuration_endpoint_address}:${aws_elasticache_replication_group.this.port}"
}

output "auth_secret_arn" {
  description = "Secrets Manager secret holding the AUTH token."
  value       = aws_secretsmanager_secret.auth.arn
}

output "security_group_id" {
  description = "Security group of the cache nodes."
  value       = aws_security_group.redis.id
}
