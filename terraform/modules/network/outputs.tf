output "vpc_id" {
  description = "VPC id."
  value       = aws_vpc.this.id
}

output "vpc_cidr_block" {
  description = "VPC CIDR."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "Private subnets (EKS nodes, ElastiCache), one per availability zone."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnets (NAT gateways and internet-facing load balancers)."
  value       = aws_subnet.public[*].id
}

output "s3_endpoint_id" {
  description = "S3 gateway endpoint id (snapshot bucket policies may pin access to it)."
  value       = aws_vpc_endpoint.s3.id
}
