"""Emulated inference engines: a pure model of one replica (:mod:`bench.emulator.model`) and HTTP servers that
speak an engine's API in front of it (:mod:`bench.emulator.server`, `skylb emulator --engine vllm --port P`).

Only the model is imported here, so the trace-driven simulator can use it without aiohttp.
"""

from bench.emulator.model import EngineModel, EngineParams, FinishedRequest, Step, TokenOutput

__all__ = ["EngineModel", "EngineParams", "FinishedRequest", "Step", "TokenOutput"]
