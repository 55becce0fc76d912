"""A balancer's settings from its command line, config file, environment and key files; re-read on reload.

``resolve`` turns `skylb balancer`'s arguments into ``Settings`` (the same code at start and at each reload, so a
reload sees exactly what a restart would). ``Reload`` applies a new ``Settings`` to a running balancer (SIGHUP, or a
watched file changed; skylb/reload.py): what can change at run time is applied at once, everything else is logged as
needing a restart, and an invalid file changes nothing.

Applied at run time: the client API keys and tenants (``api_keys``, ``api_keys_file`` and the file's content,
``$SKYLB_API_KEYS``, ``tenants``), ``metrics_token``, and ``quotas`` (while the controller holds none). Logged as
needing a restart (``reload_needs_restart``): every other setting, e.g. ``peer_token``, ``policy``, ``port``,
TLS files, and turning client keys on or off (the relay decides at start whether a client's own Authorization is
passed on). Requests in flight keep the credentials they were admitted with; a removed key is refused from the next
request on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from skylb import environment
from skylb.balancer.auth import Credentials, load_api_keys, load_tenants
from skylb.balancer.static import STATIC_REGION, parse_peers, static_membership
from skylb.config import (BalancerConfig, ConfigError, DeploymentConfig, RegionConfig, balancer_settings,
                          load_config)
from skylb.reload import changed_keys
from skylb.tokens import check_token

if TYPE_CHECKING:
    from skylb.balancer.balancer import Balancer

__all__ = ["Settings", "resolve", "Reload", "LIVE_KEYS"]

#: The settings a reload applies without a restart (this module's docstring).
LIVE_KEYS = frozenset({"api_keys", "api_keys_file", "tenants", "metrics_token", "quotas"})

log = structlog.get_logger("skylb.balancer")


@dataclass
class Settings:
    """What one balancer runs with. ``static_membership``: the snapshot of --replica and --peer (None: membership
    from the controller); ``config_path``: the YAML read (None: defaults or the embedded file)."""

    cfg: BalancerConfig
    region: str
    api_keys: frozenset[str] = frozenset()
    tenants: dict[str, str] = field(default_factory=dict)
    static_membership: dict | None = None
    config_path: str | None = None

    def credentials(self) -> Credentials:
        """The secrets the auth middleware checks (skylb/balancer/auth.py)."""
        return Credentials(api_keys=self.api_keys, peer_token=self.cfg.peer_token,
                           metrics_token=self.cfg.metrics_token, tenants=dict(self.tenants))

    def files(self) -> list[str]:
        """The files a reload re-reads and the poll watches: the config file and the client keys file."""
        keys_file = environment.env(environment.API_KEYS_FILE) or self.cfg.api_keys_file
        return [p for p in (self.config_path, keys_file) if p]


def _peer_urls(items: list[str]) -> dict[str, str]:
    peer_urls = {}
    for item in items:
        region, sep, url = item.partition("=")
        if not sep or not url:
            raise ConfigError(f"--peer-url must be REGION=URL, got {item!r}")
        peer_urls[region] = url
    return peer_urls


def _deployment(args: argparse.Namespace, region: str, static: bool) -> DeploymentConfig:
    """The deployment file, or without --config the defaults with ``region`` as its one region (as `skylb
    controller` without --config runs on its defaults; the peers then come from the controller)."""
    if not args.config:
        return DeploymentConfig(regions={region: RegionConfig()})
    deployment = load_config(args.config)
    if static:  # the file gives the balancer settings; the membership comes from the flags
        deployment.regions.setdefault(region, RegionConfig())
    return deployment


def resolve(args: argparse.Namespace) -> Settings:
    """The settings of `skylb balancer` with ``args`` (its parsed flags), read from the config file, the environment
    and the key files now.

    Raises ConfigError (or pydantic's ValidationError, ValueError) naming what is wrong: a bad file or flag, an
    unreadable keys file, client keys without a peer token, peers (by flag, by ``peer_urls``, or other regions in the
    deployment file) without a peer token.
    """
    replicas, peer_items = list(getattr(args, "replica", None) or []), list(getattr(args, "peer", None) or [])
    static = bool(replicas or peer_items)
    if static and args.controller:
        raise ConfigError("--replica and --peer run without a controller: leave out --controller")
    if not static and args.engine != "auto":
        raise ConfigError("--engine is the engine of the --replica URLs; with a controller, each replica's engine is "
                          "given when it is added (skylb-ctl replica add --engine)")
    if not static and args.region is None:
        raise ConfigError("--region is required with a controller (or give the replicas with --replica URL)")
    region = args.region or STATIC_REGION
    peers = parse_peers(peer_items, region=region)
    deployment = _deployment(args, region, static)
    cfg = balancer_settings(deployment, region, {
        "host": args.host, "port": args.port, "controller_url": args.controller, "advertise_url": args.advertise_url,
        "balancer_id": getattr(args, "balancer_id", None), "policy": args.policy,
        "peer_urls": _peer_urls(args.peer_url)})
    if static:
        cfg.controller_url = None
    elif cfg.controller_url is None:
        cfg.controller_url = f"http://{deployment.controller.host}:{deployment.controller.port}"
    check_token("the peer token", cfg.peer_token)
    check_token("the metrics token", cfg.metrics_token, strong=False)  # read-only: a scraper's credential
    expected = set(peers) | set(cfg.peer_urls) | ({r for r in deployment.regions if r != region} if not static
                                                   else set())
    if expected and not cfg.peer_token:
        raise ConfigError(
            f"peers are configured ({', '.join(sorted(expected))}) but no peer token: balancers prove forwarded "
            f"requests with it. Set ${environment.PEER_TOKEN.name} (the same secret on every balancer, e.g. from "
            "`openssl rand -hex 32`) or balancer.peer_token; only a single region without peers runs without one")
    tenants = load_tenants(cfg.tenants, cfg.api_keys_file)
    api_keys = load_api_keys(cfg.api_keys + [k for keys in cfg.tenants.values() for k in keys], cfg.api_keys_file)
    if api_keys and not cfg.peer_token:
        # Peers prove themselves with the token and skip the key check; without one, anybody could.
        raise ConfigError(f"client API keys need a peer token: set ${environment.PEER_TOKEN.name} or "
                          "balancer.peer_token")
    membership = static_membership(region, replicas, engine=args.engine, peers=peers) if static else None
    return Settings(cfg=cfg, region=region, api_keys=api_keys, tenants=tenants, static_membership=membership,
                    config_path=args.config)


class Reload:
    """Re-reads a running balancer's settings and applies what may change at run time (module docstring).

    Args:
        args: the balancer's parsed flags; settings: those it started with; set_credentials: puts new credentials
        in force; balancer: the running Balancer (its quotas and membership watcher).
    """

    def __init__(self, args: argparse.Namespace, settings: Settings, *,
                 set_credentials: Callable[[Credentials], None], balancer: Balancer):
        self.args = args
        self.settings = settings
        self.set_credentials = set_credentials
        self.balancer = balancer

    def __call__(self, reason: str) -> None:
        """Reload now; an invalid file or setting is logged (``reload_failed``) and nothing changes."""
        try:
            new = resolve(self.args)
        except (ConfigError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            log.error("reload_failed", reason=reason, error=str(exc), detail="kept the running configuration")
            return
        old = self.settings
        restart = [k for k in changed_keys(old.cfg.model_dump(), new.cfg.model_dump())
                   if k.split(".")[0] not in LIVE_KEYS]
        if bool(new.api_keys) != bool(old.api_keys):
            restart.append("client API keys on/off")
            new.api_keys, new.tenants = old.api_keys, old.tenants
        if restart:
            log.warning("reload_needs_restart", keys=restart,
                        detail="these settings changed but apply only at start; the running values stay")
        # Apply only the live settings; the others keep their running values (so the next diff is against them).
        applied = old.cfg.model_copy(update={k: getattr(new.cfg, k) for k in LIVE_KEYS})
        self.settings = Settings(cfg=applied, region=old.region, api_keys=new.api_keys, tenants=new.tenants,
                                 static_membership=old.static_membership, config_path=old.config_path)
        self.set_credentials(self.settings.credentials())
        self.balancer.key_tenants = frozenset(self.settings.tenants.values())  # metric labels of configured tenants
        self._apply_quotas(old.cfg, applied)
        log.info("reload_done", reason=reason, client_api_keys=len(new.api_keys),
                 tenants=len(set(new.tenants.values())), needs_restart=len(restart))

    def _apply_quotas(self, old: BalancerConfig, new: BalancerConfig) -> None:
        if old.quotas == new.quotas:
            return
        watcher = self.balancer.membership
        if watcher is not None:
            watcher.config_quotas = new.quotas
        if watcher is None or watcher.quotas_doc is None:  # the controller's quotas, when it holds some, win
            self.balancer.apply_quotas(new.quotas)
        else:
            log.info("reload_quotas_not_applied", detail="the controller's quotas are in force; the config's are kept "
                                                         "for when it drops them")
