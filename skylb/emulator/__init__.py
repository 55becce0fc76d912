"""Emulated inference engines: a pure model of one replica (:mod:`skylb.emulator.model`) and HTTP servers that
speak an engine's API in front of it (:mod:`skylb.emulator.server`, `skylb emulator --engine vllm --port P`).

Only the model is imported here, so the trace-driven simulator can use it without aiohttp.
"""

from skylb.emulator.model import EngineModel, EngineParams, FinishedRequest, Step, TokenOutput

__all__ = ["EngineModel", "EngineParams", "FinishedRequest", "Step", "TokenOutput"]
