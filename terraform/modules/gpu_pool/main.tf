# EKS cluster with two managed node groups: a small always-on CPU group (API, KEDA, CoreDNS,
# cluster autoscaler) and a tainted GPU group that scales to zero. KEDA sizes the worker
# Deployment from Redis stream lag; pending GPU pods make the cluster autoscaler add nodes
# (from zero, too: the ASG tags below tell it what a GPU node would look like); idle nodes are
# removed after scale-down-unneeded-time.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  gpu_label = { key = "ferry/pool", value = "gpu" }
  gpu_taint = { key = "nvidia.com/gpu", value = "true", effect = "NoSchedule" }
  # Read by the cluster autoscaler when the group has no node to look at (scale from zero).
  gpu_asg_tags = {
    "k8s.io/cluster-autoscaler/node-template/label/${local.gpu_label.key}"  = local.gpu_label.value
    "k8s.io/cluster-autoscaler/node-template/taint/${local.gpu_taint.key}"  = "${local.gpu_taint.value}:${local.gpu_taint.effect}"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"      = tostring(var.gpus_per_node)
    "k8s.io/cluster-autoscaler/node-template/label/nvidia.com/gpu.present" = "true"
  }
  policy_prefix = "arn:${data.aws_partition.current.partition}:iam::aws:policy"
}

# --- control plane ---------------------------------------------------------------------------

resource "aws_kms_key" "eks" {
  description         = "${var.name} EKS secrets and control-plane logs"
  enable_key_rotation = true
  policy              = local.eks_key_policy
  tags                = var.tags
}

# A key policy, not an IAM policy: its Resource "*" means this key. The account administers
# the key; CloudWatch Logs may use it for this environment's log groups only.
locals {
  eks_key_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdmin"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogs"
        Effect    = "Allow"
        Principal = { Service = "logs.${data.aws_region.current.name}.amazonaws.com" }
        Action    = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnLike = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${data.aws_partition.current.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:/aws/eks/${var.name}/*"
          }
        }
      },
    ]
  })
}

resource "aws_cloudwatch_log_group" "eks" {
  name              = "/aws/eks/${var.name}/cluster" # the name EKS writes to
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.eks.arn
  tags              = var.tags
}

data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.name}-eks-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "${local.policy_prefix}/AmazonEKSClusterPolicy"
}

resource "aws_eks_cluster" "this" {
  name                      = var.name
  version                   = var.kubernetes_version
  role_arn                  = aws_iam_role.cluster.arn
  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_config {
    subnet_ids              = var.subnet_ids
    endpoint_private_access = true
    endpoint_public_access  = length(var.public_access_cidrs) > 0
    # Unused while the public endpoint is off; set so that no plan ever shows 0.0.0.0/0.
    public_access_cidrs = length(var.public_access_cidrs) > 0 ? var.public_access_cidrs : ["10.255.255.255/32"]
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = aws_kms_key.eks.arn
    }
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.cluster, aws_cloudwatch_log_group.eks]
}

# IRSA: pods assume IAM roles through the cluster's OIDC issuer (no node-wide credentials).
data "tls_certificate" "oidc" {
  url = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

resource "aws_iam_openid_connect_provider" "this" {
  url             = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list  = ["sts.amazonaws.com"]
  thumbprint_list = [data.tls_certificate.oidc.certificates[0].sha1_fingerprint]
  tags            = var.tags
}

# --- nodes -----------------------------------------------------------------------------------

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.name}-eks-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each   = toset(["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly"])
  role       = aws_iam_role.node.name
  policy_arn = "${local.policy_prefix}/${each.value}"
}

# IMDSv2 only, one hop: pods cannot borrow the node role; they get credentials through IRSA.
resource "aws_launch_template" "gpu" {
  name_prefix = "${var.name}-gpu-"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = var.gpu_disk_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-gpu" })
  }
  tags = var.tags
}

resource "aws_launch_template" "system" {
  name_prefix = "${var.name}-system-"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = 50
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-system" })
  }
  tags = var.tags
}

resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = var.system_instance_types
  capacity_type   = "ON_DEMAND"
  labels          = { "ferry/pool" = "system" }

  scaling_config {
    min_size     = var.system_min_size
    max_size     = var.system_max_size
    desired_size = var.system_min_size
  }
  launch_template {
    id      = aws_launch_template.system.id
    version = aws_launch_template.system.latest_version
  }
  update_config {
    max_unavailable = 1
  }
  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }
  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_NVIDIA" # EKS-optimised AMI with the NVIDIA driver and container toolkit
  instance_types  = var.gpu_instance_types
  capacity_type   = var.gpu_capacity_type
  labels          = { (local.gpu_label.key) = local.gpu_label.value }

  taint {
    key    = local.gpu_taint.key
    value  = local.gpu_taint.value
    effect = "NO_SCHEDULE"
  }
  scaling_config {
    min_size     = var.gpu_min_size
    max_size     = var.gpu_max_size
    desired_size = var.gpu_min_size
  }
  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }
  update_config {
    max_unavailable = 1
  }
  lifecycle {
    # The cluster autoscaler owns the current size; Terraform owns the bounds.
    ignore_changes = [scaling_config[0].desired_size]
    precondition {
      condition     = var.gpu_min_size <= var.gpu_max_size
      error_message = "gpu_min_size must not exceed gpu_max_size."
    }
  }
  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_autoscaling_group_tag" "gpu_template" {
  for_each               = local.gpu_asg_tags
  autoscaling_group_name = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name
  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}
