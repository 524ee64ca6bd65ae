"""Activation checkpointing: keep each block's input instead of its internals, recompute them in backward.

    python -m recipes.activation_checkpointing                           # per_block, "small" model
    python -m recipes.activation_checkpointing --mode selective --every-k 2
    python -m recipes.activation_checkpointing --mode sequential --segments 2
    python -m recipes.activation_checkpointing --mode none               # the baseline to compare with

Backward needs tensors that forward computed (a linear layer's input, a GELU's input, attention's
q/k/v...); autograd keeps them alive from forward until backward, and for a transformer they dominate
memory: ~16 x dim floats per token per block here. Checkpointing a block keeps only its input (dim
floats per token) and runs the block's forward a second time during backward to rebuild the rest:
one extra forward of each checkpointed block (a forward is roughly a third of a step's compute) buys
back most of the activation memory.

Modes: ``per_block`` checkpoints every block; ``selective`` every k-th block (a knob between memory and
recompute, torchtitan's "selective layer" AC); ``sequential`` uses ``checkpoint_sequential`` on the block
stack, which splits it into segments and - pitfall - never checkpoints the last segment.

Always ``use_reentrant=False``: the reentrant variant does not support ``torch.autograd.grad``, drops
the parameters' gradients when no input requires grad, and needs ``static_graph=True`` under DDP;
PyTorch recommends this one - but leaving ``use_reentrant`` out still selects the reentrant variant
(torch 2.13 only warns), so always pass it. Gradients are unchanged by checkpointing (tests assert it exactly).

The recipe reports the bytes autograd keeps for backward, measured, not estimated (``SavedTensorBytes``),
and the time per step. It trains on one device; the same wrapping works under DDP and FSDP (apply it
before wrapping the model in them).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, full_state_on_cpu, make_result
from recipes.core.workload import (MODEL_PRESETS, TransformerLM, build_model, distributed_loader, iterate_steps,
                                   lm_loss, make_dataset)
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class ACConfig(TrainConfig):
    model: Literal["tiny", "small", "100m"] = opt("small", "model size preset; small has 4 blocks, enough to compare modes")
    mode: Literal["none", "per_block", "selective", "sequential"] = opt(
        "per_block", "none | per_block: checkpoint every block | selective: every k-th block | "
                     "sequential: checkpoint_sequential over the blocks")
    every_k: int = opt(2, "selective: checkpoint blocks 0, k, 2k, ...")
    segments: int = opt(2, "sequential: segments of the block stack; all but the last are checkpointed")

    def __post_init__(self) -> None:
        super().__post_init__()
        n_layers = MODEL_PRESETS[self.model].n_layers
        if self.every_k < 1:
            raise RecipeError(f"every_k must be >= 1, got {self.every_k}")
        if not 1 <= self.segments <= n_layers:
            raise RecipeError(f"segments must be between 1 and the model's {n_layers} blocks, got {self.segments}")


# --8<-- [start:apply]
def apply_activation_checkpointing(model: TransformerLM, *, every_k: int = 1) -> list[nn.Module]:
    """Checkpoint blocks 0, k, 2k, ... of ``model`` in place and return them.

    Each chosen block's ``forward`` is replaced by ``checkpoint(original_forward, x, use_reentrant=False)``.
    No wrapper module is inserted, so parameter names (and state dicts, optimizer states, checkpoints
    on disk) stay exactly as they were; a wrapper such as torch's ``checkpoint_wrapper`` adds a
    ``_checkpoint_wrapped_module.`` prefix that every loader then has to strip.
    Call it before DDP/FSDP/torch.compile wrap the model, and only once.
    """
    blocks = [block for index, block in enumerate(model.layers.values()) if index % every_k == 0]
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return blocks
# --8<-- [end:apply]


# --8<-- [start:sequential]
def sequential_forward(model: TransformerLM, tokens: torch.Tensor, *, segments: int) -> torch.Tensor:
    """``model(tokens)`` with ``checkpoint_sequential`` over the blocks (mirrors TransformerLM.forward).

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
class SavedTensorBytes:
    """Bytes autograd holds for backward during a forward pass, counted once per storage.

    ``saved_tensors_hooks`` sees every tensor an op saves for backward. Parameters are excluded (they
    exist anyway), and a storage saved by several ops (q, k and v views, a norm's input that is also
    the residual) counts once. Inside a checkpointed region checkpoint installs its own hooks, so
    nothing there reaches ours - that is the saving. What checkpoint does keep is each region's input.
    How it keeps it depends on the torch version (2.13 stores it as a saved tensor, which our hook
    sees; an implementation that holds it in a closure would hide it), so a forward pre-hook on each
    checkpointed region counts it either way, and the storage deduplication counts it once.
    """

    def __init__(self, model: nn.Module, checkpointed_regions: list[nn.Module]):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._regions = checkpointed_regions
        self._seen: dict[int, tuple[int, str]] = {}  # storage pointer -> (bytes, "saved" or "checkpoint_input")

    def _remember(self, tensor: torch.Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()  # every counted storage stays alive until backward: pointers are unique
        if pointer in self._params:
            return
        if pointer not in self._seen or kind == "checkpoint_input":  # the input label wins, whichever came first
            self._seen[pointer] = (storage.nbytes(), kind)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._remember(tensor, "saved")
        return tensor

    def __enter__(self) -> "SavedTensorBytes":
        self._handles = [region.register_forward_pre_hook(lambda _m, args: self._remember(args[0], "checkpoint_input"))
                         for region in self._regions]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    @property
    def total(self) -> int:
        return sum(nbytes for nbytes, _ in self._seen.values())

    @property
    def checkpoint_inputs(self) -> int:
        return sum(nbytes for nbytes, kind in self._seen.values() if kind == "checkpoint_input")
# --8<-- [end:measure]


# --8<-- [start:train]
def train(cfg: ACConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        if world.world_size > 1:
            raise RecipeError(f"activation_checkpointing trains on one device, got a world of {world.world_size}; "
                              "run `python -m recipes.activation_checkpointing`")
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        blocks = list(model.layers.values())
        forward, regions = model, []
        if cfg.mode in ("per_block", "selective"):
            regions = apply_activation_checkpointing(model, every_k=1 if cfg.mode == "per_block" else cfg.every_k)
        elif cfg.mode == "sequential":
            forward = functools.partial(sequential_forward, model, segments=cfg.segments)
            regions = [blocks[start] for start in sequential_segment_starts(len(blocks), cfg.segments)]
        checkpointed = [blocks.index(region) for region in regions]
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1,
                                             per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed)

        losses, timer, saved = [], StepTimer(world.device), SavedTensorBytes(model, regions)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                # Measure in step 0 only: the hooks cost time, and step 0 is left out of seconds_per_step.
                with saved if step == 0 else contextlib.nullcontext():
                    loss = lm_loss(forward(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # checkpointed blocks run their forward again here, one at a time
                optimizer.step()
            losses.append(float(loss.item()))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        log.info("mode %s: blocks %s checkpointed; %.2f MiB saved for backward (%.2f MiB of it checkpoint inputs)",
                 cfg.mode, checkpointed, saved.total / 2**20, saved.checkpoint_inputs / 2**20)
        return make_result("activation_checkpointing", world, losses, model.parameters(), timer,
                           keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
                           mode=cfg.mode, checkpointed_blocks=checkpointed, saved_bytes=saved.total,
                           checkpoint_input_bytes=saved.checkpoint_inputs,
                           tokens_per_step=cfg.global_batch_size * MODEL_PRESETS[cfg.model].seq_len)
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, ACConfig, __doc__)
