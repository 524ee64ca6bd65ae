"""The one result type every recipe returns, and the measurements that fill it."""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "RecipeResult",
    "param_checksum",
    "peak_memory_bytes",
    "StepTimer",
    "make_result",
]


@dataclass
class RecipeResult:
    """What a run produced. On rank 0 a recipe's CLI prints it as its last stdout line
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


class StepTimer:
    """Wall time per step; synchronises CUDA so that queued kernels are counted in their own
    step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.durations: list[float] = []
        self._start = 0.0

    def __enter__(self) -> StepTimer:
        self._sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.durations.append(time.perf_counter() - self._start)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def seconds_per_step(self) -> float:
        steady = self.durations[1:] or self.durations
        return statistics.median(steady) if steady else 0.0


def make_result(
    recipe: str,
    world: Any,
    losses: list[float],
    params: Iterable[torch.Tensor] | float,
    timer: StepTimer,
    *,
    keep_final_state: dict[str, torch.Tensor] | None = None,
    workload: Any = None,
    **extras: Any,
) -> RecipeResult:
    """Fill a RecipeResult from what every training recipe has at its end.

    ``params``: the final parameters, or their checksum where no rank holds them all (a sharded
    model: ``full_state_on_rank0`` returns the checksum on every rank).
    ``workload`` (a ``recipes.core.throughput.Workload``) turns the step time into tokens/s and MFU.
    """
    checksum = params if isinstance(params, float) else param_checksum(params)
    speed = {}
    if workload is not None:
        devices = world.world_size if world.device.type == "cuda" else 1
        speed = workload.measure(timer.seconds_per_step, world.device, devices)
    return RecipeResult(
        recipe=recipe,
        world_size=world.world_size,
        backend=world.backend,
        device=str(world.device),
        losses=losses,
        param_checksum=checksum,
        seconds_per_step=timer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(world.device),
        extras=extras,
        final_state=keep_final_state,
        **speed,
    )
