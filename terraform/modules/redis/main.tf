# ElastiCache Redis 7 in cluster mode: `num_node_groups` shards (hash slots spread over them), each
# a primary with `replicas_per_node_group` replicas in other zones and automatic failover; TLS in
# transit, KMS at rest, an AUTH token kept in Secrets Manager. The queues, job hashes and token
# streams live here (FERRY_REDIS_CLUSTER=true, FERRY_REDIS_URL = the configuration endpoint);
# durability comes from the replicas (the API's WAIT) and daily backups.

resource "random_password" "auth" {
  length  = 64
  special = false # ElastiCache AUTH tokens refuse several punctuation characters
}

data "aws_caller_identity" "current" {}

resource "aws_kms_key" "redis" {
  description         = "${var.name} ElastiCache at-rest encryption and its auth secret"
  enable_key_rotation = true
  # The account administers the key; IAM policies grant its use. (A key policy's "*" is this key.)
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

resource "aws_secretsmanager_secret" "auth" {
  name_prefix = "${var.name}-redis-auth-"
  description = "AUTH token of the ${var.name} Redis replication group"
  kms_key_id  = aws_kms_key.redis.arn
  tags        = var.tags
}

resource "aws_secretsmanager_secret_version" "auth" {
  secret_id     = aws_secretsmanager_secret.auth.id
  secret_string = random_password.auth.result
}

resource "aws_elasticache_subnet_group" "this" {
  name       = var.name
  subnet_ids = var.subnet_ids
  tags       = var.tags
}

resource "aws_security_group" "redis" {
  name_prefix = "${var.name}-redis-"
  description = "Redis for ${var.name}: reachable from the worker and API nodes only"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-redis" })
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "redis" {
  for_each                     = toset(var.allowed_security_group_ids)
  security_group_id            = aws_security_group.redis.id
  description                  = "Redis TLS from ${each.value}"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  tags                         = var.tags
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id       = var.name
  description                = "Ferry queues, jobs and token streams (${var.name})"
  engine                     = "redis"
  engine_version             = var.engine_version
  parameter_group_name       = "default.redis7.cluster.on"
  node_type                  = var.node_type
  port                       = 6379
  cluster_mode               = "enabled"
  num_node_groups            = var.num_node_groups
  replicas_per_node_group    = var.replicas_per_node_group
  multi_az_enabled           = var.replicas_per_node_group > 0
  automatic_failover_enabled = true # required in cluster mode; a shard without a replica has nothing to fail over to
  subnet_group_name          = aws_elasticache_subnet_group.this.name
  security_group_ids         = [aws_security_group.redis.id]
  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.redis.arn
  transit_encryption_enabled = true
  auth_token                 = random_password.auth.result
  auth_token_update_strategy = "ROTATE"
  snapshot_retention_limit   = var.snapshot_retention_days
  auto_minor_version_upgrade = true
  apply_immediately          = false
  tags                       = var.tags
}
