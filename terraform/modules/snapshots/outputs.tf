output "bucket_name" {
  description = "Snapshot bucket name."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "Snapshot bucket ARN."
  value       = aws_s3_bucket.this.arn
}

output "kms_key_arn" {
  description = "KMS key that encrypts the snapshots (workers need Decrypt and GenerateDataKey on it)."
  value       = aws_kms_key.snapshots.arn
}

output "snapshot_prefix" {
  description = "Key prefix workers write under."
  value       = var.snapshot_prefix
}

output "snapshot_url" {
  description = "FERRY_SNAPSHOT_URL for the workers."
  value       = "s3://${aws_s3_bucket.this.id}/${var.snapshot_prefix}"
}
