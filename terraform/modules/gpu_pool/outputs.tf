output "cluster_name" {
  description = "EKS cluster name."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API endpoint."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca_certificate" {
  description = "Base64 cluster CA certificate."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "cluster_security_group_id" {
  description = "Security group EKS attaches to the control plane and managed nodes (allow it into Redis)."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "IAM OIDC provider of the cluster, for IRSA roles."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer" {
  description = "OIDC issuer host/path without https:// (the prefix of IRSA condition keys)."
  value       = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
}

output "gpu_node_label" {
  description = "Label on every GPU node; the worker Deployment's nodeSelector."
  value       = local.gpu_label
}

output "gpu_node_taint" {
  description = "Taint on every GPU node; the worker Deployment tolerates it."
  value       = local.gpu_taint
}
