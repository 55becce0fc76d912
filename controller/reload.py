"""The controller's settings from its flags, config file, environment and token file; re-read on reload.

``resolve`` turns `skylb controller`'s arguments into its settings and credentials (the same code at start and at
each reload). ``Reload`` is called on SIGHUP or when the config file or the admin token file changes
(skylb/reload.py): the admin token and the peer token are put in force at once, for the next request; every other
setting (address, store, health checks, failover, DNS) is logged as needing a restart (``reload_needs_restart``).
An invalid file, or an unreadable token file, changes nothing (``reload_failed``).
"""

from __future__ import annotations

import argparse

import structlog

from controller.auth import ControllerCredentials, resolve_credentials
from skylb import environment
from skylb.config import ConfigError, ControllerConfig, load_config
from skylb.reload import changed_keys

__all__ = ["resolve", "Reload", "LIVE_KEYS"]

#: The controller settings a reload applies without a restart.
LIVE_KEYS = frozenset({"admin_token", "admin_token_file", "peer_token"})

log = structlog.get_logger("skylb.controller")


def resolve(args: argparse.Namespace) -> tuple[ControllerConfig, ControllerCredentials]:
    """The controller's settings (the config file's ``controller`` section under the flags) and credentials (with the
    environment and the admin token file). Raises ConfigError or ValueError (pydantic's ValidationError is one)."""
    config = load_config(args.config).controller if args.config else ControllerConfig()
    overrides = {k: v for k in ("host", "port", "db", "store") if (v := getattr(args, k)) is not None}
    if args.etcd_endpoints is not None:
        overrides["etcd"] = config.etcd.model_dump() | {"endpoints": args.etcd_endpoints.split(",")}
    config = ControllerConfig.model_validate(config.model_dump() | overrides)
    return config, resolve_credentials(config.admin_token, config.admin_token_file, config.peer_token)


class Reload:
    """Re-reads the controller's settings; ``credentials`` is the object the running application checks, updated in
    place."""

    def __init__(self, args: argparse.Namespace, config: ControllerConfig, credentials: ControllerCredentials):
        self.args = args
        self.config = config
        self.credentials = credentials

    def files(self) -> list[str]:
        """The files watched: the config file and the admin token file (when the token comes from one)."""
        token_file = None
        if environment.env(environment.ADMIN_TOKEN) is None:
            token_file = environment.env(environment.ADMIN_TOKEN_FILE) or self.config.admin_token_file
        return [p for p in (self.args.config, token_file) if p]

    def __call__(self, reason: str) -> None:
        """Reload now; an invalid file is logged and nothing changes."""
        try:
            config, credentials = resolve(self.args)
        except (ConfigError, ValueError) as exc:
            log.error("reload_failed", reason=reason, error=str(exc), detail="kept the running configuration")
            return
        restart = [k for k in changed_keys(self.config.model_dump(), config.model_dump())
                   if k.split(".")[0] not in LIVE_KEYS]
        if restart:
            log.warning("reload_needs_restart", keys=restart,
                        detail="these settings changed but apply only at start; the running values stay")
        self.config = self.config.model_copy(update={k: getattr(config, k) for k in LIVE_KEYS})
        self.credentials.replace_with(credentials)
        log.info("reload_done", reason=reason, admin_token=credentials.admin_token is not None,
                 peer_token=credentials.peer_token is not None, needs_restart=len(restart))
