"""ZeRO-1: DDP with ZeroRedundancyOptimizer, each rank keeps AdamW state for its partition only.

    torchrun --standalone --nproc_per_node=2 -m recipes.zero
    torchrun --standalone --nproc_per_node=2 -m recipes.zero --optimizer adamw  # plain DDP

Copy with it: recipes/toy.py, recipes/dist_setup.py

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
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class ZeroConfig:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per optimizer step, summed over all ranks
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    optimizer: str = "zero"  # zero: ZeroRedundancyOptimizer(AdamW); adamw: the DDP baseline
    max_grad_norm: float = 0.0  # clip the total gradient norm to this (0: off)
    precision: str = "auto"  # auto: bf16 autocast on a GPU, fp32 on CPU
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0
    save_path: str | None = None  # rank 0 saves the model and the whole optimizer state here


# --8<-- [start:train]
def train(cfg: ZeroConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        if cfg.global_batch_size % world.world_size:
            n = world.world_size
            lower = max(n, cfg.global_batch_size - cfg.global_batch_size % n)
            raise ValueError(f"global_batch_size={cfg.global_batch_size} does not divide across "
                             f"{n} ranks; use a multiple of {n}, e.g. {lower} or {lower + n}")
        on_cuda = world.device.type == "cuda"
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and on_cuda
                                           and torch.cuda.is_bf16_supported())
        if on_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        ddp_model = DDP(model, device_ids=[world.device.index] if on_cuda else None)
        if cfg.optimizer == "zero":
            # AdamW's arguments, plus the class: each rank builds an AdamW over its own partition
            # (fused on CUDA: one kernel per partition)
            optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(),
                                                optimizer_class=torch.optim.AdamW, lr=cfg.lr,
                                                fused=True if on_cuda else None)
        else:
            optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr,
                                          fused=True if on_cuda else None)
        if observer: observer.model_ready(ddp_model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        sampler = DistributedSampler(dataset, num_replicas=world.world_size, rank=world.rank,
                                     shuffle=True, seed=cfg.seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=cfg.global_batch_size // world.world_size,
                            sampler=sampler, drop_last=True, pin_memory=on_cuda)
        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            sampler.set_epoch(epoch)  # Pitfall: without it every epoch repeats the first's order
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(ddp_model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces FULL gradients: every rank has all of them
                if cfg.max_grad_norm > 0:
                    # Gradients are replicated, so the local norm IS the global norm: no
                    # collective needed (unlike FSDP, where each rank holds a shard).
                    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), cfg.max_grad_norm)
                optimizer.step()  # ZeRO: update the owned partition, broadcast it to the others
                global_loss = loss.detach().float().clone()  # rank 0's alone is its share only
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                if world.rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer: observer.step_end(step, losses[-1])
                step += 1
            epoch += 1

        if cfg.save_path:
            if cfg.optimizer == "zero":
                # Pitfall: optimizer.state_dict() on rank 0 alone raises (or returns a stale
                # state). Every rank must first send its partition: this is a collective.
                optimizer.consolidate_state_dict(to=0)
            if world.rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           cfg.save_path)
            dist.barrier()  # no rank reads the file or exits before it is complete
        return losses
    finally:
        cleanup_distributed()
# --8<-- [end:train]


def _number(kind, *, above=None, at_least=None):
    """An argparse type: a finite ``kind`` in range, else one line that says what is valid."""
    bound = f"> {above}" if above is not None else f">= {at_least}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or not (value > above if above is not None
                                            else value >= at_least):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value
    return parse


def make_parser() -> argparse.ArgumentParser:
    defaults = ZeroConfig()
    parser = argparse.ArgumentParser(
        prog="python -m recipes.zero", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model size")
    add("--steps", type=_number(int, at_least=1), default=defaults.steps, help="optimizer steps")
    add("--global-batch-size", type=_number(int, at_least=1), default=defaults.global_batch_size,
        help="sequences per optimizer step, summed over all ranks")
    add("--lr", type=_number(float, above=0), default=defaults.lr, help="AdamW's")
    add("--seed", type=_number(int, at_least=0), default=defaults.seed,
        help="model init and data order; the same seed gives the same losses on any world size")
    add("--optimizer", choices=["zero", "adamw"], default=defaults.optimizer,
        help="zero: ZeroRedundancyOptimizer(AdamW), 1/N of the state per rank; adamw: plain DDP")
    add("--max-grad-norm", type=_number(float, at_least=0), default=defaults.max_grad_norm,
        help="clip the total gradient norm with torch.nn.utils.clip_grad_norm_ (0: off)")
    add("--precision", choices=["auto", "fp32", "bf16"], default=defaults.precision,
        help="auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)")
    add("--backend", choices=["auto", "nccl", "gloo"], default=defaults.backend,
        help="process-group backend; auto: nccl with a GPU per local rank, else gloo")
    add("--timeout-s", type=_number(float, above=0), default=defaults.timeout_s,
        help="seconds a collective waits for its peers before failing")
    add("--save-path", default=defaults.save_path,
        help="rank 0 saves the model and the consolidated optimizer state here (torch.save)")
    return parser


def main(argv: list[str] | None = None) -> None:
    cfg = ZeroConfig(**vars(make_parser().parse_args(argv)))
    try:
        train(cfg)
    except ValueError as exc:  # bad input every rank sees (a batch that does not divide)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
