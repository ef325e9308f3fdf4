"""Throughput-derived figures with one definition each: MFU and USD per million tokens."""

from __future__ import annotations

from attune.spec.hardware import GPU
from attune.spec.model import ModelSpec

# Training FLOPs per token per active parameter: forward 2 + backward 4 (Kaplan et al. 2020, "Scaling
# Laws for Neural Language Models", C = 6N), the convention of the seed recipe's MFU 0.3886.
FLOPS_PER_TOKEN_PER_PARAM = 6


def model_flops_utilization(tokens_per_s_per_gpu: float, model: ModelSpec, gpu: GPU) -> float:
    """Model FLOPs utilisation: 6 x active parameters x tokens/s/GPU over the GPU's dense BF16 peak."""
    return tokens_per_s_per_gpu * FLOPS_PER_TOKEN_PER_PARAM * model.active_params / (gpu.bf16_tflops * 1e12)


def usd_per_million_tokens(tokens_per_s_per_gpu: float, gpu: GPU) -> float:
    """Cost of a million trained tokens at the GPU's price per GPU-hour (USD)."""
    if tokens_per_s_per_gpu <= 0:
        return float("inf")
    return gpu.usd_per_hour / 3600.0 / tokens_per_s_per_gpu * 1e6
