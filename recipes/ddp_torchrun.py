"""DDP under torchrun: the canonical data-parallel training loop, equal to single-process training.

    torchrun --standalone --nproc_per_node=2 -m recipes.ddp_torchrun
    python -m recipes.ddp_torchrun                      # a world of 1: no torchrun needed
    python -m recipes.ddp_torchrun --model 100m --global-batch-size 64 --compile   # on a GPU: fast

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

Multi-node: run the same command on every node; they meet at node 0's address.

    # static: each node knows its rank (node 1 runs the same with --node_rank=1)
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=node0 --master_port=29500 \\
        -m recipes.ddp_torchrun
    # elastic rendezvous: identical command everywhere, torchrun assigns node ranks
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=job42 --rdzv_backend=c10d \\
        --rdzv_endpoint=node0:29500 -m recipes.ddp_torchrun

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it
starts. Each rank trains on global_batch_size / world_size sequences per step and DDP averages the
gradients, so with the same seed and global batch the losses are the same on any number of ranks
(tests/test_ddp_torchrun.py asserts it for worlds of 1, 2 and 3). It prints one line per step
from rank 0: the step and the loss of the whole global batch.

Fast by default: on a GPU, bf16 autocast with fp32 master weights, fused AdamW, and ``--compile``
compiles each block before DDP wraps the model. ``--precision fp32`` is the exact reference.

Pitfalls, each named where it bites below: ``torch.cuda.set_device`` before anything touches the
GPU; the same seed on every rank; ``sampler.set_epoch`` every epoch; rank 0's loss is only its
share of the batch; save ``model.module`` from rank 0 only, then a barrier;
``destroy_process_group`` in a ``finally``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class DDPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    compile: bool = option(False, "torch.compile each transformer block (and the loss)")
    compile_backend: str = option(
        "inductor", "torch.compile's backend", choices=["inductor", "aot_eager", "eager"]
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)
    save_path: str | None = option(None, "rank 0 saves the trained weights here (torch.save)")

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "backend nccl needs a CUDA device per rank and there is none; "
                "use backend gloo (or auto)"
            )


# --8<-- [start:train]
def train(cfg: DDPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # set by torchrun, 0 when alone
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # Checked before joining: every rank refuses at once (a rank that leaves during the others'
    # handshake gives them "connectFullMesh failed" instead of this line)
    if cfg.global_batch_size % world_size:
        lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
            f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
        )
    # auto: NCCL when this node has a GPU for each of its ranks, else gloo on CPU
    gpus_needed = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = cfg.backend == "nccl" or (
        cfg.backend == "auto"
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= gpus_needed
    )
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        # Pitfall: without set_device every rank's NCCL work and allocations land on cuda:0
        torch.cuda.set_device(device)
    # timeout: a collective that a peer never joins fails after this long instead of hanging
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:  # torchrun: meet at MASTER_ADDR:MASTER_PORT (init_method env://)
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:  # alone: a world of 1, which needs no rendezvous
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    try:
        rank = dist.get_rank()
        per_rank_batch = cfg.global_batch_size // world_size
        bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
        )
        if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        loss_fn = lm_loss
        if cfg.compile:  # each block's forward, before DDP: DDP's hooks stay out of the graphs
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
            loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)
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
                    loss = loss_fn(model(inputs), targets)  # this rank's sequences' mean
                loss.backward()  # DDP averages the gradients here, overlapped with backward
                optimizer.step()  # every rank applies the same averaged gradient
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
            # Pitfall: save model.module, the model itself: model.state_dict() prefixes
            # every key with "module." and no longer loads into a plain model. Only rank 0
            # writes (the replicas are identical; N writers would clobber one file).
            if rank == 0:
                torch.save(model.module.state_dict(), cfg.save_path)
            dist.barrier()  # no rank reads the file or exits before it is complete
        return losses
    finally:
        # Pitfall: DDP's reducer holds the process group. Freed after the group is destroyed (at
        # exit, say), it takes gloo's threads down with it and can abort the process ("terminate
        # called without an active exception"): free the model before the group.
        model = None
        gc.collect()
        dist.destroy_process_group()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(DDPConfig, prog="python -m recipes.ddp_torchrun", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), DDPConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
