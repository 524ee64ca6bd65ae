"""The result ``prove`` returns for a recipe (``RecipeResult``), and the measurements in it."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "RecipeResult",
    "param_checksum",
    "peak_memory_bytes",
]


@dataclass
class RecipeResult:
    """What a run produced. On rank 0 ``python -m recipes.core.prove`` prints it as its last line
    (``to_json``)."""

    recipe: str
    world_size: int
    backend: str
    device: str
    losses: list[float]  # the global mean loss of each optimizer step, identical on every rank
    # sum of every final parameter, in float64: equal checksums, equal training
    param_checksum: float
    seconds_per_step: float  # median over the steps after the first (which includes warm-up)
    # CUDA: max allocated on this device; CPU: the process's peak resident set
    peak_memory_bytes: int
    # what the run computed in: fp32, tf32, bf16 or fp16 (``auto`` resolved)
    precision: str = "fp32"
    tokens_per_second: float = 0.0  # global: every rank's tokens, per second of a steady step
    # the model's FLOPs at that rate (recipes.core.throughput.flops_per_token)
    model_tflops: float = 0.0
    # model_tflops / (devices x the device's dense peak); None on CPU or an unknown device
    mfu: float | None = None
    # recipe-specific figures, e.g. skipped_steps
    extras: dict[str, Any] = field(default_factory=dict)
    # only with keep_final_state
    final_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def to_json(self) -> str:
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "final_state"
        }
        return json.dumps(data, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def param_checksum(tensors: Iterable[torch.Tensor]) -> float:
    return float(sum(t.detach().double().sum().item() for t in tensors))


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
