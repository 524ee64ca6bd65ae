"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

    torchrun --standalone --nproc_per_node=2 -m recipes.expert_parallel
    python -m recipes.expert_parallel                   # a world of 1: every expert on one rank

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/options.py (the command line, from
the config).

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
MoE output is zero, the residual carries them) and counted in ``dropped_tokens``.

``train`` returns an ``EPRun``: the loss of each step (the global batch's, aux loss included), the
aux loss of each step, and of the last step ``tokens_per_expert`` (the assignments the router sent
to each expert of each layer, over the whole batch, before any drop) and ``dropped_tokens``. Rank 0
prints one line per step. Proven by tests/test_expert_parallel.py on gloo: outputs,
input, router and expert gradients and the token counts equal the one-process MoE; training
equals one process.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class EPConfig:
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
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 "
        "matmuls (CUDA)",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    num_experts: int = option(4, "experts per MoE layer, placed evenly on the ranks", at_least=1)
    top_k: int = option(2, "experts each token is routed to", at_least=1)
    # inf on purpose: no token is dropped, so EP is exactly the one-process MoE
    capacity_factor: float = option(
        math.inf,
        "inf: no token is dropped (exact parity); c > 0: an expert takes at most "
        "ceil(c * tokens * top_k / experts) of a rank's tokens",
        above=0,
        finite=False,
    )
    aux_loss_coef: float = option(
        0.01, "weight of the load-balancing loss E * sum_e f_e * P_e", at_least=0
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        if not self.capacity_factor > 0:  # nan too; first, with why 0 is refused
            raise ExpertParallelError(capacity_problem(self.capacity_factor))
        check_options(self)  # the ranges and choices above: one line each
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} > num_experts={self.num_experts}: a token needs "
                f"top_k different experts; use --top-k {self.num_experts} or less"
            )


@dataclass
class EPRun:
    """What ``train`` returns: the losses, and what the router did."""

    losses: list[float]  # the global batch's loss of each step, aux loss included
    aux_losses: list[float]  # the load-balancing loss of each step (the whole batch's)
    tokens_per_expert: list[list[int]]  # last step, per MoE layer: assignments per expert
    dropped_tokens: list[int]  # last step, per MoE layer: assignments over capacity


def capacity_problem(capacity_factor: float) -> str:
    why = ": an expert would take no token and every token would be dropped" * (
        capacity_factor == 0
    )
    return (
        f"capacity_factor must be > 0, got {capacity_factor:g}{why}; leave it out (inf: none "
        "dropped) or use e.g. 1.25"
    )


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
            f"multiple of {ep_size} experts, or an EP size of {', '.join(map(str, sizes))}"
        )


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

    def __init__(
        self, dim: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float = math.inf
    ):
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
        return torch.cat(
            [F.gelu(chunk @ self.w_in[e]) @ self.w_out[e] for e, chunk in enumerate(chunks)]
        )

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
        expert_of_row = (
            torch.arange(local, device=rows.device).repeat(size).repeat_interleave(recv_counts)
        )
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
        raise ExpertParallelError(f"apply_ep found no MoE layer in the model; its modules: {found}")
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moes:
        check_ep_fits(moe.num_experts, size)
        if size > 1:
            local = moe.num_experts // size
            for name in ("w_in", "w_out"):
                full = getattr(moe, name)
                setattr(
                    moe,
                    name,
                    nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone()),
                )
            moe.ep_group = ep_mesh.get_group()
    return moes


# --8<-- [end:moe]


def build_moe_model(cfg: EPConfig, device: torch.device) -> nn.Module:
    """The toy transformer with an MoE in place of every MLP, the same on every rank."""
    model_cfg = MODEL_PRESETS[cfg.model]
    model = build_model(cfg.model, seed=cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        for block in model.layers.values():
            block.mlp = MoE(
                model_cfg.dim,
                model_cfg.mlp_ratio * model_cfg.dim,
                cfg.num_experts,
                cfg.top_k,
                cfg.capacity_factor,
            )
    return model.to(device)


# --8<-- [start:train]
def train(cfg: EPConfig, observer=None) -> EPRun:
    """Train on this process's rank; returns the losses (every rank) and the router's counts."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        check_ep_fits(cfg.num_experts, world_size)  # the EP group is the world
        if cfg.global_batch_size % world_size:
            lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world_size} ranks; use a multiple of {world_size}, e.g. {lower} "
                f"or {lower + world_size}"
            )
        per_rank_batch = cfg.global_batch_size // world_size
        use_cuda = device.type == "cuda"
        bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
        )
        if cfg.precision == "tf32" and not use_cuda:  # else it would run fp32 and say tf32
            raise ValueError(
                f"--precision tf32 is a CUDA matmul mode and this run is on "
                f"{device.type}; use --precision fp32 (or bf16)"
            )
        if use_cuda:  # a process-wide switch: set it every run, never inherit it
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
                cfg.precision == "tf32"
            )
        ep_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",))
        if rank == 0:
            print(
                f"expert parallel over {world_size} rank(s): {cfg.num_experts // world_size} "
                f"of {cfg.num_experts} experts each, top_k={cfg.top_k}",
                flush=True,
            )

        # --8<-- [start:loop]
        # The same seed on every rank: the same router and experts before each keeps its slice
        model = build_moe_model(cfg, device)
        moes = apply_ep(model, ep_mesh)  # before the optimizer: it must see the slices
        experts = {id(p) for moe in moes for p in (moe.w_in, moe.w_out)}
        replicated = [p for p in model.parameters() if id(p) not in experts]
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch, as under DDP; the experts see
        # every rank's tokens through the all-to-alls.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )

        losses, aux_losses, step, epoch = [], [], 0, 0
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
                aux = sum(moe.aux_loss for moe in moes)  # this rank's share of the batch's
                # No DDP: summed over the ranks, this is the one-process loss of the whole batch
                (loss / world_size + cfg.aux_loss_coef * aux).backward()
                # Expert gradients already hold every rank's tokens (the all-to-all backward
                # brought them); the replicated parameters' gradients are summed here.
                if world_size > 1:
                    for p in replicated:
                        dist.all_reduce(p.grad)
                optimizer.step()
                # Pitfall: rank 0's loss alone is its share of the batch: sum the shares
                global_loss = torch.stack([loss.detach() / world_size, aux.detach()]).float()
                dist.all_reduce(global_loss)
                losses.append(float(global_loss[0] + cfg.aux_loss_coef * global_loss[1]))
                aux_losses.append(float(global_loss[1]))
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f} aux {aux_losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]

        run = EPRun(
            losses,
            aux_losses,
            [moe.tokens_per_expert for moe in moes],
            [moe.dropped_tokens for moe in moes],
        )
        if rank == 0:
            print(
                f"last step: tokens per expert {run.tokens_per_expert}, dropped "
                f"{run.dropped_tokens}",
                flush=True,
            )
        return run
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(EPConfig, prog="python -m recipes.expert_parallel", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), EPConfig, argv)
    with exit_on_bad_input():  # experts that do not split evenly: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
