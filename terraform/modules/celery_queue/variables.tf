variable "name" {
  description = "Name prefix of the dead-letter queue and the key (e.g. ferry-dev)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,40}$", var.name))
    error_message = "name must be lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "key_prefix" {
  description = "FERRY_KEY_PREFIX of the deployment: the queue is named <key_prefix>_webhooks, as kombu spells the Celery queue."
  type        = string
  default     = "ferry"
  validation {
    condition     = can(regex("^[A-Za-z0-9_-]{1,60}$", var.key_prefix))
    error_message = "key_prefix must be 1-60 letters, digits, dashes or underscores (an SQS queue name)."
  }
}

variable "visibility_timeout_s" {
  description = "How long a received task stays invisible: longer than the longest webhook backoff, 2 x FERRY_WEBHOOK_RETRY_MAX_S + FERRY_WEBHOOK_TIMEOUT_S (worker/webhooks/tasks.py)."
  type        = number
  default     = 7260
  validation {
    condition     = var.visibility_timeout_s >= 3600 && var.visibility_timeout_s <= 43200
    error_message = "visibility_timeout_s must be between 3600 and 43200 (the SQS maximum)."
  }
}

variable "max_receive_count" {
  description = "Receives without an acknowledgement before a task moves to the dead-letter queue."
  type        = number
  default     = 5
  validation {
    condition     = var.max_receive_count >= 1 && var.max_receive_count <= 1000
    error_message = "max_receive_count must be between 1 and 1000."
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
