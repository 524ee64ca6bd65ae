"""Gradient accumulation under DDP: k micro-batches, one gradient all-reduce per optimizer step.

    torchrun --standalone --nproc_per_node=2 -m recipes.grad_accumulation --micro-batches 3
    python -m recipes.grad_accumulation --no-use-no-sync     # the naive loop: k all-reduces a step

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

Each rank runs ``micro_batches`` forward/backward passes of
global_batch_size / (world_size * micro_batches) sequences and then one optimizer step. DDP
all-reduces gradients at the end of every backward pass, unless the backward runs inside
``model.no_sync()``: then gradients just accumulate locally in ``.grad``, and the next
synchronised backward all-reduces the accumulated sum. So: ``no_sync`` for all but the last
micro-batch of a step. ``train`` returns the global batch's loss of each step and prints it from
rank 0.

Two claims, both measured from outside (tests/test_grad_accumulation.py):

- communication: a DDP communication hook counts the all-reduce rounds; with ``no_sync`` there is
  exactly one round per optimizer step (without it, one per micro-batch);
- equivalence: each micro-batch loss is divided by ``micro_batches``, so the accumulated gradient
  is the mean over the global batch, and k micro-batches on N ranks give the same update as one
  step on the whole global batch in one process.

Dividing by ``micro_batches`` is right here because every sequence has the same number of real
tokens. With padding or packing it is a mean of means; recipes/sharded_accumulation.py
normalises by the tokens of the whole step instead (its ``--loss-normalisation``), under
fully_shard, with the same test against one process.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class GradAccumulationConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks and micro-batches", at_least=1
    )
    micro_batches: int = option(
        2, "forward/backward passes per optimizer step on each rank", at_least=1
    )
    use_no_sync: bool = option(
        True, "skip the all-reduce on all but the last micro-batch (the point of this recipe)"
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


# --8<-- [start:train]
def train(cfg: GradAccumulationConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        rank, world_size, device = world.rank, world.world_size, world.device
        use_cuda = device.type == "cuda"
        parts = world_size * cfg.micro_batches
        if cfg.global_batch_size % parts:  # every rank refuses, after the join's barrier
            lower = max(parts, cfg.global_batch_size - cfg.global_batch_size % parts)
            over = f" x {cfg.micro_batches} micro-batches" if cfg.micro_batches > 1 else ""
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world_size} ranks{over}; use a multiple of {parts}, e.g. {lower} or "
                f"{lower + parts}"
            )
        micro_batch = cfg.global_batch_size // parts
        bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
        )
        if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = DDP(model, device_ids=[world.local_rank] if use_cuda else None)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        # One rank's share of a whole step, cut into micro-batches below: a step reads the same
        # samples as without accumulation
        loader = DataLoader(
            dataset,
            batch_size=micro_batch * cfg.micro_batches,
            sampler=sampler,
            drop_last=True,
            pin_memory=use_cuda,
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
                step_loss = torch.zeros((), device=device)
                micro = zip(inputs.split(micro_batch), targets.split(micro_batch))
                for index, (x, y) in enumerate(micro):
                    last = index == cfg.micro_batches - 1
                    # no_sync: accumulate into .grad locally; the last backward all-reduces the sum
                    sync = (
                        model.no_sync()
                        if cfg.use_no_sync and not last
                        else contextlib.nullcontext()
                    )
                    with sync:
                        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                            loss = lm_loss(model(x), y)  # this micro-batch's mean
                        # Pitfall: divided by k, the sum of k means is the mean of the whole step
                        loss = loss / cfg.micro_batches
                        loss.backward()
                    step_loss += loss.detach()
                optimizer.step()  # once, on the accumulated, averaged gradient
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = step_loss.float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
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
        GradAccumulationConfig, prog="python -m recipes.grad_accumulation", doc=__doc__
    )


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), GradAccumulationConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
