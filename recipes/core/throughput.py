"""How fast a run trained: global tokens per second, model FLOPs per token, and MFU.

MFU (model FLOPs utilisation) = the FLOPs the model needs per second at the measured token rate,
divided by the device's dense peak for the precision used. It counts the model's arithmetic, not the
hardware's (a recomputed forward under activation checkpointing is not counted), so it compares runs
that train the same model honestly. nanoGPT's ``estimate_mfu`` and torchtitan's MFU logging use the
same formula.

Peaks are vendor datasheet figures for dense tensor-core math (no sparsity); a device not in the
table, and every CPU, gets ``mfu = None``, never a made-up number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipes.core.workload import ModelConfig

__all__ = ["Workload", "flops_per_token", "peak_flops", "PEAK_TFLOPS"]

# Dense TFLOP/s by precision, from the vendors' datasheets. fp32 = plain CUDA cores (no TF32).
# Matched against torch.cuda.get_device_name in order: the first key that appears in the name wins.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
}


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token of the cookbook's transformer (forward + backward = 3 x forward).

    6 x the matmul parameters (each does a multiply and an add per token, forward, and twice that in
    backward), plus the attention scores and their weighted sum, 12 x layers x dim x seq_len (QK^T
    and AV are 2 x seq_len x dim multiply-adds per token per layer, x3 for backward). Embedding
    lookups are not matmuls and are left out; the output head is one. Causal masking is not
    subtracted (PaLM and nanoGPT count it the same way).
    """
    hidden = cfg.mlp_ratio * cfg.dim
    per_block = 4 * cfg.dim * cfg.dim + 2 * cfg.dim * hidden  # wq, wk, wv, wo; w_in, w_out
    matmul_params = cfg.n_layers * per_block + cfg.dim * cfg.vocab_size  # + the output head
    attention = 12 * cfg.n_layers * cfg.dim * cfg.seq_len
    return 6 * matmul_params + attention


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s for ``precision``; None on CPU or a device not in the table"""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[precision] * 1e12 if precision in peaks else None
    return None


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: enough to turn a step time into tokens/s and MFU."""

    model: ModelConfig
    global_batch_size: int  # sequences per optimizer step, over all ranks
    precision: str  # the precision actually used: fp32, tf32, bf16 or fp16

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq_len

    def measure(self, seconds_per_step: float, device: torch.device, devices: int) -> dict:
        """Global tokens/s, achieved model TFLOP/s, MFU over ``devices`` devices (None: no peak)."""
        tokens_per_second = self.tokens_per_step / seconds_per_step if seconds_per_step > 0 else 0.0
        achieved = tokens_per_second * flops_per_token(self.model)
        peak = peak_flops(device, self.precision)
        return {
            "precision": self.precision,
            "tokens_per_second": tokens_per_second,
            "model_tflops": achieved / 1e12,
            "mfu": achieved / (devices * peak) if peak and achieved else None,
        }
