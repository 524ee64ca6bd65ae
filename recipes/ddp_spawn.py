"""DDP started from Python by torch.multiprocessing.spawn, with DDP's options and a rank-0
checkpoint every rank loads.

    python -m recipes.ddp_spawn --nprocs 2
    python -m recipes.ddp_spawn --nprocs 3 --static-graph --bucket-cap-mb 1

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

``mp.spawn`` starts ``nprocs`` copies of ``worker`` on this machine, each with its rank as the
first argument; the parent picks the rendezvous (MASTER_ADDR/MASTER_PORT) that torchrun would set.
Use it when one Python process must own the job (a notebook, a sweep driver): ``train(cfg)``
returns rank 0's losses to its caller. Use torchrun (recipes/ddp_torchrun.py) for everything
else: it restarts failed workers and spans nodes. ``worker`` must live in an importable file:
spawn starts fresh interpreters that import it by name. When a child raises, ``mp.spawn`` stops
the others and raises ``ProcessRaisedException`` in the parent, with the child's rank
(``error_index``) and traceback; ``main`` prints both.

DDP options, and when to touch them:

- ``find_unused_parameters``: only if some parameters get no gradient in a step (branches, frozen
  heads); it costs a graph traversal every step. Wrongly left off, DDP errors on the 2nd step.
- ``gradient_as_bucket_view``: gradients alias the all-reduce buckets: one gradient copy less.
- ``static_graph``: the graph is the same every step; DDP skips per-step bookkeeping, and
  activation checkpointing works with unused parameters.
- ``bucket_cap_mb``: gradients are all-reduced in buckets of this size, overlapping backward;
  smaller buckets start communicating sooner, larger ones use the network better.

The checkpoint: rank 0 saves, a barrier, every rank loads it with ``weights_only=True`` and
``map_location``. tests/test_ddp_spawn.py asserts that every option trains like one process and
that every rank holds exactly the saved weights afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class DDPSpawnConfig:
    nprocs: int = option(2, "processes (ranks) to start on this machine", at_least=1)
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
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per process, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)
    find_unused_parameters: bool = option(
        False, "walk the graph for parameters without gradients (costs time)"
    )
    gradient_as_bucket_view: bool = option(
        True, "let gradients alias DDP's all-reduce buckets (saves memory)"
    )
    static_graph: bool = option(False, "promise DDP the graph never changes between steps")
    bucket_cap_mb: float = option(
        25.0, "gradient bucket size in MiB for the overlapped all-reduce", above=0
    )
    checkpoint_path: str = option("", "where rank 0 saves the checkpoint; empty: a temporary file")

    def __post_init__(self):
        """What every child would find wrong, found once, here (ValueError, one line): the
        parent builds the config, the children get it as it is."""
        check_options(self)  # the ranges and choices above: one line each
        if self.global_batch_size % self.nprocs:
            lower = max(self.nprocs, self.global_batch_size - self.global_batch_size % self.nprocs)
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not divide across "
                f"{self.nprocs} ranks; use a multiple of {self.nprocs}, e.g. {lower} or "
                f"{lower + self.nprocs}"
            )
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.backend == "nccl" and gpus < self.nprocs:
            raise ValueError(
                f"backend nccl needs one CUDA device per process: {self.nprocs} "
                f"processes, {gpus} device(s); use backend gloo or fewer nprocs"
            )
        path = self.checkpoint_path
        existing = os.path.dirname(os.path.abspath(path))
        if path and os.path.isdir(path):  # found only after training otherwise
            raise ValueError(
                f"checkpoint_path {path} is a directory; name a file, e.g. "
                f"{os.path.join(path, 'model.pt')}"
            )
        while path and not os.path.exists(existing):  # what makedirs would create goes in here
            existing = os.path.dirname(existing)
        if path and not os.path.isdir(existing):
            raise ValueError(
                f"checkpoint_path {path}: {existing} is a file, so nothing can be "
                "created under it; name a file in a directory you can write to"
            )


# --8<-- [start:launch]
def train(cfg: DDPSpawnConfig, observer=None) -> list[float]:
    """Start ``cfg.nprocs`` training processes, wait for them; returns rank 0's losses (the
    global batch's, one per step). Raises ValueError before starting any of them on bad input
    (the config checked its own values when the parent built it: once, not once per child)."""
    # The rendezvous torchrun would set: rank 0 listens on this port, the others connect to it
    port = master_port()
    temporary = None
    if not cfg.checkpoint_path:  # every rank must load the same file: the parent names it
        temporary = tempfile.mkdtemp(prefix="ddp-spawn-")
        cfg = dataclasses.replace(cfg, checkpoint_path=os.path.join(temporary, "checkpoint.pt"))
    try:
        # Pitfall: the queue must come from the "spawn" context mp.spawn uses. The parent reads
        # it only after every child has exited, so keep the message small: one larger than the
        # pipe's buffer (64 KiB) would block rank 0 forever.
        results = mp.get_context("spawn").SimpleQueue()
        # join=True: wait for all; if a child raises, mp.spawn terminates the others and raises
        # ProcessRaisedException here (ProcessExitedException for one that died without raising)
        mp.spawn(
            worker, args=(cfg.nprocs, port, cfg, results, observer), nprocs=cfg.nprocs, join=True
        )
        return results.get()
    finally:
        if temporary:  # a checkpoint nobody asked to keep leaves with the run
            shutil.rmtree(temporary, ignore_errors=True)


def worker(
    rank: int, world_size: int, port: int, cfg: DDPSpawnConfig, results, observer=None
) -> None:
    """What mp.spawn runs in each child: ``rank`` comes first, then ``args``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # one machine: mp.spawn cannot span nodes
    os.environ["MASTER_PORT"] = str(port)
    use_cuda = cfg.backend == "nccl" or (
        cfg.backend == "auto"
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= world_size
    )
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        # Pitfall: without set_device every rank's NCCL work and allocations land on cuda:0
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        device_id=device if use_cuda else None,
    )
    try:
        losses = train_one_rank(cfg, observer)
        if rank == 0:
            results.put(losses)  # mp.spawn returns nothing: a queue is how results come back
    finally:
        dist.destroy_process_group()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:launch]


# --8<-- [start:train]
def train_one_rank(cfg: DDPSpawnConfig, observer=None) -> list[float]:
    """One rank's DDP training, in the world its process joined; returns the global losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
    )
    if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    # --8<-- [start:loop]
    # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
    # rank 0's weights at construction, but a model built differently still diverges)
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    model = DDP(
        model,
        device_ids=[device.index] if use_cuda else None,
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
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
        dataset,
        batch_size=cfg.global_batch_size // world_size,
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
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
            loss.backward()  # DDP all-reduces the gradients in buckets, overlapped with backward
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

    if cfg.checkpoint_path:
        if rank == 0:  # one writer: the replicas are identical, N writers would clobber one file
            save_checkpoint(model, optimizer, step, cfg.checkpoint_path)
            print(f"rank 0 of {world_size} saved step {step} to {cfg.checkpoint_path}", flush=True)
        dist.barrier()  # nobody reads before rank 0 has finished writing
        restored = load_checkpoint(cfg.checkpoint_path, cfg.model, device)
        # what a resumed job would start from: exactly the trained weights, on every rank
        for (name, trained), loaded in zip(model.module.named_parameters(), restored.parameters()):
            if not torch.equal(trained, loaded):
                raise RuntimeError(f"rank {rank}: {name} differs after loading the checkpoint")
    return losses


# --8<-- [end:train]


# --8<-- [start:checkpoint]
def save_checkpoint(ddp_model: DDP, optimizer: torch.optim.Optimizer, step: int, path: str) -> None:
    # Pitfall: save ddp_model.module: DDP's own state_dict prefixes every key with "module."
    state = {
        "model": ddp_model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # readers never see a half-written file


def load_checkpoint(path: str, model_name: str, device: torch.device) -> nn.Module:
    """A fresh model (other weights, seed 12345) with the checkpoint's weights loaded."""
    # weights_only: a pickle from disk must not run code; map_location: onto this rank's device
    state = torch.load(path, map_location=device, weights_only=True)
    restored = build_model(model_name, seed=12345, device=device)
    restored.load_state_dict(state["model"])
    return restored


# --8<-- [end:checkpoint]


def master_port() -> int:
    """``MASTER_PORT`` if it is set and free, else a free port the OS picks (another process
    could take it before rank 0 listens: a small window)."""
    port = int(os.environ.get("MASTER_PORT") or 0)
    with socket.socket() as sock:
        try:  # a busy port would fail in every child, after a wait: refused here instead
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise ValueError(
                f"MASTER_PORT {port} is already in use on 127.0.0.1; set "
                "MASTER_PORT to a free port, or unset it and a free one is picked"
            ) from None
        return sock.getsockname()[1]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(DDPSpawnConfig, prog="python -m recipes.ddp_spawn", doc=__doc__)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), DDPSpawnConfig, argv)
    try:
        with exit_on_bad_input():  # found in the parent, before any process started: one line
            train(cfg)
    except mp.ProcessRaisedException as exc:  # a child raised: its traceback, then one line
        print(exc.msg.rstrip(), file=sys.stderr)
        print(
            f"error: rank {exc.error_index} failed: {exc.msg.strip().splitlines()[-1]}",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except mp.ProcessExitedException as exc:  # killed, os._exit, a segfault: no traceback
        print(
            f"error: rank {exc.error_index} died with exit code {exc.exit_code}; the other "
            "ranks were stopped",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
