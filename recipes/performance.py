"""The single-GPU habits every scaling guide starts with, each one a switch, each one measured.

    python -m recipes.performance                                # the fast loop on this device
    python -m recipes.performance --model 100m --global-batch-size 32     # on a GPU: the fast loop
    python -m recipes.performance --model 100m --precision fp32 --optimizer foreach   # the slow one
    python -m recipes.performance --sdpa-backend math                   # force an attention kernel
    python scripts/bench.py                      # every switch, one after the other, in one table

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

Before a second GPU, make one GPU fast: every recipe in this cookbook multiplies whatever one device
does. The bare training loop below (one device, no wrapper) has one switch per habit:

- ``--precision``: fp32 (TF32 off, torch's default) -> tf32 (TF32 tensor-core matmuls) -> bf16
  (autocast). (fp16 and its loss scaler are recipes/amp.py's lesson.)
- ``--optimizer``: AdamW's ``for_loop`` (one kernel per op per tensor), ``foreach`` (one per op over
  all tensors, torch's CUDA default) or ``fused`` (one kernel for the whole update).
- ``--compile``: ``torch.compile`` each block's forward and the loss. ``--compile-scope model``
  compiles the whole forward and the loss as one graph instead (one device, no wrapper), and
  ``--compile-mode reduce-overhead`` records that graph as CUDA graphs, so the host launches one
  graph instead of every kernel. Compiling the loss also lowers the peak memory: the fp32 copies
  of the [tokens, vocabulary] logits are never written.
- ``--zero-grad``: ``set_to_none=True`` frees the gradients (the next backward writes them fresh);
  ``zeros`` keeps them and launches a memset per gradient: more kernels and more memory traffic.
- ``--sdpa-backend``: which scaled-dot-product-attention kernel may run. The run names the one
  that did, read from the aten op it dispatched: flash, efficient (memory-efficient), cudnn or math.
- ``--pin-memory``: page-locked host batches, copied with ``non_blocking=True``: the copy overlaps
  with the step instead of stalling it (CUDA only: pinned memory needs an accelerator).

One device and one process: no process group. ``train`` returns a ``PerformanceRun``, each step's
loss and the attention kernel that ran. Timing, tokens/s and MFU come from the harness
(``python -m recipes.core.prove performance``), which also reports the ``torch.backends`` flags that
decide these (TF32, the SDPA backends, bf16 reductions): a measured number always comes with the
settings it was measured with.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, RandomSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

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
OPTIMIZERS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},  # as AdamW takes them
    "for_loop": {"foreach": False, "fused": False},
}


class SpeedSwitchError(ValueError):
    """A switch this device, or this combination of switches, cannot run."""


@dataclass
class PerformanceConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(
        8,
        "optimizer steps to run (the first, with warm-up and compilation, is not timed)",
        at_least=1,
    )
    # one device: the whole global batch
    global_batch_size: int = option(12, "sequences per optimizer step", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order", at_least=0)
    device: str = option(
        "auto", "auto: the GPU when there is one, else cpu", choices=["auto", "cpu", "cuda"]
    )
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; fp32: TF32 off (torch's default); tf32: TF32 matmuls "
        "(CUDA); bf16: autocast",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    optimizer: str = option(
        "fused",
        "AdamW implementation: fused = one kernel for the whole update, foreach = one per "
        "op over all tensors, for_loop = one per op per tensor",
        choices=list(OPTIMIZERS),
    )
    zero_grad: str = option(
        "none",
        "none = zero_grad(set_to_none=True), frees the gradients; zeros = fill them with 0",
        choices=["none", "zeros"],
    )
    sdpa_backend: str = option(
        "auto",
        "attention kernels allowed: auto = torch picks; the others force one (an error if "
        "it cannot run these shapes on this device)",
        choices=["auto", *SDPA_BACKENDS],
    )
    pin_memory: bool = option(
        False, "pinned host batches copied with non_blocking=True (CUDA only)"
    )
    compile: bool = option(
        False, "torch.compile each transformer block and the loss (see --compile-scope)"
    )
    compile_backend: str = option(
        "inductor",
        "torch.compile's backend; inductor is the fast one",
        choices=["inductor", "aot_eager", "eager"],
    )
    compile_scope: str = option(
        "blocks",
        "with --compile: blocks = each block and the loss (what every recipe does); "
        "model = the whole forward and the loss as one graph",
        choices=["blocks", "model"],
    )
    compile_mode: str = option(
        "default",
        "torch.compile mode with --compile-scope model; reduce-overhead = CUDA graphs",
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
    )

    def __post_init__(self):
        # What this machine cannot run (tf32 or pinned memory without a GPU) is refused by
        # train(): scripts/bench.py builds every row's config up front and skips those rows.
        check_options(self)  # the ranges and choices above: one line each
        if self.compile_scope == "model" and not self.compile:
            raise SpeedSwitchError("compile_scope model needs compile (--compile)")
        if self.compile_mode != "default" and self.compile_scope != "model":
            raise SpeedSwitchError(
                f"compile_mode {self.compile_mode} needs compile_scope model "
                "(--compile --compile-scope model)"
            )


@dataclass
class PerformanceRun:
    """What ``train`` returns: each step's loss, and the attention kernel that ran."""

    losses: list[float]
    sdpa_backend_ran: str


class OpsThatRan(TorchDispatchMode):
    """Records the name of every aten op that runs inside it: the kernels torch actually chose."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def attention_kernel_that_ran(
    model: torch.nn.Module, inputs: torch.Tensor, allowed, precision: str, requested: str
) -> str:
    """Run one forward and name the SDPA backend whose aten op was dispatched."""
    device, bf16 = inputs.device, precision == "bf16"
    try:
        with (
            torch.no_grad(),
            allowed(),
            OpsThatRan() as ops,
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
        ):
            model(inputs)
    # a forced kernel does not fall back: it refuses shapes it cannot run
    except RuntimeError as exc:
        if "backend" not in str(exc) and "kernel" not in str(exc):
            raise
        raise SpeedSwitchError(
            f"sdpa_backend {requested} cannot run this model's attention on "
            f"{device.type} in {precision}; use sdpa_backend auto (or math)"
        ) from None
    ran = [backend for backend, op in SDPA_OPS.items() if any(op in name for name in ops.names)]
    if not ran and any("_softmax" in name for name in ops.names):
        return "math"  # the math path is composite: it reaches the dispatch mode as bmm + softmax
    return ran[0] if ran else "unknown"


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto -> bf16 on a GPU that has it, else fp32. Sets the fp32 matmul mode on CUDA: TF32 for
    ``tf32`` only (a process-wide switch: set on every run, never inherited from an earlier one)."""
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "tf32" and not on_cuda:
        raise SpeedSwitchError(
            f"precision tf32 is a CUDA matmul mode and this run is on "
            f"{device.type}; use precision fp32 (or bf16)"
        )
    if requested == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise SpeedSwitchError(
            f"{torch.cuda.get_device_name(device)} has no bf16 support; "
            "use precision tf32 (or fp16 with recipes/amp.py's loss scaler)"
        )
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            requested == "tf32"
        )
    return requested


# --8<-- [start:train]
def train(cfg: PerformanceConfig, observer=None) -> PerformanceRun:
    """Train on one device, every speed switch as configured; returns each step's loss."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SpeedSwitchError("device cuda: this machine has no CUDA device; use device cpu")
    if cfg.pin_memory and not use_cuda:
        raise SpeedSwitchError("pin_memory needs a GPU: pinned memory speeds up copies to one")
    precision = resolve_precision(cfg.precision, device)  # TF32 on for tf32 only
    bf16 = precision == "bf16"

    # --8<-- [start:loop]
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    # Pitfall: sdpa_kernel is a context manager, not a switch: the forward runs inside it.
    allowed = (
        contextlib.nullcontext
        if cfg.sdpa_backend == "auto"
        else lambda: sdpa_kernel(SDPA_BACKENDS[cfg.sdpa_backend])
    )
    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    sample = dataset[0][0][None].to(device)  # before compiling: the probe sees the eager op
    attention = attention_kernel_that_ran(model, sample, allowed, precision, cfg.sdpa_backend)
    print(f"{precision} on {device.type}, attention kernel: {attention}", flush=True)
    loss_fn = lm_loss
    if cfg.compile and cfg.compile_scope == "blocks":  # each block's forward, and the loss
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
        loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)

    def forward_and_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(inputs), targets)

    if cfg.compile and cfg.compile_scope == "model":  # one graph: embedding to loss
        mode = None if cfg.compile_mode == "default" else cfg.compile_mode
        forward_and_loss = torch.compile(forward_and_loss, backend=cfg.compile_backend, mode=mode)
    cuda_graphs = cfg.compile_mode == "reduce-overhead"
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, **OPTIMIZERS[cfg.optimizer])
    if observer:
        observer.model_ready(model, optimizer)

    # A new order every epoch, the same on every run: reseeded from seed + epoch. (The sampler
    # holds the generator: given to the DataLoader, it would also draw the workers' base seed.)
    order = torch.Generator()
    loader = DataLoader(
        dataset,
        batch_size=cfg.global_batch_size,
        drop_last=True,
        pin_memory=cfg.pin_memory,
        sampler=RandomSampler(dataset, generator=order),
    )

    losses, step, epoch = [], 0, 0
    while step < cfg.steps:
        order.manual_seed(cfg.seed + epoch)
        for inputs, targets in loader:
            if step == cfg.steps:
                break
            # From pinned memory a non_blocking copy is asynchronous: it overlaps the step.
            inputs = inputs.to(device, non_blocking=cfg.pin_memory)
            targets = targets.to(device, non_blocking=cfg.pin_memory)
            if cuda_graphs:  # a new step: the graphs' output buffers may be reused
                torch.compiler.cudagraph_mark_step_begin()
            # none frees the gradients; zeros keeps them and launches a memset per gradient
            optimizer.zero_grad(set_to_none=cfg.zero_grad == "none")
            with allowed(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = forward_and_loss(inputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]
    return PerformanceRun(losses=losses, sdpa_backend_ran=attention)


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(PerformanceConfig, prog="python -m recipes.performance", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), PerformanceConfig, argv)
    with exit_on_bad_input():  # a switch this device cannot run: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
