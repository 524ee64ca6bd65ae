"""Meta-device initialisation: build on meta, shard, then materialise and initialise each shard.

    torchrun --standalone --nproc_per_node=2 -m recipes.meta_init
    python -m recipes.meta_init --create-seed-checkpoint   # once: the full build, in one process
    torchrun --standalone --nproc_per_node=2 -m recipes.meta_init --method seed_checkpoint

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``build_sharded_on_meta``: meta, ``apply_fully_shard``,
``to_empty``; ``local_slices``), recipes/options.py (the command line, from the config).

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

``run`` builds and initialises the model, prints what rank 0 holds and the initial model's loss on
two sequences (the normal build's loss: the weights are the same), and returns a ``MetaInitRun``:
that loss, and the bytes the method held in full on top of the shard (replay's cost). It trains
nothing: a training loop on the sharded model is recipes/fsdp2.py's.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import build_sharded_on_meta, local_slices
from recipes.toy import MODEL_PRESETS, Block, TransformerLM, build_model, lm_loss, make_dataset


@dataclass
class MetaInitConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    method: str = option(
        "replay",
        "replay: each rank re-runs the init one module at a time and keeps its rows; "
        "seed_checkpoint: load a DCP checkpoint of the initial weights (see the docstring)",
        choices=["replay", "seed_checkpoint"],
    )
    seed: int = option(0, "the seed a normal build would use (build_model(seed=...))", at_least=0)
    seed_checkpoint_dir: str = option(
        "checkpoints/seed_checkpoint", "where the seed checkpoint lives"
    )
    create_seed_checkpoint: bool = option(
        False,
        "build the model once in this process, save it to --seed-checkpoint-dir, and exit",
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        path = self.seed_checkpoint_dir
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"seed_checkpoint_dir={path!r} is a file; name a directory (created if missing)"
            )


@dataclass
class MetaInitRun:
    losses: list[float] = field(default_factory=list)  # the initial model's loss (one)
    largest_module_bytes: int = 0  # held in full on top of the shard, for a moment (replay)


def reset_parameters(module: nn.Module) -> None:
    """torch's convention: a layer (re-)initialises its own parameters in ``reset_parameters``."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


# --8<-- [start:replay_init]
@torch.no_grad()
def replay_init(
    model: nn.Module, *, seed: int, init_fn: Callable[[nn.Module], None] = reset_parameters
) -> int:
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
            full = {
                name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
                for name, p in sharded.items()
            }
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
    dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)


def load_seed_checkpoint(model: nn.Module, path: str) -> None:
    """Load a seed checkpoint into a sharded model: each rank reads the rows of its shards."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(
            f"no seed checkpoint in {path}; create it once with python -m recipes."
            f"meta_init --create-seed-checkpoint --seed-checkpoint-dir {path}"
        )
    state = get_model_state_dict(model)  # DTensors: DCP reads into each rank's shard
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)


# --8<-- [end:seed_checkpoint]


def create_seed_checkpoint(cfg: MetaInitConfig) -> None:
    """The seed_checkpoint method's one full build: in this process, before the sharded run."""
    write_seed_checkpoint(build_model(cfg.model, seed=cfg.seed), cfg.seed_checkpoint_dir)
    print(
        f"seed checkpoint of {cfg.model} (seed {cfg.seed}) written to {cfg.seed_checkpoint_dir}",
        flush=True,
    )


# --8<-- [start:run]
def run(cfg: MetaInitConfig, observer=None) -> MetaInitRun:
    """Build the model sharded, never whole, and initialise it; returns its loss (every rank)."""
    if cfg.create_seed_checkpoint:
        raise ValueError(
            "create_seed_checkpoint is a step of its own, before this run: "
            "python -m recipes.meta_init --create-seed-checkpoint"
        )
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        mesh = init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("shard",))
        model_cfg = MODEL_PRESETS[cfg.model]
        model = build_sharded_on_meta(
            lambda: TransformerLM(model_cfg), mesh, block_types=(Block,), device=world.device
        )
        largest_module_bytes = 0
        if cfg.method == "replay":
            largest_module_bytes = replay_init(model, seed=cfg.seed)
        else:
            load_seed_checkpoint(model, cfg.seed_checkpoint_dir)
        # no optimizer: this recipe ends where training would start
        if observer:
            observer.model_ready(model, None)
        # Before any forward: fully_shard's root keeps its parameters unsharded after one.
        shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global
        if world.rank == 0:
            print(
                f"{cfg.method}: {shard_bytes} of {full_bytes} parameter bytes on rank 0, "
                f"+ {largest_module_bytes} for one module in full",
                flush=True,
            )

        # One forward of the initial model: its loss equals the normal build's (tested). Every
        # rank runs the same two sequences, so every rank gets the same loss.
        tokens = make_dataset(cfg.model, 2, seed=cfg.seed).tokens[:2].to(world.device)
        with torch.no_grad():
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()
        if world.rank == 0:
            print(f"initial loss {loss:.4f}", flush=True)
        if observer:
            observer.step_end(0, loss)
        return MetaInitRun(losses=[loss], largest_module_bytes=largest_module_bytes)
    finally:
        cleanup_distributed()


# --8<-- [end:run]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(MetaInitConfig, prog="python -m recipes.meta_init", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), MetaInitConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees (a missing seed checkpoint): exit 2
        if cfg.create_seed_checkpoint:  # one process, the one full build of seed_checkpoint
            create_seed_checkpoint(cfg)
        else:
            run(cfg)


if __name__ == "__main__":
    main()
