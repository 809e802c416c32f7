variable "name" {
  description = "Name prefix for every resource (e.g. ferry-dev)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name must be 2-31 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "cidr_block" {
  description = "VPC CIDR; split into one public and one private subnet per availability zone."
  type        = string
  default     = "10.40.0.0/16"
  validation {
    condition     = can(cidrnetmask(var.cidr_block)) && tonumber(split("/", var.cidr_block)[1]) <= 20
    error_message = "cidr_block must be a valid IPv4 CIDR of /20 or larger."
  }
}

variable "availability_zones" {
  description = "Availability zones to spread subnets over (2 or 3). GPU capacity differs by zone: list the zones that have your instance types."
  type        = list(string)
  validation {
    condition     = length(var.availability_zones) >= 2 && length(var.availability_zones) <= 3
    error_message = "Give 2 or 3 availability zones (EKS and ElastiCache Multi-AZ need at least 2)."
  }
}

variable "single_nat_gateway" {
  description = "One NAT gateway for all zones (cheaper, one zone's failure cuts egress) instead of one per zone."
  type        = bool
  default     = true
}

variable "cluster_name" {
  description = "EKS cluster name, for the subnet discovery tags load balancers and Karpenter-style tools read."
  type        = string
}

variable "flow_log_retention_days" {
  description = "Days to keep VPC flow logs."
  type        = number
  default     = 365
  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days must be a retention period CloudWatch Logs accepts."
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
