"""Gradient clipping that is right on every layout: one total norm over the whole mesh.

    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout fsdp
    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout pp
    torchrun --standalone --nproc_per_node=4 -m recipes.grad_clipping --layout fsdp_tp --mesh 2 2
    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout pp --clip torch
    python -m recipes.grad_clipping --layout single       # the one-process reference

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fully_shard``, ``checked_mesh``),
recipes/options.py (the command line, from the config).

Clipping scales every gradient by ``max_norm / total_norm``, where the total is the norm of ALL the
model's gradients. Once the gradients are split over ranks, no rank sees them all:

- DDP: every rank holds every (all-reduced) gradient; the local norm is the total.
- fully_shard / HSDP / TP: gradients are DTensors. ``get_total_norm`` gives a DTensor norm whose
  local value is this rank's part; ``.full_tensor()`` reduces it over the mesh (replicated dims are
  not counted twice). TP leaves the parameters it does not split as plain tensors, and fully_shard
  x TP puts the split ones on a 2-D mesh and the rest on the 1-D dp mesh: norms on different meshes
  cannot be stacked, so ``clip_grad_norm_across`` takes one norm per mesh and combines them.
- Pipeline: each stage holds only its own layers' gradients; no DTensor knows about the other
  stages. The stage norms combine as a sum of squares over the pp group (torchtitan#596).

Then ``clip_grads_with_norm_`` scales with that one total on every rank. Asserted equal to one
process (the norm, and the weights after the clipped SGD steps) on every layout
(tests/test_grad_clipping.py). SGD, not Adam: Adam divides the clipping scale away, so a wrong
clip would barely show in its weights. ``train`` returns the global batch's loss of each step and
prints it from rank 0 with the total norm the step clipped with.

The pitfalls, each shown by a test:

- ``--clip torch`` (``torch.nn.utils.clip_grad_norm_`` as is) on a pipeline stage clips with the
  stage's own norm (torchtitan#596): the weights differ from one process. Under TP it raises
  (``_foreach_norm`` gets plain tensors mixed with DTensors).
- ``--clip local_shards``: ``clip_grad_norm_`` on this rank's shards as plain tensors (code that
  unwraps DTensors, or a hand-sharded model) gets a local norm, different on every rank
  (pytorch#170862): each rank clips by its own factor.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_fully_shard, checked_mesh
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

# layout -> its mesh dims, outermost first ("single": one process, no mesh: the reference)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "single": (),
    "ddp": ("dp",),
    "fsdp": ("dp",),
    "hsdp": ("replicate", "dp"),
    "tp": ("tp",),
    "pp": ("pp",),
    "fsdp_tp": ("dp", "tp"),
    "pp_fsdp": ("pp", "dp"),
    "pp_fsdp_tp": ("pp", "dp", "tp"),
}
CLIPS = ("across", "torch", "local_shards")  # torch and local_shards: the pitfalls


@dataclass
class GradClippingConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    layout: str = option(
        "fsdp",
        "how the model is split over the ranks (single: one process, the reference)",
        choices=list(LAYOUTS),
    )
    mesh: tuple[int, ...] = option(
        (),
        "mesh sizes, one per dim of the layout (product = world size); none: 2 for each "
        "dim but dp, which takes the rest",
    )
    max_grad_norm: float = option(0.05, "clip the total gradient norm to this", above=0)
    clip: str = option(
        "across",
        "across: clip_grad_norm_across (right on every layout); torch: "
        "torch.nn.utils.clip_grad_norm_ as is; local_shards: the same on this rank's shards "
        "(the pitfalls)",
        choices=list(CLIPS),
    )
    steps: int = option(2, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        8, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(
        0.5, "SGD's learning rate (large: a wrong clip shows in the weights)", above=0
    )
    # the same seed -> the same weights and data order on every rank, on any layout
    seed: int = option(0, "model init and data order", at_least=0)
    # no bf16: this recipe compares norms exactly
    precision: str = option(
        "auto",
        "auto: fp32, on a GPU too (the norms are compared exactly); tf32: TF32 matmuls (CUDA)",
        choices=["auto", "fp32", "tf32"],
    )
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if any(size < 1 for size in self.mesh):
            raise ValueError(f"mesh sizes must be >= 1, got {list(self.mesh)}; pass one per dim")


# --8<-- [start:clip]
def clip_grad_norm_across(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model split over ranks; returns the total norm
    (a plain tensor, the same on every rank). Pass ``pp_group`` when this rank is one pipeline
    stage: the stages' norms are combined over it."""
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:  # DTensor gradients on different meshes cannot be stacked: group them
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
        # A DTensor norm holds this rank's partial value: full_tensor() all-reduces it over the
        # mesh. A plain one is whole already (DDP's all-reduced grads, TP's replicated params).
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device if norms else torch.device("cpu")
    # The norm of the per-mesh norms is the norm of all the gradients (the max, for inf).
    total = (
        torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)
        if norms
        else torch.zeros((), device=device)
    )
    if pp_group is not None:  # each stage saw only its own layers
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


# --8<-- [end:clip]


def default_mesh(layout: str, world_size: int) -> list[int]:
    names = LAYOUTS[layout]
    others = 2 ** (len(names) - 1)
    if "dp" not in names or world_size % others:
        return [world_size] if len(names) == 1 else [2] * len(names)
    return [world_size // others if name == "dp" else 2 for name in names]


# --8<-- [start:tp_plan]
def tp_plan() -> dict:
    """Megatron-style: q/k/v and the MLP's first layer by columns, their outputs by rows."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(),
        "layers.*.mlp.w_in": ColwiseParallel(),
        "layers.*.mlp.w_out": RowwiseParallel(),
    }


# --8<-- [end:tp_plan]


def keep_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Cut ``model`` to pipeline stage ``stage``: its share of the blocks, the embeddings on the
    first stage, the final norm and output on the last (TransformerLM skips what is None)."""
    blocks = list(model.layers)
    if len(blocks) % stages:
        raise ValueError(f"{len(blocks)} blocks do not split into {stages} stages; use a divisor")
    per_stage = len(blocks) // stages
    for name in blocks[: stage * per_stage] + blocks[(stage + 1) * per_stage :]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


# --8<-- [start:pipeline]
def pipeline_forward_backward(
    stage_model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    hidden_shape: tuple[int, ...],
) -> torch.Tensor:
    """One batch through the stages and back, by hand: activations go forward with send/recv,
    their gradients come back the same way. Returns the loss (on the last stage, else 0)."""
    stage, stages = dist.get_rank(group), dist.get_world_size(group)
    previous = dist.get_global_rank(group, stage - 1) if stage > 0 else None
    following = dist.get_global_rank(group, stage + 1) if stage < stages - 1 else None
    inputs = x
    if previous is not None:
        inputs = torch.empty(hidden_shape, device=x.device)
        dist.recv(inputs, src=previous, group=group)
        inputs.requires_grad_()
    out = stage_model(inputs)
    loss = torch.zeros((), device=x.device)
    if following is None:
        loss = lm_loss(out, y)
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), dst=following, group=group)
        grad = torch.empty_like(out)
        dist.recv(grad, src=following, group=group)
        out.backward(grad)
    if previous is not None:
        dist.send(inputs.grad.contiguous(), dst=previous, group=group)
    return loss.detach()


# --8<-- [end:pipeline]


def local_shards(model: nn.Module) -> list[torch.Tensor]:
    """Each parameter as the plain tensor this rank holds, with its local gradient (shared
    storage: clipping these clips the model's gradients). What code that unwraps DTensors, or a
    hand-sharded model, passes to ``clip_grad_norm_``."""
    shards = []
    for p in model.parameters():
        if isinstance(p, DTensor) and p.grad is not None:
            shard = p.to_local().detach()
            shard.grad = p.grad.to_local()
            shards.append(shard)
        elif p.grad is not None:
            shards.append(p)
    return shards


# --8<-- [start:train]
def train(cfg: GradClippingConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, names = world.device, world.rank, LAYOUTS[cfg.layout]
        if not names and world.world_size > 1:
            raise ValueError("layout single is the one-process reference; run it without torchrun")
        if cfg.precision == "tf32" and device.type != "cuda":
            raise ValueError(
                f"precision tf32 is a CUDA matmul mode and this run is on "
                f"{device.type}; use precision fp32"
            )
        if device.type == "cuda":  # fp32 means fp32: TF32 only when asked (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
                cfg.precision == "tf32"
            )
        mesh = (
            checked_mesh(world, list(cfg.mesh) or default_mesh(cfg.layout, world.world_size), names)
            if names
            else None
        )
        size = {name: mesh[name].size() for name in names}
        dp_dims = tuple(name for name in ("replicate", "dp") if name in size)
        dp_size, dp_rank = 1, 0  # the data-parallel coordinate: which share of the batch
        for name in dp_dims:
            dp_rank = dp_rank * size[name] + mesh.get_local_rank(name)
            dp_size *= size[name]
        if cfg.global_batch_size % dp_size:
            lower = max(dp_size, cfg.global_batch_size - cfg.global_batch_size % dp_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{dp_size} data-parallel ranks; use a multiple of {dp_size}, e.g. "
                f"{lower} or {lower + dp_size}"
            )
        heads = MODEL_PRESETS[cfg.model].n_heads
        if "tp" in size and heads % size["tp"]:
            raise ValueError(
                f"tp={size['tp']} does not split the {heads} attention heads; "
                f"use a divisor of {heads}"
            )

        # --8<-- [start:loop]
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        pp_group = mesh["pp"].get_group() if "pp" in size else None
        if pp_group is not None:
            model = keep_stage(model, mesh["pp"].get_local_rank(), size["pp"])
        # Order (torchtitan): pipeline cut, then tensor parallel, then fully_shard, then optimizer.
        if "tp" in size:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh["tp"], tp_plan())
        if cfg.layout == "ddp":
            model = DDP(model, device_ids=[world.local_rank] if device.type == "cuda" else None)
        elif dp_dims:
            model = apply_fully_shard(model, mesh[dp_dims], block_types=(Block,))
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # The data-parallel ranks read disjoint shares; the tp ranks and pipeline stages of one dp
        # rank read the same one (a stage past the first reads it for the targets only).
        sampler = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset,
            batch_size=cfg.global_batch_size // dp_size,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
        )

        losses, step, epoch, stages = [], 0, 0, size.get("pp", 1)
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                if pp_group is not None:
                    hidden = (*inputs.shape, MODEL_PRESETS[cfg.model].dim)
                    loss = pipeline_forward_backward(
                        model, inputs, targets, group=pp_group, hidden_shape=hidden
                    )
                else:
                    loss = lm_loss(model(inputs), targets)
                    loss.backward()
                if cfg.clip == "across":
                    norm = clip_grad_norm_across(
                        model.parameters(), cfg.max_grad_norm, pp_group=pp_group
                    )
                elif cfg.clip == "torch":  # what a loop written for one process does
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                else:  # the pitfall: the local shards, as plain tensors
                    norm = torch.nn.utils.clip_grad_norm_(local_shards(model), cfg.max_grad_norm)
                optimizer.step()
                # Pitfall: rank 0's loss alone is its share of the batch; and the stages but the
                # last hold 0, so the mean over the world is 1/stages of the global loss
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item() * stages)
                if rank == 0:
                    print(
                        f"step {step} loss {losses[-1]:.4f} grad norm {float(norm):.4f}", flush=True
                    )
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        model = optimizer = None  # Pitfall: a DDP reducer freed after the group can hang gloo
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(GradClippingConfig, prog="python -m recipes.grad_clipping", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), GradClippingConfig, argv)
    with exit_on_bad_input():  # a mesh or batch that does not divide: one line from rank 0
        train(cfg)


if __name__ == "__main__":
    main()
