"""The environment variables SkyLB's processes read: one table, one function that reads them.

Secrets (tokens, API keys) and per-host choices are better kept out of the deployment file, in the environment
(a systemd ``EnvironmentFile``, a Kubernetes Secret): each variable below overrides one setting of the config file
or of the command line's defaults. Every read goes through :func:`env`, so one rule holds for all of them: a
variable that is unset, empty or only blanks counts as unset (an ``EnvironmentFile`` line ``SKYLB_PEER_TOKEN=``
turns nothing on). ``skylb balancer --help`` and ``skylb controller --help`` list theirs (:func:`epilog`). This
module imports only the standard library, so the smallest modules (the event-loop choice, the log set-up) can use it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = [
    "EnvVar", "env", "epilog",
    "LOG_LEVEL", "EVENT_LOOP", "GC_FREEZE", "PEER_TOKEN", "METRICS_TOKEN", "REPLICA_API_KEY", "API_KEYS",
    "API_KEYS_FILE",
    "REDIS_URL", "ADMIN_TOKEN", "ADMIN_TOKEN_FILE", "CONTROLLER_URL",
    "OTEL_ENDPOINT", "OTEL_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER",
    "BALANCER_VARIABLES", "CONTROLLER_VARIABLES",
]


class EnvVar(NamedTuple):
    """One environment variable: its ``name`` and what it sets (``help``, one sentence for ``--help``)."""

    name: str
    help: str


LOG_LEVEL = EnvVar("SKYLB_LOG_LEVEL", "the lowest log level written: debug, info (the default), warning, error "
                                      "(--log-level wins)")
EVENT_LOOP = EnvVar("SKYLB_EVENT_LOOP", "'asyncio' runs the standard event loop instead of uvloop")
GC_FREEZE = EnvVar("SKYLB_GC_FREEZE", "'0' leaves the startup heap to the garbage collector's full collections "
                                      "(frozen by default: shorter pauses; skylb/gc_pauses.py)")
PEER_TOKEN = EnvVar("SKYLB_PEER_TOKEN", "the shared secret between balancers and of their heartbeats to the "
                                        "controller (overrides balancer.peer_token and controller.peer_token)")
METRICS_TOKEN = EnvVar("SKYLB_METRICS_TOKEN", "accepted on /metrics besides the peer token "
                                              "(overrides balancer.metrics_token)")
REPLICA_API_KEY = EnvVar("SKYLB_REPLICA_API_KEY", "sent to local replicas as a bearer token "
                                                  "(overrides balancer.replica_api_key)")
API_KEYS = EnvVar("SKYLB_API_KEYS", "client API keys, comma-separated (added to balancer.api_keys)")
API_KEYS_FILE = EnvVar("SKYLB_API_KEYS_FILE", "a file of client API keys, one a line "
                                              "(overrides balancer.api_keys_file)")
REDIS_URL = EnvVar("SKYLB_REDIS_URL", "the Redis that holds the quota buckets (overrides balancer.quota.redis_url)")
ADMIN_TOKEN = EnvVar("SKYLB_ADMIN_TOKEN", "the admin token every change of membership must carry "
                                          "(overrides controller.admin_token)")
ADMIN_TOKEN_FILE = EnvVar("SKYLB_ADMIN_TOKEN_FILE", "a file holding the admin token, read when $SKYLB_ADMIN_TOKEN "
                                                    "is unset (overrides controller.admin_token_file)")
CONTROLLER_URL = EnvVar("SKYLB_CONTROLLER", "the controller's base URL that skylb-ctl talks to")
# The OpenTelemetry SDK's own names (OpenTelemetry specification, "Environment Variable Specification" and
# "OpenTelemetry Protocol Exporter"), so a balancer traces where the rest of an operator's services do.
OTEL_ENDPOINT = EnvVar("OTEL_EXPORTER_OTLP_ENDPOINT", "an OTLP/HTTP collector's base URL: traces go to its /v1/traces "
                                                      "(turns tracing on; overrides balancer.tracing.otlp_endpoint)")
OTEL_TRACES_ENDPOINT = EnvVar("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "the full URL traces are posted to (wins over "
                                                                    "$OTEL_EXPORTER_OTLP_ENDPOINT)")
OTEL_SDK_DISABLED = EnvVar("OTEL_SDK_DISABLED", "'true' turns tracing off whatever else is set")
OTEL_TRACES_EXPORTER = EnvVar("OTEL_TRACES_EXPORTER", "'none' turns tracing off whatever else is set")

#: What `skylb balancer` reads, in the order ``--help`` lists it.
BALANCER_VARIABLES: tuple[EnvVar, ...] = (PEER_TOKEN, API_KEYS, API_KEYS_FILE, METRICS_TOKEN, REPLICA_API_KEY,
                                          REDIS_URL, OTEL_ENDPOINT, OTEL_TRACES_ENDPOINT, OTEL_SDK_DISABLED,
                                          OTEL_TRACES_EXPORTER, LOG_LEVEL, EVENT_LOOP, GC_FREEZE)
#: What `skylb controller` reads, in the order ``--help`` lists it.
CONTROLLER_VARIABLES: tuple[EnvVar, ...] = (ADMIN_TOKEN, ADMIN_TOKEN_FILE, PEER_TOKEN, LOG_LEVEL, EVENT_LOOP,
                                            GC_FREEZE)


def env(var: EnvVar | str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``var`` (an EnvVar or a name) in ``environ`` (default: this process's environment), blanks
    stripped; None when it is unset or blank."""
    name = var.name if isinstance(var, EnvVar) else var
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or None


def epilog(variables: Iterable[EnvVar]) -> str:
    """An ``--help`` epilog listing ``variables``, one a line (for argparse's RawDescriptionHelpFormatter)."""
    lines = ["environment (a variable that is unset or empty counts as unset):"]
    lines += [f"  ${var.name}: {var.help}" for var in variables]
    return "\n".join(lines)
