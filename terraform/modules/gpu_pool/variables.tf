variable "name" {
  description = "EKS cluster name (e.g. ferry-dev)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.31"
  validation {
    condition     = can(regex("^1\\.(2[9]|3[0-9])$", var.kubernetes_version))
    error_message = "kubernetes_version must be 1.29 or newer, as MAJOR.MINOR."
  }
}

variable "vpc_id" {
  description = "VPC of the cluster."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets for the control plane ENIs and the nodes."
  type        = list(string)
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two availability zones."
  }
}

variable "public_access_cidrs" {
  description = "CIDRs allowed to reach the Kubernetes API from the internet (your office or VPN). Empty: private endpoint only (run kubectl from inside the VPC)."
  type        = list(string)
  default     = []
  validation {
    condition     = alltrue([for c in var.public_access_cidrs : can(cidrnetmask(c)) && c != "0.0.0.0/0"])
    error_message = "public_access_cidrs must be valid IPv4 CIDRs, and not 0.0.0.0/0."
  }
}

variable "gpu_instance_types" {
  description = "GPU instance types for the worker pool, in order of preference (one GPU per worker: the *.xlarge-*.4xlarge sizes)."
  type        = list(string)
  default     = ["g6.xlarge", "g5.xlarge"]
  validation {
    condition     = length(var.gpu_instance_types) > 0 && alltrue([for t in var.gpu_instance_types : can(regex("^(g[4-6][a-z]*|p[3-5][a-z]*)\\.[0-9a-z]+$", t))])
    error_message = "gpu_instance_types must be NVIDIA GPU instance types (g4dn/g5/g6/g6e/p3/p4d/p5 families)."
  }
}

variable "gpus_per_node" {
  description = "GPUs on each instance type above (tells the cluster autoscaler what a node from zero will offer)."
  type        = number
  default     = 1
  validation {
    condition     = var.gpus_per_node >= 1 && var.gpus_per_node <= 8
    error_message = "gpus_per_node must be between 1 and 8."
  }
}

variable "gpu_capacity_type" {
  description = "ON_DEMAND or SPOT for the GPU nodes (workers drain on SIGTERM and hand jobs back, so SPOT is safe)."
  type        = string
  default     = "ON_DEMAND"
  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "gpu_min_size" {
  description = "Fewest GPU nodes. 0 lets an idle pool cost nothing."
  type        = number
  default     = 0
  validation {
    condition     = var.gpu_min_size >= 0
    error_message = "gpu_min_size must be >= 0."
  }
}

variable "gpu_max_size" {
  description = "Most GPU nodes (your GPU quota and budget ceiling)."
  type        = number
  default     = 4
  validation {
    condition     = var.gpu_max_size >= 1 && var.gpu_max_size <= 100
    error_message = "gpu_max_size must be between 1 and 100."
  }
}

variable "gpu_disk_gb" {
  description = "Root volume of a GPU node: container image plus model weights."
  type        = number
  default     = 200
  validation {
    condition     = var.gpu_disk_gb >= 50
    error_message = "gpu_disk_gb must be at least 50."
  }
}

variable "system_instance_types" {
  description = "Instance types of the always-on CPU node group (API, KEDA, CoreDNS, cluster autoscaler)."
  type        = list(string)
  default     = ["t3.large"]
}

variable "system_min_size" {
  description = "Fewest CPU system nodes (at least 1: KEDA must be running to wake the GPU pool)."
  type        = number
  default     = 1
  validation {
    condition     = var.system_min_size >= 1
    error_message = "system_min_size must be >= 1: something has to run KEDA while the GPU pool is at zero."
  }
}

variable "system_max_size" {
  description = "Most CPU system nodes."
  type        = number
  default     = 3
}

variable "log_retention_days" {
  description = "Days to keep control-plane logs."
  type        = number
  default     = 365
}

variable "chart_versions" {
  description = "Helm chart versions of the cluster add-ons."
  type = object({
    nvidia_device_plugin = string
    keda                 = string
    cluster_autoscaler   = string
  })
  default = {
    nvidia_device_plugin = "0.17.0"
    keda                 = "2.16.1"
    cluster_autoscaler   = "9.43.2"
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
