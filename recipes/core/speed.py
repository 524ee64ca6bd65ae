"""What a strong engineer turns on for speed, once for every recipe: precision, AdamW, compile.

``--precision`` (every training recipe) takes one of:

- ``auto``: bf16 on a GPU that supports it, fp32 elsewhere (CPU). The default: fast where it runs.
- ``fp32``: true fp32. On CUDA this also turns TF32 *off* for matmuls (torch's own default), so the
  parity tests compare like with like.
- ``tf32``: fp32 tensors, but CUDA matmuls use TF32 tensor cores (10-bit mantissa inputs, fp32
  accumulation): about 3x fp32 on an H100/H200 with no code change. CUDA only.
- ``bf16``: autocast to bfloat16 for the DDP-style recipes (fp32 master weights and optimizer
  state); the sharding APIs' own mixed-precision policy in the FSDP recipes (never autocast on top).
- ``fp16``: the same with float16, always with a loss scaler (``make_grad_scaler``).

AdamW is ``fused=True`` on CUDA (one kernel for every parameter, DTensor parameters included): the
default ``foreach`` implementation on DTensor parameters costs tens of ms a step in dispatch alone.

``apply_compile`` compiles each transformer block's ``forward`` in place, so parameter names and
checkpoints are unchanged. Order, as torchtitan documents it: activation checkpointing, then
compile, then sharding (fully_shard / DDP).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Literal

import torch

from recipes.core.config import RecipeError
from recipes.parallelize import CompileTargetError, apply_compile  # noqa: F401  (re-exported)

__all__ = [
    "Precision",
    "setup_precision",
    "low_precision_dtype",
    "mixed_precision_policy",
    "autocast",
    "check_autocast",
    "make_grad_scaler",
    "step_with_scaler",
    "make_adamw",
    "apply_compile",
    "compile_loss",
]

Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16"]
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def setup_precision(requested: str, device: torch.device) -> str:
    """Resolve ``auto`` for ``device``, set this process's fp32 matmul mode, return the precision.

    Pitfall: TF32 is a process-wide switch (``torch.backends.cuda.matmul``). Setting it here, for
    every precision, means a run never inherits it from an earlier one in the same process.
    """
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "tf32" and not on_cuda:
        raise RecipeError(
            f"--precision tf32 is a CUDA matmul mode and this run is on {device.type}; "
            "use --precision fp32 (or bf16)"
        )
    if requested == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise RecipeError(
            f"{torch.cuda.get_device_name(device)} has no bf16 support; "
            "use --precision fp16 (with its loss scaler) or tf32"
        )
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = requested == "tf32"
        torch.backends.cudnn.allow_tf32 = requested == "tf32"
    return requested


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """bf16 / fp16 -> their dtype; fp32 / tf32 -> None (no low-precision compute)."""
    return LOW_PRECISION.get(precision)


def mixed_precision_policy(precision: str) -> Any:
    """fully_shard's ``MixedPrecisionPolicy`` for the harness-built recipes. bf16/fp16: compute in
    that dtype, reduce gradients in fp32 (a sum over many ranks in bf16 loses bits); fp32/tf32:
    the default policy (everything in the parameters' fp32). recipes/fsdp2.py writes it inline."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # only the sharded recipes pay for it

    low = low_precision_dtype(precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to the precision's 16-bit type; a no-op for fp32/tf32. Wrap forward and loss."""
    dtype = low_precision_dtype(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def check_autocast(device: torch.device, precision: str) -> None:
    """Refuse, with the fix, a precision this torch build cannot autocast to on this device.

    Pitfall: an unsupported autocast dtype is not an error in torch: it warns and *disables*
    autocast, so the run would silently be fp32. A matmul probe tells the truth.
    """
    dtype = low_precision_dtype(precision)
    if dtype is None:
        return
    probe = torch.ones(2, 2, device=device)
    with torch.autocast(device.type, dtype=dtype):
        produced = (probe @ probe).dtype
    if produced != dtype:
        raise RecipeError(
            f"torch {torch.__version__} cannot autocast to {precision} on {device.type} "
            "(needs torch >= 2.3 for cpu fp16); use --precision bf16, or a GPU"
        )


def make_grad_scaler(
    device: torch.device, precision: str, *, init_scale: float = 2.0**16
) -> torch.amp.GradScaler:
    """A dynamic loss scaler for fp16; a disabled one (scale() and step() pass through) otherwise.

    fp16's 5 exponent bits flush small gradients to zero: the loss is multiplied by the scale before
    backward and the gradients divided by it before the step, which is skipped on inf/nan.
    """
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=precision == "fp16")
    if precision == "fp16" and not scaler.is_enabled():  # it disables itself where unsupported
        raise RecipeError(
            f"torch.amp.GradScaler is unavailable on {device.type} in this torch build; "
            "use --precision bf16 (no scaler needed)"
        )
    return scaler


def step_with_scaler(optimizer: torch.optim.Optimizer, scaler: Any) -> bool:
    """``optimizer.step()``, through the fp16 loss scaler when there is one (None: no scaler).
    True when the scaler skipped the step (an inf/nan gradient, on any rank for a sharded scaler)
    and lowered its scale."""
    if scaler is None:
        optimizer.step()
        return False
    scale = scaler.get_scale()
    scaler.step(optimizer)  # skips optimizer.step() if any inf/nan was found
    scaler.update()
    return scaler.get_scale() < scale


def make_adamw(
    params: Iterable[torch.Tensor], *, lr: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW, fused into one kernel on CUDA (DTensor parameters too); torch's default elsewhere.

    On CPU the default keeps the parity tests bit-exact against the textbook loop.
    """
    return torch.optim.AdamW(params, lr=lr, fused=True if device.type == "cuda" else None)


def compile_loss(loss_fn: Callable[..., torch.Tensor], *, backend: str = "inductor"
                 ) -> Callable[..., torch.Tensor]:
    """``torch.compile`` the loss, as ``--compile`` does beside the blocks.

    Why: the blocks are not all of the step. With the 100m preset's 16k vocabulary the eager
    cross entropy writes an fp32 copy of the logits, then the log-probabilities, then their
    gradient, each [tokens, 16384]; compiled, the cast, the log-softmax and its gradient fuse into
    reductions that read the bf16 logits once. Separate from the model, it needs no change to
    the model or to the wrappers (DDP, fully_shard, TP) around it.
    """
    return torch.compile(loss_fn, backend=backend)


LIGHTNING_PRECISION = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def lightning_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """(Lightning's precision string, the cookbook's name for it); ``auto``: bf16-mixed on a GPU.

    Also sets the fp32 matmul mode as ``setup_precision`` does, so 32-true on CUDA is true fp32.
    """
    if requested == "auto":
        requested = "bf16-mixed" if setup_precision("auto", device) == "bf16" else "32-true"
    return requested, setup_precision(LIGHTNING_PRECISION[requested], device)
