output "worker_role_arn" {
  description = "Annotate the ferry-worker service account with it (eks.amazonaws.com/role-arn)."
  value       = aws_iam_role.worker.arn
}

output "api_role_arn" {
  description = "Annotate the ferry-api service account with it (eks.amazonaws.com/role-arn)."
  value       = aws_iam_role.api.arn
}
