"""The per-region balancer process: API, queue, dispatcher, proxy, probers, membership, metrics."""
