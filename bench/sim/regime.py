"""The calibrated regime: the engine and workload parameters of the paper's scenarios, frozen in one file.

Source: SkyLB paper §5 ("Experiment setup": one L4 per replica, meta-llama/Llama-3.1-8B-Instruct on SGLang, up to
12 replicas in three regions). The values live in bench/sim/regime.yaml, committed before any SkyLB run that uses
them, so a result can never have been tuned after the fact: the report (bench/bench_cli.py) names the commit that
last changed the file, and the calibration table (bench/sim/calibration.py) sets the simulated figures of the
baselines beside the paper's cells before SkyLB is compared with anything.

The file has three sections, each checked when loaded (a misspelt key is an error naming it):

* ``engine``: keyword arguments of ``bench.emulator.model.EngineParams`` (the admission model and its knobs) for
  every replica of the paper's scenarios.
* ``conversations``: ``max_tokens`` (what each client request asks for: the engine reserves KV by it, and a reply
  ends at its own length before that), and per dataset (``arena``, ``wildchat``) overrides of
  ``bench.sim.workloads.ConversationShape``.
* ``mooncake``: the trace at its real prompt lengths: ``prompt_scale``, ``replicas_per_region`` (with the sizing
  arithmetic in the file's comment), ``max_output``.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from bench.emulator.model import EngineParams
from bench.sim.workloads import ARENA, WILDCHAT, ConversationShape

__all__ = ["REGIME_FILE", "Regime", "regime", "engine_params", "shape", "regime_commit"]

#: The committed file of the calibrated regime.
REGIME_FILE = Path(__file__).with_name("regime.yaml")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Conversations(_Strict):
    """Conversation workloads: the clients' ``max_tokens`` and shape overrides per dataset."""

    max_tokens: int | None = Field(None, gt=0)
    arena: dict[str, Any] = Field(default_factory=dict)
    wildchat: dict[str, Any] = Field(default_factory=dict)


class Mooncake(_Strict):
    """The Mooncake trace at real prompt lengths: scale, replicas per region (us, eu, asia), output cap (tokens)."""

    prompt_scale: float = Field(1.0, gt=0)
    replicas_per_region: int = Field(8, gt=0)
    max_output: int = Field(1024, gt=0)


class Regime(_Strict):
    """The whole file: ``engine`` (EngineParams keyword arguments), ``conversations``, ``mooncake``."""

    engine: dict[str, Any] = Field(default_factory=dict)
    conversations: Conversations = Field(default_factory=Conversations)
    mooncake: Mooncake = Field(default_factory=Mooncake)


@functools.lru_cache(maxsize=4)
def regime(path: Path = REGIME_FILE) -> Regime:
    """The regime in ``path`` (parsed once per process); raises pydantic.ValidationError naming a bad key, and
    TypeError / ValueError from EngineParams for a bad engine value (checked here, not at the first run)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    loaded = Regime.model_validate(data)
    EngineParams(**loaded.engine)
    for name, base in (("arena", ARENA), ("wildchat", WILDCHAT)):
        replace(base, **getattr(loaded.conversations, name))
    return loaded


def engine_params(path: Path = REGIME_FILE) -> EngineParams:
    """The replicas' EngineParams in the calibrated regime."""
    return EngineParams(**regime(path).engine)


def shape(name: str, path: Path = REGIME_FILE) -> ConversationShape:
    """The ConversationShape of dataset ``name`` ("arena" or "wildchat") in the calibrated regime, with the
    clients' ``max_tokens``; KeyError for another name."""
    base = {"arena": ARENA, "wildchat": WILDCHAT}[name]
    conv = regime(path).conversations
    return replace(base, **getattr(conv, name), max_tokens=conv.max_tokens)


def regime_commit(path: Path = REGIME_FILE) -> str:
    """The commit that last changed the regime file (short hash and date), "uncommitted" when the working tree
    differs from it, "unknown" without git."""
    cwd = Path(path).parent
    try:
        log = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", Path(path).name], cwd=cwd,
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", Path(path).name], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not log:
        return "uncommitted"
    return log + (" (changed since: uncommitted)" if dirty else "")
