"""Engine adapters: how to read pending / running / health / served models from one replica of each engine.

Adding an engine is adding one adapter module and its test. ``adapter_for(engine)`` returns
the adapter registered under that engine name:

========  =====================================================  ==========================================
engine    pending signal                                         fallbacks / notes
========  =====================================================  ==========================================
vllm      /metrics ``vllm:num_requests_waiting``                 -
sglang    /metrics ``sglang:num_queue_reqs``                     /v1/loads, then /get_load
llamacpp  /metrics ``llamacpp:requests_deferred``                needs ``--metrics``; 503 = loading model
tgi       /metrics ``tgi_queue_size``                            -
ollama    none: in-flight - max_concurrency (default 1)          health ``GET /``, models /api/tags
openai    none: in-flight - max_concurrency (default 8)          health ``GET /v1/models``
auto      detects one of the above once per URL, then delegates  :func:`skylb.engines.auto.detect_engine`
========  =====================================================  ==========================================
"""

from skylb.engines.base import ADAPTERS, EngineAdapter, ProbeResult, adapter_for
from skylb.engines import vllm as _vllm  # noqa: F401  (each import registers its adapter)
from skylb.engines import sglang as _sglang  # noqa: F401
from skylb.engines import llamacpp as _llamacpp  # noqa: F401
from skylb.engines import tgi as _tgi  # noqa: F401
from skylb.engines import ollama as _ollama  # noqa: F401
from skylb.engines import openai as _openai  # noqa: F401
from skylb.engines import auto as _auto  # noqa: F401
from skylb.engines.auto import detect_engine

__all__ = ["ADAPTERS", "EngineAdapter", "ProbeResult", "adapter_for", "detect_engine"]
