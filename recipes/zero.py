"""ZeRO-1: DDP with ZeroRedundancyOptimizer, each rank keeps AdamW state for its partition only.

    torchrun --standalone --nproc_per_node=2 -m recipes.zero
    torchrun --standalone --nproc_per_node=2 -m recipes.zero --optimizer adamw  # plain DDP

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

DDP still replicates the parameters and all-reduces full gradients; only the optimizer state is
partitioned. Each rank runs AdamW on the parameters it owns, then broadcasts them to the others, so
the replicas stay equal and the training equals DDP's (tests/test_zero.py). AdamW keeps two fp32
tensors per parameter (exp_avg, exp_avg_sq), 2x the parameter bytes: ZeRO-1 divides that part by N.

The partition is by whole parameters (greedy, largest first, onto the least-loaded rank), so one
rank can hold up to one parameter's state more than 1/N: a model with a few huge tensors (a large
vocabulary embedding) balances worse than one with many small ones. It prints one line per step
from rank 0: the step and the loss of the whole global batch. Pitfalls named where they bite: the
optimizer state dict must be consolidated by every rank before rank 0 saves it; clipping needs no
collective here because DDP's gradients are full.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class ZeroConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    optimizer: str = option(
        "zero",
        "zero: ZeroRedundancyOptimizer(AdamW), 1/N of the state per rank; adamw: plain DDP",
        choices=["zero", "adamw"],
    )
    max_grad_norm: float = option(
        0.0,
        "clip the total gradient norm with torch.nn.utils.clip_grad_norm_ (0: off)",
        at_least=0,
    )
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)
    save_path: str | None = option(
        None, "rank 0 saves the model and the consolidated optimizer state here (torch.save)"
    )

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.save_path and os.path.isdir(self.save_path):
            raise ValueError(
                f"save_path={self.save_path!r} is a folder; name the file to write, e.g. "
                f"{os.path.join(self.save_path, 'zero.pt')!r}"
            )


# --8<-- [start:train]
def train(cfg: ZeroConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        if cfg.global_batch_size % world_size:
            lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
            )
        per_rank_batch = cfg.global_batch_size // world_size
        use_cuda = device.type == "cuda"
        bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
        )
        if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = DDP(model, device_ids=[device.index] if use_cuda else None)
        if cfg.optimizer == "zero":
            # AdamW's arguments, plus the class: each rank builds an AdamW over its own partition
            # (fused on CUDA: one kernel per partition)
            optimizer = ZeroRedundancyOptimizer(
                model.parameters(),
                optimizer_class=torch.optim.AdamW,
                lr=cfg.lr,
                fused=True if use_cuda else None,
            )
        else:
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
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
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
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
                loss.backward()  # DDP all-reduces FULL gradients: every rank has all of them
                if cfg.max_grad_norm > 0:
                    # Gradients are replicated, so the local norm IS the global norm: no
                    # collective needed (unlike FSDP, where each rank holds a shard).
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()  # ZeRO: update the owned partition, broadcast it to the others
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]

        if cfg.save_path:
            if cfg.optimizer == "zero":
                # Pitfall: optimizer.state_dict() on rank 0 alone raises (or returns a stale
                # state). Every rank must first send its partition: this is a collective.
                optimizer.consolidate_state_dict(to=0)
            if rank == 0:
                torch.save(  # model.module: DDP's own state_dict prefixes keys with "module."
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                    cfg.save_path,
                )
            dist.barrier()  # no rank reads the file or exits before it is complete
        return losses
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(ZeroConfig, prog="python -m recipes.zero", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), ZeroConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
