# Inputs of the SkyLB Route 53 records: the hosted zone, the service name, and one entry per regional balancer.

variable "zone_id" {
  description = "ID of the Route 53 hosted zone that holds service_name (e.g. Z0123456789ABCDEFGHIJ)."
  type        = string
}

variable "service_name" {
  description = "The one name every client resolves, inside the hosted zone (e.g. llm.example.com)."
  type        = string
}

variable "ttl_s" {
  description = "TTL of each record (s): how long a resolver may keep sending clients to a balancer that failed. SkyLB's BIND views use 5 s too."
  type        = number
  default     = 5
}

variable "balancers" {
  description = "Region name -> its balancer's public IPv4 address and the AWS region Route 53 measures client latency to (latency_routing_policy)."
  type = map(object({
    address    = string
    aws_region = string
  }))
  # e.g. { us = { address = "203.0.113.10", aws_region = "us-east-1" },
  #        eu = { address = "203.0.113.20", aws_region = "eu-west-1" },
  #        asia = { address = "203.0.113.30", aws_region = "ap-northeast-1" } }
}

variable "balancer_port" {
  description = "The port each balancer serves (the health check asks GET /healthz there)."
  type        = number
  default     = 8080
}

variable "health_check_protocol" {
  description = "HTTP, or HTTPS when the balancers terminate TLS."
  type        = string
  default     = "HTTP"
  validation {
    condition     = contains(["HTTP", "HTTPS"], var.health_check_protocol)
    error_message = "health_check_protocol must be HTTP or HTTPS."
  }
}

variable "health_check_interval_s" {
  description = "Seconds between two checks from each Route 53 checker (10 or 30)."
  type        = number
  default     = 10
}

variable "health_check_failure_threshold" {
  description = "Consecutive failed checks that make a balancer unhealthy (its record stops being answered)."
  type        = number
  default     = 3
}
