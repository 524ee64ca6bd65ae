"""DDP launched by torch.multiprocessing.spawn, with DDP's options and a rank-0 checkpoint every
rank loads.

    python -m recipes.ddp_spawn --nprocs 2
    python -m recipes.ddp_spawn --nprocs 3 --static-graph --bucket-cap-mb 1

``mp.spawn`` starts ``nprocs`` copies of ``worker`` on this machine and passes each its rank as the
first argument; the parent sets the rendezvous (MASTER_ADDR/MASTER_PORT) that torchrun would
otherwise set. Use it when one Python process must own the whole job (a notebook, a sweep driver);
use torchrun (recipes.ddp_torchrun) for everything else: it restarts failed workers and spans nodes.

DDP options, and when to touch them:

- ``find_unused_parameters``: only if some parameters get no gradient in a step (branches, frozen
  heads); it costs an extra graph traversal every step. Wrongly left off, DDP errors on the second
  step.
- ``gradient_as_bucket_view``: gradients alias the all-reduce buckets: saves one gradient-sized
  copy.
- ``static_graph``: the graph is the same every step; lets DDP skip per-step bookkeeping and makes
  activation checkpointing and unused-parameter handling work together.
- ``bucket_cap_mb``: gradients are all-reduced in buckets of this size, overlapping backward;
  smaller buckets start communicating sooner, larger ones use the network better.

The checkpoint: rank 0 saves (one writer, no clobbering), a barrier makes the file visible before
anyone reads it, every rank loads it with ``weights_only=True`` (a pickle from disk must not run
code) and ``map_location`` (or every rank loads onto the GPU that saved it). tests/test_ddp_spawn.py
asserts that every rank holds exactly the saved weights afterwards.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.paths import output_file_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result, param_checksum
from recipes.core.state import full_state_on_cpu, mean_over_ranks
from recipes.core.speed import autocast, make_adamw, make_grad_scaler, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.spawn import check_port_free, free_port
from recipes.core.world import RankError, join_world, resolve_backend

log = get_logger(__name__)


@dataclass
class DDPSpawnConfig(TrainConfig):
    nprocs: int = opt(2, "processes (ranks) to spawn on this machine", ge=1)
    find_unused_parameters: bool = opt(
        False, "walk the graph for parameters without gradients (costs time)"
    )
    gradient_as_bucket_view: bool = opt(
        True, "let gradients alias DDP's all-reduce buckets (saves memory)"
    )
    static_graph: bool = opt(False, "promise DDP the graph never changes between steps")
    bucket_cap_mb: float = opt(
        25.0, "gradient bucket size in MiB for the overlapped all-reduce", gt=0
    )
    checkpoint_path: str = opt("", "where rank 0 saves the checkpoint; empty = a temporary file")


# --8<-- [start:train]
def train(cfg: DDPSpawnConfig) -> RecipeResult:
    """One rank's training; runs inside the world that ``launch`` (or a test) spawned."""
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        precision = setup_precision(cfg.precision, world.device)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        ddp_model = DDP(
            model,
            device_ids=[world.device.index] if world.device.type == "cuda" else None,
            find_unused_parameters=cfg.find_unused_parameters,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        optimizer = make_adamw(ddp_model.parameters(), lr=cfg.lr, device=world.device)
        scaler = make_grad_scaler(world.device, precision)  # a pass-through unless fp16
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(
            dataset,
            rank=world.rank,
            world_size=world.world_size,
            per_rank_batch_size=per_rank_batch,
            seed=cfg.seed,
        )
        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                with autocast(world.device, precision):
                    loss = lm_loss(ddp_model(inputs.to(world.device)), targets.to(world.device))
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            losses.append(mean_over_ranks(loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        loaded = save_on_rank0_and_load_everywhere(
            ddp_model, optimizer, cfg.steps, cfg.checkpoint_path, world.device
        )
        return make_result(
            "ddp_spawn",
            world,
            losses,
            model.parameters(),
            timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            **loaded,
        )
# --8<-- [end:train]


# --8<-- [start:checkpoint]
def save_on_rank0_and_load_everywhere(
    ddp_model: DDP, optimizer: torch.optim.Optimizer, step: int, path: str, device: torch.device
) -> dict:
    """Rank 0 writes; everyone waits; everyone reads back into a fresh model and proves it
    matches."""
    if not path:  # every rank must use the same path: rank 0 picks it and tells the others
        picked = [
            os.path.join(tempfile.mkdtemp(prefix="ddp-spawn-"), "checkpoint.pt")
            if dist.get_rank() == 0
            else ""
        ]
        dist.broadcast_object_list(picked, src=0)
        path = picked[0]
    if dist.get_rank() == 0:
        # .module: save the plain model's weights, without DDP's "module." prefix.
        state = {
            "model": ddp_model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # readers never see a half-written file
    dist.barrier()  # nobody reads before rank 0 has finished writing

    state = torch.load(path, map_location=device, weights_only=True)
    # deliberately other weights
    restored = build_model(ddp_model.module.cfg, seed=12345, device=device)
    restored.load_state_dict(state["model"])
    # Every rank reports what it loaded; all must equal what was trained.
    checksum = torch.tensor(
        [param_checksum(restored.parameters())], dtype=torch.float64, device=device
    )
    checksums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(checksums, checksum)
    trained = param_checksum(ddp_model.module.parameters())
    if not all(c.item() == trained for c in checksums):
        raise RuntimeError(
            f"loaded checkpoints differ from the trained model: {[c.item() for c in checksums]} vs "
            f"{trained}"
        )
    return {
        "checkpoint_path": path,
        "checkpoint_step": state["step"],
        "loaded_checksums": [c.item() for c in checksums],
    }
# --8<-- [end:checkpoint]


# --8<-- [start:launch]
def worker(
    rank: int, world_size: int, master_port: int, cfg: DDPSpawnConfig, results: mp.SimpleQueue
) -> None:
    """What mp.spawn runs in each child: ``rank`` comes first, then ``args``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        RECIPES_LAUNCHER="spawn",
    )
    result = train(cfg)
    if rank == 0:
        # keep the queue message small: tensors would go through shared memory
        result.final_state = None
        results.put(result)


def launch(cfg: DDPSpawnConfig) -> RecipeResult:
    # Check what we can in the parent: a bad config should fail once, here, not in every child.
    per_rank_batch_size(cfg.global_batch_size, cfg.nprocs)
    resolve_backend(cfg.backend, cfg.nprocs)
    if cfg.nprocs < 1:
        raise RecipeError(f"nprocs must be >= 1, got {cfg.nprocs}")
    if cfg.checkpoint_path:  # a folder in the file's place failed only after training
        refuse(output_file_problem(cfg.checkpoint_path, "--checkpoint-path"))
    if os.environ.get("MASTER_PORT"):
        master_port = int(os.environ["MASTER_PORT"])
        check_port_free(master_port)
    else:
        master_port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    # join=True: wait for all; if any child fails, mp.spawn terminates the others and raises here.
    try:
        mp.spawn(worker, args=(cfg.nprocs, master_port, cfg, results), nprocs=cfg.nprocs, join=True)
    except mp.ProcessExitedException as exc:  # died without raising: killed, os._exit, segfault
        raise RankError(
            f"rank {exc.error_index} died with exit code {exc.exit_code}; the other ranks were "
            "stopped",
            rank=exc.error_index,
            operation=None,
        ) from None
    except mp.ProcessRaisedException as exc:
        last_line = exc.msg.strip().splitlines()[-1]
        if last_line.startswith(f"{RecipeError.__module__}.RecipeError: "):
            raise RecipeError(f"rank {exc.error_index}: {last_line.split(': ', 1)[1]}") from None
        raise RankError(
            f"rank {exc.error_index} failed: {last_line}",
            rank=exc.error_index,
            operation=None,
            remote_traceback=exc.msg.split("following error:", 1)[-1].strip(),
        ) from None
    return results.get()
# --8<-- [end:launch]


if __name__ == "__main__":
    run_cli(launch, DDPSpawnConfig, __doc__)
