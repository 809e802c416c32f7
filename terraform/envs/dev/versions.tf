terraform {
  required_version = ">= 1.6.0"
  # Exact pins for the root module; `terraform init` writes .terraform.lock.hcl, commit it.
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "5.80.0"
    }
    helm = {
      source  = "hashicorp/helm"
      version = "2.16.1"
    }
    random = {
      source  = "hashicorp/random"
      version = "3.6.3"
    }
    tls = {
      source  = "hashicorp/tls"
      version = "4.0.6"
    }
  }
}

provider "aws" {
  region = var.region
  default_tags {
    tags = local.tags
  }
}

# Helm talks to the cluster this configuration creates, authenticating with the AWS CLI.
provider "helm" {
  kubernetes {
    host                   = module.gpu_pool.cluster_endpoint
    cluster_ca_certificate = base64decode(module.gpu_pool.cluster_ca_certificate)
    exec {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", module.gpu_pool.cluster_name, "--region", var.region]
    }
  }
}
