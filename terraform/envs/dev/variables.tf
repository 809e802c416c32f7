variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "name" {
  description = "Name of this environment's resources (cluster, Redis, roles)."
  type        = string
  default     = "ferry-dev"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "availability_zones" {
  description = "Two or three zones of the region that offer your GPU instance types."
  type        = list(string)
  default     = ["us-east-1a", "us-east-1b"]
}

variable "snapshot_bucket_name" {
  description = "Globally unique bucket name for prefix-cache snapshots."
  type        = string
}

variable "model_object_arns" {
  description = "Model weights in S3 the workers may read (FERRY_MODEL=s3://...), e.g. [\"arn:aws:s3:::my-models/llama-3.1-8b/*\"]."
  type        = list(string)
  default     = []
}

variable "public_access_cidrs" {
  description = "Your public IP/CIDR for kubectl (empty: private API endpoint only)."
  type        = list(string)
  default     = []
}

variable "gpu_instance_types" {
  description = "GPU instance types of the worker pool."
  type        = list(string)
  default     = ["g6.xlarge", "g5.xlarge"]
}

variable "gpu_max_size" {
  description = "Most GPU nodes."
  type        = number
  default     = 2
}

variable "redis_num_node_groups" {
  description = "Redis Cluster shards (docs/cluster.md sizes them: bench/redis_capacity.py)."
  type        = number
  default     = 1
}

variable "redis_replicas_per_node_group" {
  description = "Replicas per Redis shard, in other zones (0 keeps an idle dev environment cheap; production: 1 or more)."
  type        = number
  default     = 0
}

variable "key_prefix" {
  description = "FERRY_KEY_PREFIX of the deployment (infra/k8s sets ferry); names the Celery queue."
  type        = string
  default     = "ferry"
}

variable "owner" {
  description = "Owner tag (team or person) on every resource."
  type        = string
  validation {
    condition     = length(trimspace(var.owner)) > 0
    error_message = "owner must not be empty: every resource is tagged with it."
  }
}
