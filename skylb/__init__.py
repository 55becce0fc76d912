"""SkyLB: a locality-aware, cross-region load balancer for LLM inference.

One balancer runs per region in front of that region's inference replicas; balancers forward overflow to peers in other
regions; a central controller owns membership. Source: "SkyLB: A Locality-Aware Cross-Region Load Balancer for LLM
Inference" (the SkyLB paper), §3-§4.
"""

__all__ = ["__version__", "PROTOCOL_VERSION"]

__version__ = "0.1.0"
#: Version of the balancer-to-balancer msgpack protocol (peer status, forwarded-request marking).
PROTOCOL_VERSION = 1
