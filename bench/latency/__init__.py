"""Injected cross-region latency: a Toxiproxy-API-compatible proxy and a helper that builds links with it.

- ``skylb toxiproxy`` (bench.latency.server): the proxy server, Shopify Toxiproxy's HTTP API v2.
- bench.latency.toxics: what each toxic (latency, bandwidth, timeout, reset_peer, slow_close, limit_data) does.
- bench.latency.links: ``LatencyLinks``, which turns "region A reaches region B with RTT r" into a proxy address.
"""

from bench.latency.links import LatencyLinks, api_reachable

__all__ = ["LatencyLinks", "api_reachable"]
