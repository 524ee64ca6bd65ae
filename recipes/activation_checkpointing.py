"""Activation checkpointing: keep less of the forward for backward, recompute the rest.

    python -m recipes.activation_checkpointing                         # per_block, "small" model
    python -m recipes.activation_checkpointing --mode op_selective     # keep matmul outputs only
    python -m recipes.activation_checkpointing --mode selective --every-k 2
    python -m recipes.activation_checkpointing --mode sequential --segments 2
    python -m recipes.activation_checkpointing --mode none             # the baseline

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
on CUDA; the result reports tokens/s and MFU (the recomputed forward is not counted as model
FLOPs). The recipe also reports the bytes the forward leaves alive for backward, measured
(``SavedTensorBytes``). It trains on one device; the same wrapping works under DDP and FSDP
(apply it before wrapping the model in them, and before torch.compile).

``apply_activation_checkpointing`` itself lives in recipes/parallelize.py with the other functions
that parallelize a model (each copies alone); this recipe compares the modes.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint_sequential

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, opt
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import (apply_compile, autocast, check_autocast, compile_loss, make_adamw,
                                make_grad_scaler, setup_precision)
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, Block, TransformerLM, build_model,
                                   distributed_loader, iterate_steps, lm_loss, make_dataset)
from recipes.core.world import join_world
from recipes.parallelize import (  # noqa: F401  (copyable: it lives with the others)
    CACHE_ARGUMENTS, CheckpointingError, apply_activation_checkpointing)

log = get_logger(__name__)
aten = torch.ops.aten


@dataclass
class ACConfig(CompileOption, TrainConfig):
    model: Literal["tiny", "small", "100m"] = opt(
        "small", "model size preset; small has 4 blocks, enough to compare modes")
    mode: Literal["none", "per_block", "selective", "sequential", "op_selective"] = opt(
        "per_block", "none | per_block: checkpoint every block | selective: every k-th block | "
        "sequential: checkpoint_sequential over the blocks | op_selective: every block, keeping "
        "the matmul outputs and recomputing the rest")
    every_k: int = opt(2, "selective: checkpoint blocks 0, k, 2k, ...", ge=1)
    segments: int = opt(2, "sequential: segments of the blocks; all but the last are checkpointed",
                        ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        n_layers = MODEL_PRESETS[self.model].n_layers
        if self.segments > n_layers:
            raise RecipeError(f"segments must be between 1 and the model's {n_layers} blocks, "
                              f"got {self.segments}")


# --8<-- [start:policy]
# The ops whose outputs op-level selective checkpointing keeps: the matmuls (nn.Linear is mm, or
# addmm with a bias) and the fused attention kernels, as torchtitan's _save_list does. Pitfall: the
# CPU attention kernel has a name of its own; a list written for GPUs recomputes attention on CPU.
MATMUL_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def save_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what is expensive to recompute, recompute what is cheap (called per op, in forward).

    MUST_SAVE keeps the op's output in the checkpoint's cache until backward; PREFER_RECOMPUTE lets
    backward run the op again. A policy keyed by op keeps some outputs nothing reads back: the MLP's
    output projection, here (torchtitan's policy also recomputed every second mm, to keep less).
    """
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE
# --8<-- [end:policy]


# --8<-- [start:sequential]
def sequential_forward(model: TransformerLM, tokens: torch.Tensor, *,
                       segments: int) -> torch.Tensor:
    """``model(tokens)`` with ``checkpoint_sequential`` over the blocks (mirrors its forward).

    checkpoint_sequential splits the blocks into ``segments`` runs of len // segments blocks and
    checkpoints all of them but the last, whose activations backward needs right away anyway.
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


# --8<-- [start:measure]
class SavedTensorBytes(TorchDispatchMode):
    """Bytes a forward pass leaves alive for backward, counted once per storage.

    Whatever keeps a tensor for backward - autograd's saved tensors, checkpoint's copy of a region's
    input, the cache where selective checkpointing keeps what its policy saves - keeps its storage
    alive after the forward. So a dispatch mode notes a weak reference to the storage of every
    tensor an op produces (it sees every op, inside checkpointed regions too) and counts those still
    alive at the end. Pitfall: ``saved_tensors_hooks`` alone misses that cache (it holds no saved
    tensors) and would report op_selective as small as per_block. Parameters and views of them are
    excluded (they exist anyway), and so is the batch (made before the forward). Hold nothing else
    from the forward, such as the logits, or it is counted too; and exit after autocast, whose cache
    of low-precision weights lives until autocast exits. Regions' inputs are labelled by a forward
    pre-hook, to show what checkpoint itself keeps.
    """

    def __init__(self, model: nn.Module, checkpointed_regions: list[nn.Module]):
        super().__init__()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._regions = checkpointed_regions
        self.total = self.checkpoint_inputs = 0

    @staticmethod
    def _note(tensors, notes: list) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                notes.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))

    def _alive_bytes(self, notes: list) -> int:
        # A freed storage's address can be reused by a later one: only a live reference names it.
        alive = {pointer: nbytes for ref, pointer, nbytes in notes if not ref.expired()}
        return sum(nbytes for pointer, nbytes in alive.items() if pointer not in self._params)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._note(out if isinstance(out, (tuple, list)) else (out,), self._made)
        return out

    def __enter__(self) -> "SavedTensorBytes":
        self._made, self._inputs = [], []
        self._handles = [region.register_forward_pre_hook(
            lambda _module, args: self._note(args[:1], self._inputs)) for region in self._regions]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self.total, self.checkpoint_inputs = map(self._alive_bytes, (self._made, self._inputs))
        self._made, self._inputs = [], []
# --8<-- [end:measure]


# --8<-- [start:train]
def train(cfg: ACConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        if world.world_size > 1:
            raise RecipeError(f"activation_checkpointing trains on one device, got a world of "
                              f"{world.world_size}; run "
                              "`python -m recipes.activation_checkpointing`")
        precision = setup_precision(cfg.precision, world.device)  # auto: bf16 on a GPU, else fp32
        check_autocast(world.device, precision)  # an unsupported dtype would silently run fp32
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        blocks = list(model.layers.values())
        forward, regions = model, []
        if cfg.mode == "sequential":
            forward = functools.partial(sequential_forward, model, segments=cfg.segments)
            starts = sequential_segment_starts(len(blocks), cfg.segments)
            regions = [blocks[start] for start in starts]
        elif cfg.mode != "none":
            regions = apply_activation_checkpointing(
                model, block_types=(Block,), every_k=cfg.every_k if cfg.mode == "selective" else 1,
                policy=save_matmul_outputs if cfg.mode == "op_selective" else None)
        checkpointed = [blocks.index(region) for region in regions]
        loss_fn = lm_loss
        if cfg.compile:  # after checkpointing: each block's checkpoint is traced with its policy
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
            loss_fn = compile_loss(lm_loss, backend=cfg.compile_backend)
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)  # fused on CUDA
        scaler = make_grad_scaler(world.device, precision)  # a pass-through unless fp16
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1, seed=cfg.seed,
                                             per_rank_batch_size=cfg.global_batch_size)

        losses, timer, saved = [], StepTimer(world.device), SavedTensorBytes(model, regions)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                # Measure in step 0 only (the mode costs time; step 0 is left out of the timing),
                # and around autocast: its cache of bf16 weight copies is freed when it exits.
                # Compiled, the graph decides what it saves, out of the dispatch mode's sight: the
                # peak memory tells instead.
                measure = saved if step == 0 and not cfg.compile else contextlib.nullcontext()
                with measure, autocast(world.device, precision):  # forward and loss only
                    loss = loss_fn(forward(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # checkpointed blocks run their forward again here
                scaler.step(optimizer)
                scaler.update()
            losses.append(float(loss.item()))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        if not cfg.compile:
            log.info("mode %s (%s): blocks %s checkpointed; %.2f MiB saved for backward "
                     "(%.2f MiB of it checkpoint inputs)", cfg.mode, precision, checkpointed,
                     saved.total / 2**20, saved.checkpoint_inputs / 2**20)
        final_state = full_state_on_cpu(model) if cfg.keep_final_state else None
        workload = Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision)
        return make_result("activation_checkpointing", world, losses, model.parameters(), timer,
                           keep_final_state=final_state, workload=workload,
                           mode=cfg.mode, checkpointed_blocks=checkpointed, compiled=cfg.compile,
                           saved_bytes=None if cfg.compile else saved.total,
                           checkpoint_input_bytes=None if cfg.compile else saved.checkpoint_inputs)
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, ACConfig, __doc__)
