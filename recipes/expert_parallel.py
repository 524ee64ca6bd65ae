"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

    torchrun --standalone --nproc_per_node=2 -m recipes.expert_parallel
    python -m recipes.expert_parallel                   # a world of 1: every expert on one rank

Every block's MLP becomes a mixture of experts (MoE): a router scores each token against E experts
(each an MLP), the token goes to its top-k, and their outputs are summed with the router's
(renormalised) weights. Expert parallelism (EP) puts E/N experts on each of N ranks. Each rank
reads its own share of the batch, as under DDP; a token whose expert lives elsewhere travels there
and back:

1. the split sizes first: ``all_to_all_single`` of the per-expert token counts, so that every rank
   knows how many rows it will receive from each other rank;
2. dispatch: the tokens, sorted by expert, go to the experts' ranks (``all_to_all_single`` with
   those splits); each rank runs its experts on what it received;
3. combine: the outputs come back by the reverse all-to-all and are summed per token with the router
   weights. The backward of an all-to-all is the all-to-all with the splits swapped.

The load-balancing loss (Switch Transformer, GShard) is ``E * sum_e f_e * P_e``: f_e the fraction of
assignments routed to expert e, P_e its mean router probability. It is computed over the whole
batch (the counts are summed over the EP group), so it is the one-process loss; each rank adds its
share to its backward. Expert gradients come home through the all-to-alls; the other parameters
are replicated and their gradients are summed across ranks.

Capacity is explicit: ``--capacity-factor inf`` (the default) drops no token, so EP is exactly the
one-process MoE; 0 is refused (it would drop every token). With a finite c > 0 each expert takes at
most ceil(c * tokens * top_k / E) of a rank's tokens, in token order; the rest are dropped (their
MoE output is zero, the residual carries them) and counted in ``dropped_tokens``. The result
reports ``tokens_per_expert`` of the last step: the assignments the router sent to each expert of
each layer, over the whole batch, before any drop.

Proven by tests/test_expert_parallel.py on gloo (torch 2.13): outputs, input, router and expert
gradients and the token counts equal the one-process MoE; training equals one process.

Length: about 310 lines, just over the cookbook's ~300: the MoE layer, its all-to-all dispatch
and ``apply_ep`` copy together, with the refusals that keep them exact.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import autocast, make_adamw, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class EPConfig(TrainConfig):
    num_experts: int = opt(4, "experts per MoE layer, placed evenly on the ranks", ge=1)
    top_k: int = opt(2, "experts each token is routed to", ge=1)
    capacity_factor: float = opt(math.inf, "inf: no token is dropped (exact parity); c > 0: an "
                                           "expert takes at most ceil(c * tokens * top_k / "
                                           "experts) of a rank's tokens", gt=0, finite=False)
    aux_loss_coef: float = opt(0.01, "weight of the load-balancing loss E * sum_e f_e * P_e",
                               ge=0)

    def __post_init__(self) -> None:
        if self.capacity_factor == 0:  # read as "no capacity" by some, as "room for 0" by others
            raise RecipeError(capacity_problem(self.capacity_factor))
        super().__post_init__()
        if self.top_k > self.num_experts:
            raise RecipeError(f"top_k={self.top_k} > num_experts={self.num_experts}: a token needs "
                              f"top_k different experts; use --top-k {self.num_experts} or less")


def capacity_problem(capacity_factor: float) -> str:
    why = ": an expert would take no token and every token would be dropped" * (
        capacity_factor == 0)
    return (f"capacity_factor must be > 0, got {capacity_factor:g}{why}; leave it out (inf: none "
            "dropped) or use e.g. 1.25")


class ExpertParallelError(ValueError):
    """apply_ep refused the model: no MoE layer, or experts that do not split evenly over the ranks.

    A ValueError of this module's own, so that apply_ep copies without the cookbook's package.
    """


def check_ep_fits(num_experts: int, ep_size: int) -> None:
    """ExpertParallelError unless every rank gets the same number of whole experts."""
    if num_experts % ep_size:
        sizes = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ExpertParallelError(
            f"num_experts={num_experts} cannot be placed evenly on {ep_size} ranks; use a "
            f"multiple of {ep_size} experts, or an EP size of {', '.join(map(str, sizes))}")


# --8<-- [start:all_to_all]
class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: the gradient goes back the way the
    rows came, the same collective with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return AllToAll.apply(grad, recv_splits, send_splits, ctx.group), None, None, None
# --8<-- [end:all_to_all]


# --8<-- [start:moe]
class MoE(nn.Module):
    """Top-k router and E expert MLPs stacked in [E, ...] weights. ``ep_group`` None: every expert
    is here (the one-process MoE); else this rank holds experts [r*E/N, (r+1)*E/N) (apply_ep)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int,
                 capacity_factor: float = math.inf):
        super().__init__()
        if not capacity_factor > 0:  # nan too
            raise ExpertParallelError(capacity_problem(capacity_factor))
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(hidden))
        self.ep_group: dist.ProcessGroup | None = None
        self.aux_loss = self.tokens_per_expert = self.dropped_tokens = None  # of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        num_experts, k = self.num_experts, self.top_k
        probs = self.router(x).float().softmax(-1)
        weights, experts = probs.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Assignments (token, expert) sorted by expert, token order kept within each expert: the
        # layout all_to_all needs (the experts of rank r are contiguous) and capacity cuts.
        order = experts.flatten().argsort(stable=True)
        expert_of, token_of = experts.flatten()[order], order // k
        routed = torch.bincount(expert_of, minlength=num_experts)
        counts = routed
        if math.isfinite(self.capacity_factor):  # keep the first `capacity` tokens of each expert
            capacity = math.ceil(self.capacity_factor * len(x) * k / num_experts)
            start = (routed.cumsum(0) - routed)[expert_of]
            kept = torch.arange(len(order), device=x.device) - start < capacity
            order, expert_of, token_of = order[kept], expert_of[kept], token_of[kept]
            counts = torch.bincount(expert_of, minlength=num_experts)
        # The load-balancing loss of the whole batch: the counts are summed over the group.
        totals = torch.cat([routed, routed.new_tensor([len(x), len(x) * k - len(order)])])
        if self.ep_group is not None:
            dist.all_reduce(totals, group=self.ep_group)
        fraction, tokens = totals[:-2].float() / (totals[-2] * k), totals[-2]
        self.aux_loss = num_experts * (fraction * probs.sum(0) / tokens).sum()  # this rank's share
        self.tokens_per_expert, self.dropped_tokens = totals[:-2].tolist(), int(totals[-1])
        y = self.dispatch_and_compute(x[token_of], counts)
        y = y * weights.flatten()[order, None].to(y.dtype)
        return y.new_zeros(len(x), y.shape[-1]).index_add(0, token_of, y).view(shape)

    def run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert, ``counts[e]`` of them for expert e: one MLP each."""
        chunks = rows.split(counts)
        return torch.cat([F.gelu(chunk @ self.w_in[e]) @ self.w_out[e]
                          for e, chunk in enumerate(chunks)])

    def dispatch_and_compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.run_experts(rows, counts.tolist())
        group, size = self.ep_group, dist.get_world_size(self.ep_group)
        local = self.num_experts // size
        # 1. Split sizes first: rank j receives, from every rank, the counts of j's experts.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits = counts.view(size, local).sum(1).tolist()
        recv_splits = recv_counts.view(size, local).sum(1).tolist()
        # 2. Dispatch. The rows arrive grouped by source rank, then expert: regroup them by expert.
        received = AllToAll.apply(rows, send_splits, recv_splits, group)
        expert_of_row = (torch.arange(local, device=rows.device).repeat(size)
                         .repeat_interleave(recv_counts))
        by_expert = expert_of_row.argsort(stable=True)
        out = self.run_experts(received[by_expert], recv_counts.view(size, local).sum(0).tolist())
        # 3. Combine: back in arrival order, then home by the reverse all-to-all.
        return AllToAll.apply(out[by_expert.argsort()], recv_splits, send_splits, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[MoE]:
    """Keep this rank's slice of every MoE's experts; the router stays replicated. Apply it before
    building the optimizer. A 1-rank mesh holds every expert and communicates nothing."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        found = sorted({type(m).__name__ for m in model.modules()})
        raise ExpertParallelError(
            f"apply_ep found no MoE layer in the model; its modules: {found}")
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moes:
        check_ep_fits(moe.num_experts, size)
        if size > 1:
            local = moe.num_experts // size
            for name in ("w_in", "w_out"):
                full = getattr(moe, name)
                setattr(moe, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local]
                                                .clone()))
            moe.ep_group = ep_mesh.get_group()
    return moes
# --8<-- [end:moe]


def build_moe_model(cfg: EPConfig, device: torch.device) -> nn.Module:
    """The cookbook's transformer with an MoE in place of every MLP, the same on every rank."""
    model_cfg = MODEL_PRESETS[cfg.model]
    model = build_model(cfg.model, seed=cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        for block in model.layers.values():
            block.mlp = MoE(model_cfg.dim, model_cfg.mlp_ratio * model_cfg.dim, cfg.num_experts,
                            cfg.top_k, cfg.capacity_factor)
    return model.to(device)


def full_state(model: nn.Module, moes: list[MoE]) -> dict[str, torch.Tensor]:
    """Every parameter on CPU, expert slices all-gathered (a collective: every rank calls it)."""
    sliced = {id(p): moe.ep_group for moe in moes for p in (moe.w_in, moe.w_out)}
    state = {}
    for name, p in model.named_parameters():
        group = sliced.get(id(p))
        if group is not None:
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            p = torch.cat(parts)
        state[name] = p.detach().cpu().clone()
    return state


# --8<-- [start:train]
def train(cfg: EPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        ep_size = world.world_size
        check_ep_fits(cfg.num_experts, ep_size)
        per_rank = per_rank_batch_size(cfg.global_batch_size, ep_size)
        ep_mesh = init_device_mesh(world.device.type, (ep_size,), mesh_dim_names=("ep",))
        model = build_moe_model(cfg, world.device)
        moes = apply_ep(model, ep_mesh)
        experts = {id(p) for moe in moes for p in (moe.w_in, moe.w_out)}
        replicated = [p for p in model.parameters() if id(p) not in experts]
        precision = setup_precision(cfg.precision, world.device)
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
        # Each rank reads its share of the batch, as under DDP; the experts see every rank's tokens.
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=ep_size,
                                             per_rank_batch_size=per_rank, seed=cfg.seed)
        log.info("expert parallel over %d rank(s): %d of %d experts each, top_k=%d",
                 ep_size, cfg.num_experts // ep_size, cfg.num_experts, cfg.top_k)
        losses, aux_losses, timer = [], [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with autocast(world.device, precision):
                    logits = model(inputs)
                lm = lm_loss(logits, targets)  # the mean over this rank's tokens
                aux = sum(moe.aux_loss for moe in moes)  # this rank's share of the batch's aux loss
                optimizer.zero_grad(set_to_none=True)
                # Summed over the ranks, this is the one-process loss of the whole batch.
                (lm / ep_size + cfg.aux_loss_coef * aux).backward()
                # Expert gradients already hold every rank's tokens (the all-to-all backward
                # brought them); the replicated parameters' gradients are summed here.
                if ep_size > 1:
                    for p in replicated:
                        dist.all_reduce(p.grad)
                optimizer.step()
            figures = torch.stack([lm.detach() / ep_size, aux.detach()]).float()
            dist.all_reduce(figures)
            losses.append(float(figures[0] + cfg.aux_loss_coef * figures[1]))
            aux_losses.append(float(figures[1]))
            log.info("step %d loss %.4f (aux %.4f) time %.1f ms", step, losses[-1], aux_losses[-1],
                     timer.durations[-1] * 1e3)

        state = full_state(model, moes)
        # Active FLOPs: a token runs top_k expert MLPs the size of the dense one (router left out).
        active = dataclasses.replace(MODEL_PRESETS[cfg.model],
                                     mlp_ratio=MODEL_PRESETS[cfg.model].mlp_ratio * cfg.top_k)
        return make_result(
            "expert_parallel", world, losses, state.values(), timer,
            keep_final_state=state if cfg.keep_final_state else None,
            workload=Workload(active, cfg.global_batch_size, precision),
            ep_size=ep_size, experts_per_rank=cfg.num_experts // ep_size, top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor if math.isfinite(cfg.capacity_factor) else None,
            aux_losses=aux_losses,
            tokens_per_expert=[moe.tokens_per_expert for moe in moes],
            dropped_tokens=[moe.dropped_tokens for moe in moes],
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, EPConfig, __doc__)
