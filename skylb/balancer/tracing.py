"""Tracing's settings and switch: whether a balancer records OpenTelemetry spans, and where it sends them.

Off by default. On when an OTLP endpoint is configured: ``balancer.tracing.otlp_endpoint`` in the config file, or the
standard variables of the OpenTelemetry SDK ("OpenTelemetry Protocol Exporter" and "Environment Variable
Specification" of the OpenTelemetry specification), which override it as SkyLB's other variables override the file:
``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL traces are posted to), else ``$OTEL_EXPORTER_OTLP_ENDPOINT`` (a
base URL, ``v1/traces`` appended). ``$OTEL_SDK_DISABLED=true`` or ``$OTEL_TRACES_EXPORTER=none`` turn it off whatever
else is set. Spans go out over OTLP/HTTP with protobuf bodies (opentelemetry-exporter-otlp-proto-http), which every
collector (the OpenTelemetry Collector, Jaeger, Tempo) accepts on port 4318.

This module imports no part of OpenTelemetry: :func:`start_tracing` imports the SDK (skylb/balancer/spans.py) only
when tracing is on, so a balancer without it loads no SDK and creates no span object on a request's path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skylb import environment

if TYPE_CHECKING:  # the SDK's module, imported at run time only when tracing is on
    from skylb.balancer.spans import Tracing

__all__ = ["TracingSettings", "traces_endpoint", "start_tracing", "check_installed", "FLUSH_S", "MISSING_SDK"]

#: The most a stopping balancer waits for its last spans to reach the collector, s.
FLUSH_S = 2.0
#: Why a balancer asked to trace cannot: the SDK is an optional extra (pyproject.toml).
MISSING_SDK = ("tracing is configured ({endpoint}) but the OpenTelemetry SDK is not installed: "
               "pip install 'skylb[tracing]' (from a checkout: pip install '.[tracing]')")
#: The path of the traces signal under an OTLP/HTTP base URL (OTLP specification, "OTLP/HTTP Request").
TRACES_PATH = "v1/traces"
#: The modules of the ``tracing`` extra that skylb/balancer/spans.py imports.
_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


class TracingSettings(BaseModel):
    """``balancer.tracing``: OpenTelemetry spans of every request's stages, sent to an OTLP collector (off by default).

    Attributes:
        otlp_endpoint: the collector's OTLP/HTTP base URL, e.g. ``http://127.0.0.1:4318`` (traces are posted to its
            ``/v1/traces``; a URL that already ends so is taken as it is); None: off unless the environment sets one.
        sample_ratio: the share of traces started here that are recorded (0-1; the OpenTelemetry SDK's
            "ParentBased(TraceIdRatioBased)" sampler): a request that arrives with a ``traceparent`` follows its
            caller's sampled flag instead, so a trace is recorded in every region or in none.
    """

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = None
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {value!r}")
        return value


def _signal_url(base: str) -> str:
    """``base`` with the traces path appended (OTLP exporter spec: "the signal path is appended to the base URL")."""
    base = base.rstrip("/")
    return base if base.endswith("/" + TRACES_PATH) else f"{base}/{TRACES_PATH}"


def traces_endpoint(settings: TracingSettings, environ: Mapping[str, str] | None = None) -> str | None:
    """The URL the balancer posts its spans to, or None when tracing is off (module docstring: the variables of
    ``environ``, default this process's environment, then ``settings.otlp_endpoint``)."""
    disabled = (environment.env(environment.OTEL_SDK_DISABLED, environ) or "").lower() == "true"
    exporter = (environment.env(environment.OTEL_TRACES_EXPORTER, environ) or "").lower()
    if disabled or exporter == "none":
        return None
    if (url := environment.env(environment.OTEL_TRACES_ENDPOINT, environ)) is not None:
        return url
    if (base := environment.env(environment.OTEL_ENDPOINT, environ)) is not None:
        return _signal_url(base)
    return None if settings.otlp_endpoint is None else _signal_url(settings.otlp_endpoint)


def check_installed(settings: TracingSettings, environ: Mapping[str, str] | None = None) -> None:
    """Raise RuntimeError (MISSING_SDK) when tracing is on but its packages are not installed; import nothing."""
    endpoint = traces_endpoint(settings, environ)
    if endpoint is not None and not all(_installed(name) for name in _PACKAGES):
        raise RuntimeError(MISSING_SDK.format(endpoint=endpoint))


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (its parent packages are imported to tell; a missing one means no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def start_tracing(settings: TracingSettings, *, region: str, instance: str,
                  environ: Mapping[str, str] | None = None) -> "Tracing | None":
    """A running Tracing for a balancer of ``region`` reached at ``instance`` (its advertised URL), or None when
    tracing is off; only then is the OpenTelemetry SDK imported. Raises RuntimeError (MISSING_SDK) when tracing is
    on and the SDK is not installed."""
    endpoint = traces_endpoint(settings, environ)
    if endpoint is None:
        return None
    check_installed(settings, environ)
    from skylb.balancer.spans import Tracing  # the SDK and its exporter load only for a balancer that traces
    return Tracing(endpoint=endpoint, region=region, instance=instance, sample_ratio=settings.sample_ratio)
