r"""Gradient accumulation under fully_shard, three ways, each with its communication counted.

    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation --mode sync_last
    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation \
        --mode reduce_scatter_every
    torchrun --standalone --nproc_per_node=4 -m recipes.sharded_accumulation \
        --mode hsdp_all_reduce_last --mesh 2 2 --global-batch-size 8
    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_accumulation --pad-fraction 0.5 \
        --loss-normalisation batches        # the pitfall: the mean of micro-batch means

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fully_shard``, ``checked_mesh``),
recipes/options.py (the command line, from the config).

k micro-batches per optimizer step; what each mode sends per step (G = fully_shard groups):

- ``reduce_scatter_every``: every backward reduce-scatters (k x G); the gradients stay sharded
  between micro-batches (1/N of the gradient bytes held);
- ``sync_last``: ``model.set_requires_gradient_sync(False)`` until the last micro-batch: G
  reduce-scatters a step, but each rank holds the *unsharded* gradients meanwhile (N x the bytes);
- ``hsdp_all_reduce_last`` (mesh replicate x shard): ``set_requires_all_reduce(False)`` until the
  last one: the shard group reduce-scatters every time (k x G, sharded memory), the replica group
  all-reduces once (G);
- ``ddp_no_sync_helper``: the pitfall (NVIDIA/cosmos-framework#161). A helper written for DDP,
  ``model.no_sync() if hasattr(model, "no_sync") else nullcontext()``, is silently a no-op under
  fully_shard (which has no ``no_sync``): the traffic of ``reduce_scatter_every``, not of
  ``sync_last``.

The counts and bytes are measured from outside: the cookbook's harness runs each step under a
``TorchDispatchMode`` that sees every c10d collective (recipes/core/counting.py), and
tests/test_sharded_accumulation.py asserts them exactly. ``train`` returns the global batch's loss
of each step and prints it from rank 0.

Loss normalisation: with ragged samples (``--pad-fraction``: right padding whose targets are
``ignore_index``), the loss a single process computes on the whole batch is the mean over its real
tokens. The naive accumulated loss, each micro-batch's mean divided by k and averaged over ranks, is
a mean of means: a token in a short sample weighs more (transformers PR #35207, torchtune#1275).
``--loss-normalisation tokens`` counts the real tokens of the whole step, over every micro-batch and
every data-parallel rank (one all-reduce of one number per step), and divides each micro-batch's
*summed* loss by that count: equal to the single process, asserted.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_fully_shard, checked_mesh
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

MODES = ("reduce_scatter_every", "sync_last", "hsdp_all_reduce_last", "ddp_no_sync_helper")
NORMALISATIONS = ("tokens", "batches")
IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss or gradient


@dataclass
class ShardedAccumulationConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    micro_batches: int = option(
        2, "forward/backward passes per optimizer step on each rank", at_least=1
    )
    mode: str = option(
        "sync_last", "how the micro-batches communicate (see the docstring)", choices=MODES
    )
    # a tuple: recipes/options.py's check reads list[int] as one int and refuses every list
    mesh: tuple[int, ...] = option(
        (),
        "data-parallel mesh: SHARD, or REPLICATE SHARD (HSDP); product = world size; none: "
        "the world size",
    )
    pad_fraction: float = option(
        0.25,
        "ragged samples: right-pad up to this fraction of each sequence (targets = "
        "ignore_index); below 1",
        at_least=0,
    )
    loss_normalisation: str = option(
        "tokens",
        "tokens: the global per-token mean (one process's loss); batches: the mean of "
        "micro-batch means (the pitfall)",
        choices=NORMALISATIONS,
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; bf16: fully_shard's MixedPrecisionPolicy (fp32 "
        "gradient reduction); fp16 is refused (it needs a scaler)",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.pad_fraction >= 1:
            raise ValueError(
                f"pad_fraction must be < 1 (a sample keeps at least one token), "
                f"got {self.pad_fraction}"
            )
        if any(size < 1 for size in self.mesh) or len(self.mesh) > 2:
            raise ValueError(f"mesh={self.mesh}: use [shard] or [replicate, shard], each size >= 1")
        if self.mode == "hsdp_all_reduce_last" and len(self.mesh) != 2:
            raise ValueError(
                "mode hsdp_all_reduce_last needs a replicate x shard mesh, e.g. --mesh 2 2 on 4 "
                "ranks"
            )
        if self.precision == "fp16":  # fp16 gradients need a loss scaler, not this lesson
            raise ValueError(
                "--precision fp16 needs a GradScaler (see recipes/amp.py); use bf16 or fp32"
            )


class RaggedTokens(Dataset):
    """A dataset's samples with a real length each: targets past it are ``IGNORE_INDEX``.

    The length of sample ``i`` depends only on ``seed`` and ``i``, so every world size sees the same
    tokens. Causal attention keeps the padding from changing the real positions' logits.
    """

    def __init__(self, base: Dataset, pad_fraction: float, seq_len: int, seed: int):
        generator = torch.Generator().manual_seed(seed + 1)
        shortest = max(1, round(seq_len * (1 - pad_fraction)))
        self.base = base
        self.lengths = torch.randint(shortest, seq_len + 1, (len(base),), generator=generator)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.base[index]
        targets = targets.clone()
        targets[int(self.lengths[index]) :] = IGNORE_INDEX
        return inputs, targets


def make_ragged_dataset(model: str, global_batch_size: int, *, pad_fraction: float, seed: int):
    """The shared synthetic dataset, ragged when ``pad_fraction`` > 0 (tests train on it too)."""
    dataset = make_dataset(model, global_batch_size, seed=seed)
    if pad_fraction == 0:
        return dataset
    return RaggedTokens(dataset, pad_fraction, MODEL_PRESETS[model].seq_len, seed)


def ddp_style_no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """The pitfall, as found in training code written for DDP: under fully_shard it does nothing."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


# --8<-- [start:accumulate]
def accumulate_gradients(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str,
    normalise_by_tokens: bool,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches; returns this rank's share of
    the step's loss (the sum over ranks is the global loss)."""
    dp_size = dist.get_world_size(dp_group)
    if normalise_by_tokens:
        # The real tokens of the whole step: every micro-batch, every data-parallel rank. One
        # all-reduce of one number, before the first backward, since each loss needs the total.
        tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches).float()
        dist.all_reduce(tokens, group=dp_group)
    step_loss = torch.zeros((), device=micro_batches[0][0].device)
    for index, (x, y) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if mode == "sync_last":  # no reduce-scatter: each rank keeps UNSHARDED gradients meanwhile
            model.set_requires_gradient_sync(last)
        elif mode == "hsdp_all_reduce_last":  # reduce-scatter in the shard group, all-reduce once
            model.set_requires_all_reduce(last)
        # Pitfall: fully_shard has no no_sync(); a DDP helper falls back to doing nothing.
        skip = ddp_style_no_sync(model) if mode == "ddp_no_sync_helper" and not last else None
        with skip or contextlib.nullcontext():
            logits = model(x)
            if normalise_by_tokens:
                summed = F.cross_entropy(
                    logits.float().flatten(0, 1),
                    y.flatten(0, 1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                # fully_shard averages gradients over the dp ranks (divides by dp_size): scale
                # back up, so the gradient is d(sum over all tokens) / tokens.
                loss = summed * dp_size / tokens
            else:  # the naive mean of means: each micro-batch's token mean weighs 1/k
                loss = lm_loss(logits, y) / len(micro_batches)
            loss.backward()
        step_loss += loss.detach() / dp_size
    return step_loss


# --8<-- [end:accumulate]


def data_parallel_mesh(world, sizes: list[int]):
    """A 1-D ("shard",) mesh, or 2-D ("replicate", "shard") for HSDP; [] = all ranks shard."""
    sizes = sizes or [world.world_size]
    names = ("shard",) if len(sizes) == 1 else ("replicate", "shard")
    return checked_mesh(world, sizes, names)


# --8<-- [start:train]
def train(cfg: ShardedAccumulationConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank = world.device, world.rank
        mesh = data_parallel_mesh(world, cfg.mesh)
        parts = world.world_size * cfg.micro_batches
        if cfg.global_batch_size % parts:
            lower = max(parts, cfg.global_batch_size - cfg.global_batch_size % parts)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world.world_size} ranks x {cfg.micro_batches} micro-batches; use a multiple "
                f"of {parts}, e.g. {lower} or {lower + parts}"
            )
        micro = cfg.global_batch_size // parts  # sequences per micro-batch, on each rank
        precision = resolve_precision(cfg.precision, device)

        # --8<-- [start:loop]
        model = build_model(cfg.model, seed=cfg.seed, device="cpu")  # fully_shard moves shards
        # bf16: fully_shard computes in bf16 and reduces gradients in fp32
        model = apply_fully_shard(
            model,
            mesh,
            block_types=(Block,),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16"
            else None,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if device.type == "cuda" else None
        )
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_ragged_dataset(
            cfg.model, cfg.global_batch_size, pad_fraction=cfg.pad_fraction, seed=cfg.seed
        )
        # Each rank reads a disjoint 1/world_size of every epoch (HSDP's replicas too: every rank
        # is a data-parallel rank), all its micro-batches at once; drop_last keeps it full.
        sampler = DistributedSampler(
            dataset,
            num_replicas=world.world_size,
            rank=rank,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        loader = DataLoader(
            dataset,
            batch_size=micro * cfg.micro_batches,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
        )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = accumulate_gradients(
                    model,
                    list(zip(inputs.split(micro), targets.split(micro))),
                    mode=cfg.mode,
                    normalise_by_tokens=cfg.loss_normalisation == "tokens",
                )
                optimizer.step()
                # Each rank's loss is its share of the step's: their sum is the global loss
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(
        ShardedAccumulationConfig, prog="python -m recipes.sharded_accumulation", doc=__doc__
    )


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), ShardedAccumulationConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
