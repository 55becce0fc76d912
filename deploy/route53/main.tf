# SkyLB behind Route 53: one latency-based record per regional balancer, each tied to a health check of that
# balancer's GET /healthz. Route 53 answers a client with the healthy balancer of lowest measured latency, and
# stops answering with a balancer whose health check fails (clients then go to the next nearest region). This is
# the cloud counterpart of the BIND views that `skylb local --dns` runs and tests (see README.md here).
#
#   terraform init && terraform apply -var-file=skylb.tfvars

terraform {
  required_version = ">= 1.3"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

# Route 53 is global; the provider's region only picks the API endpoint (from AWS_REGION or the profile).
provider "aws" {}

resource "aws_route53_health_check" "balancer" {
  for_each = var.balancers

  ip_address        = each.value.address
  port              = var.balancer_port
  type              = var.health_check_protocol
  resource_path     = "/healthz"
  request_interval  = var.health_check_interval_s
  failure_threshold = var.health_check_failure_threshold

  tags = {
    Name = "skylb-${each.key}"
  }
}

resource "aws_route53_record" "balancer" {
  for_each = var.balancers

  zone_id         = var.zone_id
  name            = var.service_name
  type            = "A"
  ttl             = var.ttl_s
  records         = [each.value.address]
  set_identifier  = "skylb-${each.key}"
  health_check_id = aws_route53_health_check.balancer[each.key].id

  latency_routing_policy {
    region = each.value.aws_region
  }
}

output "health_check_ids" {
  description = "Region -> the Route 53 health check of its balancer."
  value       = { for region, check in aws_route53_health_check.balancer : region => check.id }
}
