"""Meta-device initialisation: build on meta, shard, then materialise and initialise each shard.

    torchrun --standalone --nproc_per_node=2 -m recipes.meta_init
    python -m recipes.meta_init --create-seed-checkpoint   # once: the full build, in one process
    torchrun --standalone --nproc_per_node=2 -m recipes.meta_init --method seed_checkpoint

A model too big for one rank cannot be built on CPU first and sharded after (recipes/fsdp2.py does
that: every rank holds the whole model for a moment). Here it is built under
``torch.device("meta")`` (shapes only, no bytes), sharded with ``apply_fully_shard`` (each parameter
becomes a DTensor whose local shard is still on meta), materialised with ``to_empty`` (each rank
allocates only its shard, uninitialised) and then initialised. The weights equal
``build_model(seed=...)`` exactly (tests/test_meta_init.py), by one of two methods:

- ``replay`` (default): for one module at a time, each rank creates the module's parameters at full
  size on the host, runs the module's own init (``reset_parameters``) with the CPU generator seeded
  as a normal build seeds it, copies out the rows of its shard and frees the rest. The generator
  draws the same numbers in the same order as the normal build, so every shard is bit-identical.
  Cost: every rank runs the init of the whole model (the random draws of one normal build), and
  holds at most one module's parameters in full on top of its shard (``largest_module_bytes``); no
  communication. It needs a model whose normal build initialises each module as it constructs it,
  in ``model.modules()`` order (torch's own layers, the cookbook's model). A Hugging Face model does
  not qualify: its constructor draws once per layer and ``post_init`` draws again, post-order.
- ``seed_checkpoint`` (any model; torchtitan's ``--create_seed_checkpoint``): one process builds the
  model once, normally, and saves it with DCP; the sharded run loads it and every rank reads only
  its own rows. Cost: one full build in one process before training (host memory for the whole
  model once), one write and one read of the weights. The checkpoint loads into any layout.

Not DTensor random init (``nn.init.normal_`` on a DTensor). On a CPU mesh DTensor has no RNG
tracker (``OffsetBasedRNGTracker`` refuses CPU), so each rank draws from its own generator for its
own shard: with the same seed, rank 1's rows repeat rank 0's (asserted). On CUDA the tracker gives
each shard its own Philox offset, so the result does not depend on the layout, but the numbers are
the CUDA generator's: they cannot equal a CPU build, and every init function must accept DTensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from recipes.core.cli import run_cli
from recipes.core.config import Config, RecipeError, opt
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.paths import output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import all_ranks, full_state_on_rank0, mean_over_ranks
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    TransformerLM,
    build_model,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world
from recipes.parallelize import apply_fully_shard

log = get_logger(__name__)


@dataclass
class MetaInitConfig(Config):
    model: Literal["tiny", "small", "100m"] = opt("tiny", "model size preset")
    method: Literal["replay", "seed_checkpoint"] = opt(
        "replay", "replay = each rank re-runs the init one module at a time and keeps its rows; "
        "seed_checkpoint = load a DCP checkpoint of the initial weights (see the docstring)")
    seed: int = opt(0, "the seed a normal build would use (build_model(seed=...))", ge=0)
    seed_checkpoint_dir: str = opt("checkpoints/seed_checkpoint", "where the seed checkpoint lives")
    create_seed_checkpoint: bool = opt(
        False, "build the model once in this process, save it to --seed-checkpoint-dir, and exit")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "process-group backend")
    timeout_s: float = opt(300.0, "collective timeout in seconds", gt=0)
    keep_final_state: bool = opt(False, "return the full initial state in the result (tests)")


# --8<-- [start:local_slices]
def local_slices(param: DTensor) -> tuple[slice, ...]:
    """The index of this rank's shard inside the full tensor, e.g. rows 32:64 of a (64, 32) weight.

    DCP's own chunk list (``__create_chunk_list__``) gives the offsets and sizes for any placement,
    uneven shards included, without a collective."""
    (chunk,) = param.__create_chunk_list__()
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
# --8<-- [end:local_slices]


def reset_parameters(module: nn.Module) -> None:
    """torch's convention: a layer (re-)initialises its own parameters in ``reset_parameters``."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


# --8<-- [start:replay_init]
@torch.no_grad()
def replay_init(model: nn.Module, *, seed: int,
                init_fn: Callable[[nn.Module], None] = reset_parameters) -> int:
    """Initialise a sharded, materialised (``to_empty``) model as ``seed`` + a normal build would.

    One module at a time: its parameters at full size on the host, ``init_fn(module)`` on them,
    this rank's rows copied into the shard. Returns the largest number of bytes held in full at
    once (one module's own parameters), the memory this method adds to the shard."""
    largest = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the CPU generator, as build_model seeds it
        for module in model.modules():  # the order in which a normal build constructs them
            sharded = dict(module.named_parameters(recurse=False))
            if not sharded:
                continue
            full = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                    for name, p in sharded.items()}
            module._parameters.update(full)  # init_fn writes into the full-size stand-ins...
            try:
                init_fn(module)
            finally:
                module._parameters.update(sharded)  # ...and the sharded parameters come back
            for name, param in sharded.items():
                param.to_local().copy_(full[name][local_slices(param)])
            largest = max(largest, sum(t.numel() * t.element_size() for t in full.values()))
    return largest
# --8<-- [end:replay_init]


# --8<-- [start:seed_checkpoint]
def write_seed_checkpoint(model: nn.Module, path: str) -> None:
    """Save a normally built model's initial weights with DCP (one process, no world needed)."""
    dcp.save(model.state_dict(), checkpoint_id=path)


def load_seed_checkpoint(model: nn.Module, path: str) -> None:
    """Load a seed checkpoint into a sharded model: each rank reads the rows of its shards."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise RecipeError(f"no seed checkpoint in {path}; create it once with python -m recipes."
                          f"meta_init --create-seed-checkpoint --seed-checkpoint-dir {path}")
    state = get_model_state_dict(model)  # DTensors: DCP reads into each rank's shard
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
# --8<-- [end:seed_checkpoint]


# --8<-- [start:build]
def build_sharded_on_meta(make_model: Callable[[], nn.Module], mesh, *,
                          block_types: tuple[type[nn.Module], ...],
                          device: torch.device) -> nn.Module:
    """Build under meta (no bytes), shard, then allocate only this rank's shards (uninitialised).

    Pitfall: ``to_empty`` gives every parameter and buffer new, uninitialised memory: each one
    must be initialised or loaded afterwards, buffers too (a rotary table, a causal mask)."""
    with torch.device("meta"):
        model = make_model()
    apply_fully_shard(model, mesh, block_types=block_types)
    model.to_empty(device=device)
    return model
# --8<-- [end:build]


def full_model_bytes(model: nn.Module) -> int:
    """What the whole model's parameters take unsharded (DTensor: its global shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --8<-- [start:run]
def run(cfg: MetaInitConfig) -> RecipeResult:
    model_cfg = MODEL_PRESETS[cfg.model]
    if cfg.create_seed_checkpoint:  # one process, the one full build of the seed_checkpoint method
        refuse(output_dir_problem(cfg.seed_checkpoint_dir, "--seed-checkpoint-dir"))
        write_seed_checkpoint(build_model(cfg.model, seed=cfg.seed), cfg.seed_checkpoint_dir)
        log.info("seed checkpoint of %s (seed %d) written to %s", cfg.model, cfg.seed,
                 cfg.seed_checkpoint_dir)
        return None  # type: ignore[return-value]
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("shard",))
        timer = StepTimer(world.device)  # its one "step": build, shard and initialise
        with timer:
            model = build_sharded_on_meta(lambda: TransformerLM(model_cfg), mesh,
                                          block_types=(Block,), device=world.device)
            if cfg.method == "replay":
                largest_module_bytes = replay_init(model, seed=cfg.seed)
            else:
                largest_module_bytes = 0
                load_seed_checkpoint(model, cfg.seed_checkpoint_dir)
        # Before any forward: fully_shard's root keeps its parameters unsharded after one.
        shard_bytes = model_state_bytes(model)["param_bytes"]
        local_sum = sum(p.to_local().double().sum().item() for p in model.parameters())
        checksum = torch.tensor([local_sum], dtype=torch.float64, device=world.device)
        torch.distributed.all_reduce(checksum)
        log.info("%s: %d of %d parameter bytes on this rank, + %d for one module in full",
                 cfg.method, shard_bytes, full_model_bytes(model), largest_module_bytes)
        # One forward of the initial model: its loss equals the normal build's (tested).
        tokens = make_dataset(cfg.model, 2, seed=cfg.seed).tokens[:2]
        inputs, targets = tokens[:, :-1].to(world.device), tokens[:, 1:].to(world.device)
        loss = mean_over_ranks(lm_loss(model(inputs), targets))
        state = full_state_on_rank0(model)[0] if cfg.keep_final_state else {}
        return make_result(
            # the checksum equals build_model's (tested)
            "meta_init", world, [loss], float(checksum.item()), timer,
            keep_final_state=state if world.is_main and cfg.keep_final_state else None,
            full_model_bytes=full_model_bytes(model),
            param_bytes_per_rank=all_ranks(shard_bytes),
            largest_module_bytes_per_rank=all_ranks(largest_module_bytes),
        )
# --8<-- [end:run]


if __name__ == "__main__":
    run_cli(run, MetaInitConfig, __doc__)
