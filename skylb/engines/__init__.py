"""Engine adapters: how to read pending / running / health / served models from one replica of each engine.

Adding an engine is adding one adapter module and its test (DESIGN.md decision 2). ``adapter_for(engine)`` returns
the adapter registered under that engine name.
"""

from skylb.engines.base import ADAPTERS, EngineAdapter, ProbeResult, adapter_for
from skylb.engines import vllm as _vllm  # noqa: F401  (registers the adapter)

__all__ = ["ADAPTERS", "EngineAdapter", "ProbeResult", "adapter_for"]
