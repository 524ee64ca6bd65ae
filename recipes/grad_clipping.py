"""Gradient clipping that is right on every layout: one total norm over the whole mesh.

    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout fsdp
    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout pp
    torchrun --standalone --nproc_per_node=4 -m recipes.grad_clipping --layout fsdp_tp --mesh 2 2
    torchrun --standalone --nproc_per_node=2 -m recipes.grad_clipping --layout pp --clip torch

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
clip would barely show in its weights.

The pitfalls, each shown by a test:

- ``--clip torch`` (``torch.nn.utils.clip_grad_norm_`` as is) on a pipeline stage clips with the
  stage's own norm (torchtitan#596): the weights differ from one process. Under TP it raises
  (``_foreach_norm`` gets plain tensors mixed with DTensors).
- ``--clip local_shards``: ``clip_grad_norm_`` on this rank's shards as plain tensors (code that
  unwraps DTensors, or a hand-sharded model) gets a local norm, different on every rank
  (pytorch#170862): each rank clips by its own factor.

Length: about 330 lines, over the cookbook's ~300, because the lesson is one clipping
function across six layouts (DDP, FSDP, HSDP, TP, PP, 2-D/3-D meshes): each layout's few lines of
set-up sit next to the others so that the one total norm can be compared across them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import setup_precision
from recipes.core.state import all_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world

log = get_logger(__name__)

# layout -> its mesh dims, outermost first ("single": one process, no mesh: the reference)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "single": (), "ddp": ("dp",), "fsdp": ("dp",), "hsdp": ("replicate", "dp"), "tp": ("tp",),
    "pp": ("pp",), "fsdp_tp": ("dp", "tp"), "pp_fsdp": ("pp", "dp"),
    "pp_fsdp_tp": ("pp", "dp", "tp"),
}


@dataclass
class GradClippingConfig(TrainConfig):
    layout: Literal[tuple(LAYOUTS)] = opt("fsdp", "how the model is split over the ranks")
    mesh: list[int] = opt([], "mesh sizes, one per dim of the layout (product = world size); "
                              "empty = 2 for each dim but dp, which takes the rest")
    max_grad_norm: float = opt(0.05, "clip the total gradient norm to this", gt=0)
    clip: Literal["across", "torch", "local_shards"] = opt(
        "across", "across = clip_grad_norm_across (right on every layout); torch = "
                  "torch.nn.utils.clip_grad_norm_ as is; local_shards = the same on this rank's "
                  "shards (the pitfalls)")
    steps: int = opt(2, "optimizer steps to run", ge=1)
    global_batch_size: int = opt(8, "sequences per optimizer step, summed over all ranks", ge=1)
    lr: float = opt(0.5, "SGD learning rate (large: a wrong clip shows in the weights)", gt=0)


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
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type) if norms \
        else torch.zeros((), device=device)
    if pp_group is not None:  # each stage saw only its own layers
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
            total = total ** (1.0 / norm_type)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
# --8<-- [end:clip]


def checked_mesh(world, sizes: list[int], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh`` after the checks that give one line instead of a deep traceback."""
    if len(sizes) != len(names):
        raise RecipeError(f"mesh {sizes} has {len(sizes)} dims but this layout has "
                          f"{len(names)} ({', '.join(names)}); pass one size per dim")
    if any(size < 1 for size in sizes) or math.prod(sizes) != world.world_size:
        shown = "x".join(map(str, sizes))
        raise RecipeError(f"mesh {shown} has {math.prod(sizes)} ranks but the world has "
                          f"{world.world_size}; pass sizes >= 1 whose product is "
                          f"{world.world_size}")
    return init_device_mesh(world.device.type, tuple(sizes), mesh_dim_names=names)


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

    return {"layers.*.attn.wq": ColwiseParallel(), "layers.*.attn.wk": ColwiseParallel(),
            "layers.*.attn.wv": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(),
            "layers.*.mlp.w_in": ColwiseParallel(), "layers.*.mlp.w_out": RowwiseParallel()}
# --8<-- [end:tp_plan]


def keep_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Cut ``model`` to pipeline stage ``stage``: its share of the blocks, the embeddings on the
    first stage, the final norm and output on the last (TransformerLM skips what is None)."""
    blocks = list(model.layers)
    if len(blocks) % stages:
        raise RecipeError(f"{len(blocks)} blocks do not split into {stages} stages; use a divisor")
    per_stage = len(blocks) // stages
    for name in blocks[:stage * per_stage] + blocks[(stage + 1) * per_stage:]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


# --8<-- [start:pipeline]
def pipeline_forward_backward(stage_model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                              group: dist.ProcessGroup,
                              hidden_shape: tuple[int, ...]) -> torch.Tensor:
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


def full_state_merged(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, from every rank (pipeline stages hold different ones): a
    collective, every rank calls it. Fine for the small models this recipe checks."""
    module = model.module if isinstance(model, DDP) else model
    local = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
             for name, p in module.named_parameters()}
    merged: dict[str, torch.Tensor] = {}
    for state in all_ranks(local):
        merged.update(state)
    return merged


# --8<-- [start:train]
def train(cfg: GradClippingConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        names = LAYOUTS[cfg.layout]
        if not names and world.world_size > 1:
            raise RecipeError("layout single is the one-process reference; run it without torchrun")
        mesh = checked_mesh(world, cfg.mesh or default_mesh(cfg.layout, world.world_size), names) \
            if names else None
        size = {name: mesh[name].size() for name in names} if mesh else {}
        dp_dims = tuple(name for name in ("replicate", "dp") if name in size)
        dp_size, dp_rank = 1, 0  # the data-parallel coordinate: which share of the batch
        for name in dp_dims:
            dp_rank = dp_rank * size[name] + mesh.get_local_rank(name)
            dp_size *= size[name]
        # Exact fp32 (auto = fp32 here, on a GPU too): the norms are compared with one process.
        precision = setup_precision("fp32" if cfg.precision == "auto" else cfg.precision,
                                    world.device)
        if precision not in ("fp32", "tf32"):
            raise RecipeError(f"--precision {precision}: this recipe compares norms exactly; "
                              "use fp32 or tf32")
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        pp_group = mesh["pp"].get_group() if "pp" in size else None
        if pp_group is not None:
            model = keep_stage(model, mesh["pp"].get_local_rank(), size["pp"])
        # Order (torchtitan): pipeline cut, then tensor parallel, then fully_shard, then optimizer.
        if "tp" in size:
            from torch.distributed.tensor.parallel import parallelize_module

            heads = MODEL_PRESETS[cfg.model].n_heads
            if heads % size["tp"]:
                raise RecipeError(f"tp={size['tp']} does not split the {heads} attention heads; "
                                  f"use a divisor of {heads}")

            parallelize_module(model, mesh["tp"], tp_plan())
        if cfg.layout == "ddp":
            model = DDP(model)
        elif dp_dims:
            from recipes.parallelize import apply_fully_shard

            model = apply_fully_shard(model, mesh[dp_dims], block_types=(Block,))
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        per_rank = per_rank_batch_size(cfg.global_batch_size, dp_size)
        loader, sampler = distributed_loader(
            make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed), rank=dp_rank,
            world_size=dp_size, per_rank_batch_size=per_rank, seed=cfg.seed)

        losses, norms, torch_local_norms, timer = [], [], [], StepTimer(world.device)
        for step, (x, y) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                x, y = x.to(world.device), y.to(world.device)
                optimizer.zero_grad(set_to_none=True)
                if pp_group is not None:
                    hidden = (*x.shape, MODEL_PRESETS[cfg.model].dim)
                    loss = pipeline_forward_backward(model, x, y, group=pp_group,
                                                     hidden_shape=hidden)
                else:
                    loss = lm_loss(model(x), y)
                    loss.backward()
                if cfg.clip == "across":
                    norm = clip_grad_norm_across(model.parameters(), cfg.max_grad_norm,
                                                 pp_group=pp_group)
                elif cfg.clip == "torch":  # what a loop written for one process does
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                else:  # the pitfall: the local shards, as plain tensors
                    norm = torch.nn.utils.clip_grad_norm_(local_shards(model), cfg.max_grad_norm)
                optimizer.step()
            norms.append(float(norm))
            torch_local_norms.append(all_ranks(float(norm)))
            losses.append(_global_loss(loss, pp_group, dp_size))
            log.info("step %d loss %.4f grad norm %.4f", step, losses[-1], norms[-1])

        state = full_state_merged(model)
        result = make_result(
            "grad_clipping", world, losses, state.values(), timer,
            keep_final_state=state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            grad_norms=norms, grad_norms_per_rank=torch_local_norms, layout=cfg.layout,
            mesh=list(mesh.shape) if mesh else [],
        )
        # Pitfall: free a DDP wrapper while the process group is alive; its reducer collected
        # after the teardown can deadlock gloo at exit (recipes/lightning_fabric.py).
        del model, optimizer
        return result
# --8<-- [end:train]


def _global_loss(loss: torch.Tensor, pp_group, dp_size: int) -> float:
    """The step's loss as one process computes it: the last stage's, averaged over dp ranks."""
    value = loss.detach().float().reshape(1).clone()
    if dist.get_world_size() > 1:
        dist.all_reduce(value)  # stages other than the last contribute 0; tp ranks repeat it
    stages = dist.get_world_size(pp_group) if pp_group else 1
    tp_copies = dist.get_world_size() // dp_size // stages
    return float(value.item()) / dp_size / tp_copies


if __name__ == "__main__":
    run_cli(train, GradClippingConfig, __doc__)
