variable "name" {
  description = "Name prefix of the roles (e.g. ferry-dev)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,40}$", var.name))
    error_message = "name must be lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "oidc_provider_arn" {
  description = "IAM OIDC provider of the EKS cluster."
  type        = string
}

variable "oidc_issuer" {
  description = "OIDC issuer without https:// (gpu_pool output oidc_issuer)."
  type        = string
}

variable "namespace" {
  description = "Kubernetes namespace of the Ferry service accounts (infra/k8s uses ferry)."
  type        = string
  default     = "ferry"
}

variable "worker_service_account" {
  description = "Service account of the GPU workers."
  type        = string
  default     = "ferry-worker"
}

variable "api_service_account" {
  description = "Service account of the API and the webhook worker."
  type        = string
  default     = "ferry-api"
}

variable "snapshot_bucket_arn" {
  description = "ARN of the snapshot bucket."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:s3:::[a-z0-9.-]+$", var.snapshot_bucket_arn))
    error_message = "snapshot_bucket_arn must be an S3 bucket ARN."
  }
}

variable "snapshot_prefix" {
  description = "The only key prefix the workers may read and write."
  type        = string
  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_.-]*$", var.snapshot_prefix))
    error_message = "snapshot_prefix must be one path segment without slashes or wildcards."
  }
}

variable "model_object_arns" {
  description = "Model weights the workers may read for FERRY_MODEL=s3://BUCKET/PREFIX/ (docs/models.md): object ARNs ending in a prefix wildcard, e.g. arn:aws:s3:::my-models/llama-3.1-8b/*. Empty: no model bucket."
  type        = list(string)
  default     = []
  validation {
    condition     = alltrue([for arn in var.model_object_arns : can(regex("^arn:aws[a-z-]*:s3:::[a-z0-9.-]+/[^*]+\\*$", arn))])
    error_message = "model_object_arns entries must look like arn:aws:s3:::BUCKET/PREFIX/*."
  }
}

variable "snapshot_kms_key_arn" {
  description = "KMS key of the snapshot bucket."
  type        = string
}

variable "celery_queue_arn" {
  description = "ARN of the Celery task queue on SQS (celery_queue output queue_arn)."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:sqs:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]+$", var.celery_queue_arn))
    error_message = "celery_queue_arn must be an SQS queue ARN."
  }
}

variable "celery_queue_kms_key_arn" {
  description = "KMS key of the Celery queue."
  type        = string
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
