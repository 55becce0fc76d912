"""Static membership: a balancer's replicas and peers given on its command line, with no controller.

`skylb balancer --replica URL [--replica URL ...] [--peer REGION=URL ...]` serves in front of replicas that already
run, as HAProxy's ``server`` lines or the SGLang router's ``--worker-urls`` do. The flags become one membership
snapshot, in the controller's shape (controller/store.py ``snapshot``: ``revision``, ``replicas``, ``balancers``,
``assignments``), that the balancer applies once at start (Balancer.apply_membership); nothing is persisted and
nothing is watched. Replicas are probed and ejected as always; a replica that is down stays a member and comes back
when its probes succeed.

A replica that publishes KV-cache events (vLLM ``--kv-events-config``) names its endpoints after ``#``:
``http://10.0.0.5:8000#kv=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,block_size=16`` (``replay`` and
``block_size`` optional). They become the entry's ``kv_events``, ``kv_events_replay`` and ``kv_block_size``, as
`skylb-ctl replica add --kv-events` sets them (skylb/balancer/kv_routing.py). ``max_concurrency=N`` after ``#``
states the replica's batch (vLLM ``--max-num-seqs``), as `skylb-ctl replica add --max-concurrency` does:
``http://10.0.0.5:8000#max_concurrency=64``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from skylb.balancer.kv_routing import kv_endpoint
from skylb.config import ConfigError

__all__ = ["STATIC_REGION", "ENGINES", "static_membership", "parse_peers", "parse_replica"]

#: The region of a balancer started with --replica and no --region.
STATIC_REGION = "local"
#: The engines --engine accepts: the adapters' names (skylb/engines), and ``auto``, which detects each replica's.
ENGINES: tuple[str, ...] = ("auto", "vllm", "sglang", "llamacpp", "tgi", "ollama", "openai")


def _url(text: str, flag: str) -> str:
    """``text`` without a trailing slash; ConfigError naming ``flag`` when it is not an http(s) URL with a host and,
    if it has one, a port in 1..65535 (as the controller accepts, controller/store.py ``normalize_url``)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} must be an http:// or https:// URL such as http://127.0.0.1:8000, got {text!r}")
    try:
        port = parts.port  # None without one; ValueError: not a number, or past 65535
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"{flag}: the port of {text!r} must be a number from 1 to 65535")
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


#: ``--replica URL#...`` keys -> membership entry keys.
_ENTRY_KEYS = {"kv": "kv_events", "replay": "kv_events_replay", "block_size": "kv_block_size",
               "max_concurrency": "max_concurrency"}
#: The keys whose values are positive integers, and their unit.
_COUNTS = {"block_size": "tokens", "max_concurrency": "requests the engine runs at once"}


def parse_replica(text: str) -> tuple[str, dict]:
    """``--replica URL[#kv=ENDPOINT,replay=ENDPOINT,block_size=N,max_concurrency=N]`` as (URL, {membership entry
    keys}: the KV keys and ``max_concurrency``).

    Raises ConfigError for an unknown key, a key given twice, an endpoint that is not ``tcp://HOST:PORT`` (or
    ``ipc://``), a block size or concurrency that is not a positive integer, or ``replay``/``block_size`` without
    ``kv``.
    """
    url, _, extra = text.strip().partition("#")
    entry: dict = {}
    for item in filter(None, extra.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _ENTRY_KEYS:
            raise ConfigError(f"--replica {url}: after '#' expected kv=tcp://HOST:PORT[,replay=tcp://HOST:PORT]"
                              f"[,block_size=N][,max_concurrency=N], got {item!r}")
        if _ENTRY_KEYS[key] in entry:
            raise ConfigError(f"--replica {url}: {key} is given twice")
        if key in _COUNTS:
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--replica {url}: {key} must be a positive integer ({_COUNTS[key]}), "
                                  f"got {value!r}")
            entry[_ENTRY_KEYS[key]] = int(value)
        else:
            entry[_ENTRY_KEYS[key]] = value
    if any(k in entry for k in ("kv_events_replay", "kv_block_size")) and "kv_events" not in entry:
        raise ConfigError(f"--replica {url}: replay and block_size need kv=tcp://HOST:PORT (the event endpoint)")
    try:
        kv_endpoint(entry)
    except ValueError as exc:
        raise ConfigError(f"--replica {url}: {exc}") from None
    return url, entry


def static_membership(region: str, replicas: list[str], *, engine: str = "auto",
                      peers: dict[str, str] | None = None) -> dict:
    """The membership snapshot of ``replicas`` (base URLs, each with its optional KV-cache event endpoints and
    stated batch: ``parse_replica``; served by ``region``'s balancer through the ``engine``
    adapter) and ``peers`` ({region: balancer URL}). Replica ids are ``<region>-<n>``, n from 1 in flag order.

    Raises ConfigError for a URL that is not http(s), a URL given twice, an unknown engine, or bad KV-cache event
    endpoints.
    """
    _region_name(region, "--region")
    if engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    parsed = [parse_replica(u) for u in replicas]
    urls = [_url(url, "--replica") for url, _ in parsed]
    if len(set(urls)) != len(urls):
        raise ConfigError("--replica: the same URL is given twice")
    return {
        "revision": 0,
        "replicas": [{"id": f"{region}-{i}", "region": region, "url": url, "engine": engine, **kv}
                     for i, (url, (_, kv)) in enumerate(zip(urls, parsed), start=1)],
        "balancers": [{"region": name, "url": url} for name, url in (peers or {}).items()],
        "assignments": [],
    }
