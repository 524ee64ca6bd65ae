"""Gradient accumulation under DDP: k micro-batches, one gradient all-reduce per optimizer step.

    torchrun --standalone --nproc_per_node=2 -m recipes.grad_accumulation --micro-batches 3
    python -m recipes.grad_accumulation --no-use-no-sync     # the naive loop: k all-reduces a step

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world).

Each rank runs ``micro_batches`` forward/backward passes of
global_batch_size / (world_size * micro_batches) sequences and then one optimizer step. DDP
all-reduces gradients at the end of every backward pass, unless the backward runs inside
``ddp_model.no_sync()``: then gradients just accumulate locally in ``.grad``, and the next
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
import math
import os
import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class GradAccumulationConfig:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per optimizer step, summed over all ranks
    micro_batches: int = 2  # forward/backward passes per optimizer step on each rank
    use_no_sync: bool = True  # the point of this recipe; False: the naive loop
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    precision: str = "auto"  # auto: bf16 autocast on a GPU, fp32 on CPU
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto -> bf16 on a GPU that has it, else fp32. Sets the fp32 matmul mode on CUDA: TF32 for
    ``tf32`` only (a process-wide switch: set on every run, never inherited from an earlier one)."""
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "tf32" and not on_cuda:
        raise ValueError(
            f"--precision tf32 is a CUDA matmul mode and this run is on "
            f"{device.type}; use --precision fp32 (or bf16)"
        )
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            requested == "tf32"
        )
    return requested


# --8<-- [start:train]
def train(cfg: GradAccumulationConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    if cfg.micro_batches < 1:  # before joining: no rank waits for one that refused
        raise ValueError(f"micro_batches must be >= 1, got {cfg.micro_batches}")
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
        precision = resolve_precision(cfg.precision, device)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        ddp_model = DDP(model, device_ids=[world.local_rank] if use_cuda else None)
        optimizer = torch.optim.AdamW(
            ddp_model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(ddp_model, optimizer)
        # fp16: scale every micro-batch's loss, unscale and step once (a disabled one passes
        # everything through)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

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
                        ddp_model.no_sync()
                        if cfg.use_no_sync and not last
                        else contextlib.nullcontext()
                    )
                    with sync:
                        with torch.autocast(
                            device.type, dtype=low or torch.float32, enabled=low is not None
                        ):
                            loss = lm_loss(ddp_model(x), y)  # this micro-batch's mean
                        # Pitfall: divided by k, the sum of k means is the mean of the whole step
                        loss = loss / cfg.micro_batches
                        scaler.scale(loss).backward()
                    step_loss += loss.detach()
                scaler.step(optimizer)  # optimizer.step() on the accumulated, averaged gradient
                scaler.update()
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


def _number(kind, *, above=None, at_least=None):
    """An argparse type: a finite ``kind`` in range, else what is valid (one line, see below)."""
    bound = f"> {above}" if above is not None else f">= {at_least}"
    what = "a finite number " if kind is float else ""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            noun = "a number" if kind is float else "an integer"
            raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None
        if not math.isfinite(value) or not (
            value > above if above is not None else value >= at_least
        ):
            raise argparse.ArgumentTypeError(f"must be {what}{bound}, got {text}")
        return value

    return parse


def _backend(text: str) -> str:
    if text == "nccl" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            "backend 'nccl' needs one CUDA device per local rank and this machine has none; "
            "use --backend gloo"
        )
    return text


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its usage first: here one line, exit 2
        # "argument --lr: must be ..." reads "lr must be ...": the option, then what is valid
        message = re.sub(
            r"^argument --([\w-]+): (?=must be)", lambda m: m[1].replace("-", "_") + " ", message
        )
        self.exit(2, f"error: {message}\n")


def make_parser() -> argparse.ArgumentParser:
    defaults = GradAccumulationConfig()
    parser = OneLineParser(
        prog="python -m recipes.grad_accumulation",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model size")
    add("--steps", type=_number(int, at_least=1), default=defaults.steps, help="optimizer steps")
    add(
        "--global-batch-size",
        type=_number(int, at_least=1),
        default=defaults.global_batch_size,
        help="sequences per optimizer step, summed over all ranks and micro-batches",
    )
    add(
        "--micro-batches",
        type=_number(int, at_least=1),
        default=defaults.micro_batches,
        help="forward/backward passes per optimizer step on each rank",
    )
    add(
        "--use-no-sync",
        action=argparse.BooleanOptionalAction,
        default=defaults.use_no_sync,
        help="skip the all-reduce on all but the last micro-batch (the point of this recipe)",
    )
    add("--lr", type=_number(float, above=0), default=defaults.lr, help="AdamW's")
    add(
        "--seed",
        type=_number(int, at_least=0),
        default=defaults.seed,
        help="model init and data order; the same seed gives the same losses on any world size",
    )
    add(
        "--precision",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
        default=defaults.precision,
        help="auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact "
        "(TF32 off); tf32: TF32 matmuls (CUDA); fp16: autocast with a loss scaler",
    )
    add(
        "--backend",
        type=_backend,
        choices=["auto", "nccl", "gloo"],
        default=defaults.backend,
        help="process-group backend; auto: nccl with a GPU per local rank, else gloo",
    )
    add(
        "--timeout-s",
        type=_number(float, above=0),
        default=defaults.timeout_s,
        help="seconds a collective waits for its peers before failing",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    cfg = GradAccumulationConfig(**vars(make_parser().parse_args(argv)))
    try:
        train(cfg)
    except ValueError as exc:  # bad input every rank sees (a batch that does not divide)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
