"""The single-GPU habits every scaling guide starts with, each one a switch, each one measured.

    python -m recipes.performance                                # the fast loop on this device
    python -m recipes.performance --model 100m --global-batch-size 32     # on a GPU: the fast loop
    python -m recipes.performance --model 100m --precision fp32 --optimizer foreach   # the slow one
    python -m recipes.performance --sdpa-backend math                   # force an attention kernel
    python scripts/bench.py                      # every switch, one after the other, in one table

Before a second GPU, make one GPU fast: every recipe in this cookbook multiplies whatever one device
does. The bare training loop below (one device, no wrapper) has one switch per habit:

- ``--precision``: fp32 (TF32 off, torch's default) -> tf32 (TF32 tensor-core matmuls) -> bf16
  (autocast). On one H200 with the 100m preset these were 231, 76 and 40 ms a step (issue #9).
- ``--optimizer``: AdamW's ``for_loop`` (one kernel per op per tensor), ``foreach`` (one per op over
  all tensors, torch's CUDA default) or ``fused`` (one kernel for the whole update).
- ``--compile``: ``torch.compile`` each block and the loss (recipes.core.speed.apply_compile,
  compile_loss). ``--compile-scope model`` compiles the whole forward and the loss as one graph
  instead (one device and no wrapper only), and ``--compile-mode reduce-overhead`` records that
  graph as CUDA graphs, so the host launches one graph instead of every kernel. On one H200
  (100m, bf16, batch 64, torch 2.11): eager 67.4 ms a step (31.6% MFU), ``--compile`` 51.3 ms
  (41.4%), the whole model 50.2 ms (42.3%), with CUDA graphs 50.8 ms (41.8%): at this batch the
  GPU is the limit, not the host. Compiling the loss also took the peak memory from 18.9 GiB
  to 13.2: the fp32 copies of the [tokens, 16384] logits are never written.
- ``--zero-grad``: ``set_to_none=True`` frees the gradients (the next backward writes them fresh);
  ``zeros`` keeps them and launches a memset per gradient: more kernels and more memory traffic.
- ``--sdpa-backend``: which scaled-dot-product-attention kernel may run. The result names the one
  that did, read from the aten op it dispatched: flash, efficient (memory-efficient), cudnn or math.
- ``--pin-memory``: page-locked host batches, copied with ``non_blocking=True``: the copy overlaps
  with the step instead of stalling it (CUDA only: pinned memory needs an accelerator).

The ``torch.backends`` flags that decide these (TF32, the SDPA backends, bf16 reductions) are
reported in the result, so a measured number always comes with the settings it was measured with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, opt
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import (apply_compile, autocast, compile_loss, make_grad_scaler,
                                setup_precision)
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

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# The aten op each backend dispatches to: what a dispatch mode sees when it runs.
SDPA_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "math": "_scaled_dot_product_attention_math",
}


@dataclass
class PerformanceConfig(CompileOption, TrainConfig):
    steps: int = opt(
        8, "optimizer steps to run (the first, with warm-up and compilation, is not timed)", ge=1
    )
    optimizer: Literal["fused", "foreach", "for_loop"] = opt(
        "fused",
        "AdamW implementation: fused = one kernel for the whole update, foreach = one per op "
        "over all tensors, for_loop = one per op per tensor",
    )
    zero_grad: Literal["none", "zeros"] = opt(
        "none", "none = zero_grad(set_to_none=True), frees the gradients; zeros = fill them with 0"
    )
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = opt(
        "auto",
        "attention kernels allowed: auto = torch picks; the others force one (an error if it "
        "cannot run these shapes on this device)",
    )
    pin_memory: bool = opt(False, "pinned host batches copied with non_blocking=True (CUDA only)")
    compile_scope: Literal["blocks", "model"] = opt(
        "blocks", "with --compile: blocks = each block and the loss (what every recipe does); "
        "model = the whole forward and the loss as one graph")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = opt(
        "default", "torch.compile mode with --compile-scope model; reduce-overhead = CUDA graphs")


def backend_flags() -> dict:
    """The torch.backends switches a speed number depends on."""
    return {
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "sdp: flash / mem_efficient / cudnn / math": [
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
        ],
    }


class OpsThatRan(TorchDispatchMode):
    """Records the name of every aten op that runs inside it: the kernels torch actually chose."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def attention_kernel_that_ran(model: torch.nn.Module, inputs: torch.Tensor, allowed, precision: str,
                              device: torch.device, requested: str) -> str:
    """Run one forward and name the SDPA backend whose aten op was dispatched."""
    try:
        with torch.no_grad(), allowed(), autocast(device, precision), OpsThatRan() as ops:
            model(inputs)
    # a forced kernel does not fall back: it refuses shapes it cannot run
    except RuntimeError as exc:
        if "backend" not in str(exc) and "kernel" not in str(exc):
            raise
        raise RecipeError(
            f"--sdpa-backend {requested} cannot run this model's attention on "
            f"{device.type} in {precision}; use --sdpa-backend auto (or math)"
        ) from None
    ran = [backend for backend, op in SDPA_OPS.items() if any(op in name for name in ops.names)]
    if not ran and any("_softmax" in name for name in ops.names):
        return "math"  # the math path is composite: it reaches the dispatch mode as bmm + softmax
    return ran[0] if ran else "unknown"


# --8<-- [start:train]
def train(cfg: PerformanceConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        device = world.device
        if world.world_size > 1:
            raise RecipeError(f"performance measures one device, got a world of "
                              f"{world.world_size}; run `python -m recipes.performance`")
        if cfg.pin_memory and device.type != "cuda":
            raise RecipeError("--pin-memory needs a GPU: pinned memory speeds up copies to one")
        precision = setup_precision(cfg.precision, device)  # TF32 on for tf32 only
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        # Pitfall: sdpa_kernel is a context manager, not a switch: the forward runs inside it.
        allowed = (contextlib.nullcontext if cfg.sdpa_backend == "auto"
                   else lambda: sdpa_kernel(SDPA_BACKENDS[cfg.sdpa_backend]))
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        sample = dataset[0][0][None].to(device)
        attention = attention_kernel_that_ran(model, sample, allowed, precision, device,
                                              cfg.sdpa_backend)
        if cfg.compile_scope == "model" and not cfg.compile:
            raise RecipeError("--compile-scope model needs --compile")
        if cfg.compile_mode != "default" and cfg.compile_scope != "model":
            raise RecipeError("--compile-mode needs --compile --compile-scope model")

        def forward_and_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return lm_loss(model(inputs), targets)

        if cfg.compile and cfg.compile_scope == "model":  # one graph: embedding to loss
            mode = None if cfg.compile_mode == "default" else cfg.compile_mode
            forward_and_loss = torch.compile(forward_and_loss, backend=cfg.compile_backend,
                                             mode=mode)
        elif cfg.compile:  # after the probe, which must see the eager attention op
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
            compiled_loss = compile_loss(lm_loss, backend=cfg.compile_backend)

            def forward_and_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                return compiled_loss(model(inputs), targets)
        cuda_graphs = cfg.compile_mode == "reduce-overhead"
        implementation = {"fused": {"fused": True}, "foreach": {"foreach": True},
                          "for_loop": {"foreach": False, "fused": False}}[cfg.optimizer]
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, **implementation)
        scaler = make_grad_scaler(device, precision)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1, seed=cfg.seed,
                                             per_rank_batch_size=cfg.global_batch_size,
                                             pin_memory=cfg.pin_memory)

        losses, timer = [], StepTimer(device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                # From pinned memory a non_blocking copy is asynchronous: it overlaps the step.
                inputs = inputs.to(device, non_blocking=cfg.pin_memory)
                targets = targets.to(device, non_blocking=cfg.pin_memory)
                if cuda_graphs:  # a new step: the graphs' output buffers may be reused
                    torch.compiler.cudagraph_mark_step_begin()
                with allowed(), autocast(device, precision):
                    loss = forward_and_loss(inputs, targets)
                optimizer.zero_grad(set_to_none=cfg.zero_grad == "none")
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            losses.append(float(loss.item()))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1],
                     timer.durations[-1] * 1e3)

        return make_result(
            "performance", world, losses, model.parameters(), timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            optimizer=cfg.optimizer, compiled=cfg.compile, zero_grad=cfg.zero_grad,
            compile_scope=cfg.compile_scope if cfg.compile else None,
            compile_mode=cfg.compile_mode if cfg.compile else None,
            sdpa_backend_allowed=cfg.sdpa_backend, sdpa_backend_ran=attention,
            pin_memory=cfg.pin_memory, backends=backend_flags())
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, PerformanceConfig, __doc__)
