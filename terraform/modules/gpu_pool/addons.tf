# Cluster add-ons as Helm releases: the NVIDIA device plugin (advertises nvidia.com/gpu),
# KEDA (scales the worker Deployment on Redis stream lag, to and from zero) and the cluster
# autoscaler (adds GPU nodes for pending workers, removes idle ones).

resource "helm_release" "nvidia_device_plugin" {
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.chart_versions.nvidia_device_plugin
  namespace  = "kube-system"
  values = [yamlencode({
    nodeSelector = { (local.gpu_label.key) = local.gpu_label.value }
    tolerations  = [{ key = local.gpu_taint.key, operator = "Exists", effect = local.gpu_taint.effect }]
  })]
  depends_on = [aws_eks_node_group.system]
}

resource "helm_release" "keda" {
  name             = "keda"
  repository       = "https://kedacore.github.io/charts"
  chart            = "keda"
  version          = var.chart_versions.keda
  namespace        = "keda"
  create_namespace = true
  values = [yamlencode({
    nodeSelector = { "ferry/pool" = "system" }
  })]
  depends_on = [aws_eks_node_group.system]
}

resource "helm_release" "cluster_autoscaler" {
  name       = "cluster-autoscaler"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = var.chart_versions.cluster_autoscaler
  namespace  = "kube-system"
  values = [yamlencode({
    awsRegion     = data.aws_region.current.name
    autoDiscovery = { clusterName = aws_eks_cluster.this.name }
    nodeSelector  = { "ferry/pool" = "system" }
    rbac = {
      serviceAccount = {
        name        = "cluster-autoscaler"
        annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.cluster_autoscaler.arn }
      }
    }
    extraArgs = {
      expander                        = "least-waste"
      "balance-similar-node-groups"   = "true"
      "skip-nodes-with-local-storage" = "false"
      # How long an empty GPU node is kept: the tail of the idle cost in terraform/README.md.
      "scale-down-unneeded-time"   = "5m"
      "scale-down-delay-after-add" = "5m"
    }
  })]
  depends_on = [aws_eks_node_group.system]
}

# The cluster autoscaler's IRSA role: describe everything, resize only this cluster's groups.
data "aws_iam_policy_document" "cluster_autoscaler_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [aws_iam_openid_connect_provider.this.arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")}:sub"
      values   = ["system:serviceaccount:kube-system:cluster-autoscaler"]
    }
    condition {
      test     = "StringEquals"
      variable = "${replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster_autoscaler" {
  name               = "${var.name}-cluster-autoscaler"
  assume_role_policy = data.aws_iam_policy_document.cluster_autoscaler_assume.json
  tags               = var.tags
}

locals {
  node_group_asg_arns = [
    for ng in [aws_eks_node_group.system, aws_eks_node_group.gpu] :
    "arn:${data.aws_partition.current.partition}:autoscaling:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:autoScalingGroup:*:autoScalingGroupName/${ng.resources[0].autoscaling_groups[0].name}"
  ]
}

data "aws_iam_policy_document" "cluster_autoscaler" {
  statement {
    sid = "Describe"
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLaunchConfigurations",
      "autoscaling:DescribeScalingActivities",
      "autoscaling:DescribeTags",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:GetInstanceTypesFromInstanceRequirements",
    ]
    resources = ["*"] # these calls take no resource-level permissions
  }
  statement {
    sid       = "DescribeOwnNodeGroups"
    actions   = ["eks:DescribeNodegroup"]
    resources = [aws_eks_node_group.system.arn, aws_eks_node_group.gpu.arn]
  }
  statement {
    sid       = "ResizeOwnGroups"
    actions   = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
    resources = local.node_group_asg_arns
  }
}

resource "aws_iam_role_policy" "cluster_autoscaler" {
  name   = "cluster-autoscaler"
  role   = aws_iam_role.cluster_autoscaler.id
  policy = data.aws_iam_policy_document.cluster_autoscaler.json
}
