variable "name" {
  description = "Replication group id and name prefix (e.g. ferry-dev)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,34}$", var.name))
    error_message = "name must be 2-35 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the cache nodes (one per availability zone)."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 1
    error_message = "Give at least one subnet."
  }
}

variable "allowed_security_group_ids" {
  description = "Security groups allowed to reach Redis on its port (the EKS node and cluster security groups)."
  type        = list(string)
}

variable "node_type" {
  description = "ElastiCache node type. Jobs and token streams are small: cache.t4g.small is plenty for a dev pool."
  type        = string
  default     = "cache.t4g.small"
  validation {
    condition     = can(regex("^cache\\.[a-z0-9]+\\.[a-z0-9]+$", var.node_type))
    error_message = "node_type must look like cache.<family>.<size>, e.g. cache.t4g.small."
  }
}

variable "engine_version" {
  description = "Redis engine version. 7.x is required: the autoscalers read consumer-group lag (XINFO GROUPS)."
  type        = string
  default     = "7.1"
  validation {
    condition     = can(regex("^7\\.", var.engine_version))
    error_message = "engine_version must be Redis 7.x (KEDA's lagCount and the autoscaler need XINFO GROUPS lag)."
  }
}

variable "num_node_groups" {
  description = "Shards of the cluster; each holds a share of the hash slots, so of the queue shards (FERRY_QUEUE_SHARDS). bench/redis_capacity.py sizes it."
  type        = number
  default     = 1
  validation {
    condition     = var.num_node_groups >= 1 && var.num_node_groups <= 500 && floor(var.num_node_groups) == var.num_node_groups
    error_message = "num_node_groups must be a whole number from 1 to 500."
  }
}

variable "replicas_per_node_group" {
  description = "Replicas of each shard's primary, in other zones (0-5). With 1 or more, Multi-AZ and failover protect acknowledged jobs (FERRY_REDIS_MIN_REPLICAS)."
  type        = number
  default     = 0
  validation {
    condition     = var.replicas_per_node_group >= 0 && var.replicas_per_node_group <= 5 && floor(var.replicas_per_node_group) == var.replicas_per_node_group
    error_message = "replicas_per_node_group must be a whole number from 0 to 5."
  }
}

variable "snapshot_retention_days" {
  description = "Days of automatic backups kept (0 turns backups off)."
  type        = number
  default     = 3
  validation {
    condition     = var.snapshot_retention_days >= 0 && var.snapshot_retention_days <= 35
    error_message = "snapshot_retention_days must be between 0 and 35."
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
