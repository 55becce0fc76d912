"""Static membership: a balancer's replicas and peers given on its command line, with no controller.

`skylb balancer --replica URL [--replica URL ...] [--peer REGION=URL ...]` serves in front of replicas that already
run, as HAProxy's ``server`` lines or the SGLang router's ``--worker-urls`` do. The flags become one membership
snapshot, in the controller's shape (controller/store.py ``snapshot``: ``revision``, ``replicas``, ``balancers``,
``assignments``), that the balancer applies once at start (Balancer.apply_membership); nothing is persisted and
nothing is watched. Replicas are probed and ejected as always; a replica that is down stays a member and comes back
when its probes succeed.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from skylb.config import ConfigError

__all__ = ["STATIC_REGION", "ENGINES", "static_membership", "parse_peers"]

#: The region of a balancer started with --replica and no --region.
STATIC_REGION = "local"
#: The engines --engine accepts: the adapters' names (skylb/engines), and ``auto``, which detects each replica's.
ENGINES: tuple[str, ...] = ("auto", "vllm", "sglang", "llamacpp", "tgi", "ollama", "openai")


def _url(text: str, flag: str) -> str:
    """``text`` without a trailing slash; ConfigError naming ``flag`` when it is not an http(s) URL with a host."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} must be an http:// or https:// URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _region_name(name: str, flag: str) -> str:
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"{flag}: region name {name!r} must be letters, digits, '-' or '_'")
    return name


def parse_peers(items: list[str], *, region: str) -> dict[str, str]:
    """``--peer REGION=URL`` items as {region: url}. Raises ConfigError for a malformed item, a region given twice,
    or a peer named like this balancer's own ``region``."""
    peers: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep:
            raise ConfigError(f"--peer must be REGION=URL (the peer balancer's region and URL), got {item!r}")
        name = _region_name(name.strip(), "--peer")
        if name == region:
            raise ConfigError(f"--peer {name}: a peer needs a region of its own; this balancer's region is "
                              f"{region!r} (set it with --region)")
        if name in peers:
            raise ConfigError(f"--peer {name} is given twice")
        peers[name] = _url(url.strip(), f"--peer {name}")
    return peers


def static_membership(region: str, replicas: list[str], *, engine: str = "auto",
                      peers: dict[str, str] | None = None) -> dict:
    """The membership snapshot of ``replicas`` (base URLs, served by ``region``'s balancer through the ``engine``
    adapter) and ``peers`` ({region: balancer URL}). Replica ids are ``<region>-<n>``, n from 1 in flag order.

    Raises ConfigError for a URL that is not http(s), a URL given twice, or an unknown engine.
    """
    _region_name(region, "--region")
    if engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    urls = [_url(u.strip(), "--replica") for u in replicas]
    if len(set(urls)) != len(urls):
        raise ConfigError("--replica: the same URL is given twice")
    return {
        "revision": 0,
        "replicas": [{"id": f"{region}-{i}", "region": region, "url": url, "engine": engine}
                     for i, url in enumerate(urls, start=1)],
        "balancers": [{"region": name, "url": url} for name, url in (peers or {}).items()],
        "assignments": [],
    }
