variable "bucket_name" {
  description = "Globally unique S3 bucket name for prefix-cache snapshots."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)) && !can(regex("\\.\\.", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 lowercase letters, digits, dots, dashes)."
  }
}

variable "snapshot_prefix" {
  description = "Key prefix under which workers write snapshots (FERRY_SNAPSHOT_URL = s3://BUCKET/PREFIX/...)."
  type        = string
  default     = "snapshots"
  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9_.-]*$", var.snapshot_prefix))
    error_message = "snapshot_prefix must be one path segment without slashes (letters, digits, _ . -)."
  }
}

variable "noncurrent_version_days" {
  description = "Days an overwritten or deleted snapshot object is kept as a noncurrent version."
  type        = number
  default     = 7
  validation {
    condition     = var.noncurrent_version_days >= 1
    error_message = "noncurrent_version_days must be at least 1."
  }
}

variable "snapshot_expiry_days" {
  description = "Days after which a snapshot object is expired even if current (a model idle that long starts cold)."
  type        = number
  default     = 30
  validation {
    condition     = var.snapshot_expiry_days >= 1
    error_message = "snapshot_expiry_days must be at least 1."
  }
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete a bucket that still holds snapshots (dev only)."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
