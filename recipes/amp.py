"""Mixed precision (AMP): bf16 autocast, or fp16 autocast with a dynamic GradScaler, on one device.

    python -m recipes.amp --precision bf16               # cuda if available, else cpu
    python -m recipes.amp --precision fp16 --overflow-at-step 2   # watch the scaler skip a step
    python -m recipes.amp --precision fp32 --device cpu  # the plain fp32 loop, for comparison

Autocast runs matmuls (and other ops that tolerate it) in a 16-bit type while the parameters, the
optimizer state and precision-sensitive ops (softmax, layer norm, the loss) stay in fp32. The two
16-bit types trade differently:

- **bf16** keeps fp32's 8 exponent bits (range up to ~3e38) and has 7 mantissa bits (~2-3
  significant digits). Gradients do not overflow or underflow any more than in fp32, so no loss
  scaling is needed: bf16 is a drop-in ``torch.autocast(dtype=torch.bfloat16)``.
- **fp16** has 10 mantissa bits (more precise than bf16) but only 5 exponent bits: its largest value
  is 65504 and values below ~6e-8 flush to zero. Small gradients underflow to 0 in fp16, so the loss
  is multiplied by a large *scale* before backward (gradients scale with it), and the gradients are
  divided by it again before the optimizer step. Too large a scale overflows to inf: the GradScaler
  then skips that optimizer step and halves the scale; after ``growth_interval`` clean steps it
  doubles the scale again. A few skipped steps at the start are normal; many mean trouble.

This recipe trains on one device (the process group is a world of 1); AMP composes unchanged with
DDP/FSDP (autocast around the forward, the scaler around backward and step on every rank).
CPU fp16 autocast and ``torch.amp.GradScaler("cpu")`` exist since torch 2.3; on a build without
them the recipe stops with a message naming the fix instead of silently training in another
precision.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, check_step_reached, opt
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import (
    apply_compile,
    autocast,
    check_autocast,
    compile_loss,
    low_precision_dtype,
    make_adamw,
    make_grad_scaler,
    setup_precision,
)
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world

log = get_logger(__name__)

@dataclass
class AMPConfig(CompileOption, TrainConfig):
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16"] = opt(
        "bf16", "bf16: autocast, no scaler; fp16: autocast + GradScaler; fp32: no autocast (the "
                "reference); tf32: fp32 with TF32 matmuls (CUDA); auto: bf16 on a GPU, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = opt(
        "auto", "where to train; auto = cuda if a GPU is visible, else cpu"
    )
    overflow_at_step: int = opt(
        -1,
        "fp16 only: put an inf into one gradient at this step (as if fp16 had overflowed), to "
        "watch the scaler skip the step and halve the scale; -1 = never",
        ge=-1,
    )
    init_scale: float = opt(2.0**16, "fp16: the GradScaler's initial loss scale", gt=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overflow_at_step >= 0 and self.precision != "fp16":
            raise RecipeError(
                "overflow_at_step needs --precision fp16 (only the GradScaler detects and skips "
                "an "
                f"overflowing step); got --precision {self.precision}"
            )
        if self.overflow_at_step >= 0:
            check_step_reached("overflow_at_step", self.overflow_at_step, self.steps)


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RecipeError(
            "--device cuda needs a CUDA GPU and none is visible; use --device cpu (or auto)"
        )
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return (
        torch.device(requested, torch.cuda.current_device())
        if requested == "cuda"
        else torch.device("cpu")
    )


# --8<-- [start:train]
def train(cfg: AMPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        if world.world_size > 1:
            raise RecipeError(
                f"amp trains on one device, got a world of {world.world_size}; run "
                "`python -m recipes.amp` (AMP with DDP: see ddp_torchrun, add this loop's autocast)"
            )
        device = pick_device(cfg.device)
        # also sets TF32 on or off for fp32 matmuls
        precision = setup_precision(cfg.precision, device)
        check_autocast(device, precision)  # an unsupported dtype would silently run fp32
        # parameters stay fp32 ("master weights")
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        if cfg.compile:
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        loss_fn = compile_loss(lm_loss, backend=cfg.compile_backend) if cfg.compile else lm_loss
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=device)  # fused on CUDA
        scaler = make_grad_scaler(device, precision, init_scale=cfg.init_scale)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(
            dataset, rank=0, world_size=1, per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed
        )
        log.info(
            "%s on %s (autocast dtype %s, loss scaling %s)",
            precision,
            device,
            low_precision_dtype(precision),
            "on" if scaler.is_enabled() else "off",
        )

        losses, scales, skipped_steps, timer = [], [], [], StepTimer(device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(device), targets.to(device)
                # Only the forward (and the loss) runs under autocast; backward reuses the dtypes
                # the forward chose. lm_loss computes the cross entropy in fp32 either way.
                with autocast(device, precision):
                    loss = loss_fn(model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                # fp16: loss * scale, so small gradients survive in fp16
                scaler.scale(loss).backward()
                if step == cfg.overflow_at_step:
                    inject_overflow(model)
                scale_before = scaler.get_scale()
                # unscales the grads; skips optimizer.step() if any is inf/nan
                scaler.step(optimizer)
                # halves the scale after an overflow, doubles it after growth_interval good steps
                scaler.update()
                # The scaler does not report a skip; a scale that went down is the only public sign
                # of one.
                if scaler.get_scale() < scale_before:
                    skipped_steps.append(step)
            losses.append(float(loss.item()))
            scales.append(scaler.get_scale())
            log.info(
                "step %d loss %.4f scale %g%s time %.1f ms",
                step,
                losses[-1],
                scales[-1],
                " (skipped: inf/nan gradient)" if skipped_steps[-1:] == [step] else "",
                timer.durations[-1] * 1e3,
            )

        return make_result(
            "amp",
            dataclasses.replace(world, device=device),
            losses,
            model.parameters(),
            timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            skipped_steps=len(skipped_steps),
            skipped_step_indices=skipped_steps,
            final_scale=scaler.get_scale(),
            scales=scales,
        )
# --8<-- [end:train]


def inject_overflow(model: torch.nn.Module) -> None:
    """Put one inf into one gradient: what an fp16 overflow in backward looks like to the scaler."""
    first = next(model.parameters())
    with torch.no_grad():
        first.grad.view(-1)[0] = float("inf")


if __name__ == "__main__":
    run_cli(train, AMPConfig, __doc__)
