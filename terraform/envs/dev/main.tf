# One example environment: the whole Ferry stack in one region, GPU pool at zero when idle.

locals {
  tags = {
    Project     = "ferry"
    Environment = "dev"
    Owner       = var.owner
    ManagedBy   = "terraform"
  }
}

module "network" {
  source             = "../../modules/network"
  name               = var.name
  availability_zones = var.availability_zones
  cluster_name       = var.name
  single_nat_gateway = true
  tags               = local.tags
}

module "gpu_pool" {
  source              = "../../modules/gpu_pool"
  name                = var.name
  vpc_id              = module.network.vpc_id
  subnet_ids          = module.network.private_subnet_ids
  public_access_cidrs = var.public_access_cidrs
  gpu_instance_types  = var.gpu_instance_types
  gpu_min_size        = 0
  gpu_max_size        = var.gpu_max_size
  tags                = local.tags
}

module "redis" {
  source                     = "../../modules/redis"
  name                       = var.name
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.gpu_pool.cluster_security_group_id]
  num_node_groups            = var.redis_num_node_groups
  replicas_per_node_group    = var.redis_replicas_per_node_group
  tags                       = local.tags
}

module "snapshots" {
  source          = "../../modules/snapshots"
  bucket_name     = var.snapshot_bucket_name
  snapshot_prefix = "snapshots"
  force_destroy   = true # dev: `terraform destroy` may delete snapshots
  tags            = local.tags
}

module "celery_queue" {
  source     = "../../modules/celery_queue"
  name       = var.name
  key_prefix = var.key_prefix
  tags       = local.tags
}

module "iam" {
  source                   = "../../modules/iam"
  name                     = var.name
  oidc_provider_arn        = module.gpu_pool.oidc_provider_arn
  oidc_issuer              = module.gpu_pool.oidc_issuer
  snapshot_bucket_arn      = module.snapshots.bucket_arn
  snapshot_prefix          = module.snapshots.snapshot_prefix
  snapshot_kms_key_arn     = module.snapshots.kms_key_arn
  model_object_arns        = var.model_object_arns
  celery_queue_arn         = module.celery_queue.queue_arn
  celery_queue_kms_key_arn = module.celery_queue.kms_key_arn
  tags                     = local.tags
}
