"""Activation checkpointing: keep less of the forward for backward, recompute the rest.

    python -m recipes.activation_checkpointing                         # per_block, "small" model
    python -m recipes.activation_checkpointing --mode op_selective     # keep matmul outputs only
    python -m recipes.activation_checkpointing --mode selective --every-k 2
    python -m recipes.activation_checkpointing --mode sequential --segments 2
    python -m recipes.activation_checkpointing --mode none             # the baseline

Copy with it: recipes/toy.py (the model and data you replace), recipes/parallelize.py
(``apply_activation_checkpointing``, and ``apply_compile`` for --compile), recipes/options.py (the
command line, from the config).

Backward needs tensors that forward computed (a linear layer's input, a GELU's input, attention's
q/k/v...); autograd keeps them alive from forward until backward, and for a transformer they
dominate memory: ~16 x dim floats per token per block here. Checkpointing a block keeps only its
input (dim floats per token) and runs the block's forward a second time during backward to rebuild
the rest: one extra forward of each checkpointed block (a forward is roughly a third of a step's
compute) buys back most of the activation memory.

Modes: ``per_block`` checkpoints every block; ``selective`` every k-th block (torchtitan's
"selective layer" AC); ``sequential`` uses ``checkpoint_sequential``, which splits the blocks into
segments and - pitfall - never checkpoints the last one. ``op_selective`` (torchtitan's "selective
op" AC) checkpoints every block with a policy that decides op by op: it keeps the outputs of the
matmuls and attention kernels and recomputes the rest (layer norms, GELU, adds, views, casts).
The trade: the matmuls hold nearly all of a block's FLOPs, the expensive ops to redo; a pointwise
op is cheap to redo, but its output is as large as a matmul's. Keeping only the matmuls' outputs
makes the recompute almost free and puts memory between ``none`` and ``per_block``: here
(7 + mlp_ratio) x dim floats per token per block (block input, q, k, v, attention output, the two
output projections, the MLP's hidden layer), against 16 x dim. Fewer FLOPs is not less time: in
eager mode every op passes through the policy's Python dispatch mode, which on a small model costs
more than the matmuls it saves (measured on the docs page).

Always ``use_reentrant=False``: the reentrant variant does not support ``torch.autograd.grad`` or
selective checkpointing, drops the parameters' gradients when no input requires grad, and needs
``static_graph=True`` under DDP; leaving the argument out still selects it (torch 2.13 only warns).
Gradients are unchanged by checkpointing (tests assert it exactly, in fp32).

Speed: ``--precision`` (auto = bf16 on a GPU, fp32 on CPU) autocasts the forward; AdamW is fused
on CUDA. It trains on one device in one process; the same wrapping works under DDP and FSDP (apply
it before wrapping the model in them, and before torch.compile). ``train`` returns the loss of each
step and prints it. What each mode keeps for backward is measured from outside, by the harness
(``python -m recipes.core.prove activation_checkpointing``: the bytes the first forward leaves
alive, and which blocks backward ran again).
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint_sequential
from torch.utils.data import DataLoader, RandomSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_activation_checkpointing, apply_compile
from recipes.toy import MODEL_PRESETS, Block, TransformerLM, build_model, lm_loss, make_dataset

aten = torch.ops.aten
MODES = ("none", "per_block", "selective", "sequential", "op_selective")


@dataclass
class ACConfig:
    model: str = option(
        "small",
        "model size; small has 4 blocks, enough to compare modes",
        choices=sorted(MODEL_PRESETS),
    )
    mode: str = option(
        "per_block",
        "none | per_block: checkpoint every block | selective: every k-th block | "
        "sequential: checkpoint_sequential over the blocks | op_selective: every block, keeping "
        "the matmul outputs and recomputing the rest",
        choices=list(MODES),
    )
    every_k: int = option(2, "selective: checkpoint blocks 0, k, 2k, ...", at_least=1)
    segments: int = option(
        2, "sequential: segments of the blocks; all but the last are checkpointed", at_least=1
    )
    steps: int = option(6, "optimizer steps", at_least=1)
    # one device: the whole global batch
    global_batch_size: int = option(12, "sequences per optimizer step", at_least=1)
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    device: str = option(
        "auto",
        "where to train; auto: cuda if a GPU is visible, else cpu",
        choices=["auto", "cpu", "cuda"],
    )
    compile: bool = option(
        False, "torch.compile each transformer block (after checkpointing) and the loss"
    )
    compile_backend: str = option(
        "inductor",
        "torch.compile's backend; inductor is the fast one",
        choices=["inductor", "aot_eager", "eager"],
    )

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        n_blocks = MODEL_PRESETS[self.model].n_layers
        if self.segments > n_blocks:
            raise ValueError(
                f"segments must be between 1 and the model's {n_blocks} blocks, got {self.segments}"
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device cuda needs a CUDA GPU and none is visible; use device cpu (or auto)"
            )


# --8<-- [start:policy]
# The ops whose outputs op-level selective checkpointing keeps: the matmuls (nn.Linear is mm, or
# addmm with a bias) and the fused attention kernels, as torchtitan's _save_list does. Pitfall: the
# CPU attention kernel has a name of its own; a list written for GPUs recomputes attention on CPU.
MATMUL_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def save_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what is expensive to recompute, recompute what is cheap (called per op, in forward).

    MUST_SAVE keeps the op's output in the checkpoint's cache until backward; PREFER_RECOMPUTE lets
    backward run the op again. A policy keyed by op keeps some outputs nothing reads back: the MLP's
    output projection, here (torchtitan's policy also recomputed every second mm, to keep less).
    """
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# --8<-- [end:policy]


# --8<-- [start:sequential]
def sequential_forward(
    model: TransformerLM, tokens: torch.Tensor, *, segments: int
) -> torch.Tensor:
    """``model(tokens)`` with ``checkpoint_sequential`` over the blocks (mirrors its forward).

    checkpoint_sequential splits the blocks into ``segments`` runs of len // segments blocks and
    checkpoints all of them but the last, whose activations backward needs right away anyway.
    ``train`` installs it as ``model.forward``, so that ``model(tokens)`` (and any hook on the
    model) still runs it.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.tok_embeddings(tokens) + model.pos_embeddings(positions)
    x = checkpoint_sequential(list(model.layers.values()), segments, x, use_reentrant=False)
    return model.output(model.norm(x))


def sequential_segment_starts(n_blocks: int, segments: int) -> list[int]:
    """The first block of each checkpointed segment, as checkpoint_sequential splits them."""
    size = n_blocks // segments
    return list(range(0, size * (segments - 1), size))


# --8<-- [end:sequential]


# --8<-- [start:train]
def train(cfg: ACConfig, observer=None) -> list[float]:
    """Train on one device with ``cfg.mode``'s checkpointing; returns the loss of each step."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError(
            f"activation_checkpointing trains on one device, got a launcher's world "
            f"of {os.environ['WORLD_SIZE']}; run `python -m "
            "recipes.activation_checkpointing`"
        )
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
    )
    if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    # --8<-- [start:loop]
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    blocks = list(model.layers.values())
    if cfg.mode == "sequential":  # model(tokens) now runs checkpoint_sequential over the blocks
        model.forward = functools.partial(sequential_forward, model, segments=cfg.segments)
        checkpointed = sequential_segment_starts(len(blocks), cfg.segments)
    elif cfg.mode != "none":
        regions = apply_activation_checkpointing(
            model,
            block_types=(Block,),
            every_k=cfg.every_k if cfg.mode == "selective" else 1,
            policy=save_matmul_outputs if cfg.mode == "op_selective" else None,
        )
        checkpointed = [blocks.index(region) for region in regions]
    else:
        checkpointed = []
    loss_fn = lm_loss
    if cfg.compile:  # after checkpointing: each block's checkpoint is traced with its policy
        apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
    )  # one kernel on CUDA
    if observer:
        observer.model_ready(model, optimizer)
    precision = "bf16" if bf16 else "fp32"
    print(f"mode {cfg.mode} ({precision}): blocks {checkpointed} checkpointed", flush=True)

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
    losses, step, epoch = [], 0, 0
    while step < cfg.steps:
        order.manual_seed(cfg.seed + epoch)
        for inputs, targets in loader:
            if step == cfg.steps:
                break
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(inputs), targets)
            loss.backward()  # checkpointed blocks run their forward again here
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]
    return losses


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(ACConfig, prog="python -m recipes.activation_checkpointing", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), ACConfig, argv)
    with exit_on_bad_input():  # a launcher's world it cannot use: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
