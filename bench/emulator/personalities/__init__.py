"""Engine personalities of the emulator: each speaks one engine's HTTP dialect over the same EngineModel.

=========  ==================================================  =============================================
engine     load signal a balancer reads                        module
=========  ==================================================  =============================================
vllm       /metrics ``vllm:num_requests_waiting``              :mod:`.vllm`
sglang     /metrics ``sglang:num_queue_reqs``, /v1/loads,      :mod:`.sglang`
           /get_load
llamacpp   /metrics ``llamacpp:requests_deferred``             :mod:`.llamacpp`
tgi        /metrics ``tgi_queue_size``                         :mod:`.tgi`
ollama     none (the balancer counts its own in-flight)        :mod:`.ollama`
openai     none: a generic OpenAI-compatible server, only      :mod:`.generic`
           /v1/* (liveness from /v1/models)
=========  ==================================================  =============================================

Importing this package registers every personality in :data:`PERSONALITIES`.
"""

from bench.emulator.personalities.base import (
    DEFAULT_MODEL,
    PERSONALITIES,
    ApiError,
    Generation,
    Personality,
    PersonalityOptions,
)
from bench.emulator.personalities.generic import GenericOpenAIPersonality
from bench.emulator.personalities.llamacpp import LlamaCppPersonality
from bench.emulator.personalities.ollama import OllamaPersonality
from bench.emulator.personalities.openai import OpenAIServing
from bench.emulator.personalities.sglang import SglangPersonality
from bench.emulator.personalities.tgi import TgiPersonality
from bench.emulator.personalities.vllm import VllmPersonality

__all__ = [
    "DEFAULT_MODEL",
    "PERSONALITIES",
    "ApiError",
    "Generation",
    "GenericOpenAIPersonality",
    "LlamaCppPersonality",
    "OllamaPersonality",
    "OpenAIServing",
    "Personality",
    "PersonalityOptions",
    "SglangPersonality",
    "TgiPersonality",
    "VllmPersonality",
]
