"""Mixed precision (AMP): bf16 autocast, or fp16 autocast with a dynamic GradScaler, on one device.

    python -m recipes.amp --precision bf16               # cuda if available, else cpu
    python -m recipes.amp --precision fp16               # autocast fp16 + GradScaler
    python -m recipes.amp --precision fp32 --device cpu  # the plain fp32 loop, for comparison

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

Autocast runs matmuls (and other ops that tolerate it) in a 16-bit type while the parameters, the
optimizer state and precision-sensitive ops (softmax, layer norm, the loss) stay in fp32. The two
16-bit types trade differently:

- **bf16** keeps fp32's 8 exponent bits (range up to ~3e38) and has 7 mantissa bits (~2-3
  significant digits). Gradients do not overflow or underflow any more than in fp32, so no loss
  scaling is needed: bf16 is a drop-in ``torch.autocast(dtype=torch.bfloat16)``.
- **fp16** has 10 mantissa bits (more precise than bf16) but only 5 exponent bits: its largest
  value is 65504 and values below ~6e-8 flush to zero. Small gradients underflow to 0 in fp16, so
  the loss is multiplied by a large *scale* before backward (gradients scale with it), and the
  gradients are divided by it again before the optimizer step. Too large a scale overflows to inf:
  the GradScaler then skips that optimizer step and halves the scale; after ``growth_interval``
  clean steps it doubles the scale again. A few skipped steps at the start are normal; many mean
  trouble.

It prints one line per step: the loss, the scale, and "(skipped: inf/nan gradient)" on a step the
scaler skipped. ``train`` returns an ``AMPRun``: the losses, and the scale after each step and the
steps skipped, because watching the scaler is this recipe's point.

This recipe trains on one device in one process (no process group); AMP composes unchanged with
DDP/FSDP (autocast around the forward, the scaler around backward and step on every rank).
CPU fp16 autocast and ``torch.amp.GradScaler("cpu")`` exist since torch 2.3; on a build without
them the recipe stops with a message naming the fix instead of silently training in another
precision.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, RandomSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class AMPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    # one device: the whole global batch
    global_batch_size: int = option(12, "sequences per optimizer step", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "bf16",
        "bf16: autocast, no scaler; fp16: autocast + GradScaler; fp32: no autocast (the "
        "reference); tf32: fp32 with TF32 matmuls (CUDA); auto: bf16 on a GPU, fp32 on CPU",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
    )
    device: str = option(
        "auto",
        "where to train; auto: cuda if a GPU is visible, else cpu",
        choices=["auto", "cpu", "cuda"],
    )
    init_scale: float = option(2.0**16, "fp16: the GradScaler's initial loss scale", above=0)
    compile: bool = option(False, "torch.compile each transformer block (and the loss)")
    compile_backend: str = option(
        "inductor",
        "torch.compile's backend; inductor is the fast one",
        choices=["inductor", "aot_eager", "eager"],
    )

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device cuda needs a CUDA GPU and none is visible; use device cpu (or auto)"
            )
        on_cpu = self.device == "cpu" or not torch.cuda.is_available()
        if self.precision == "tf32" and on_cpu:
            raise ValueError(
                "precision tf32 is a CUDA matmul mode and this run is on cpu; "
                "use precision fp32 (or bf16)"
            )


@dataclass
class AMPRun:
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # after each step; 1.0 without a scaler
    skipped_steps: list[int] = field(default_factory=list)  # steps the scaler skipped


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return (
        torch.device("cuda", torch.cuda.current_device())
        if requested == "cuda"
        else torch.device("cpu")
    )


def pick_precision(requested: str, device: torch.device) -> str:
    """Resolve ``auto``, refuse what this device cannot do, and set the fp32 matmul mode."""
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"{torch.cuda.get_device_name(device)} has no bf16 support; use "
            "precision fp16 (with its loss scaler) or tf32"
        )
    if on_cuda:  # a process-wide switch: set it for every precision, never inherit it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            requested == "tf32"
        )
    dtype = LOW_PRECISION.get(requested)
    if dtype is not None:
        # Pitfall: autocast to a dtype the device cannot do is no error: torch warns and runs
        # fp32. A matmul probe tells the truth.
        probe = torch.ones(2, 2, device=device)
        with torch.autocast(device.type, dtype=dtype):
            if (probe @ probe).dtype != dtype:
                raise ValueError(
                    f"torch {torch.__version__} cannot autocast to {requested} on "
                    f"{device.type} (needs torch >= 2.3 for cpu fp16); use "
                    "precision bf16, or a GPU"
                )
    return requested


# --8<-- [start:train]
def train(cfg: AMPConfig, observer=None) -> AMPRun:
    """Train on one device; returns the losses, the scale after each step and the skipped steps."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError(
            "amp trains on one device, got a launcher's world of "
            f"{os.environ['WORLD_SIZE']}; run `python -m recipes.amp` (AMP with DDP: "
            "see ddp_torchrun, add this loop's autocast)"
        )
    device = pick_device(cfg.device)
    use_cuda = device.type == "cuda"
    precision = pick_precision(cfg.precision, device)
    dtype = LOW_PRECISION.get(precision)  # None: no autocast (fp32, tf32)
    # --8<-- [start:loop]
    model = build_model(cfg.model, seed=cfg.seed, device=device)  # parameters stay fp32
    loss_fn = lm_loss
    if cfg.compile:  # each block's forward, and the loss
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
        loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
    )  # one kernel on CUDA
    # fp16 only; a disabled scaler (bf16, fp32) passes scale() and step() through unchanged
    scaler = torch.amp.GradScaler(
        device.type, init_scale=cfg.init_scale, enabled=precision == "fp16"
    )
    if precision == "fp16" and not scaler.is_enabled():  # it disables itself where unsupported
        raise ValueError(
            f"torch.amp.GradScaler is unavailable on {device.type} in this torch "
            "build; use precision bf16 (no scaler needed)"
        )
    if observer:
        observer.model_ready(model, optimizer)

    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    # A new order every epoch, the same on every run: reseeded from seed + epoch. (The sampler
    # holds the generator: given to the DataLoader, it would also draw the workers' base seed.)
    order = torch.Generator()
    loader = DataLoader(
        dataset,
        batch_size=cfg.global_batch_size,
        drop_last=True,
        pin_memory=use_cuda,
        sampler=RandomSampler(dataset, generator=order),
    )
    run, step, epoch = AMPRun(), 0, 0
    while step < cfg.steps:
        order.manual_seed(cfg.seed + epoch)
        for inputs, targets in loader:
            if step == cfg.steps:
                break
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            # Only the forward (and the loss) runs under autocast; backward reuses the dtypes
            # the forward chose. lm_loss computes the cross entropy in fp32 either way.
            with torch.autocast(
                device.type, dtype=dtype or torch.float32, enabled=dtype is not None
            ):
                loss = loss_fn(model(inputs), targets)
            scaler.scale(loss).backward()  # fp16: loss * scale, so small gradients survive
            scale_before = scaler.get_scale()
            scaler.step(optimizer)  # unscales the grads; skips optimizer.step() on inf/nan
            scaler.update()  # halves the scale after an overflow, doubles it after 2000 good
            # The scaler does not report a skip: a scale that went down is the public sign.
            skipped = scaler.get_scale() < scale_before
            if skipped:
                run.skipped_steps.append(step)
            run.losses.append(loss.item())
            run.scales.append(scaler.get_scale())
            print(
                f"step {step} loss {run.losses[-1]:.4f} scale {run.scales[-1]:g}"
                + (" (skipped: inf/nan gradient)" if skipped else ""),
                flush=True,
            )
            if observer:
                observer.step_end(step, run.losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]
    return run


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(AMPConfig, prog="python -m recipes.amp", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), AMPConfig, argv)
    with exit_on_bad_input():  # a precision this device cannot do: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
