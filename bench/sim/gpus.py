"""GPU classes for the simulated replicas: engine timings and KV capacity from published memory bandwidth, FLOPS
and memory, scaled from the L4 defaults of ``bench.emulator.model.EngineParams`` (same model: Llama-3.1-8B, fp16).

The L4 defaults are derived in ``EngineParams``' docstring: the memory-bound terms of a step (reading the 16.06 GB
of weights, 128 KiB of KV per context token) from 300 GB/s, the compute-bound terms (per-sequence decode work,
prefill per prompt token, 0.48 ms from the SkyLB paper §2.1's 300 ms for a 512-token prompt) from 121 TFLOPS, and
the KV cache from 24 GB x 0.9 - 16.06 GB of weights - 1.3 GB of activations = 4.24 GB. Another class keeps the
L4's efficiency and scales each term by its own resource:

    decode_base_ms, decode_ms_per_kv_token  x  300 GB/s / bandwidth
    decode_ms_per_seq, prefill_ms_per_token x  121 TFLOPS / fp16 dense tensor TFLOPS
    kv_cache_tokens                         x  (memory x 0.9 - 16.06 - 1.3 GB) / 4.24 GB, down to whole blocks

Classes (datasheet figures; dense fp16 tensor FLOPS, no sparsity):

* ``L4`` (AWS g6, GCP g2): 24 GB GDDR6, 300 GB/s, 121 TFLOPS: the defaults (53.5 ms per decode step's base,
  0.48 ms per prefill token, 32,768 KV tokens).
* ``A10`` (NVIDIA A10; AWS g5's A10G is its cloud variant with the same 24 GB GDDR6 and 600 GB/s): 125 TFLOPS:
  decode base 53.5 x 300/600 = 26.75 ms, KV read 0.000437 x 0.5 = 0.000219 ms per token, per sequence
  0.25 x 121/125 = 0.242 ms, prefill 0.48 x 121/125 = 0.465 ms per token, KV 32,768 tokens (same memory).
* ``A100`` (A100 40 GB SXM, AWS p4d, GCP a2): 40 GB HBM2, 1,555 GB/s, 312 TFLOPS: decode base 53.5 x 300/1555 =
  10.32 ms, KV read 0.0000843 ms per token, per sequence 0.0970 ms, prefill 0.186 ms per token, KV
  32,768 x (36 - 17.36) / 4.24 = 144,058 -> 144,048 tokens (9,003 blocks).

No cloud GPU slower than the L4 holds the model's 16.06 GB of fp16 weights on one card (the T4 and the A2 have
16 GB), so the L4 is the slowest class and the two others are faster. Each class keeps vLLM V1's defaults for a GPU
under 70 GB (256 sequences, 2,048 batched tokens, blocks of 16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.emulator.model import EngineParams

__all__ = ["GpuClass", "GPU_CLASSES", "L4", "engine_params"]

#: Llama-3.1-8B fp16 weights and the activation / CUDA graph reserve vLLM profiles on an L4, GB.
_WEIGHTS_GB = 16.06
_RESERVE_GB = 1.3
_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuClass:
    """A GPU's published figures: ``memory_gb`` (GB), ``bandwidth_gbs`` (GB/s), ``tflops`` (dense fp16 tensor)."""

    name: str
    memory_gb: float
    bandwidth_gbs: float
    tflops: float

    @property
    def kv_gb(self) -> float:
        """Memory left for the KV cache, GB: memory x 0.9 - weights - activations."""
        return self.memory_gb * _GPU_MEMORY_UTILIZATION - _WEIGHTS_GB - _RESERVE_GB


L4 = GpuClass("L4", 24.0, 300.0, 121.0)
GPU_CLASSES: dict[str, GpuClass] = {g.name: g for g in (
    L4,
    GpuClass("A10", 24.0, 600.0, 125.0),
    GpuClass("A100", 40.0, 1555.0, 312.0),
)}


def engine_params(gpu: GpuClass, base: EngineParams | None = None) -> EngineParams:
    """The engine model of ``gpu``: ``base`` (default: the L4 defaults) with each term scaled by the ratio of the
    resource that bounds it (module docstring); the L4 itself gets ``base`` unchanged."""
    base = base or EngineParams()
    if gpu == L4:
        return base
    mem, flops = L4.bandwidth_gbs / gpu.bandwidth_gbs, L4.tflops / gpu.tflops
    blocks = int(base.kv_cache_tokens * gpu.kv_gb / L4.kv_gb) // base.block_size
    return replace(base, decode_base_ms=base.decode_base_ms * mem,
                   decode_ms_per_kv_token=base.decode_ms_per_kv_token * mem,
                   decode_ms_per_seq=base.decode_ms_per_seq * flops,
                   prefill_ms_per_token=base.prefill_ms_per_token * flops,
                   kv_cache_tokens=blocks * base.block_size)
